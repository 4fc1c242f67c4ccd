"""Ring-DTP: fused output projection + cross-entropy over the P ranks of a ring, never forming [N, V] logits.

Each rank r holds its own batch h_r [N_r, H] with labels [N_r] and its own vocab shard W_r [V_r, H]
(rows ``vocab_shard_range(V, P, r)``; V need not divide by P). Over P ring rounds every batch meets every
shard once; each round makes logit strips [N, C] (C <= V_r), folds them into a per-token online
log-sum-exp state (running max, running sum of exponentials, target logit) and frees them.

Two branches (docs/design.md §2): **move activations** circulates each batch (and its state, or in backward its
dh accumulator) when N_max < V_max; **move weights** circulates the shards (and in backward their dW
accumulators) otherwise. Backward recomputes strips from the saved log-sum-exp, so both dh and dW are exact.

The op returns this rank's *sum* of token losses (ignore_index tokens excluded) and the per-token
log-sum-exp. Dividing by the global number of valid tokens (torchtitan's normalisation) is the caller's.
dW_r holds the contributions of *every* rank's batch to shard r: the gradient of sum_r loss_r.
"""
from __future__ import annotations

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

BRANCHES = ("auto", "activations", "weights")


# ----------------------------------------------------------------------------------------------- shards
def vocab_shard_sizes(vocab_size: int, ring_size: int) -> list[int]:
    """Rows of the vocab held by each rank: the first V % P ranks hold one more row (tokens are rows)."""
    if ring_size < 1 or vocab_size < ring_size:
        raise BoundpassInputError(
            f"Ring-DTP needs 1 <= P <= V, got P={ring_size}, V={vocab_size}: use a smaller ring group")
    base, extra = divmod(vocab_size, ring_size)
    return [base + (1 if r < extra else 0) for r in range(ring_size)]


def vocab_shard_range(vocab_size: int, ring_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) vocab rows of ``rank``'s shard."""
    sizes = vocab_shard_sizes(vocab_size, ring_size)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def choose_branch(max_tokens: int, vocab_size: int, ring_size: int) -> str:
    """'activations' when a batch is smaller than a shard (it is the cheaper payload), else 'weights'."""
    return "activations" if max_tokens < -(-vocab_size // ring_size) else "weights"


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 accumulation for bf16/fp16/fp32 inputs, fp64 stays fp64 (gradcheck needs it).
    return torch.promote_types(dtype, torch.float32)


# ------------------------------------------------------------------------------------------ strip math
def _fold_strip(h, w_block, v0, labels, run_max, run_sum, target, acc):
    """Fold one logit strip h @ w_block.T into the online log-sum-exp state (in place)."""
    logits = torch.mm(h, w_block.t())
    if logits.dtype != acc:
        logits = logits.to(acc)  # the bf16 strip is freed here: the model upcasts its logits the same way
    width = logits.shape[1]
    # per-token temporaries are kept few and in place: their bytes are part of the declared bound
    idx = labels - v0
    hit = (idx >= 0) & (idx < width)
    idx.clamp_(0, width - 1)
    picked = logits.gather(1, idx.unsqueeze(1)).squeeze(1)
    target.add_(picked.mul_(hit))
    del idx, hit, picked
    new_max = torch.maximum(run_max, logits.amax(dim=1))
    logits.sub_(new_max.unsqueeze(1)).exp_()
    run_sum.mul_(run_max.sub_(new_max).exp_()).add_(logits.sum(dim=1))
    run_max.copy_(new_max)


def _grad_strip(h, w_block, v0, labels, lse, token_scale, dh_acc, dw_acc_block, acc, lse_scale=None):
    """Accumulate one strip's contribution to dh (all its rows) and to dW (its vocab rows), in place.

    d/d(logit_v) of token_scale * loss + lse_scale * lse = (token_scale + lse_scale) p_v - token_scale [v = y].
    """
    probs = torch.mm(h, w_block.t())
    if probs.dtype != acc:
        probs = probs.to(acc)
    width = probs.shape[1]
    probs.sub_(lse.unsqueeze(1)).exp_()
    idx = labels - v0
    hit = (idx >= 0) & (idx < width)
    idx.clamp_(0, width - 1)
    if lse_scale is None:
        probs.scatter_add_(1, idx.unsqueeze(1), hit.to(acc).neg_().unsqueeze(1))
        probs.mul_(token_scale.unsqueeze(1))  # d(loss_sum)/d(logit); zero rows for ignore_index tokens
    else:  # the lse output's gradient too (where: no 0 * inf for a target outside this strip)
        probs.mul_((token_scale + lse_scale).unsqueeze(1))
        probs.scatter_add_(1, idx.unsqueeze(1), torch.where(hit, token_scale, 0).neg_().unsqueeze(1))
    del idx, hit
    if h.dtype == acc:
        dh_acc.addmm_(probs, w_block)
        dw_acc_block.addmm_(probs.t(), h)
    else:  # the model's logits grad is cast back to the input dtype before its matmuls: do the same
        probs = probs.to(h.dtype)
        dh_acc.add_(torch.mm(probs, w_block))
        dw_acc_block.add_(torch.mm(probs.t(), h))


def _blocks(rows: int, block: int):
    for v in range(0, rows, block):
        yield v, min(v + block, rows)


# ------------------------------------------------------------------------------------------------- ring
class _Ring:
    """Ring neighbours of a process group (P = 1: no group, nothing moves)."""

    def __init__(self, group_name: str):
        self.group = dist.distributed_c10d._resolve_process_group(group_name) if group_name else None
        self.size = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0

    def owner(self, step: int) -> int:
        """Group rank whose batch/shard this rank holds after ``step`` shifts."""
        return (self.rank - step) % self.size

    def start_shift(self, sends: list[Tensor], recvs: list[Tensor]):
        """Post send(to next) / recv(from prev) for matching tensor lists; returns the requests."""
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=nxt) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=prv) for t in recvs]
        return dist.batch_isend_irecv(ops)

    def shift(self, sends: list[Tensor], recvs: list[Tensor]) -> None:
        for req in self.start_shift(sends, recvs):
            req.wait()


