"""PipelinedLLEP: expert-parallel MoE dispatch whose peak is fixed at launch, plus the two schedules it replaces.

One interface for all three (docs/design.md §2): x [T, H], topk_ids [T, k] (global expert ids), topk_scores [T, k],
this rank's experts as torchtitan's GroupedExperts holds them (w1 [e, I, H], w2 [e, H, I], w3 [e, I, H];
expert j of EP rank r is global id r*e + j), an EP process group (None: E_p = 1). Output [T, H] in x's dtype:
sum over k of score * expert(x), each route's product taken in fp32 (fp64 for fp64) and cast back before the
sum, as torchtitan's combine does. The expert MLP is GroupedExperts' (silu(x w1^T) * (x w3^T)) w2^T, but in the
input dtype: torchtitan casts to bf16 inside its grouped mm; we do not, so fp32/fp64 comparisons are tight.

- ``standard_ep``: torchtitan's all-to-all dispatcher (count exchange, one token all-to-all, experts, back).
- ``llep``: all-gathered counts, the least-loaded plan (llep_plan.py), borrowed weights sent to helpers
  and their gradients summed at the owners in backward, one token all-to-all.
- ``pipelined_llep``: the LLEP plan delivered in K = ceil(N_max / c) chunks, at most c k routes per source per
  chunk; each chunk is dispatch -> experts -> combine, and backward recomputes it chunk by chunk, so no
  routing-sized tensor outlives its chunk. Its bound (``pipelined_llep_bound``) depends on launch shapes only.
"""
from __future__ import annotations

import functools
import time

import sympy
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError
from boundpass.runtime import contracts
from boundpass.runtime.agreement import agree, check_devices, mixed_real_call
from boundpass.runtime.groups import group_name_of  # noqa: F401  (also imported from here by the passes)
from boundpass.runtime.llep_plan import DEFAULT_ALPHA, ChunkedRoutes, LLEPPlan, lendable_experts, plan_llep


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32 combine, fp64 stays fp64


def expert_mlp(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
    """One expert on rows x [n, H]: (silu(x w1^T) * (x w3^T)) w2^T -> [n, H], in x's dtype."""
    return torch.mm(F.silu(torch.mm(x, w1.t())) * torch.mm(x, w3.t()), w2.t())


class _Group:
    """EP rank/size of a process group (None or a name of '': one rank, nothing moves)."""

    def __init__(self, group):
        if isinstance(group, str):
            group = dist.distributed_c10d._resolve_process_group(group) if group else None
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0

    def all_to_all(self, inp: Tensor, out_rows: list[int], in_rows: list[int]) -> Tensor:
        """Non-differentiable uneven all_to_all_single along dim 0."""
        out = inp.new_empty((sum(out_rows),) + tuple(inp.shape[1:]))
        if self.size == 1:
            return out.copy_(inp)
        dist.all_to_all_single(out, inp.contiguous(), out_rows, in_rows, group=self.group)
        return out

    def all_to_all_autograd(self, inp: Tensor, out_rows: list[int], in_rows: list[int]) -> Tensor:
        """Differentiable uneven all_to_all_single along dim 0 (backward: the same with splits swapped)."""
        return inp if self.size == 1 else _AllToAll.apply(inp, self, out_rows, in_rows)

    def gather_counts(self, local: Tensor) -> list[list[int]]:
        """counts[rank][expert] of every rank, from this rank's [E] route counts."""
        if self.size == 1:
            return [local.tolist()]
        out = local.new_empty((self.size * local.numel(),))
        dist.all_gather_single(out, local, group=self.group)
        return out.view(self.size, -1).tolist()

    def p2p(self, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]) -> None:
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=p) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=p) for t, p in recvs]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, grp, out_rows, in_rows):
        ctx.grp, ctx.out_rows, ctx.in_rows = grp, out_rows, in_rows
        return grp.all_to_all(inp, out_rows, in_rows)

    @staticmethod
    def backward(ctx, grad):
        return ctx.grp.all_to_all(grad, ctx.in_rows, ctx.out_rows), None, None, None


def _check(x, topk_ids, topk_scores, w1, w2, w3, grp: _Group) -> None:
    if w1.dim() != 3:
        raise BoundpassInputError(f"EP dispatch expects w1 [e, I, H], got {tuple(w1.shape)}")
    e, I, H = w1.shape
    if x.dim() != 2 or x.shape[1] != H or w2.shape != (e, H, I) or w3.shape != (e, I, H):
        raise BoundpassInputError(f"EP dispatch expects x [T, H], w1/w3 [e, I, H], w2 [e, H, I]; got x "
                                  f"{tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}, w3 {tuple(w3.shape)}")
    if topk_ids.shape != topk_scores.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise BoundpassInputError(f"topk_ids and topk_scores must both be [T, k] with T = {x.shape[0]}, got "
                                  f"{tuple(topk_ids.shape)} and {tuple(topk_scores.shape)}")
    if not isinstance(topk_ids, torch._subclasses.FakeTensor) and topk_ids.numel():
        if int(topk_ids.min()) < 0 or int(topk_ids.max()) >= e * grp.size:
            raise BoundpassInputError(f"expert ids must lie in [0, {e * grp.size}) (E = e * E_p)")


def _route_counts(topk_ids: Tensor, num_experts: int) -> Tensor:
    return torch.bincount(topk_ids.reshape(-1), minlength=num_experts)


