"""Sequence-to-head (Ulysses-style) attention over a process group of W ranks, exact, with its sympy bound.

Outside attention each rank holds N/W consecutive tokens of every sequence (rank r: global positions
[r*N/W, (r+1)*N/W)) and every head. Attention needs every token of a head, so around it one all-to-all
turns "my tokens, all heads" into "all tokens, my heads" (A_q/W query heads and their kv heads), the
unchanged attention kernel runs on full sequences, and a second all-to-all turns the output back.

Why this is exact: attention is independent per head, and the all-to-alls only move data (no arithmetic).
Rank r's query heads [r*A_q/W, (r+1)*A_q/W) see every key of their kv heads at its global position, so
causal masking on the gathered full sequence is the unsharded mask; RoPE is applied before the exchange by
the caller with global positions (``shard_positions``). Autograd runs the same all-to-alls backwards
(funcol's all_to_all_single is differentiable), so gradients are exact too. Only the summation order of
GQA kv-head replication (below) differs from the reference: fp64 agrees to ~1e-15.

Head counts: A_q must be a multiple of W. kv heads (GQA) are split when A_kv is a multiple of W; when
A_kv < W and W is a multiple of A_kv each kv head is replicated W/A_kv times before the exchange (rank r
then receives exactly the one kv head its query heads use; the replication's backward sums the copies'
gradients). Anything else is refused before any allocation. A ragged last shard (the sequence length not a
multiple of W) is refused: every rank must hold the same number of tokens.
"""
from __future__ import annotations

from typing import Callable

import sympy
import torch
import torch.distributed as dist
import torch.nn.functional as F

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError
from boundpass.runtime.groups import release_storage

__all__ = ["seq_to_head_attention", "SeqToHeadAttention", "seq_to_head_bound", "check_head_counts", "check_local_shapes",
           "shard_positions", "shard_sequence", "sdpa_blnh"]


# ---- layout helpers -----------------------------------------------------------------------------------------

def shard_sequence(seq_len: int, rank: int, world: int) -> slice:
    """This rank's token range of a sequence of ``seq_len`` tokens: [rank*seq_len/W, (rank+1)*seq_len/W)."""
    if world < 1 or not 0 <= rank < world:
        raise BoundpassInputError(f"shard_sequence: need 0 <= rank < world, got rank={rank}, world={world}")
    if seq_len % world:
        raise BoundpassInputError(
            f"sequence-to-head attention needs the sequence length to be a multiple of the {world} ranks "
            f"(got {seq_len}: the last shard would be ragged, {seq_len % world} tokens short of an even split); "
            f"pad or trim the sequence to {seq_len - seq_len % world} or {seq_len + world - seq_len % world} tokens")
    n = seq_len // world
    return slice(rank * n, (rank + 1) * n)


def shard_positions(seq_len: int, rank: int, world: int, device=None) -> torch.Tensor:
    """Global RoPE positions of this rank's tokens, shape [1, seq_len/W] (torchtitan's ``positions`` layout)."""
    s = shard_sequence(seq_len, rank, world)
    return torch.arange(s.start, s.stop, device=device).unsqueeze(0)


def check_head_counts(A_q: int, A_kv: int, world: int) -> int:
    """Validate head counts for W ranks; return how many times each kv head is replicated (1 = split)."""
    if A_q % A_kv:
        raise BoundpassInputError(f"query heads ({A_q}) must be a multiple of kv heads ({A_kv}) for GQA")
    if A_q % world:
        raise BoundpassInputError(
            f"sequence-to-head attention gives each of the {world} ranks A_q/W query heads, but A_q={A_q} is not "
            f"a multiple of W={world}; use a rank count that divides {A_q} for the attention group")
    if A_kv % world == 0:
        return 1
    if world % A_kv == 0:
        return world // A_kv
    raise BoundpassInputError(
        f"sequence-to-head attention cannot place A_kv={A_kv} kv heads on W={world} ranks: A_kv must be a "
        f"multiple of W (split) or divide W (replicated); use W dividing {A_kv} or a multiple of it")