def _plan(h: Tensor, w: Tensor, labels: Tensor, vocab_size: int, group_name: str, block: int,
          branch: str, token_counts: list[int], ignore_index: int = -100, check_labels: bool = False,
          extra: dict | None = None, phase: str = "forward", lse_grad: bool = False):
    """Validate this rank's input, agree with the ring, and derive the schedule every rank then runs.

    Without ``token_counts`` one all-gather carries, beside each rank's N, what the ranks must agree on (V, H,
    the input dtype, the requested branch); a rank whose own input is refused flags it in the same exchange.
    A mismatch or a refusal raises the same BoundpassInputError on every rank before anything large is
    allocated or any ring transfer is posted. With ``token_counts`` (simulated ranks) nothing is exchanged:
    the caller vouches that every rank passes the same settings.
    """
    ring = _Ring(group_name)
    error = None
    try:
        _check_inputs(h, w, labels, vocab_size, ignore_index, check_labels, extra)
        shard_sizes = vocab_shard_sizes(vocab_size, ring.size)
        if w.shape[0] != shard_sizes[ring.rank]:
            raise BoundpassInputError(
                f"Ring-DTP rank {ring.rank} of {ring.size} must hold vocab rows "
                f"{vocab_shard_range(vocab_size, ring.size, ring.rank)} ({shard_sizes[ring.rank]} rows) of "
                f"V={vocab_size}, got a shard of {w.shape[0]} rows")
        if branch not in BRANCHES:
            raise BoundpassInputError(f"Ring-DTP branch must be one of {BRANCHES}, got {branch!r}")
    except BoundpassInputError as err:
        if token_counts or ring.size == 1:
            raise
        error = err
    n = h.shape[0] if h.dim() >= 1 else 0
    if token_counts:
        counts = list(token_counts)
    else:
        two_d = h.dim() == 2
        fields = [("vocab size V", "int", vocab_size), ("hidden size H", "int", h.shape[1] if two_d else None),
                  ("input dtype", "dtype", h.dtype), ("branch", BRANCHES + ("<invalid>",), branch),
                  ("phase", ("forward", "backward"), phase), ("lse gradient", "bool", lse_grad)]
        counts = [row[0] for row in agree("Ring-DTP", ring.group, ring.rank, ring.size, fields, local_error=error,
                                          payload=[n], device=h.device, what="ring")]
    if len(counts) != ring.size or counts[ring.rank] != n:
        raise BoundpassInputError(f"Ring-DTP token_counts {counts} do not match ring of {ring.size} "
                                  f"(rank {ring.rank} holds {n} tokens)")
    if branch == "auto":
        branch = choose_branch(max(counts), vocab_size, ring.size)
    starts = [sum(shard_sizes[:r]) for r in range(ring.size)]
    return ring, counts, shard_sizes, starts, branch, (block if block > 0 else max(shard_sizes))