# ---------------------------------------------------------------------------------------- standard EP
def standard_ep(x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
                group=None) -> Tensor:
    """Reference: torchtitan's all-to-all dispatch + experts + weighted combine; differentiable. [T, H]."""
    grp = _Group(group)
    _check(x, topk_ids, topk_scores, w1, w2, w3, grp)
    e, k = w1.shape[0], topk_ids.shape[1]
    order = torch.argsort(topk_ids.reshape(-1), stable=True)  # routes grouped by expert, hence by owner
    rows = x[order // k]
    counts = _route_counts(topk_ids, e * grp.size).view(grp.size, e)
    recv_counts = counts if grp.size == 1 else torch.empty_like(counts)
    if grp.size > 1:
        dist.all_to_all_single(recv_counts, counts, group=grp.group)
    send_rows, recv_rows = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    rows = grp.all_to_all_autograd(rows, recv_rows, send_rows)
    # received rows: by source, then by local expert within a source
    blocks = [(j, n) for src_counts in recv_counts.tolist() for j, n in enumerate(src_counts)]
    # split / unbind, not rows[a:b] / w1[j]: autograd's backward of a slice or a select zero-fills a gradient the
    # size of the whole buffer for every block (measured: 44% of LLEP's time went to fill_ and add_)
    pieces, experts = torch.split(rows, [n for _, n in blocks]), list(zip(w1.unbind(0), w2.unbind(0), w3.unbind(0)))
    outs = [expert_mlp(piece, *experts[j]) for (j, n), piece in zip(blocks, pieces) if n]
    out_rows = torch.cat(outs) if outs else rows[:0] * 0
    out_rows = grp.all_to_all_autograd(out_rows, send_rows, recv_rows)
    return _combine(x, out_rows, topk_scores.reshape(-1)[order], order // k)


def _combine(x: Tensor, routed: Tensor, scores: Tensor, tokens: Tensor) -> Tensor:
    acc = _acc_dtype(x.dtype)
    weighted = (routed.to(acc) * scores.to(acc).unsqueeze(1)).to(x.dtype)
    return torch.zeros_like(x).index_add(0, tokens, weighted)


# ------------------------------------------------------------------------------------ borrowed weights
def _transfer_weights(grp: _Group, plan: LLEPPlan, weights: tuple[Tensor, ...]) -> list[Tensor]:
    """Send this rank's lent experts to their helpers, receive its borrowed ones: stacked [slots, ...] each."""
    M = plan.experts_per_rank
    slots = [w.new_empty((len(plan.borrowed[grp.rank]),) + tuple(w.shape[1:])) for w in weights]
    for expert, helper in plan.transfers:  # one pair at a time, same global order on every rank
        if plan.owner(expert) == grp.rank:
            grp.p2p([(w[expert % M], helper) for w in weights], [])
        elif helper == grp.rank:
            slot = plan.borrowed[helper].index(expert)
            grp.p2p([], [(s[slot], plan.owner(expert)) for s in slots])
    return slots


def _return_weight_grads(grp: _Group, plan: LLEPPlan, grads: list[Tensor], slot_grads: list[Tensor]) -> None:
    """Send borrowed slots' gradients back to their owners, who add them into their own (in place)."""
    M = plan.experts_per_rank
    for expert, helper in plan.transfers:
        if plan.owner(expert) == grp.rank:
            incoming = [g.new_empty(g.shape[1:]) for g in grads]  # one expert's gradient at a time
            grp.p2p([], [(t, helper) for t in incoming])
            for g, t in zip(grads, incoming):
                g[expert % M].add_(t)
            del incoming
        elif helper == grp.rank:
            slot = plan.borrowed[helper].index(expert)
            grp.p2p([(g[slot], plan.owner(expert)) for g in slot_grads], [])


class _BorrowWeights(torch.autograd.Function):
    """Identity on the dispatched rows + the borrowed weights; backward returns their gradients to owners.

    The rows pass through so that this node's backward runs after the token all-to-all's backward on every
    rank (its P2P then cannot interleave with a collective), and runs on ranks that borrowed nothing.
    """

    @staticmethod
    def forward(ctx, rows, grp, plan, w1, w2, w3):
        ctx.grp, ctx.plan = grp, plan
        return (rows.view_as(rows), *_transfer_weights(grp, plan, (w1, w2, w3)))

    @staticmethod
    def backward(ctx, grad_rows, g1, g2, g3):  # unused slots arrive as zeros (materialized grads)
        M = ctx.plan.experts_per_rank
        own = [g.new_zeros((M,) + tuple(g.shape[1:])) for g in (g1, g2, g3)]
        _return_weight_grads(ctx.grp, ctx.plan, own, [g1, g2, g3])
        return grad_rows, None, None, *own


def _dest_order(topk_ids: Tensor, routes: ChunkedRoutes, rank: int) -> Tensor:
    """This rank's flattened route indices (t*k + slot) in destination-grouped order [T*k] (int64)."""
    by_expert = torch.argsort(topk_ids.reshape(-1), stable=True)  # torchtitan's local reorder
    segs = routes.expert_sorted[rank]
    # output_size makes the length static: fake tensors (simulated ranks) refuse a data-dependent one
    dest = torch.repeat_interleave(torch.tensor([d for d, _, _ in segs], dtype=torch.int64),
                                   torch.tensor([n for _, _, n in segs], dtype=torch.int64),
                                   output_size=topk_ids.numel()).to(by_expert.device)
    return by_expert[torch.argsort(dest, stable=True)]


def _per_source(runs: list[tuple[int, int, int]], num_ranks: int) -> list[int]:
    out = [0] * num_ranks
    for s, _, n in runs:
        out[s] += n
    return out


def _weights_of(key: int, native: tuple[Tensor, ...], slots) -> tuple[Tensor, ...]:
    e = native[0].shape[0]
    return tuple(w[key] for w in native) if key < e else tuple(w[key - e] for w in slots)


def _setup(x, topk_ids, topk_scores, w1, w2, w3, group, counts, num_chunks, strided, plan_args, settings=(),
           cap: int | None = None):
    """Plan shared by LLEP and PipelinedLLEP: (group, counts, plan, chunked routes, route order).

    Without ``counts``, the ranks first agree: one all-gather of a fixed length carries what every rank must
    agree on (E, I, H, k, the dtypes of x / scores / experts, the schedule and its settings: cap c, strided,
    alpha, min_piece, imbalance_threshold, max_borrowed) and whether this rank's own input was refused. A
    mismatch or refusal raises the same BoundpassInputError on every rank before the route-count all-gather
    (whose length is E) and before anything routing-sized is allocated. The chunk count K then follows from
    agreed settings and the gathered counts, so it is the same on every rank.
    """
    grp = _Group(group)
    error = None
    try:
        check_devices("PipelinedLLEP", {"x": x, "topk_ids": topk_ids, "topk_scores": topk_scores,
                                        "w1": w1, "w2": w2, "w3": w3})
        _check(x, topk_ids, topk_scores, w1, w2, w3, grp)
        if cap is not None:
            num_chunks(0)  # refuses a cap c < 1
    except BoundpassInputError as err:
        if counts or grp.size == 1:
            raise
        error = err
    if not counts:
        shaped = w1.dim() == 3
        fields = [("experts E", "int", w1.shape[0] * grp.size if shaped else None),
                  ("expert hidden I", "int", w1.shape[1] if shaped else None),
                  ("hidden size H", "int", x.shape[1] if x.dim() == 2 else None),
                  ("top-k k", "int", topk_ids.shape[1] if topk_ids.dim() == 2 else None),
                  ("x dtype", "dtype", x.dtype), ("scores dtype", "dtype", topk_scores.dtype),
                  ("expert weights dtype", "dtype", w1.dtype),
                  ("alpha", "float", plan_args["alpha"]), ("min_piece", "int", plan_args["min_piece"]),
                  ("imbalance_threshold", "float", plan_args["imbalance_threshold"]),
                  ("max_borrowed", "int", -1 if plan_args["max_borrowed"] is None else plan_args["max_borrowed"]),
                  ("strided", "bool", strided), *settings]
        agree("PipelinedLLEP", grp.group, grp.rank, grp.size, fields, local_error=error, device=x.device,
              what="EP group")
    E, k = w1.shape[0] * grp.size, topk_ids.shape[1]
    if counts:
        counts = [list(counts[r * E:(r + 1) * E]) for r in range(grp.size)]
    else:
        counts = grp.gather_counts(_route_counts(topk_ids, E))
    if len(counts) != grp.size or sum(counts[grp.rank]) != topk_ids.numel():
        raise BoundpassInputError(f"route counts {counts} do not match EP rank {grp.rank} of {grp.size} "
                                  f"holding {topk_ids.numel()} routes")
    plan = plan_llep(counts, **plan_args)
    n_max = max(sum(row) for row in counts) // k
    routes = ChunkedRoutes(counts, plan, num_chunks(n_max), strided)
    return grp, counts, plan, routes, _dest_order(topk_ids, routes, grp.rank)


# ----------------------------------------------------------------------------------------------- LLEP
def llep(x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, group=None, *,
         alpha: float = 1.1, min_piece: int = 1024, imbalance_threshold: float = 1.3,
         max_borrowed: int | None = None) -> Tensor:
    """Least-loaded EP: plan from all-gathered counts, borrowed weights, one token all-to-all. [T, H]."""
    grp, counts, plan, routes, order = _setup(
        x, topk_ids, topk_scores, w1, w2, w3, group, (), lambda n: 1, True,
        dict(alpha=alpha, min_piece=min_piece, imbalance_threshold=imbalance_threshold, max_borrowed=max_borrowed),
        settings=[("schedule", ("llep", "pipelined_llep"), "llep"), ("cap c", "int", 0)])
    k = topk_ids.shape[1]
    rows = x[order // k]
    rows, *slots = _BorrowWeights.apply(rows, grp, plan, w1, w2, w3)
    runs = routes.recv_runs(grp.rank, 0)
    send, recv = routes.send_splits(grp.rank, 0), _per_source(runs, grp.size)
    rows = grp.all_to_all_autograd(rows, recv, send)
    # split / unbind for the same reason as in standard_ep: no whole-buffer gradient per block
    pieces = torch.split(rows, [n for _, _, n in runs])
    experts = list(zip(*(w.unbind(0) for w in (w1, w2, w3)))) + list(zip(*(s.unbind(0) for s in slots)))
    outs = [expert_mlp(piece, *experts[key]) for (_, key, _), piece in zip(runs, pieces)]
    out_rows = torch.cat(outs) if outs else rows[:0] * 0
    out_rows = grp.all_to_all_autograd(out_rows, send, recv)
    # rows of a rank that borrowed nothing still pass through _BorrowWeights: its backward returns grads
    return _combine(x, out_rows, topk_scores.reshape(-1)[order], order // k)


# -------------------------------------------------------------------------------------- PipelinedLLEP
def num_chunks(max_tokens: int, cap: int) -> int:
    """K = ceil(N_max / c) chunks (at least 1), the same on every rank because N_max is global."""
    if cap < 1:
        raise BoundpassInputError(f"PipelinedLLEP chunk cap c must be >= 1 token, got {cap}")
    return max(1, -(-max_tokens // cap))


def _pipelined_setup(x, topk_ids, topk_scores, w1, w2, w3, group_name, cap, alpha, min_piece,
                     imbalance_threshold, max_borrowed, strided, counts):
    return _setup(x, topk_ids, topk_scores, w1, w2, w3, group_name, counts, lambda n: num_chunks(n, cap), strided,
                  dict(alpha=alpha, min_piece=min_piece, imbalance_threshold=imbalance_threshold,
                       max_borrowed=None if max_borrowed < 0 else max_borrowed),
                  settings=[("schedule", ("llep", "pipelined_llep"), "pipelined_llep"), ("cap c", "int", cap)], cap=cap)


class _ChunkLayout:
    """This rank's host-side schedule of one PipelinedLLEP call (pure Python: no tensors, so it can be cached).

    Per chunk j: the send and receive splits, the chunk's span [offsets[j], offsets[j+1]) of the chunk-ordered
    route permutation, and its expert blocks. A chunk's received rows are laid out source-major (that is what an
    all-to-all delivers); the blocks regroup them by weight key across sources, at most ``cap`` rows each, so a
    chunk runs one matmul chain per expert instead of one per (source, expert) run. With strided membership every
    chunk holds every expert, and the per-run blocks made strided chunks E_p times as many, smaller matmuls
    as consecutive ones: that, not the gather, was the strided penalty.
    """

    def __init__(self, routes: ChunkedRoutes, rank: int, cap: int):
        P = routes.plan.num_ranks
        self.K = routes.K
        self.send, self.recv, self.offsets = [], [], [0]
        self.segments = []   # per chunk: (received row, length, block row) runs in key-major order
        self.blocks = []     # per chunk: (weight key, lo, hi) over the key-major row order, hi - lo <= cap
        for j in range(self.K):
            send, runs = routes.send_splits(rank, j), routes.recv_runs(rank, j)
            self.send.append(send)
            self.recv.append(_per_source(runs, P))
            self.offsets.append(self.offsets[-1] + sum(send))
            by_key, at = {}, 0
            for _, key, n in runs:
                by_key.setdefault(key, []).append((at, n))
                at += n
            segs, blocks, row = [], [], 0
            for key in sorted(by_key):
                start = row
                for a, n in by_key[key]:
                    segs.append((a, n, row))
                    row += n
                blocks += [(key, lo, min(lo + cap, row)) for lo in range(start, row, cap)]
            self.segments.append(segs)
            self.blocks.append(blocks)
        self.rows = [sum(r) for r in self.recv]
        self.n_max = max(b - a for a, b in zip(self.offsets, self.offsets[1:]))
        self.r_max = max(self.rows)

    def positions(self, j: int, device) -> Tensor:
        """[R_j] int64: received-row index of each row in key-major order (chunk j's block permutation)."""
        segs, R = self.segments[j], self.rows[j]
        if not segs:
            return torch.zeros(0, dtype=torch.int64, device=device)
        shift = torch.tensor([a - row for a, _, row in segs], dtype=torch.int64, device=device)
        lengths = torch.tensor([n for _, n, _ in segs], dtype=torch.int64, device=device)
        pos = torch.repeat_interleave(shift, lengths, output_size=R)
        return pos.add_(torch.arange(R, dtype=torch.int64, device=device))


@functools.lru_cache(maxsize=64)
def _schedule(counts: tuple, k: int, cap: int, strided: bool, plan_args: tuple, rank: int):
    """(plan, chunk layout) of one call, from the gathered counts: computed once, shared by forward and backward.

    Backward reuses the forward's schedule instead of re-planning (the plan is a pure function of the counts and
    settings, so the cache can only return what planning again would give). Host memory only."""
    counts = [list(row) for row in counts]
    plan = plan_llep(counts, **dict(plan_args))
    n_max = max(sum(row) for row in counts) // k
    routes = ChunkedRoutes(counts, plan, num_chunks(n_max, cap), strided)
    return plan, routes, _ChunkLayout(routes, rank, cap)


def schedule_of(counts_rows, k, cap, strided, alpha, min_piece, imbalance_threshold, max_borrowed, rank):
    plan_args = (("alpha", alpha), ("min_piece", min_piece), ("imbalance_threshold", imbalance_threshold),
                 ("max_borrowed", None if max_borrowed < 0 else max_borrowed))
    return _schedule(tuple(tuple(int(n) for n in row) for row in counts_rows), k, cap, strided, plan_args, rank)


def _chunk_order(order: Tensor, routes: ChunkedRoutes) -> Tensor:
    """The route order permuted so that chunk j's routes are one contiguous span (strided: every K-th route).

    Built once per call; each chunk's send buffer is then one index_select of a contiguous span into a reused
    buffer, whatever the membership. Kept from forward to backward: N k indices, the plan's own size."""
    if not routes.strided or routes.K == 1:
        return order
    return torch.cat([order[j::routes.K] for j in range(routes.K)])


# Timestamps of the pipeline's collectives, for bench/dispatch.py's overlap figures: None (off, the default) or a
# list that receives (phase, collective, chunk, t_launch, t_wait_start, t_wait_end) in time.perf_counter seconds.
TIMELINE: list | None = None


class _Pipe:
    """Async uneven all-to-alls (work handles: gloo and NCCL alike) with optional timestamps."""

    def __init__(self, grp: _Group, phase: str):
        self.grp, self.phase = grp, phase

    def launch(self, what: str, j: int, out: Tensor, inp: Tensor, out_rows: list[int], in_rows: list[int]):
        t = time.perf_counter() if TIMELINE is not None else 0.0
        if self.grp.size == 1:
            out.copy_(inp)
            work = None
        else:
            work = dist.all_to_all_single(out, inp, out_rows, in_rows, group=self.grp.group, async_op=True)
        return (what, j, t, work)

    def wait(self, handle) -> None:
        what, j, t, work = handle
        t0 = time.perf_counter() if TIMELINE is not None else 0.0
        if work is not None:
            work.wait()
        if TIMELINE is not None:
            TIMELINE.append((self.phase, what, j, t, t0, time.perf_counter()))


def _forward_block(rows: Tensor, pos: Tensor, weights, cd: torch.dtype) -> None:
    """One expert on rows[pos] (at most c), written back into rows[pos]: the chunk is computed in place.

    The rows are gathered first, so overwriting them is safe (each received row belongs to one block)."""
    a = rows.index_select(0, pos)
    e1, e2, e3 = (w.to(cd) for w in weights)
    narrow = cd != rows.dtype
    a_cd = a.to(cd) if narrow else a
    h = F.silu(torch.mm(a_cd, e1.t()), inplace=True).mul_(torch.mm(a_cd, e3.t()))
    if narrow:
        del a, a_cd
        rows.index_copy_(0, pos, torch.mm(h, e2.t()).to(rows.dtype))
    else:
        rows.index_copy_(0, pos, torch.mm(h, e2.t(), out=a))  # a's rows are spent: its buffer takes the result


def pipelined_llep_forward(x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
                           group_name: str = "", cap: int = 1024, alpha: float = 1.1, min_piece: int = 1024,
                           imbalance_threshold: float = 1.3, max_borrowed: int = -1, strided: bool = True,
                           counts: tuple[int, ...] = (), compute_dtype: torch.dtype | None = None,
                           overlap: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Eager forward: (output [T, H] in x's dtype, route counts [E_p, E] int64, chunk-ordered routes [T k] int64).

    The last two are what backward needs to run the same chunks without planning or sorting again.
    compute_dtype: dtype of the expert matmuls (None: x's). torchtitan's GroupedExperts casts rows and weights
    to bf16 for its grouped mm and the result back to x's dtype; the compiler pass passes bf16 to match it.
    overlap: chunk j+1's dispatch and chunk j-1's combine are in flight while chunk j's experts run (False:
    each collective is waited for at once; one receive buffer instead of three; same numbers either way).
    """
    grp, counts, _, routes, order = _pipelined_setup(x, topk_ids, topk_scores, w1, w2, w3, group_name, cap,
                                                     alpha, min_piece, imbalance_threshold, max_borrowed,
                                                     strided, counts)
    perm = _chunk_order(order, routes)
    del order
    k, acc, cd = topk_ids.shape[1], _acc_dtype(x.dtype), compute_dtype or x.dtype
    plan, _, lay = schedule_of(counts, k, cap, strided, alpha, min_piece, imbalance_threshold, max_borrowed,
                                grp.rank)
    native = (w1, w2, w3)
    slots = _transfer_weights(grp, plan, native)
    scores = topk_scores.reshape(-1)
    out = torch.zeros_like(x)
    H, pipe = x.shape[1], _Pipe(grp, "forward")
    # reused buffers, sized by this call's largest chunk (<= c k sent, <= E_p c k received)
    send_buf, back_buf = x.new_empty((lay.n_max, H)), x.new_empty((lay.n_max, H))
    # chunks j-1 (its combine sending), j (computed in place), j+1 (arriving); fewer when there are fewer chunks
    recv_bufs = [x.new_empty((lay.r_max, H)) for _ in range(min(3 if overlap else 1, lay.K))]

    def dispatch(j):
        idx = perm[lay.offsets[j]:lay.offsets[j + 1]]
        tok = idx // k
        send = torch.index_select(x, 0, tok, out=send_buf[:idx.numel()])
        rows = recv_bufs[j % len(recv_bufs)][:lay.rows[j]]
        return pipe.launch("dispatch", j, rows, send, lay.recv[j], lay.send[j]), rows, idx, tok

    def combine_done(handle, idx, tok):
        pipe.wait(handle)
        back = back_buf[:idx.numel()]
        out.index_add_(0, tok, (back.to(acc) * scores[idx].to(acc).unsqueeze(1)).to(x.dtype))

    nxt, combine = dispatch(0), None
    for j in range(lay.K):
        handle, rows, idx, tok = nxt
        pipe.wait(handle)
        if overlap and j + 1 < lay.K:
            nxt = dispatch(j + 1)  # in flight while chunk j's experts run
        pos = lay.positions(j, x.device)
        for key, lo, hi in lay.blocks[j]:
            _forward_block(rows, pos[lo:hi], _weights_of(key, native, slots), cd)
        del pos
        if combine is not None:
            combine_done(*combine)  # chunk j-1's combine was in flight during chunk j's experts
        combine = (pipe.launch("combine", j, back_buf[:idx.numel()], rows, lay.send[j], lay.recv[j]), idx, tok)
        del rows, idx, tok, handle
        if not overlap:
            combine_done(*combine)
            combine = None
            if j + 1 < lay.K:
                nxt = dispatch(j + 1)
    if combine is not None:
        combine_done(*combine)
    return out, torch.tensor(counts, dtype=torch.int64, device=x.device), perm


def pipelined_llep_backward(grad_out: Tensor, x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor,
                            w2: Tensor, w3: Tensor, counts: Tensor | tuple[int, ...], perm: Tensor,
                            group_name: str = "", cap: int = 1024,
                            alpha: float = 1.1, min_piece: int = 1024, imbalance_threshold: float = 1.3,
                            max_borrowed: int = -1, strided: bool = True,
                            compute_dtype: torch.dtype | None = None, overlap: bool = True) -> tuple[Tensor, ...]:
    """Eager backward over the forward's chunks: (dx, dscores, dw1, dw2, dw3).

    Nothing of the dispatch is planned or sorted again: the schedule comes from the forward's counts (cached host
    plan), the chunk spans from the forward's chunk-ordered routes ``perm``. Per chunk, a route's [x | grad |
    score] travel to its expert as one packed row (x must travel again: keeping the received rows would be the
    routing-sized buffer the op exists to bound), the expert forward is recomputed, and [dx | dscore] come back.
    counts: the forward's route-count tensor, or the same counts as ints (simulated ranks: fake tensors hold no data).
    """
    counts = tuple(counts) if isinstance(counts, (tuple, list)) else tuple(counts.reshape(-1).tolist())
    grp = _Group(group_name)
    E, k = w1.shape[0] * grp.size, topk_ids.shape[1]
    if len(counts) != grp.size * E or perm.numel() != topk_ids.numel():
        raise BoundpassInputError(f"PipelinedLLEP backward: {len(counts)} counts and {perm.numel()} routes do not "
                                  f"match E_p = {grp.size}, E = {E} and {topk_ids.numel()} routes")
    rows_of = [counts[r * E:(r + 1) * E] for r in range(grp.size)]
    plan, _, lay = schedule_of(rows_of, k, cap, strided, alpha, min_piece, imbalance_threshold, max_borrowed,
                                grp.rank)
    acc, cd = _acc_dtype(x.dtype), compute_dtype or x.dtype
    native = (w1, w2, w3)
    slots = _transfer_weights(grp, plan, native)  # borrowed again: holding them across the step costs s_b experts
    grads, slot_grads = [torch.zeros_like(w) for w in native], [torch.zeros_like(s) for s in slots]
    scores, grad_out = topk_scores.reshape(-1), grad_out.contiguous()
    dx, dscores = torch.zeros_like(x), torch.zeros_like(scores)
    H, pipe = x.shape[1], _Pipe(grp, "backward")
    # one packed dtype for [x | grad | score] rows and [dx | dscore] rows (the widest of the three: casts to it and
    # back are exact)
    pd = torch.promote_types(torch.promote_types(x.dtype, grad_out.dtype), scores.dtype)
    send_buf = x.new_empty((lay.n_max, 2 * H + 1), dtype=pd)
    back_buf = x.new_empty((lay.n_max, H + 1), dtype=pd)
    depth = min(2 if overlap else 1, lay.K)
    recv_bufs = [x.new_empty((lay.r_max, 2 * H + 1), dtype=pd) for _ in range(depth)]   # chunks j, j+1
    result_bufs = [x.new_empty((lay.r_max, H + 1), dtype=pd) for _ in range(depth)]     # chunks j, j-1

    def gather(src, tok, out):
        if src.dtype == out.dtype:
            torch.index_select(src, 0, tok, out=out)
        else:
            out.copy_(src.index_select(0, tok))

    def dispatch(j):
        idx = perm[lay.offsets[j]:lay.offsets[j + 1]]
        tok, n = idx // k, idx.numel()
        send = send_buf[:n]
        gather(x, tok, send[:, :H])
        gather(grad_out, tok, send[:, H:2 * H])
        send[:, 2 * H].copy_(scores.index_select(0, idx))
        rows = recv_bufs[j % depth][:lay.rows[j]]
        return pipe.launch("dispatch", j, rows, send, lay.recv[j], lay.send[j]), rows, idx, tok

    def combine_done(handle, idx, tok):
        pipe.wait(handle)
        back = back_buf[:idx.numel()]
        dx.index_add_(0, tok, back[:, :H].to(x.dtype))
        dscores.index_copy_(0, idx, back[:, H].to(scores.dtype))

    nxt, combine = dispatch(0), None
    for j in range(lay.K):
        handle, rows, idx, tok = nxt
        pipe.wait(handle)
        if overlap and j + 1 < lay.K:
            nxt = dispatch(j + 1)
        result = result_bufs[j % depth][:lay.rows[j]]
        pos = lay.positions(j, x.device)
        for key, lo, hi in lay.blocks[j]:
            p = pos[lo:hi]
            xb, gb, sb = (rows[:, :H].index_select(0, p), rows[:, H:2 * H].index_select(0, p),
                          rows[:, 2 * H].index_select(0, p))
            if pd != x.dtype:
                xb, gb, sb = xb.to(x.dtype), gb.to(grad_out.dtype), sb.to(scores.dtype)
            dxb, dsb = _expert_backward(xb, gb, sb, _weights_of(key, native, slots),
                                        _weights_of(key, grads, slot_grads), acc, cd)
            del xb, gb, sb
            result[:, :H].index_copy_(0, p, dxb.to(pd))
            result[:, H].index_copy_(0, p, dsb.to(pd))
            del dxb, dsb
        del pos
        if combine is not None:
            combine_done(*combine)
        combine = (pipe.launch("combine", j, back_buf[:idx.numel()], result, lay.send[j], lay.recv[j]), idx, tok)
        del rows, result, idx, tok, handle
        if not overlap:
            combine_done(*combine)
            combine = None
            if j + 1 < lay.K:
                nxt = dispatch(j + 1)
    if combine is not None:
        combine_done(*combine)
    del combine, nxt, send_buf, back_buf, recv_bufs, result_bufs  # before the slot gradients travel home
    _return_weight_grads(grp, plan, grads, slot_grads)
    return dx, dscores.view_as(topk_scores), *grads


def _expert_backward(x, g, s, weights, dweights, acc, cd) -> tuple[Tensor, Tensor]:
    """One expert's rows: recompute, then return dx [n, H] and dscore [n] and add into dw1/dw2/dw3 (in place).

    cd: the matmul dtype. When it is x's, products accumulate in place (addmm_), and the score gradient
    <g, y> = <g, p w2^T> is taken as <g w2, p>: the same g w2 gives dp = score * (g w2), so y itself is never
    recomputed (one matmul of the three forward ones saved). When cd is narrower (bf16, as torchtitan's
    GroupedExperts), each product is formed in cd and added in x's dtype and y is recomputed, which is what
    autograd through torchtitan's casts computes.
    """
    narrow, x_dtype = cd != x.dtype, x.dtype
    x = x.to(cd)
    w1, w2, w3 = (w.to(cd) for w in weights)
    dw1, dw2, dw3 = dweights

    def add_mm(out, a, b):
        if narrow:
            out.add_(torch.mm(a, b))
        else:
            out.addmm_(a, b)

    h1, h3 = torch.mm(x, w1.t()), torch.mm(x, w3.t())
    act = F.silu(h1)
    p = act * h3
    if narrow:
        y = torch.mm(p, w2.t())
        ds = (g.to(acc) * y.to(acc)).sum(1)  # combine: out += (y * score), score grad = <g, y>
        del y
        dy = (g.to(acc) * s.to(acc).unsqueeze(1)).to(cd)
        add_mm(dw2, dy.t(), p)
        del p
        dp = torch.mm(dy, w2)
        del dy
    else:
        gw = torch.mm(g, w2)
        ds = (gw.to(acc) * p.to(acc)).sum(1)
        dy = (g.to(acc) * s.to(acc).unsqueeze(1)).to(cd)
        add_mm(dw2, dy.t(), p)
        del p, dy
        dp = gw.mul_(s.unsqueeze(1))  # dy w2 = score * (g w2)
        del gw
    dh3 = dp * act
    del act
    add_mm(dw3, dh3.t(), x)
    dx = torch.mm(dh3, w3).to(x_dtype)  # narrow: the two dx products are summed in x's dtype, as autograd does
    del dh3
    dact = dp.mul_(h3)
    del h3
    dh1 = torch.ops.aten.silu_backward(dact, h1)  # what autograd runs for silu: one rounding in narrow dtypes
    del dact, h1
    add_mm(dw1, dh1.t(), x)
    if narrow:
        dx.add_(torch.mm(dh1, w1))
    else:
        dx.addmm_(dh1, w1)
    return dx, ds


# ---------------------------------------------------------------------------------------- custom ops
# Opaque ops: Inductor cannot fuse across chunks (which would re-form the whole receive buffer), and
# AOTAutograd takes the backward from register_autograd instead of unrolling the chunk loop.
@torch.library.custom_op("boundpass::pipelined_llep_fwd", mutates_args=())
def pipelined_llep_fwd(x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
                       group_name: str, cap: int, alpha: float, min_piece: int, imbalance_threshold: float,
                       max_borrowed: int, strided: bool, counts: list[int],
                       compute_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    return pipelined_llep_forward(x, topk_ids, topk_scores, w1, w2, w3, group_name, cap, alpha, min_piece,
                                  imbalance_threshold, max_borrowed, strided, tuple(counts), compute_dtype)


@pipelined_llep_fwd.register_fake
def _(x, topk_ids, topk_scores, w1, w2, w3, group_name, cap, alpha, min_piece, imbalance_threshold, max_borrowed,
      strided, counts, compute_dtype):
    if mixed_real_call("PipelinedLLEP", {"x": x, "topk_ids": topk_ids, "topk_scores": topk_scores,
                                         "w1": w1, "w2": w2, "w3": w3}):
        return pipelined_llep_forward(x, topk_ids, topk_scores, w1, w2, w3, group_name, cap, alpha, min_piece,
                                      imbalance_threshold, max_borrowed, strided, tuple(counts), compute_dtype)
    size = _Group(group_name).size
    return (torch.empty_like(x), x.new_empty((size, w1.shape[0] * size), dtype=torch.int64),
            topk_ids.new_empty((topk_ids.numel(),), dtype=torch.int64))


@torch.library.custom_op("boundpass::pipelined_llep_bwd", mutates_args=())
def pipelined_llep_bwd(grad_out: Tensor, x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor,
                       w3: Tensor, counts: Tensor, perm: Tensor, group_name: str, cap: int, alpha: float,
                       min_piece: int, imbalance_threshold: float, max_borrowed: int,
                       strided: bool, compute_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return pipelined_llep_backward(grad_out, x, topk_ids, topk_scores, w1, w2, w3, counts, perm, group_name, cap,
                                   alpha, min_piece, imbalance_threshold, max_borrowed, strided, compute_dtype)


@pipelined_llep_bwd.register_fake
def _(grad_out, x, topk_ids, topk_scores, w1, w2, w3, counts, perm, *args):
    if mixed_real_call("PipelinedLLEP backward", {"grad_out": grad_out, "x": x, "topk_ids": topk_ids,
                                                  "topk_scores": topk_scores, "w1": w1, "w2": w2, "w3": w3,
                                                  "counts": counts, "perm": perm}):
        return pipelined_llep_backward(grad_out, x, topk_ids, topk_scores, w1, w2, w3, counts, perm, *args)
    return (torch.empty_like(x), torch.empty_like(topk_scores), torch.empty_like(w1), torch.empty_like(w2),
            torch.empty_like(w3))


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_scores, w1, w2, w3, *args = inputs
    ctx.save_for_backward(x, topk_ids, topk_scores, w1, w2, w3, output[1], output[2])
    ctx.args = args[:-2] + args[-1:]  # drop the counts: they come back as the forward's second output


def _backward(ctx, grad_out, grad_counts, grad_perm):
    x, topk_ids, topk_scores, w1, w2, w3, counts, perm = ctx.saved_tensors
    dx, ds, d1, d2, d3 = torch.ops.boundpass.pipelined_llep_bwd(grad_out, x, topk_ids, topk_scores, w1, w2, w3,
                                                                 counts, perm, *ctx.args)
    return (dx, None, ds, d1, d2, d3) + (None,) * 9


pipelined_llep_fwd.register_autograd(_backward, setup_context=_setup_context)


def pipelined_llep(x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
                   group=None, *, cap: int, alpha: float = 1.1, min_piece: int = 1024,
                   imbalance_threshold: float = 1.3, max_borrowed: int | None = None, strided: bool = True,
                   counts=(), compute_dtype: torch.dtype | None = None) -> Tensor:
    """Differentiable PipelinedLLEP through the custom op: [T, H]; ``cap`` = c tokens per source per chunk.

    ``max_borrowed`` (default e = E/E_p) is the number of borrowed-expert slots per rank, s_b in the bound.
    ``counts`` (flattened [E_p, E] route counts) skips the all-gather, e.g. for a simulated rank.
    ``compute_dtype``: dtype of the expert matmuls (None: x's; torchtitan's GroupedExperts uses bf16).
    """
    slots = w1.shape[0] if max_borrowed is None else max_borrowed
    out, _, _ = torch.ops.boundpass.pipelined_llep_fwd(x, topk_ids, topk_scores, w1, w2, w3, group_name_of(group),
                                                    cap, alpha, min_piece, imbalance_threshold, slots, strided,
                                                    list(counts), compute_dtype or x.dtype)
    return out


# ------------------------------------------------------------------------------------------- bounds
def borrowed_slot_count(max_borrowed: int | None, local_experts: int, ep_size: int,
                        routes_per_rank: int | None = None, alpha: float = DEFAULT_ALPHA) -> int:
    """s_b, the borrowed-expert slots one rank can fill: ``max_borrowed`` (None: e, LLEP's default; negative: no
    limit), at most the (E_p - 1) e experts the other ranks own, so none on one EP rank, and, when every rank routes
    ``routes_per_rank`` (T k) routes, at most what LLEP's planner ever lends one helper
    (``llep_plan.lendable_experts``: 15 of qwen3's 32 at E_p = 2): a smaller limit that changes no plan, and the
    bound's s_b counts only slots some routing fills. The dispatch pass gives the op this (Config's
    dispatch.borrowed_slots), the op's planner enforces it, and the composed budget counts it."""
    most = ((ep_size - 1) * local_experts if routes_per_rank is None
            else lendable_experts(int(routes_per_rank), local_experts, ep_size, alpha))
    if max_borrowed is None:
        max_borrowed = local_experts
    return most if max_borrowed < 0 else min(max_borrowed, most)


def _expert_bytes():
    return 3 * sym.I * sym.H * sym.b  # w1, w2, w3 of one expert


def expert_bytes(*, H: int, I: int, b: int) -> int:
    """One expert's w1, w2, w3 in bytes (the bound's Wx; a borrowed slot holds these and their gradients)."""
    return int(_expert_bytes().subs({sym.H: H, sym.I: I, sym.b: b}))


def pipelined_llep_bound(*, mixed_precision: bool, narrow_compute: bool = False,
                         count_own_weights: bool = True, overlap: bool = True, part: str = "peak") -> sympy.Expr:
    """Peak device bytes of one PipelinedLLEP forward + backward on a rank, from launch configuration only.

    Symbols: N (token ceiling per rank), H, I, E, E_p, k, c (tokens per source per chunk), s_b (borrowed
    slots per rank), b (input bytes/elem), b_acc (combine bytes/elem), b_idx (index bytes/elem).
    Counted: x, ids, scores, this rank's experts, output and its gradient, input gradients, what forward keeps
    for backward (the chunk-ordered routes, N k indices, and the counts), and workspace. A chunk moves at most
    c k routes per source, so a rank receives at most E_p c k rows; experts run on blocks of at most c rows.
    ``overlap`` (the op's schedule): chunk j+1's dispatch and chunk j-1's combine are in flight while chunk j
    runs, so the forward holds three receive buffers (j-1 being combined from, j computed in place, j+1
    arriving) and the backward two receive and two result buffers; without it, one of each.
    ``mixed_precision``: inputs narrower than the fp32 combine (bf16/fp16).
    ``narrow_compute``: expert matmuls in a narrower dtype than the input (torchtitan's bf16 grouped mm on an
    fp32 model): one expert's cast weights and a block's cast rows / product are added (at b, an upper bound).
    ``count_own_weights=False``: leave out this rank's own expert weights and their gradients (the compiler's
    table already counts them as parameters and gradients); borrowed slots stay in.
    ``part``: "peak" (the larger of the two), "forward" (the forward op alone: what a graph walk charges at the
    forward node, e.g. a checkpointed block's recompute, where the backward's gradients do not exist yet) or
    "backward" (the backward op alone).
    """
    if part not in ("peak", "forward", "backward"):
        raise ValueError(f"part must be 'peak', 'forward' or 'backward', got {part!r}")
    N, H, I, E, E_p, k, c, s_b = sym.N, sym.H, sym.I, sym.E, sym.E_p, sym.k, sym.c, sym.s_b
    b, b_acc, b_idx = sym.b, sym.b_acc, sym.b_idx
    cast = 1 if mixed_precision else 0
    narrow = 1 if narrow_compute else 0
    n, R = c * k, E_p * c * k  # routes per chunk out of / into this rank, whatever the router does
    depth_f, depth_b = (3, 2) if overlap else (1, 1)
    own = E / E_p if count_own_weights else 0
    weights = (own + s_b) * _expert_bytes()  # own experts + borrowed slots
    inputs = N * H * b + N * k * (b_idx + b) + weights
    plan = N * k * b_idx + 2 * E_p * E * b_idx  # chunk-ordered routes (kept for backward), gathered counts
    setup = 3 * N * k * b_idx  # argsorts building the route order, then its chunk order
    tokens = 3 * n * b_idx  # token ids of chunks j-1 (combining), j, j+1 (dispatching)
    positions = R * b_idx   # chunk j's block permutation (twice that while it is built)
    # forward: send + combine-receive buffers [c k, H], depth_f receive buffers [E_p c k, H] (computed in place)
    fwd_pools = 2 * n * H * b + depth_f * R * H * b + tokens
    block_fwd = c * H * b + 2 * c * I * b + narrow * (_expert_bytes() + c * H * b)  # rows, [c, I] x 2, casts
    combine_fwd = n * H * b_acc + n * b + cast * (n * H * (b_acc + b) + n * b_acc)  # score products, their casts
    fwd_loop = fwd_pools + sym.max_kept(2 * positions, positions + block_fwd, combine_fwd)
    fwd = inputs + plan + N * H * b + sym.max_kept(setup, fwd_loop)
    # backward: packed [x | grad | score] rows out (c k) and in (depth_b x E_p c k), [dx | dscore] rows in
    # depth_b result buffers and one combine-receive buffer
    bwd_pools = n * (3 * H + 2) * b + depth_b * R * (3 * H + 2) * b + tokens
    # one block: gathered x, grad, score rows; h1, h3, silu, product, g w2, then the score-gradient product or
    # dy (and its casts); dscore
    block_bwd = 2 * c * H * b + c * b + c * b_acc + sym.max_kept(
        5 * c * I * b + c * I * b_acc + 2 * cast * c * I * b_acc,
        5 * c * I * b + c * H * b_acc + cast * c * H * (b_acc + b))
    block_bwd += narrow * (_expert_bytes() + I * H * b + 2 * c * H * b)  # casts, one weight-grad product, y
    combine_bwd = n * H * b + 2 * n * b  # a contiguous copy of the strided dx / dscore columns, the score gather
    bwd_loop = bwd_pools + sym.max_kept(2 * positions, positions + block_bwd, combine_bwd)
    grads = N * H * b + N * k * b + weights  # dx, dscores, dw (own + borrowed slots)
    bwd = inputs + plan + 2 * N * H * b + grads + sym.max_kept(bwd_loop, _expert_bytes())
    if part != "peak":
        return fwd if part == "forward" else bwd
    # no Max here has an argument another dominates: built unevaluated (sym.max_kept; ~0.4 s of evaluation
    # otherwise)
    return sym.max_kept(fwd, bwd)


def standard_ep_bound(part: str = "peak") -> sympy.Expr:
    """Peak device bytes of standard EP forward + backward on a rank, given R = rows it received (realized).

    R is set by the router: up to E_p N k on a hot rank. Same counting as ``pipelined_llep_bound``
    (inputs, output and its gradient, input gradients); autograd keeps every received row until backward.
    The N k returned rows are counted at the combine's width b_acc (= b for fp32/fp64 inputs): for bf16/fp16
    the combine saves an fp32 copy of them, and its backward holds that copy, the fp32 output gradient and
    the two fp32 products of the score multiply at once: 4 N k H b_acc, whatever R is (a cold rank too).
    ``part``: "peak" (forward + backward, what the backward holds) or "forward" (the forward alone, e.g. a
    checkpointed block's recompute: what it saves, the expert outputs while they are concatenated, the combine's
    rows, product and output; none of the gradients)."""
    if part not in ("peak", "forward"):
        raise ValueError(f"part must be 'peak' or 'forward', got {part!r}")
    N, H, I, E, E_p, k, R = sym.N, sym.H, sym.I, sym.E, sym.E_p, sym.k, sym.R
    b, b_acc, b_idx = sym.b, sym.b_acc, sym.b_idx
    inputs = N * H * b + N * k * (b_idx + b) + E / E_p * _expert_bytes()
    saved = N * k * 2 * b_idx + R * (2 * H + 4 * I) * b  # route order, received rows, MLP activations
    if part == "forward":
        # + the expert outputs beside their concatenation (R H), the returned rows and their score product (a
        # narrower input: the rows as received, their b_acc copy, the product and its cast back, the scores' upcast),
        # the gathered scores and the combine's token index, the zero-filled sum and the output, the route counts
        narrower = sympy.Min(1, b_acc - b)
        combine_fwd = 2 * N * k * H * b_acc + narrower * N * k * (2 * H * b + b_acc)
        return inputs + saved + R * H * b + combine_fwd + N * k * (b + b_idx) + 2 * N * H * b + 2 * E * b_idx
    combine = 4 * N * k * H * b_acc  # returned rows (as the combine saves them), their grad, 2 products
    return 2 * (inputs + saved) + combine + 2 * N * H * b  # + grads of everything saved, output and its grad


def llep_bound() -> sympy.Expr:
    """Standard EP's bound plus s_b borrowed experts and their gradients; R = rows after relocation (realized)."""
    return standard_ep_bound() + 2 * sym.s_b * _expert_bytes()


def bound_values(dtype: torch.dtype, *, N: int, H: int, I: int, E: int, E_p: int, k: int, c: int | None = None,
                 s_b: int | None = None, R: int | None = None) -> dict:
    """Concrete symbol values for evaluating a dispatch bound (s_b defaults to E / E_p, c to N)."""
    acc = _acc_dtype(dtype)
    return {sym.N: N, sym.H: H, sym.I: I, sym.E: E, sym.E_p: E_p, sym.k: k, sym.c: c or N,
            sym.s_b: E // E_p if s_b is None else s_b, sym.R: R or 0,
            sym.b: torch.empty((), dtype=dtype).element_size(),
            sym.b_acc: torch.empty((), dtype=acc).element_size(), sym.b_idx: 8}


# ------------------------------------------------------------------------------------- memory contract
def _device_bound(a: dict, ctx: dict) -> sympy.Expr:
    """PipelinedLLEP's bound (inputs, own experts, outputs, workspace) at one call, its forward's at the forward and
    its backward's at the backward (the step analysis subtracts the call's own inputs and outputs); cap c symbolic.
    Charging the backward's bound at the forward counted, in a checkpointed block's recompute, the expert-weight
    gradients and input gradients the backward has not made yet."""
    forward = "grad_out" not in a
    x, ids, w1 = a["x"], a["topk_ids"], a["w1"]
    e, inter, hidden = (int(d) for d in w1.shape)
    ep, k = _Group(a["group_name"]).size, int(ids.shape[-1])
    slots = a["max_borrowed"]
    if slots < 0:  # max_borrowed -1: no limit, a helper can borrow every expert of the other ranks
        slots = borrowed_slot_count(slots, e, ep)
    values = bound_values(x.dtype, N=1, H=hidden, I=inter, E=e * ep, E_p=ep, k=k, s_b=slots)
    values[sym.N] = contracts.as_expr(x.shape[0])
    values.pop(sym.c)
    values.pop(sym.R)
    mixed = torch.promote_types(x.dtype, torch.float32) != x.dtype
    bound = contracts.cached_bound(pipelined_llep_bound, mixed_precision=mixed,
                                   narrow_compute=a["compute_dtype"] != x.dtype, count_own_weights=True,
                                   part="forward" if forward else "backward")
    return contracts.substitute(bound, values)


contracts.register_bound(torch.ops.boundpass.pipelined_llep_fwd.default, _device_bound)
contracts.register_bound(torch.ops.boundpass.pipelined_llep_bwd.default, _device_bound)
