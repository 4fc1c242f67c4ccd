"""Sequence-to-head attention with the whole-sequence tensors on the host: the MoP layout's attention in tiles.

``seq_to_head.py`` exchanges q, k and v whole ("my tokens, all heads" -> "all tokens, my heads") and runs one kernel
over the whole sequence: what the kernel keeps for its backward (q, k, v, its output) and what the backward makes (the
output gradient, dq, dk, dv) are whole [B, L, A/W, D] tensors on every rank, eight of them at the attention's backward,
the rank's peak at long contexts (docs/results/reach.md). Here the exchange moves pieces of C_s tokens per rank and
writes what it receives straight into host rows (``host_tiles.HostRows``), the kernels of
``runtime/chunked_attention.py`` walk those rows tile by tile with the next tile prefetched, and the results go back
through the same piecewise exchange:

forward : q, k, v piecewise to the host ([B, A/W, L, D] of my heads); per query tile its output against the key tiles
          (online softmax), written to the host; the output piecewise back to this rank's tokens.
backward: the output gradient piecewise to the host; rowsum(dO O) per token on this rank (from the output the op
          returned, which the output projection keeps anyway) and exchanged; per key tile its dk, dv finished and its
          part of every row's dq added into one fp32 dq on the host (``chunked_attention.key_tile_backward``); dq, dk,
          dv piecewise back to this rank's tokens.

What the device holds is the rank's own tokens' q, k, v (the caller's), the output and, in the backward, the output
gradient and the three gradients it returns: [B, N/W, A, D] tensors that exist around any attention; beside them O(C_s)
pieces and tiles. Nothing whole of the exchanged layout is on the device.

The host rows are one pooled buffer per role, kept from the forward to the backward of the same attention: a rank holds
one attention's at a time. That is the schedule under full activation checkpointing (the forward of a block is run
again right before its backward: torchtitan's FullAC, which the MoP layout's budget requires). A backward whose
forward's host rows were overwritten by another attention's forward since (no recompute) is refused with that reason,
never run on another layer's rows: the forward returns a ticket the backward checks.

Exact: every exchange moves data; the kernels' sums over key tiles are reordered (the tolerance class of a fused
kernel against the math path). Head counts: A_q and A_kv multiples of W (no kv-head replication here: refused with a
clear error, the whole-tensor exchange does it).
"""
from __future__ import annotations

import math

import sympy
import torch
import torch.distributed as dist
from torch import Tensor

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError
from boundpass.runtime import chunked_attention as ca
from boundpass.runtime import contracts
from boundpass.runtime import host_tiles
from boundpass.runtime.groups import group_of, release_storage

__all__ = ["seq_to_head_tiles", "seq_to_head_tiles_bound", "seq_to_head_tiles_host_bound", "check_tiles_heads"]

_GENERATION = [0]   # forwards run in this process: the ticket a backward checks its host rows against


def check_tiles_heads(A_q: int, A_kv: int, world: int) -> None:
    if A_q % A_kv or A_q % world or A_kv % world:
        raise BoundpassInputError(
            f"sequence-to-head attention in tiles gives each of the {world} ranks A/W heads of q and of k / v: "
            f"A_q = {A_q} and A_kv = {A_kv} must be multiples of W = {world} (and A_q of A_kv); with fewer kv heads "
            "than ranks use the whole-tensor exchange (--boundpass.attention.no-enable)")


def _pieces(n: int, chunk: int):
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _exchange_piece(send: Tensor, world: int, group) -> Tensor:
    """One piece's all-to-all over dim 0 (the destination ranks in, the source ranks out), its send buffer freed once
    sent; one rank: the piece itself."""
    if world == 1:
        return send
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    release_storage(send)
    return recv