def _check_inputs(h: Tensor, w: Tensor, labels: Tensor, vocab_size: int, ignore_index: int,
                  check_labels: bool = True, extra: dict | None = None) -> None:
    check_devices("Ring-DTP", {"h": h, "w": w, "labels": labels, **(extra or {})})
    if h.dim() != 2 or w.dim() != 2 or labels.dim() != 1:
        raise BoundpassInputError(f"Ring-DTP expects h [N, H], w [V_r, H], labels [N]; got {tuple(h.shape)}, "
                                  f"{tuple(w.shape)}, {tuple(labels.shape)}")
    if h.shape[1] != w.shape[1] or h.shape[0] != labels.shape[0] or h.dtype != w.dtype:
        raise BoundpassInputError(f"Ring-DTP shape/dtype mismatch: h {tuple(h.shape)} {h.dtype}, "
                                  f"w {tuple(w.shape)} {w.dtype}, labels {tuple(labels.shape)}")
    if not h.is_floating_point() or labels.dtype not in (torch.int64, torch.int32):
        raise BoundpassInputError(f"Ring-DTP needs floating h/w and integer labels, got {h.dtype}, {labels.dtype}")
    if check_labels and not isinstance(labels, torch._subclasses.FakeTensor) and labels.numel():
        bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
        if bool(bad.any()):
            raise BoundpassInputError(f"Ring-DTP label out of range [0, {vocab_size}) (ignore_index={ignore_index})")


def _rotate(ring: _Ring, payload: list[Tensor], accumulators: list[Tensor], payload_for, accumulators_for,
            compute) -> list[Tensor]:
    """Run the P ring rounds; returns this rank's own accumulators once they have come home.

    Each round, ``compute(owner, payload, accumulators)`` works on the payload that ``owner`` started with
    while the read-only payload already travels to the next rank (overlapped). Accumulators change in
    ``compute``, so they travel after it. ``payload_for(owner)`` / ``accumulators_for(owner)`` allocate
    receive buffers for the payload / accumulators that started on ``owner``. At most two payloads and two
    accumulator sets are live at once: that is what ``ring_dtp_bound`` counts.
    """
    for step in range(ring.size):
        last = step == ring.size - 1
        if not last:
            incoming = payload_for(ring.owner(step + 1))
            requests = ring.start_shift(payload, incoming)
        compute(ring.owner(step), payload, accumulators)
        if not last:
            for request in requests:
                request.wait()
            if accumulators:
                arriving = accumulators_for(ring.owner(step + 1))
                ring.shift(accumulators, arriving)
                accumulators = arriving
            payload = incoming
    if accumulators and ring.size > 1:  # this rank holds rank+1's finished accumulators: one hop home
        home = accumulators_for(ring.rank)
        ring.shift(accumulators, home)
        accumulators = home
    return accumulators


# ------------------------------------------------------------------------------------------ forward
def ring_dtp_forward(h: Tensor, w: Tensor, labels: Tensor, vocab_size: int, group_name: str = "",
                     block: int = 0, ignore_index: int = -100, branch: str = "auto",
                     token_counts: tuple[int, ...] = ()) -> tuple[Tensor, Tensor]:
    """Eager forward: (sum of this rank's token losses [], per-token log-sum-exp [N]) in fp32 (fp64 for fp64)."""
    ring, counts, shard_sizes, starts, branch, block = _plan(h, w, labels, vocab_size, group_name, block,
                                                             branch, token_counts, ignore_index, check_labels=True)
    acc = _acc_dtype(h.dtype)
    labels = labels.long()

    def fresh_state(owner):  # running max, running sum of exponentials, target logit
        n = counts[owner]
        return [torch.full((n,), float("-inf"), dtype=acc, device=h.device),
                torch.zeros(n, dtype=acc, device=h.device), torch.zeros(n, dtype=acc, device=h.device)]

    def fold(hh, yy, state, w_shard, v_start):
        for b0, b1 in _blocks(w_shard.shape[0], block):
            _fold_strip(hh, w_shard.narrow(0, b0, b1 - b0), v_start + b0, yy, *state, acc)

    if branch == "weights":  # shards travel; this rank's state stays here
        state = fresh_state(ring.rank)
        _rotate(ring, [w], [], lambda owner: [w.new_empty((shard_sizes[owner], w.shape[1]))], None,
                lambda owner, payload, _: fold(h, labels, state, payload[0], starts[owner]))
    else:  # batches travel, their state follows each fold and comes home at the end
        state = _rotate(ring, [h, labels], fresh_state(ring.rank),
                        lambda owner: [h.new_empty((counts[owner], h.shape[1])), labels.new_empty((counts[owner],))],
                        fresh_state,
                        lambda owner, payload, st: fold(payload[0], payload[1], st, w, starts[ring.rank]))
    run_max, run_sum, target = state
    lse = run_max + torch.log(run_sum)
    valid = labels != ignore_index
    loss_sum = torch.where(valid, lse - target, torch.zeros_like(lse)).sum()
    return loss_sum, lse


