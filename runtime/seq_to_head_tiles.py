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
from boundpass.runtime.groups import release_storage

__all__ = ["seq_to_head_tiles", "seq_to_head_tiles_bound", "seq_to_head_tiles_host_bound", "check_tiles_heads"]

_GENERATION = [0]   # forwards run in this process: the ticket a backward checks its host rows against


def check_tiles_heads(A_q: int, A_kv: int, world: int) -> None:
    if A_q % A_kv or A_q % world or A_kv % world:
        raise BoundpassInputError(
            f"sequence-to-head attention in tiles gives each of the {world} ranks A/W heads of q and of k / v: "
            f"A_q = {A_q} and A_kv = {A_kv} must be multiples of W = {world} (and A_q of A_kv); with fewer kv heads "
            "than ranks use the whole-tensor exchange (--boundpass.attention.no-enable)")


def _group(name: str):
    return None if not name else dist.distributed_c10d._resolve_process_group(name)


def _pieces(n: int, chunk: int):
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _to_heads(x: Tensor, store, world: int, group, chunk: int) -> None:
    """x [B, N/W, A, D] (my tokens, every head) into ``store`` [B, A/W, L, D] (every token, my heads), C_s of my
    tokens at a time: rank s's tokens [p0, p1) land at rows [s N/W + p0, s N/W + p1)."""
    B, n, A, D = x.shape
    a = A // world
    for p0, p1 in _pieces(n, chunk):
        send = torch.empty((world, B, a, p1 - p0, D), dtype=x.dtype, device=x.device)   # [W_dst, B, a, c, D]
        send.copy_(x[:, p0:p1].reshape(B, p1 - p0, world, a, D).permute(2, 0, 3, 1, 4))
        if world > 1:
            recv = torch.empty_like(send)                                               # [W_src, B, a, c, D]
            dist.all_to_all_single(recv, send, group=group)
            release_storage(send)
        else:
            recv = send
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
        if world > 1:
            recv = torch.empty_like(send)                                                  # [W_src, B, a, c, D]
            dist.all_to_all_single(recv, send, group=group)
            release_storage(send)
        else:
            recv = send
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