def _to_heads(x: Tensor, store, world: int, group, chunk: int) -> None:
    """x [B, N/W, A, D] (my tokens, every head) into ``store`` [B, A/W, L, D] (every token, my heads), C_s of my
    tokens at a time: rank s's tokens [p0, p1) land at rows [s N/W + p0, s N/W + p1)."""
    B, n, A, D = x.shape
    a = A // world
    for p0, p1 in _pieces(n, chunk):
        send = torch.empty((world, B, a, p1 - p0, D), dtype=x.dtype, device=x.device)   # [W_dst, B, a, c, D]
        send.copy_(x[:, p0:p1].reshape(B, p1 - p0, world, a, D).permute(2, 0, 3, 1, 4))
        recv = _exchange_piece(send, world, group)                                       # [W_src, B, a, c, D]
        del send
        for s in range(world):
            _write(store, s * n + p0, s * n + p1, recv[s])
        release_storage(recv)
        del recv


def _to_tokens(store, out: Tensor, world: int, group, chunk: int) -> None:
    """The inverse of ``_to_heads``: ``store`` [B, A/W, L, D] (host rows or a device tensor) into ``out``
    [B, N/W, A, D] of this rank, cast to out's dtype on the way."""
    B, n, A, D = out.shape
    a = A // world
    for p0, p1 in _pieces(n, chunk):
        send = torch.empty((world, B, a, p1 - p0, D), dtype=out.dtype, device=out.device)  # [W_dst, B, a, c, D]
        for d in range(world):
            send[d].copy_(_rows(store, d * n + p0, d * n + p1))
        recv = _exchange_piece(send, world, group)                                          # [W_src, B, a, c, D]
        del send
        out[:, p0:p1].copy_(recv.permute(1, 3, 0, 2, 4).reshape(B, p1 - p0, A, D))
        release_storage(recv)
        del recv


def _write(store, s: int, e: int, rows: Tensor) -> None:
    if isinstance(store, host_tiles.HostRows):
        store.write(s, e, rows)
    else:
        store[:, :, s:e].copy_(rows)


def _rows(store, s: int, e: int) -> Tensor:
    return store.host[:, :, s:e] if isinstance(store, host_tiles.HostRows) else store[:, :, s:e]


def _world(group: str) -> tuple:
    pg = group_of(group)
    return pg, (dist.get_world_size(pg) if pg is not None else 1)