# ----------------------------------------------------------------------------------------- backward
def ring_dtp_backward(grad_loss: Tensor, h: Tensor, w: Tensor, labels: Tensor, lse: Tensor, vocab_size: int,
                      group_name: str = "", block: int = 0, ignore_index: int = -100, branch: str = "auto",
                      token_counts: tuple[int, ...] = ()) -> tuple[Tensor, Tensor]:
    """Eager backward: (dh [N, H], dW_r [V_r, H]) for d(sum_r grad_loss_r * loss_r), recomputing strips.

    ``grad_loss``: the loss gradient [] (or [1]); or [1 + N] = the loss gradient then the lse output's gradient,
    when something differentiated through lse (the custom op's autograd packs it so): both are exact.
    """
    lse_grad = grad_loss.numel() > 1
    ring, counts, shard_sizes, starts, branch, block = _plan(h, w, labels, vocab_size, group_name, block,
                                                             branch, token_counts, ignore_index,
                                                             extra={"grad_loss": grad_loss, "lse": lse},
                                                             phase="backward", lse_grad=lse_grad)
    acc = _acc_dtype(h.dtype)
    labels = labels.long()
    lse_scale = None
    if lse_grad:
        if grad_loss.shape != (1 + h.shape[0],):
            raise BoundpassInputError(f"Ring-DTP backward: grad_loss must be [] or [1 + N] = [{1 + h.shape[0]}], "
                                      f"got {tuple(grad_loss.shape)}")
        grad_loss, lse_scale = grad_loss[0], grad_loss[1:].to(acc)
    # where, not a multiply: an ignored token's scale is exactly 0 even when grad_loss is inf or NaN (a mean
    # over zero valid tokens divides by 0), as torch's cross_entropy backward skips ignored rows
    token_scale = torch.where(labels != ignore_index, grad_loss.reshape(()).to(acc),
                              torch.zeros((), dtype=acc, device=h.device))

    def backprop(hh, yy, ll, scale, *rest):
        *lse_part, dh_acc, w_shard, dw_acc, v_start = rest
        for b0, b1 in _blocks(w_shard.shape[0], block):
            _grad_strip(hh, w_shard.narrow(0, b0, b1 - b0), v_start + b0, yy, ll, scale, dh_acc,
                        dw_acc.narrow(0, b0, b1 - b0), acc, *lse_part)

    def zeros(rows):
        return torch.zeros((rows, h.shape[1]), dtype=acc, device=h.device)

    if branch == "weights":  # shards travel with their dW accumulators; dh stays here
        dh = zeros(h.shape[0])
        (dw,) = _rotate(ring, [w], [zeros(w.shape[0])],
                        lambda owner: [w.new_empty((shard_sizes[owner], w.shape[1]))],
                        lambda owner: [h.new_empty((shard_sizes[owner], h.shape[1]), dtype=acc)],
                        lambda owner, payload, accs: backprop(h, labels, lse, token_scale,
                                                              *([lse_scale] if lse_grad else []), dh, payload[0],
                                                              accs[0], starts[owner]))
    else:  # batches travel with their dh accumulators; dW of this rank's shard stays here
        dw = zeros(w.shape[0])
        per_token = [lse, token_scale] + ([lse_scale] if lse_grad else [])
        (dh,) = _rotate(ring, [h, labels, *per_token], [zeros(h.shape[0])],
                        lambda owner: [h.new_empty((counts[owner], h.shape[1])), labels.new_empty((counts[owner],))]
                        + [t.new_empty((counts[owner],)) for t in per_token],
                        lambda owner: [h.new_empty((counts[owner], h.shape[1]), dtype=acc)],
                        lambda owner, payload, accs: backprop(*payload, accs[0], w, dw, starts[ring.rank]))
    return dh.to(h.dtype), dw.to(w.dtype)