def _host(role: str, like: Tensor, world: int, dtype: torch.dtype | None = None) -> host_tiles.HostRows:
    B, n, A, D = like.shape
    return host_tiles.HostRows(f"s2h_{role}", (B, A // world, n * world, D), dtype or like.dtype, like.device)


def _stores(q_shape, k_shape, v_shape, dtype, device, world: int):
    """The forward's host rows of q, k, v and the output, views of the pool (the same bytes every call)."""
    def rows(role, shape, width=None):
        B, n, A, D = shape
        return host_tiles.HostRows(f"s2h_{role}", (B, A // world, n * world, width or D), dtype, device)
    return rows("q", q_shape), rows("k", k_shape), rows("v", v_shape), rows("o", q_shape, v_shape[3])


def tiles_forward(q: Tensor, k: Tensor, v: Tensor, group: str, causal: bool, scale: float | None,
                  chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """(output [B, N/W, A_q, D_v] of my tokens, log-sum-exp [B, A_q/W, L] of my heads (fp32), ticket)."""
    pg = _group(group)
    world = dist.get_world_size(pg) if pg is not None else 1
    B, n, A_q, D = q.shape
    qs, ks, vs, os_ = _stores(q.shape, k.shape, v.shape, q.dtype, q.device, world)
    for x, store in ((q, qs), (k, ks), (v, vs)):
        _to_heads(x, store, world, pg, chunk)
    length = n * world
    lse = torch.empty((B, A_q // world, length), dtype=ca.acc_dtype(q.dtype), device=q.device)
    for (s, e), (qt,) in host_tiles.fetch((qs,), ca._tiles(length, chunk)):
        o, l = ca.chunked_attention_forward(qt, ks, vs, causal, scale, chunk, q_offset=s)
        del qt
        os_.write(s, e, o)
        lse[:, :, s:e].copy_(l)
        del o, l
    out = q.new_empty((B, n, A_q, v.shape[3]))
    _to_tokens(os_, out, world, pg, chunk)
    _GENERATION[0] += 1
    return out, lse, torch.tensor([_GENERATION[0]], dtype=torch.int64, device=q.device)


def tiles_backward(grad_out: Tensor, out: Tensor, lse: Tensor, ticket: Tensor, group: str, causal: bool,
                   scale: float | None, chunk: int, kv_heads: int, d_qk: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of my tokens, in the output's dtype."""
    if int(ticket.item()) != _GENERATION[0]:
        raise BoundpassInputError(
            "sequence-to-head attention in tiles: this attention's host rows (q, k, v of the whole sequence) were "
            "overwritten by another attention's forward before its backward ran; the tiles keep one attention's rows at "
            "a time, which needs each block's forward run again right before its backward (full activation "
            "checkpointing: torchtitan's FullAC). Use --activation_checkpoint.mode full, or the whole-tensor exchange "
            "(--boundpass.attention.no-enable)")
    pg = _group(group)
    world = dist.get_world_size(pg) if pg is not None else 1
    B, n, A_q, D_v = out.shape
    length = n * world
    acc = ca.acc_dtype(out.dtype)
    qs, ks, vs, _ = _stores((B, n, A_q, d_qk), (B, n, kv_heads, d_qk), (B, n, kv_heads, D_v), out.dtype, out.device,
                            world)
    grad_out = grad_out.contiguous()
    dos = _host("dO", grad_out, world)
    _to_heads(grad_out, dos, world, pg, chunk)
    local = torch.empty((B, n, A_q), dtype=acc, device=out.device)       # rowsum(dO O) of my tokens, every head
    for p0, p1 in _pieces(n, chunk):
        local[:, p0:p1] = (grad_out[:, p0:p1].to(acc) * out[:, p0:p1].to(acc)).sum(-1)
    delta = torch.empty_like(lse)                                        # [B, A_q/W, L] of my heads
    _to_heads(local[..., None], delta[..., None], world, pg, chunk)
    del local
    dq = host_tiles.HostRows("s2h_dq", (B, A_q // world, length, d_qk), acc, out.device)
    dks = host_tiles.HostRows("s2h_dk", (B, kv_heads // world, length, d_qk), out.dtype, out.device)
    dvs = host_tiles.HostRows("s2h_dv", (B, kv_heads // world, length, D_v), out.dtype, out.device)
    for (s, e), (kj, vj) in host_tiles.fetch((ks, vs), ca._tiles(length, chunk)):
        dkj, dvj = ca.key_tile_backward(qs, dos, lse, delta, kj, vj, s, causal, scale, chunk, dq, fresh=s == 0)
        del kj, vj
        dks.write(s, e, dkj)
        dvs.write(s, e, dvj)
        del dkj, dvj
    del delta
    grads = (out.new_empty((B, n, A_q, d_qk)), out.new_empty((B, n, kv_heads, d_qk)),
             out.new_empty((B, n, kv_heads, D_v)))
    for store, g in zip((dq, dks, dvs), grads):
        _to_tokens(store, g, world, pg, chunk)
    return grads


# ---------------------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("boundpass::seq_to_head_tiles_fwd", mutates_args=())
def seq_to_head_tiles_fwd(q: Tensor, k: Tensor, v: Tensor, group: str, causal: bool, scale: float,
                          chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    return tiles_forward(q, k, v, group, causal, scale if scale > 0 else None, chunk)


def _world_of(group: str) -> int:
    pg = _group(group)
    return dist.get_world_size(pg) if pg is not None else 1


@seq_to_head_tiles_fwd.register_fake
def _(q, k, v, group, causal, scale, chunk):
    world = _world_of(group)
    B, n, A_q, _ = q.shape
    return (q.new_empty((B, n, A_q, v.shape[3])), q.new_empty((B, A_q // world, n * world), dtype=ca.acc_dtype(q.dtype)),
            q.new_empty((1,), dtype=torch.int64))


@torch.library.custom_op("boundpass::seq_to_head_tiles_bwd", mutates_args=())
def seq_to_head_tiles_bwd(grad_out: Tensor, out: Tensor, lse: Tensor, ticket: Tensor, group: str, causal: bool,
                          scale: float, chunk: int, kv_heads: int, d_qk: int) -> tuple[Tensor, Tensor, Tensor]:
    return tiles_backward(grad_out, out, lse, ticket, group, causal, scale if scale > 0 else None, chunk, kv_heads,
                          d_qk)


@seq_to_head_tiles_bwd.register_fake
def _(grad_out, out, lse, ticket, group, causal, scale, chunk, kv_heads, d_qk):
    B, n, A_q, D_v = out.shape
    return (out.new_empty((B, n, A_q, d_qk)), out.new_empty((B, n, kv_heads, d_qk)),
            out.new_empty((B, n, kv_heads, D_v)))


def _setup_context(ctx, inputs, output):
    q, k, v, group, causal, scale, chunk = inputs
    ctx.save_for_backward(output[0], output[1], output[2])
    ctx.args = (group, causal, scale, chunk, k.shape[2], q.shape[3])


def _backward(ctx, grad_out, grad_lse, grad_ticket):
    out, lse, ticket = ctx.saved_tensors
    group, causal, scale, chunk, kv_heads, d_qk = ctx.args
    dq, dk, dv = torch.ops.boundpass.seq_to_head_tiles_bwd(grad_out, out, lse, ticket, group, causal, scale, chunk,
                                                           kv_heads, d_qk)
    return dq, dk, dv, None, None, None, None


seq_to_head_tiles_fwd.register_autograd(_backward, setup_context=_setup_context)


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
    out, _, _ = torch.ops.boundpass.seq_to_head_tiles_fwd(q, k, v, name, causal, float(scale or 0.0), int(chunk))
    return out


# ------------------------------------------------------------------------------------------------ bound
def seq_to_head_tiles_bound(part: str = "peak", *, mixed_precision: bool, gqa: bool, fused: bool,
                            padded: bool) -> sympy.Expr:
    """Device bytes of one call on a rank: N = B N/W tokens of this rank (summed over the batch B), W ranks, A_q / A_kv
    heads, head dims D (``D_h``) and D_v, tile C_s (rows per piece and per tile), L_seq = W N / B; b the inputs' bytes,
    b_acc the accumulation's. With x = min(1, W - 1) (0: one rank, no all-to-all) and r = B C_s:

    forward : q, k, v (the caller's) + lse (N A_q b_acc)
              + max(one piece exchanged: (1 + x) r A_q D b             (send and receive, the largest is q's)
                    the kernels on a query tile: two q tiles, two k / v tiles read (the one read, the next),
                    the tile's output and lse, the forward tile workspace at A_q / W, A_kv / W heads,
                    the output (made after the tiles) + the ticket + one piece of its exchange back)
    backward: the output gradient, the output, lse, the ticket
              + max(the output gradient's exchange, rowsum(dO O) per piece (its operands in b_acc) + delta whole of my
                    tokens and of my heads (2 N A_q b_acc) beside its exchange,
                    delta + per key tile: two k / v tiles, its dk / dv (b_acc), two tiles each of q, dO (b) and dq
                    (b_acc), the key tile's workspace at A_q / W, A_kv / W heads,
                    dq, dk, dv (returned, b; made after the key tiles) + one piece of their exchange back)"""
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
    if part == "forward":
        tile = ca.tile_workspace("forward", mixed_precision=mixed_precision, batch=batch, fused=fused, gqa=gqa,
                                 padded=padded).xreplace(heads)
        kernels = 2 * r * a_q * D * b + tile_kv + r * a_q * (D_v * b + b_acc) + tile
        # the output is made once the tiles are done, and filled piece by piece
        return q_b + kv_b + lse_b + sympy.Max((1 + x) * r * A_q * D * b, kernels,
                                              o_b + ticket + (1 + x) * r * A_q * D_v * b)
    if part != "backward":
        raise BoundpassInputError(f"seq_to_head_tiles_bound: part must be 'forward' or 'backward', got {part!r}")
    key = ca.tile_workspace("key", mixed_precision=mixed_precision, batch=batch, gqa=gqa).xreplace(heads)
    held = 2 * o_b + lse_b + ticket
    delta = 2 * lse_b
    phases = [
        (1 + x) * r * A_q * D_v * b,                                               # dO to the host
        delta + 3 * r * A_q * D_v * b_acc + (1 + x) * r * A_q * b_acc,              # rowsum(dO O), its exchange
        delta + tile_kv + r * a_kv * (D + D_v) * b_acc + 2 * r * a_q * ((D + D_v) * b + D * b_acc) + key,
        q_b + kv_b + (1 + x) * r * A_q * D * b,                                    # dq, dk, dv made and sent back
    ]
    return held + sympy.Max(*phases)


def seq_to_head_tiles_host_bound(part: str = "forward") -> sympy.Expr:
    """Host bytes (the pool): q, k, v and the output of the whole sequence for my heads, and in the backward dO, dk,
    dv (b) and dq (b_acc) beside them; B L A / W = N A per tensor."""
    N, A_q, A_kv, D, D_v, b, b_acc = sym.N, sym.A_q, sym.A_kv, sym.D_h, ca.D_v_sym, sym.b, sym.b_acc
    forward = N * (A_q * (D + D_v) + A_kv * (D + D_v)) * b
    if part == "forward":
        return forward
    return forward + N * (A_q * D_v + A_kv * (D + D_v)) * b + N * A_q * D * b_acc


def _values(a: dict) -> dict:
    world = _world_of(a["group"])
    if "grad_out" in a:
        out = a["out"]
        B, n, A_q, D_v = out.shape
        A_kv, D, dtype = a["kv_heads"], a["d_qk"], out.dtype
    else:
        q, v = a["q"], a["v"]
        B, n, A_q, D = q.shape
        A_kv, D_v, dtype = a["k"].shape[2], v.shape[3], q.dtype
    chunk = a["chunk"]
    n_expr = contracts.as_expr(n)
    return {sym.N: contracts.as_expr(B) * n_expr, sym.W: world, sym.A_q: int(A_q), sym.A_kv: int(A_kv),
            sym.D_h: int(D), ca.D_v_sym: int(D_v), sym.b: dtype.itemsize, sym.b_acc: ca.acc_dtype(dtype).itemsize,
            ca.C_s_sym: sympy.Min(int(chunk), n_expr) if chunk > 0 else ca.C_s_sym, ca.L_seq_sym: n_expr * world}


def _flags(a: dict) -> dict:
    values = _values(a)
    dtype_b, acc = values[sym.b], values[sym.b_acc]
    D, D_v = values[sym.D_h], values[ca.D_v_sym]
    return dict(mixed_precision=acc != dtype_b, gqa=values[sym.A_q] != values[sym.A_kv], fused=D_v <= D,
                padded=D_v < D)


def _device_bound(a: dict, ctx: dict) -> sympy.Expr:
    part = "backward" if "grad_out" in a else "forward"
    bound = contracts.cached_bound(seq_to_head_tiles_bound, part=part, **_flags(a))
    return contracts.substitute(bound, _values(a))


def _host_bound(a: dict, ctx: dict) -> sympy.Expr:
    part = "backward" if "grad_out" in a else "forward"
    return contracts.substitute(contracts.cached_bound(seq_to_head_tiles_host_bound, part=part), _values(a))


contracts.register_bound(torch.ops.boundpass.seq_to_head_tiles_fwd.default, _device_bound)
contracts.register_bound(torch.ops.boundpass.seq_to_head_tiles_bwd.default, _device_bound)
contracts.register_host_bound(torch.ops.boundpass.seq_to_head_tiles_fwd.default, _host_bound)
contracts.register_host_bound(torch.ops.boundpass.seq_to_head_tiles_bwd.default, _host_bound)