def _store(role: str, shape, world: int, dtype: torch.dtype, device, width: int | None = None) -> host_tiles.HostRows:
    """The host rows of ``role`` for a [B, N/W, A, D] tensor of this rank: [B, A/W, L, width or D], of the pool."""
    B, n, A, D = shape
    return host_tiles.HostRows(f"s2h_{role}", (B, A // world, n * world, width or D), dtype, device)


def _check_ticket(ticket: Tensor) -> None:
    if int(ticket.item()) != _GENERATION[0]:
        raise BoundpassInputError(
            "sequence-to-head attention in tiles: this attention's host rows (q, k, v of the whole sequence) were "
            "overwritten by another attention's forward before its backward ran; the tiles keep one attention's rows at "
            "a time, which needs each block's forward run again right before its backward (full activation "
            "checkpointing: torchtitan's FullAC). Use --activation_checkpoint.mode full, or the whole-tensor exchange "
            "(--boundpass.attention.no-enable)")


# The forward and the backward are two ops each, so that what one ends with is freed before the next allocates:
# put (q, k, v to the host) then attend (the output from the host rows), the caller's q, k, v free once put has run;
# in the backward attend's (dq, dk, dv onto the host) then take (them back to the rank), the output gradient and the
# output free once attend's backward has run. put and attend pass an empty "handle" tensor (attend's backward its
# gradient to take) that orders them in a graph; the ticket ties every op to the forward whose host rows it reads.

def tiles_put(q: Tensor, k: Tensor, v: Tensor, group: str, chunk: int) -> tuple[Tensor, Tensor]:
    """q, k, v of my tokens to the host rows of my heads; (the handle, the ticket)."""
    pg, world = _world(group)
    for role, x in (("q", q), ("k", k), ("v", v)):
        _to_heads(x, _store(role, x.shape, world, x.dtype, x.device), world, pg, chunk)
    _GENERATION[0] += 1
    return q.new_empty((0,)), torch.tensor([_GENERATION[0]], dtype=torch.int64, device=q.device)


def tiles_attend(handle: Tensor, ticket: Tensor, group: str, causal: bool, scale: float | None, chunk: int,
                 q_shape: list[int], kv_heads: int, d_v: int) -> tuple[Tensor, Tensor]:
    """(output [B, N/W, A_q, D_v] of my tokens, log-sum-exp [B, A_q/W, L] of my heads in the accumulation dtype)."""
    _check_ticket(ticket)
    pg, world = _world(group)
    B, n, A_q, D = q_shape
    dtype, device = handle.dtype, handle.device
    qs, ks = _store("q", q_shape, world, dtype, device), _store("k", (B, n, kv_heads, D), world, dtype, device)
    vs = _store("v", (B, n, kv_heads, d_v), world, dtype, device)
    os_ = _store("o", q_shape, world, dtype, device, width=d_v)
    length = n * world
    lse = torch.empty((B, A_q // world, length), dtype=ca.acc_dtype(dtype), device=device)
    for (s, e), (qt,) in host_tiles.fetch((qs,), _pieces(length, chunk)):
        o, l = ca.chunked_attention_forward(qt, ks, vs, causal, scale, chunk, q_offset=s)
        del qt
        os_.write(s, e, o)
        lse[:, :, s:e].copy_(l)
        del o, l
    out = torch.empty((B, n, A_q, d_v), dtype=dtype, device=device)
    _to_tokens(os_, out, world, pg, chunk)
    return out, lse


def tiles_attend_backward(grad_out: Tensor, out: Tensor, lse: Tensor, ticket: Tensor, group: str, causal: bool,
                          scale: float | None, chunk: int, kv_heads: int, d_qk: int) -> Tensor:
    """dq, dk, dv of the whole sequence for my heads onto the host (dq in the accumulation dtype); the handle's
    gradient (empty) for ``tiles_take``."""
    _check_ticket(ticket)
    pg, world = _world(group)
    B, n, A_q, D_v = out.shape
    length = n * world
    acc = ca.acc_dtype(out.dtype)
    qs = _store("q", (B, n, A_q, d_qk), world, out.dtype, out.device)
    ks = _store("k", (B, n, kv_heads, d_qk), world, out.dtype, out.device)
    vs = _store("v", (B, n, kv_heads, D_v), world, out.dtype, out.device)
    dos = _store("dO", out.shape, world, out.dtype, out.device)
    _to_heads(grad_out, dos, world, pg, chunk)
    local = torch.empty((B, n, A_q), dtype=acc, device=out.device)       # rowsum(dO O) of my tokens, every head
    for p0, p1 in _pieces(n, chunk):
        local[:, p0:p1] = (grad_out[:, p0:p1].to(acc) * out[:, p0:p1].to(acc)).sum(-1)
    delta = torch.empty_like(lse)                                        # [B, A_q/W, L] of my heads
    _to_heads(local[..., None], delta[..., None], world, pg, chunk)
    del local
    dq = _store("dq", (B, n, A_q, d_qk), world, acc, out.device)
    dks = _store("dk", (B, n, kv_heads, d_qk), world, out.dtype, out.device)
    dvs = _store("dv", (B, n, kv_heads, D_v), world, out.dtype, out.device)
    for (s, e), (kj, vj) in host_tiles.fetch((ks, vs), _pieces(length, chunk)):
        dkj, dvj = ca.key_tile_backward(qs, dos, lse, delta, kj, vj, s, causal, scale, chunk, dq, fresh=s == 0)
        del kj, vj
        dks.write(s, e, dkj)
        dvs.write(s, e, dvj)
        del dkj, dvj
    return out.new_empty((0,))


def tiles_take(grad_handle: Tensor, ticket: Tensor, group: str, chunk: int, q_shape: list[int], kv_heads: int,
               d_v: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of my tokens from the host rows ``tiles_attend_backward`` wrote, in the handle's dtype."""
    _check_ticket(ticket)
    pg, world = _world(group)
    B, n, A_q, D = q_shape
    dtype, device = grad_handle.dtype, grad_handle.device
    shapes = ((B, n, A_q, D), (B, n, kv_heads, D), (B, n, kv_heads, d_v))
    stores = (_store("dq", shapes[0], world, ca.acc_dtype(dtype), device), _store("dk", shapes[1], world, dtype, device),
              _store("dv", shapes[2], world, dtype, device))
    grads = tuple(torch.empty(shape, dtype=dtype, device=device) for shape in shapes)
    for store, g in zip(stores, grads):
        _to_tokens(store, g, world, pg, chunk)
    return grads


def tiles_forward(q, k, v, group: str, causal: bool, scale, chunk: int):
    """put, then attend: (output, log-sum-exp, ticket)."""
    handle, ticket = tiles_put(q, k, v, group, chunk)
    out, lse = tiles_attend(handle, ticket, group, causal, scale, chunk, list(q.shape), k.shape[2], v.shape[3])
    return out, lse, ticket


def tiles_backward(grad_out, out, lse, ticket, group: str, causal: bool, scale, chunk: int, kv_heads: int, d_qk: int):
    """attend's backward, then take: (dq, dk, dv)."""
    grad_handle = tiles_attend_backward(grad_out, out, lse, ticket, group, causal, scale, chunk, kv_heads, d_qk)
    B, n, A_q, D_v = out.shape
    return tiles_take(grad_handle, ticket, group, chunk, [B, n, A_q, d_qk], kv_heads, D_v)


# ---------------------------------------------------------------------------------------------- custom ops
def _world_of(group: str) -> int:
    return _world(group)[1]


def _scale(scale: float) -> float | None:
    return scale if scale > 0 else None


@torch.library.custom_op("boundpass::seq_to_head_tiles_put", mutates_args=())
def seq_to_head_tiles_put(q: Tensor, k: Tensor, v: Tensor, group: str, chunk: int) -> tuple[Tensor, Tensor]:
    return tiles_put(q, k, v, group, chunk)


@seq_to_head_tiles_put.register_fake
def _(q, k, v, group, chunk):
    return q.new_empty((0,)), q.new_empty((1,), dtype=torch.int64)


@torch.library.custom_op("boundpass::seq_to_head_tiles_attend", mutates_args=())
def seq_to_head_tiles_attend(handle: Tensor, ticket: Tensor, group: str, causal: bool, scale: float, chunk: int,
                             q_shape: list[int], kv_heads: int, d_v: int) -> tuple[Tensor, Tensor]:
    return tiles_attend(handle, ticket, group, causal, _scale(scale), chunk, q_shape, kv_heads, d_v)


@seq_to_head_tiles_attend.register_fake
def _(handle, ticket, group, causal, scale, chunk, q_shape, kv_heads, d_v):
    world = _world_of(group)
    B, n, A_q, _ = q_shape
    return (handle.new_empty((B, n, A_q, d_v)),
            handle.new_empty((B, A_q // world, n * world), dtype=ca.acc_dtype(handle.dtype)))


@torch.library.custom_op("boundpass::seq_to_head_tiles_attend_bwd", mutates_args=())
def seq_to_head_tiles_attend_bwd(grad_out: Tensor, out: Tensor, lse: Tensor, ticket: Tensor, group: str, causal: bool,
                                 scale: float, chunk: int, kv_heads: int, d_qk: int) -> Tensor:
    return tiles_attend_backward(grad_out, out, lse, ticket, group, causal, _scale(scale), chunk, kv_heads, d_qk)


@seq_to_head_tiles_attend_bwd.register_fake
def _(grad_out, out, lse, ticket, group, causal, scale, chunk, kv_heads, d_qk):
    return out.new_empty((0,))


@torch.library.custom_op("boundpass::seq_to_head_tiles_take", mutates_args=())
def seq_to_head_tiles_take(grad_handle: Tensor, ticket: Tensor, group: str, chunk: int, q_shape: list[int],
                           kv_heads: int, d_v: int) -> tuple[Tensor, Tensor, Tensor]:
    return tiles_take(grad_handle, ticket, group, chunk, q_shape, kv_heads, d_v)


@seq_to_head_tiles_take.register_fake
def _(grad_handle, ticket, group, chunk, q_shape, kv_heads, d_v):
    B, n, A_q, D = q_shape
    return (grad_handle.new_empty((B, n, A_q, D)), grad_handle.new_empty((B, n, kv_heads, D)),
            grad_handle.new_empty((B, n, kv_heads, d_v)))


def _put_setup(ctx, inputs, output):
    q, k, v, group, chunk = inputs
    ctx.save_for_backward(output[1])
    ctx.args = (group, chunk, list(q.shape), k.shape[2], v.shape[3])


def _put_backward(ctx, grad_handle, grad_ticket):
    (ticket,) = ctx.saved_tensors
    group, chunk, q_shape, kv_heads, d_v = ctx.args
    # grad_handle is attend's backward's output: taking it orders take after it in a graph
    dq, dk, dv = torch.ops.boundpass.seq_to_head_tiles_take(grad_handle, ticket, group, chunk, q_shape, kv_heads, d_v)
    return dq, dk, dv, None, None


def _attend_setup(ctx, inputs, output):
    handle, ticket, group, causal, scale, chunk, q_shape, kv_heads, d_v = inputs
    ctx.save_for_backward(output[0], output[1], ticket)
    ctx.args = (group, causal, scale, chunk, kv_heads, q_shape[3])


def _attend_backward(ctx, grad_out, grad_lse):
    out, lse, ticket = ctx.saved_tensors
    group, causal, scale, chunk, kv_heads, d_qk = ctx.args
    grad_handle = torch.ops.boundpass.seq_to_head_tiles_attend_bwd(grad_out.contiguous(), out, lse, ticket, group,
                                                                   causal, scale, chunk, kv_heads, d_qk)
    return grad_handle, None, None, None, None, None, None, None, None


seq_to_head_tiles_put.register_autograd(_put_backward, setup_context=_put_setup)
seq_to_head_tiles_attend.register_autograd(_attend_backward, setup_context=_attend_setup)


def seq_to_head_tiles(q: Tensor, k: Tensor, v: Tensor, group=None, *, causal: bool = True,
                      scale: float | None = None, chunk: int = 256) -> Tensor:
    """Causal (or full) attention of this rank's tokens against the whole sequence sharded over ``group``'s W ranks,
    exact, in tiles of ``chunk`` query x key rows with the whole-sequence tensors on the host (differentiable).

    q: [B, N/W, A_q, D], k: [B, N/W, A_kv, D], v: [B, N/W, A_kv, D_v] (torchtitan's layout, RoPE applied at global
    positions); returns [B, N/W, A_q, D_v]. ``group`` None: one rank (no exchange)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise BoundpassInputError(f"seq_to_head_tiles takes [B, L, heads, D] q / k / v, got {tuple(q.shape)}, "
                                  f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise BoundpassInputError(f"seq_to_head_tiles: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if chunk < 1:
        raise BoundpassInputError(f"seq_to_head_tiles: chunk must be >= 1, got {chunk}")
    world = dist.get_world_size(group) if group is not None else 1
    check_tiles_heads(q.shape[2], k.shape[2], world)
    name = group.group_name if group is not None else ""
    # q, k, v as they are: the exchange copies them piece by piece (a whole contiguous copy would be one more tensor)
    handle, ticket = torch.ops.boundpass.seq_to_head_tiles_put(q, k, v, name, int(chunk))
    out, _ = torch.ops.boundpass.seq_to_head_tiles_attend(handle, ticket, name, causal, float(scale or 0.0),
                                                          int(chunk), list(q.shape), k.shape[2], v.shape[3])
    return out


# ------------------------------------------------------------------------------------------------ bound
def seq_to_head_tiles_bound(part: str, *, mixed_precision: bool, gqa: bool, fused: bool, padded: bool,
                            rows: int | None = None) -> sympy.Expr:
    """Device bytes of one op call on a rank: N = B N/W tokens of this rank (summed over the batch B), W ranks, A_q /
    A_kv heads, head dims D (``D_h``) and D_v, tile C_s (rows per piece and per tile), L_seq = W N / B; b the inputs'
    bytes, b_acc the accumulation's. With x = min(1, W - 1) (0: one rank, no all-to-all) and r = B C_s, ``part``:

    put            : q, k, v (the caller's) + the ticket + one piece exchanged, (1 + x) r A_q D b (send and receive;
                     the largest is q's)
    attend         : the ticket + lse (N A_q b_acc)
                     + max(the kernels on a query tile: two q tiles, two k / v tiles read (the one read, the next),
                           the tile's output and lse, the forward tile workspace at A_q / W, A_kv / W heads,
                           the output (made after the tiles) + one piece of its exchange back)
    attend_backward: the output gradient, the output, lse, the ticket
                     + max(the output gradient's exchange, rowsum(dO O) per piece (its operands in b_acc) + delta whole
                           of my tokens and of my heads (2 N A_q b_acc) beside its exchange,
                           delta + per key tile: two k / v tiles, its dk / dv (b_acc), two tiles each of q, dO (b) and
                           dq (b_acc), the key tile's workspace at A_q / W, A_kv / W heads)
    take           : the ticket + dq, dk, dv (returned, b) + one piece of their exchange back
    "forward" / "backward": the larger of put and attend / of attend_backward and take. ``rows``: the tile's rows where
    the call fixes them (torch's fused kernel splits its query rows by them; else its widest split)."""
    if part == "forward":
        return sym.max_kept(*(seq_to_head_tiles_bound(p, mixed_precision=mixed_precision, gqa=gqa, fused=fused,
                                                      padded=padded, rows=rows) for p in ("put", "attend")))
    if part == "backward":
        return sym.max_kept(*(seq_to_head_tiles_bound(p, mixed_precision=mixed_precision, gqa=gqa, fused=fused,
                                                      padded=padded) for p in ("attend_backward", "take")))
    N, W, A_q, A_kv, D, D_v = sym.N, sym.W, sym.A_q, sym.A_kv, sym.D_h, ca.D_v_sym
    b, b_acc, C_s = sym.b, sym.b_acc, ca.C_s_sym
    batch = N * W / ca.L_seq_sym
    x = sympy.Min(1, W - 1)
    r = batch * C_s
    a_q, a_kv = A_q / W, A_kv / W
    heads = {sym.A_q: a_q, sym.A_kv: a_kv}
    q_b, kv_b, o_b, lse_b = N * A_q * D * b, N * A_kv * (D + D_v) * b, N * A_q * D_v * b, N * A_q * b_acc
    ticket = 8
    tile_kv = 2 * r * a_kv * (D + D_v) * b
    if part == "put":
        return q_b + kv_b + ticket + (1 + x) * r * A_q * D * b
    if part == "take":
        return ticket + q_b + kv_b + (1 + x) * r * A_q * D * b
    if part == "attend":
        tile = ca.tile_workspace("forward", mixed_precision=mixed_precision, batch=batch, fused=fused, gqa=gqa,
                                 padded=padded, rows=rows).xreplace(heads)
        kernels = 2 * r * a_q * D * b + tile_kv + r * a_q * (D_v * b + b_acc) + tile
        return ticket + lse_b + sympy.Max(kernels, o_b + (1 + x) * r * A_q * D_v * b)
    if part != "attend_backward":
        raise BoundpassInputError("seq_to_head_tiles_bound: part must be put, attend, attend_backward, take, forward or "
                                  f"backward; got {part!r}")
    key = ca.tile_workspace("key", mixed_precision=mixed_precision, batch=batch, gqa=gqa).xreplace(heads)
    delta = 2 * lse_b
    return 2 * o_b + lse_b + ticket + sympy.Max(
        (1 + x) * r * A_q * D_v * b,                                               # dO to the host
        delta + 3 * r * A_q * D_v * b_acc + (1 + x) * r * A_q * b_acc,              # rowsum(dO O), its exchange
        delta + tile_kv + r * a_kv * (D + D_v) * b_acc + 2 * r * a_q * ((D + D_v) * b + D * b_acc) + key)


def seq_to_head_tiles_host_bound(part: str = "forward") -> sympy.Expr:
    """Host bytes (the pool): q, k, v and the output of the whole sequence for my heads (B L A / W = N A rows per
    tensor), and from the backward on dO, dk, dv (b) and dq (b_acc) beside them; ``part``: an op's (put: q, k, v) or
    "forward" / "backward"."""
    N, A_q, A_kv, D, D_v, b, b_acc = sym.N, sym.A_q, sym.A_kv, sym.D_h, ca.D_v_sym, sym.b, sym.b_acc
    qkv = N * (A_q * D + A_kv * (D + D_v)) * b
    if part == "put":
        return qkv
    forward = qkv + N * A_q * D_v * b
    if part in ("forward", "attend"):
        return forward
    return forward + N * (A_q * D_v + A_kv * (D + D_v)) * b + N * A_q * D * b_acc


_PART = {"seq_to_head_tiles_put": "put", "seq_to_head_tiles_attend": "attend",
         "seq_to_head_tiles_attend_bwd": "attend_backward", "seq_to_head_tiles_take": "take"}


def _values(part: str, a: dict) -> dict:
    world = _world_of(a["group"])
    if part == "put":
        q, v = a["q"], a["v"]
        B, n, A_q, D = q.shape
        A_kv, D_v, dtype = a["k"].shape[2], v.shape[3], q.dtype
    elif part == "attend_backward":
        out = a["out"]
        B, n, A_q, D_v = out.shape
        A_kv, D, dtype = a["kv_heads"], a["d_qk"], out.dtype
    else:
        B, n, A_q, D = a["q_shape"]
        A_kv, D_v = a["kv_heads"], a["d_v"]
        dtype = (a["handle"] if part == "attend" else a["grad_handle"]).dtype
    chunk = a["chunk"]
    n_expr = contracts.as_expr(n)
    return {sym.N: contracts.as_expr(B) * n_expr, sym.W: world, sym.A_q: int(A_q), sym.A_kv: int(A_kv),
            sym.D_h: int(D), ca.D_v_sym: int(D_v), sym.b: dtype.itemsize, sym.b_acc: ca.acc_dtype(dtype).itemsize,
            ca.C_s_sym: sympy.Min(int(chunk), n_expr) if chunk > 0 else ca.C_s_sym, ca.L_seq_sym: n_expr * world}


def _bounds(op_name: str):
    part = _PART[op_name]

    def device(a: dict, ctx: dict) -> sympy.Expr:
        values = _values(part, a)
        D, D_v = values[sym.D_h], values[ca.D_v_sym]
        rows = values[ca.C_s_sym]   # the tile's rows where the call fixes them (a number)
        bound = contracts.cached_bound(seq_to_head_tiles_bound, part=part,
                                       mixed_precision=values[sym.b_acc] != values[sym.b],
                                       gqa=values[sym.A_q] != values[sym.A_kv], fused=D_v <= D, padded=D_v < D,
                                       rows=int(rows) if rows.is_number else None)
        return contracts.substitute(bound, values)

    def host(a: dict, ctx: dict) -> sympy.Expr:
        return contracts.substitute(contracts.cached_bound(seq_to_head_tiles_host_bound, part=part),
                                    _values(part, a))
    return device, host


for _name in _PART:
    _op = getattr(torch.ops.boundpass, _name).default
    _device, _host_fn = _bounds(_name)
    contracts.register_bound(_op, _device)
    contracts.register_host_bound(_op, _host_fn)