# ------------------------------------------------------------------------------------- custom ops
# Opaque torch.library ops: Inductor cannot fuse across strips (which would re-form [N, V]), and
# AOTAutograd takes the backward from register_autograd instead of unrolling the ring into the graph.
@torch.library.custom_op("boundpass::ring_dtp_fwd", mutates_args=())
def ring_dtp_fwd(h: Tensor, w: Tensor, labels: Tensor, vocab_size: int, group_name: str, block: int,
                 ignore_index: int, branch: str, token_counts: list[int]) -> tuple[Tensor, Tensor]:
    return ring_dtp_forward(h, w, labels, vocab_size, group_name, block, ignore_index, branch, tuple(token_counts))


@ring_dtp_fwd.register_fake
def _(h, w, labels, vocab_size, group_name, block, ignore_index, branch, token_counts):
    if mixed_real_call("Ring-DTP", {"h": h, "w": w, "labels": labels}):
        return ring_dtp_forward(h, w, labels, vocab_size, group_name, block, ignore_index, branch, tuple(token_counts))
    acc = _acc_dtype(h.dtype)
    return h.new_empty((), dtype=acc), h.new_empty((h.shape[0],), dtype=acc)


@torch.library.custom_op("boundpass::ring_dtp_bwd", mutates_args=())
def ring_dtp_bwd(grad_loss: Tensor, h: Tensor, w: Tensor, labels: Tensor, lse: Tensor, vocab_size: int,
                 group_name: str, block: int, ignore_index: int, branch: str,
                 token_counts: list[int]) -> tuple[Tensor, Tensor]:
    return ring_dtp_backward(grad_loss, h, w, labels, lse, vocab_size, group_name, block, ignore_index, branch,
                             tuple(token_counts))