def sdpa_blnh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              enable_gqa: bool = False, is_causal: bool = True, **_: object) -> torch.Tensor:
    """torch SDPA on torchtitan's [B, L, heads, D] layout (the reference kernel and the default inner one)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         scale=scale, is_causal=is_causal, enable_gqa=enable_gqa)
    return out.transpose(1, 2)


# ---- the two all-to-alls ------------------------------------------------------------------------------------

def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Even all-to-all over dim 0, differentiable (the functional op's registered autograd: the backward is the
    same exchange). Used while compiling (Inductor owns the buffers there); eager runs ``_Relayout``."""
    world = dist.get_world_size(group)
    splits = [x.shape[0] // world] * world
    out = torch.ops._c10d_functional.all_to_all_single(x, splits, splits, group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _exchange(x: torch.Tensor, to_heads: bool, world: int, group) -> torch.Tensor:
    """One relayout, eager: copy into a send buffer this function owns, exchange, copy the receive buffer into the
    result, freeing each buffer as soon as it is done with. Peak beside the input: send + receive, then
    receive + result.

    to_heads: [B, N/W, A, D] (my tokens, all heads) -> [B, N, A/W, D] (all tokens, my heads); else the inverse."""
    if to_heads:
        B, n, A, D = x.shape
        view = x.reshape(B, n, world, A // world, D).permute(2, 0, 1, 3, 4)        # [W_dst, B, n, a, D]
    else:
        B, L, a, D = x.shape
        view = x.reshape(B, world, L // world, a, D).permute(1, 0, 2, 3, 4)        # [W_dst, B, n, a, D]
    send = torch.empty(view.shape, dtype=x.dtype, device=x.device)  # owned: never an alias of the caller's x
    send.copy_(view)
    recv = torch.empty_like(send)                                                  # [W_src, B, n, a, D]
    dist.all_to_all_single(recv, send, group=group)
    release_storage(send)
    W, B, n, a, D = recv.shape
    if to_heads:
        out = torch.empty((B, W, n, a, D), dtype=x.dtype, device=x.device)
        out.copy_(recv.permute(1, 0, 2, 3, 4))
        out = out.view(B, W * n, a, D)
    else:
        out = torch.empty((B, n, W, a, D), dtype=x.dtype, device=x.device)
        out.copy_(recv.permute(1, 2, 0, 3, 4))
        out = out.view(B, n, W * a, D)
    release_storage(recv)
    return out


class _Relayout(torch.autograd.Function):
    """The sequence-to-head relayout (or its inverse) with its exact inverse as the backward: data movement only."""

    @staticmethod
    def forward(ctx, x, to_heads, world, group):
        ctx.to_heads, ctx.world, ctx.group = to_heads, world, group
        return _exchange(x, to_heads, world, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, not ctx.to_heads, ctx.world, ctx.group), None, None, None


def _seq_to_head(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """[B, N/W, A, D] (my tokens, all heads) -> [B, N, A/W, D] (all tokens, my heads)."""
    if not torch.compiler.is_compiling():
        return _Relayout.apply(x, True, world, group)
    B, n, A, D = x.shape
    recv = _all_to_all(x.reshape(B, n, world, A // world, D).permute(2, 0, 1, 3, 4).contiguous(),  # [W_dst, ...]
                       group)                                                                        # [W_src, ...]
    return recv.permute(1, 0, 2, 3, 4).reshape(B, world * n, A // world, D)


def _head_to_seq(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """[B, N, A/W, D] (all tokens, my heads) -> [B, N/W, A, D] (my tokens, all heads)."""
    if not torch.compiler.is_compiling():
        return _Relayout.apply(x, False, world, group)
    B, L, a, D = x.shape
    recv = _all_to_all(x.reshape(B, world, L // world, a, D).permute(1, 0, 2, 3, 4).contiguous(),  # [W_dst, ...]
                       group)                                                                       # [W_src, ...]
    return recv.permute(1, 2, 0, 3, 4).reshape(B, L // world, world * a, D)


def _group_size(group) -> int:
    if group is None:
        return 1
    return dist.get_world_size(group)


def check_local_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> None:
    """Refuse, on every rank and with the same message, local shapes that differ across the group.

    One small all_gather of the six sizes; a ragged last shard otherwise fails deep in the all-to-all."""
    world = _group_size(group)
    if world == 1:
        return
    mine = torch.tensor([q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]],
                        dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = [tuple(t.tolist()) for t in every]
    if len(set(rows)) > 1:
        lengths = [r[1] for r in rows]
        if len({(r[0],) + r[2:] for r in rows}) == 1:
            raise BoundpassInputError(
                f"sequence-to-head attention needs the same number of tokens on every rank, got {lengths} "
                f"(a ragged last shard); pad the sequence to a multiple of W={world} tokens and shard it with "
                f"boundpass.runtime.seq_to_head.shard_sequence")
        raise BoundpassInputError(
            f"sequence-to-head attention: ranks disagree on [batch, tokens, q heads, kv heads, qk dim, v dim]: "
            f"{rows}; every rank must run the same attention shapes on an equal token shard")


# ---- the operator -------------------------------------------------------------------------------------------

def seq_to_head_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                          attention: Callable[..., torch.Tensor] = sdpa_blnh, scale: float | None = None,
                          is_causal: bool = True, check_shapes: bool = True, equalize_head_dims: bool = True,
                          **attention_kwargs) -> torch.Tensor:
    """Attention of this rank's tokens against the whole (sequence-sharded) sequence, exact.

    q: [B, N/W, A_q, D_qk], k: [B, N/W, A_kv, D_qk], v: [B, N/W, A_kv, D_v] with RoPE already applied at
    global positions (torchtitan's layout). Returns [B, N/W, A_q, D_v], this rank's tokens, all heads.
    ``attention(q, k, v, scale=, enable_gqa=, is_causal=)`` is the unchanged kernel run on [B, N, heads/W, D]
    (default: torch SDPA). ``group``: the W ranks (None: one rank, no exchange). ``check_shapes``: one small
    all_gather that refuses ragged shards with a clear error (skipped while compiling). ``equalize_head_dims``:
    zero-pad q/k or v to one head dim so SDPA keeps its O(N) fused kernel (see ``_attend``).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise BoundpassInputError(f"seq_to_head_attention takes [B, L, heads, D] q/k/v, got {q.shape}, {k.shape}, "
                                  f"{v.shape}")
    world = _group_size(group)
    A_q, A_kv = q.shape[2], k.shape[2]
    replicas = check_head_counts(A_q, A_kv, world)
    if check_shapes and world > 1 and not torch.compiler.is_compiling():
        check_local_shapes(q, k, v, group)
    if world == 1:
        return _attend(attention, q, k, v, scale, is_causal, equalize_head_dims, attention_kwargs)
    if replicas > 1:  # A_kv < W: rank r needs kv head r // replicas, so give each rank its own copy
        k = k.repeat_interleave(replicas, dim=2)
        v = v.repeat_interleave(replicas, dim=2)
    q_h, k_h, v_h = (_seq_to_head(t, world, group) for t in (q, k, v))
    out_h = _attend(attention, q_h, k_h, v_h, scale, is_causal, equalize_head_dims, attention_kwargs)
    return _head_to_seq(out_h, world, group)


def _attend(attention, q, k, v, scale, is_causal, equalize_head_dims, kwargs):
    """Run the kernel; with ``equalize_head_dims`` zero-pad the narrower of qk / v head dims first.

    Why: torch SDPA has no fused (flash) kernel for a v head dim different from the qk one (MLA: 192 vs 128)
    and falls back to the math path, which materialises [B, heads, N, N] scores (measured: the per-rank peak
    grew quadratically in bench/mop.py). Zero columns of v give zero output columns (sliced off); zero
    columns of q and k add 0 to every score, and the scale stays the unpadded 1/sqrt(D_qk). Same function,
    O(N) memory per head, which is what seq_to_head_bound counts (D_h = the larger dim)."""
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if equalize_head_dims and d_qk != d_v:
        scale = d_qk ** -0.5 if scale is None else scale
        if d_v < d_qk:
            v = F.pad(v, (0, d_qk - d_v))
        else:
            q, k = F.pad(q, (0, d_v - d_qk)), F.pad(k, (0, d_v - d_qk))
    out = attention(q, k, v, scale=scale, enable_gqa=q.shape[2] != k.shape[2], is_causal=is_causal, **kwargs)
    return out[..., :d_v] if out.shape[-1] != d_v else out


class SeqToHeadAttention(torch.nn.Module):
    """Wraps an inner attention module with torchtitan's signature ``(q, k, v, *, scale, enable_gqa, ...)``.

    Used as ``block.attention.inner_attention = SeqToHeadAttention(block.attention.inner_attention, group)``:
    the projections, RoPE (fed global positions) and output projection stay per-token on this rank's shard.
    Shapes are checked across ranks on the first call and whenever the local shape changes.

    ``tiles`` > 0: the exchange and the kernel in tiles of that many rows with the whole-sequence tensors on the host
    (runtime/seq_to_head_tiles.py: the device holds O(tiles) beside this rank's own tokens' tensors); the inner
    module is then not called (its kernel is the tiles' online softmax, causal SDPA's function).
    """

    def __init__(self, inner: torch.nn.Module, group, tiles: int = 0) -> None:
        super().__init__()
        self.inner = inner
        self.group = group
        self.tiles = tiles
        self._checked: tuple | None = None

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, is_causal=True, **kwargs):
        if attention_masks is not None:
            raise BoundpassInputError("SeqToHeadAttention supports causal attention without attention_masks "
                                      "(document masks would need the global mask sharded by heads)")
        if self.tiles:
            from boundpass.runtime.seq_to_head_tiles import seq_to_head_tiles
            return seq_to_head_tiles(q, k, v, self.group, causal=is_causal, scale=scale, chunk=self.tiles)
        if torch.compiler.is_compiling():
            # inside a compiled block (torchtitan's per-block compile): no cross-rank check and no cached shapes,
            # which Dynamo would guard on (the cache set after the first call failed that guard and recompiled every
            # block graph at step 2). The graph's shapes are static; the layout's launch checks (mop_config,
            # check_mop_launch: sequence and head counts divisible by W) ran before anything was built.
            return seq_to_head_attention(q, k, v, self.group, attention=self._inner, scale=scale,
                                         is_causal=is_causal, check_shapes=False, **kwargs)
        shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
        check = self._checked != shapes
        out = seq_to_head_attention(q, k, v, self.group, attention=self._inner, scale=scale, is_causal=is_causal,
                                    check_shapes=check, **kwargs)
        self._checked = shapes
        return out

    def _inner(self, q, k, v, **kwargs):
        return self.inner(q, k, v, **kwargs)


# ---- the bound ----------------------------------------------------------------------------------------------

def seq_to_head_bound(*, count_io: bool = True, part: str = "peak", caller_keeps_inputs: bool = True) -> sympy.Expr:
    """Peak bytes on one rank of one sequence-to-head attention forward + backward, all-to-all buffers included.

    Symbols: N (tokens on this rank outside attention, summed over the batch), W (ranks), A_q, A_kv (heads),
    D_h (the larger of the qk and v head dims), b (bytes/element of q/k/v), b_acc (bytes/element of the
    kernel's log-sum-exp: fp32 for bf16/fp16 inputs, the input dtype otherwise).

    Counted (measured op by op, see docs/mop.md): the caller's q/k/v, output, incoming output gradient and the
    q/k/v gradients (``count_io=False`` leaves these to a budget that counts them as the surrounding layer's
    activations); the gathered q/k/v and output the kernel saves for backward (a flash-style kernel: O(N)
    per head, no N x N score matrix) and its log-sum-exp; the kernel's dq/dk/dv; per exchange two of its send
    buffer, receive buffer and re-laid-out result (``_exchange`` frees each when done, so no earlier exchange
    outlives its call whatever the backend's threads do). Not counted: the fused kernel's internal tile
    workspace (not visible as tensors; on-chip on GPUs). Eager only: under torch.compile the exchange is traced
    as functional collectives and Inductor plans those buffers (W > 1 compiled is not measured here).

    W = 1 (factor ``x = Min(1, W - 1)`` = 0): nothing is exchanged, so no exchange buffers and no gathered copies:
    the kernel runs on the caller's q/k/v (or, with ``equalize_head_dims``, on a zero-padded copy of the narrower
    ones, counted at D_h), its output is the caller's output, its dq/dk/dv are the input gradients and the output
    gradient reaches it directly (or as one padded copy). ``caller_keeps_inputs`` (default): the caller may hold
    its q/k/v and output gradient through backward (a test holding leaf tensors does), so at W = 1 the padded
    copies of v and of the output gradient come on top of them. ``caller_keeps_inputs=False``: the caller holds
    its q/k/v only through this op and passes the output gradient on (torchtitan's attention modules: RoPE, cat
    and split outputs, autograd's incoming gradient; measured), so once the forward returns the padded copy
    replaces the original, and at W > 1 the caller's q/k/v are gone by backward (the exchange copied them; they
    count in the forward only), and so are its output (once the output projection's backward has run) and output
    gradient (once the exchange has sent it) when the kernel's backward runs (where A_kv = A_q). Measured on
    deepseek_v3's MLA (qk 192, v 128), equal head dims and GQA (tests/runtime/test_seq_to_head.py); the composed budget (boundpass/bound/composed.py) uses False.

    ``part="backward"``: the backward's moments alone (the kernel's backward, then the exchanges that send its
    gradients back), for a budget that sets them beside a one-rank trace's attention backward.

    ``part="saved"``: what one attention keeps from its forward until its backward (the kernel's q/k/v and
    output, log-sum-exp; the caller's output): what is live beside the rest of the block (its FFN) while that
    runs forward and backward under activation recomputation (boundpass/bound/composed.py composes the two parts).
    Under the same assumption the caller's q/k/v are not held then at W > 1 (the exchange copied them).
    """
    if part not in ("peak", "saved", "backward"):
        raise BoundpassInputError(f"seq_to_head_bound: part must be 'peak', 'saved' or 'backward', got {part!r}")
    N, W, A_q, A_kv, D_h, b, b_acc = sym.N, sym.W, sym.A_q, sym.A_kv, sym.D_h, sym.b, sym.b_acc
    x = sympy.Min(1, W - 1)                # 1: the W ranks exchange; 0: one rank, no exchange
    q = N * A_q * D_h * b                  # this rank's query / output / their gradients, either layout
    kv_in = N * A_kv * D_h * b             # one of k/v (or its gradient) before the exchange
    kv = N * sympy.Max(A_kv, W) * D_h * b  # one of k/v after replication (A_kv < W) and exchange
    # one exchange: send + receive, then receive + result (each buffer freed when done: ``_exchange``); the
    # largest one moves q-sized tensors (A_q >= A_kv and A_q >= W: check_head_counts)
    exchange = x * 2 * q
    lse = N * A_q * b_acc
    keep = 1 if count_io else 0
    inputs, output, grad_output, input_grads = keep * (q + 2 * kv_in), keep * q, keep * q, keep * (q + 2 * kv_in)
    gathered = 2 * q + 2 * kv              # gathered q, k, v and output, saved from forward to backward (W > 1)
    # W = 1 with a caller that keeps its tensors: the padded copies of v (or q, k) and of the output gradient
    copies = (1 - x) * (kv + grad_output) if caller_keeps_inputs else 0
    if part == "saved":
        return (1 - x) * inputs + x * gathered + output + lse + (1 - x) * kv * int(caller_keeps_inputs)
    kernel_grads = q + 2 * kv              # dq, dk, dv on the gathered layout (W = 1: the input gradients)
    # the caller's q/k/v in backward: kept by the caller, or (W = 1) the kernel's own (inputs or padded copies)
    inputs_bwd = inputs if caller_keeps_inputs else (1 - x) * inputs
    # the caller's output and output gradient in backward. W = 1: the output is the one the kernel saved. W > 1: both
    # are tensors of their own (the exchange's result, autograd's incoming gradient); a caller that drops them frees
    # the output once its output projection's backward has run and the gradient once the exchange has sent it,
    # both before the kernel's backward (measured: tests/runtime/test_seq_to_head.py, the dropping caller). Only
    # where every query head has its own k/v head (A_kv = A_q): under GQA the kernel's backward holds more than the
    # tensors named here (measured up to 1.13 q over them, W = 4, A_q = 4, A_kv = 1: SDPA's grouped k/v on the CPU),
    # which these two (2 q) cover
    mha = 1 - sympy.Min(1, A_q - A_kv)     # 1: A_kv = A_q; 0: GQA (check_head_counts: A_kv <= A_q)
    output_bwd = output if caller_keeps_inputs else (1 - x * mha) * output
    grad_output_bwd = grad_output if caller_keeps_inputs else (1 - mha) * grad_output
    # forward: saved tensors + the output's exchange (its result is the output); W = 1: the padded copy + output
    forward = inputs + x * (gathered + exchange) + (1 - x) * (kv + output) + lse
    # backward in the kernel: + the gathered output gradient and the kernel's grads (W = 1: the kernel's q/k/v
    # are the inputs or their padded copies, its output the caller's, one output gradient)
    backward_kernel = inputs_bwd + output_bwd + x * (grad_output_bwd + gathered) + lse + q + kernel_grads + copies
    # backward exchanges after the kernel freed what it saved: kernel grads not yet sent back, the input grads
    # being written (together at most the kernel grads + the replicated dk/dv before it is summed), one exchange
    backward_exchange = inputs_bwd + output + grad_output + kernel_grads + kv + exchange
    if part == "backward":  # the backward alone: the kernel's and the exchanges after it
        return sym.max_kept(backward_kernel, x * backward_exchange)
    # none of the three dominates another: built unevaluated (sym.max_kept; ~0.15 s of evaluation otherwise)
    return sym.max_kept(forward, backward_kernel, x * backward_exchange)