@ring_dtp_bwd.register_fake
def _(grad_loss, h, w, labels, lse, vocab_size, group_name, block, ignore_index, branch, token_counts):
    if mixed_real_call("Ring-DTP backward", {"grad_loss": grad_loss, "h": h, "w": w, "labels": labels, "lse": lse}):
        return ring_dtp_backward(grad_loss, h, w, labels, lse, vocab_size, group_name, block, ignore_index, branch,
                                 tuple(token_counts))
    # the real kernel returns fresh (contiguous) accumulators, also for a transposed w or a strided h
    return (torch.empty_like(h, memory_format=torch.contiguous_format),
            torch.empty_like(w, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    h, w, labels, vocab_size, group_name, block, ignore_index, branch, token_counts = inputs
    ctx.save_for_backward(h, w, labels, output[1])
    ctx.args = (vocab_size, group_name, block, ignore_index, branch, token_counts)
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not as zeros


def _backward(ctx, grad_loss, grad_lse):
    # Both outputs are differentiable and exact. lse's gradient (None when nothing used lse: the CE region the
    # compiler rewrites) is folded into the same strips: d/dlogit += grad_lse * softmax.
    h, w, labels, lse = ctx.saved_tensors
    if grad_loss is None and grad_lse is None:
        return (None,) * 9
    if grad_loss is None:
        grad_loss = lse.new_zeros(())
    if grad_lse is not None:  # the lse output was differentiated (e.g. a z-loss): its gradient travels too
        grad_loss = torch.cat([grad_loss.reshape(1).to(lse.dtype), grad_lse.to(lse.dtype)])
    dh, dw = torch.ops.boundpass.ring_dtp_bwd(grad_loss, h, w, labels, lse, *ctx.args)
    return dh, dw, None, None, None, None, None, None, None


ring_dtp_fwd.register_autograd(_backward, setup_context=_setup_context)


def ring_dtp_loss(h: Tensor, w_shard: Tensor, labels: Tensor, *, vocab_size: int, group=None, block: int = 0,
                  ignore_index: int = -100, branch: str = "auto", token_counts=()) -> Tensor:
    """Differentiable sum of this rank's token cross-entropies (fp32 scalar) through the Ring-DTP op."""
    loss_sum, _ = torch.ops.boundpass.ring_dtp_fwd(h, w_shard, labels, vocab_size, group_name_of(group), block,
                                                   ignore_index, branch, list(token_counts))
    return loss_sum


# --------------------------------------------------------------------------------------- reference
def reference_loss(h: Tensor, w_shard: Tensor, labels: Tensor, *, vocab_size: int, group=None,
                   ignore_index: int = -100) -> Tensor:
    """The standard schedule Ring-DTP replaces: gather the whole weight, form [N, V] logits, F.cross_entropy."""
    if group is not None and dist.get_world_size(group) > 1:
        from torch.distributed.nn.functional import all_gather  # differentiable: grads of W sum over ranks
        size = dist.get_world_size(group)
        rows = vocab_shard_sizes(vocab_size, size)
        padded = F.pad(w_shard, (0, 0, 0, max(rows) - w_shard.shape[0]))
        w_full = torch.cat([part[:r] for part, r in zip(all_gather(padded, group=group), rows)])
    else:
        w_full = w_shard
    logits = h @ w_full.t()
    return F.cross_entropy(logits.float() if h.dtype != torch.float64 else logits, labels,
                           reduction="sum", ignore_index=ignore_index)


# ------------------------------------------------------------------------------------------- bounds
def _indicator_ring(P):
    return sympy.Min(1, P - 1)  # 1 when something travels (P >= 2), 0 on a single device


def ring_dtp_bound(branch: str, *, mixed_precision: bool, count_weight_shard: bool = True) -> sympy.Expr:
    """Peak device bytes of one Ring-DTP forward+backward on a rank (inputs, outputs and workspace).

    Symbols: N (this rank's tokens), N_max (largest batch on the ring), H, V, P, C (strip width),
    b (input bytes/elem), b_acc (accumulation bytes/elem), b_idx (label bytes/elem). ``mixed_precision``
    is True when the input dtype is narrower than the fp32 accumulation (bf16/fp16): strips are cast.
    ``count_weight_shard=False`` leaves out W_r, for budgets that count parameters as persistent state.
    """
    N, N_max, H, V, P, C = sym.N, sym.N_max, sym.H, sym.V, sym.P, sym.C
    b, b_acc, b_idx = sym.b, sym.b_acc, sym.b_idx
    cast = 1 if mixed_precision else 0
    V_max = sympy.ceiling(V / P)
    width = sympy.Min(C, V_max)
    ring = _indicator_ring(P)
    extra_payloads = sympy.Min(2, P - 1)  # the travelling copy being read + the one being received
    resident = N * H * b + int(count_weight_shard) * V_max * H * b + N * b_idx  # h, W_r, labels (caller's)
    if branch == "weights":
        n = N
        shard_in_flight = extra_payloads * V_max * H * b
        fwd = resident + shard_in_flight + 3 * N * b_acc + _strip_fwd(n, width, b, b_acc, b_idx, cast)
        # one dW accumulator, plus either a strip, the dW being received, or the final narrow casts
        grad_in_flight = V_max * H * b_acc + sympy.Max(_strip_bwd(n, width, H, b, b_acc, b_idx, cast),
                                                       ring * V_max * H * b_acc,
                                                       cast * (N * H * b + V_max * H * b))
        bwd = resident + shard_in_flight + 2 * N * b_acc + N * H * b_acc + grad_in_flight
    elif branch == "activations":
        n = N_max
        batch_in_flight = extra_payloads * N_max * (H * b + b_idx)
        fwd = resident + batch_in_flight + 3 * N * b_acc + ring * 6 * N_max * b_acc \
            + _strip_fwd(n, width, b, b_acc, b_idx, cast)
        bwd_batches = extra_payloads * N_max * (H * b + b_idx + 2 * b_acc)
        grad_in_flight = N_max * H * b_acc + sympy.Max(_strip_bwd(n, width, H, b, b_acc, b_idx, cast),
                                                       ring * N_max * H * b_acc,
                                                       cast * (N * H * b + V_max * H * b))
        bwd = resident + bwd_batches + 2 * N * b_acc + V_max * H * b_acc + grad_in_flight
    else:
        raise BoundpassInputError(f"ring_dtp_bound: branch must be 'weights' or 'activations', got {branch!r}")
    # + the loss scalar and, in backward, its incoming gradient
    return sympy.Max(fwd, bwd) + 2 * b_acc


def _strip_fwd(n, width, b, b_acc, b_idx, cast):
    # the strip (plus its narrow copy when cast) and the per-token temporaries of one fold:
    # index + hit mask (+2 transient masks) + picked target, or later the new max + its row sums
    return n * width * (b_acc + cast * b) + n * (b_idx + 3 + 2 * b_acc)


def _strip_bwd(n, width, H, b, b_acc, b_idx, cast):
    # the probability strip, its narrow copy and one narrow matmul product when cast, per-token temporaries
    return n * width * (b_acc + cast * b) + cast * sympy.Max(n, width) * H * b + n * (b_idx + 3 + b_acc)


def reference_bound(*, mixed_precision: bool) -> sympy.Expr:
    """Peak device bytes of the standard schedule: whole W gathered, full [N, V] logits (fwd + bwd)."""
    N, H, V, P = sym.N, sym.H, sym.V, sym.P
    b, b_acc, b_idx = sym.b, sym.b_acc, sym.b_idx
    cast = 1 if mixed_precision else 0
    V_max = sympy.ceiling(V / P)
    gathered = _indicator_ring(P) * V * H * b
    resident = N * H * b + V_max * H * b + N * b_idx + gathered
    logits = N * V * (b + cast * b_acc)           # h @ W.T (and its fp32 upcast)
    fwd = resident + logits + N * V * b_acc       # + log_softmax
    bwd = resident + N * V * b_acc + 2 * N * V * b_acc + N * H * b + V * H * b  # saved log_softmax, grads
    return sympy.Max(fwd, bwd)


def bound_values(dtype: torch.dtype, *, N: int, H: int, V: int, P: int = 1, C: int | None = None,
                 N_max: int | None = None) -> dict:
    """Concrete symbol values for evaluating a Ring-DTP bound at launch configuration."""
    acc = _acc_dtype(dtype)
    return {sym.N: N, sym.N_max: N_max or N, sym.H: H, sym.V: V, sym.P: P, sym.C: C or -(-V // P),
            sym.b: torch.empty((), dtype=dtype).element_size(), sym.b_acc: torch.empty((), dtype=acc).element_size(),
            sym.b_idx: 8}


# ------------------------------------------------------------------------------------- memory contract
def _ring_size(group_name: str) -> int:
    if not group_name:
        return 1
    return dist.get_world_size(dist.distributed_c10d._resolve_process_group(group_name))


def _device_bound(a: dict, ctx: dict) -> sympy.Expr:
    """Ring-DTP's whole bound (inputs, outputs, workspace) at one forward or backward call; strip width C symbolic."""
    h, w = a["h"], a["w"]
    ring = _ring_size(a["group_name"])
    tokens = contracts.as_expr(h.shape[0])
    # the ring's largest N: at least this rank's (symbolic under dynamic shapes, so the budget guard sees it grow)
    declared = ctx.get("max_tokens_per_rank")
    n_max = tokens if not declared else sympy.Max(int(declared), tokens)
    branch = a["branch"]
    if branch == "auto":
        branch = choose_branch(int(n_max) if sympy.sympify(n_max).is_number else 1 << 62, a["vocab_size"], ring)
    mixed = torch.promote_types(h.dtype, torch.float32) != h.dtype
    values = bound_values(h.dtype, N=1, H=int(w.shape[1]), V=a["vocab_size"], P=ring)
    values.update({sym.N: tokens, sym.N_max: n_max})
    values.pop(sym.C)
    bound = contracts.substitute(contracts.cached_bound(ring_dtp_bound, branch=branch, mixed_precision=mixed,
                                                        count_weight_shard=True), values)
    grad_loss = a.get("grad_loss")
    if isinstance(grad_loss, torch.Tensor) and grad_loss.dim() == 1:
        # grad_loss is [1 + N]: the lse output is differentiated (a z-loss); its per-token scale is live in
        # backward and travels with the batch (docs/ring_dtp.md), which ring_dtp_bound does not count
        bound = bound + (1 + min(2, ring - 1)) * n_max * _acc_dtype(h.dtype).itemsize
    return bound


contracts.register_bound(torch.ops.boundpass.ring_dtp_fwd.default, _device_bound)
contracts.register_bound(torch.ops.boundpass.ring_dtp_bwd.default, _device_bound)
