"""Sequence-chunked attention: scaled dot-product attention computed one (query chunk, key chunk) tile at a time,
with an online softmax across the key chunks, forward and backward, so no [L, L] score matrix ever exists.

Layout is ``F.scaled_dot_product_attention``'s: q [B, A_q, L, D], k [B, A_kv, L, D], v [B, A_kv, L, D_v] (GQA: query
head h reads key/value head h // (A_q / A_kv), SDPA's ``enable_gqa``; MLA: D_v may differ from D), causal or not,
``scale`` (None: 1 / sqrt(D)). The op returns the output [B, A_q, L, D_v] in q's dtype and the per-row log-sum-exp
[B, A_q, L] in the accumulation dtype (fp32 for bf16 / fp16 / fp32, fp64 for fp64), which the backward reads
instead of the scores: the backward recomputes each tile's probabilities from it (FlashAttention's schedule).

Exactness: each row's softmax is the same function of the same scores; the sums over key chunks are reordered
(online softmax), so results match the math path within the tolerance a fused attention kernel has against it.

The forward's tiles run through torch's fused CPU kernel where it applies (``fused_tiles``: on a CPU, v's head dim
at most q's, tiles on one grid), merged by their log-sum-exp; on its narrow (bf16) output each tile's partial result
is rounded once before it is merged in fp32. The backward's tiles are the tile math below (PyTorch ops): the fused
backward per tile measured no faster on the op here, and it allocates ~650 small buffers per call outside any aten op
(bf16, 16 heads, C_s = 128), which torch's profiler, the step's measure, cannot follow over a 4K step (10 GB of events).

The chunk size ``chunk`` (C_s: query rows and key rows per tile) is the op's knob: a tile holds [B, A_q, C_s, C_s]
scores and probabilities in the accumulation dtype, so the workspace is O(C_s^2 + C_s L / L) and its
``chunked_attention_bound`` says exactly what the op allocates beyond its inputs and outputs.
"""
from __future__ import annotations

import math

import sympy
import torch
from torch import Tensor

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError
from boundpass.runtime import contracts
from boundpass.runtime import host_tiles


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels accumulate in (fp32 for bf16 / fp16 / fp32, fp64 for fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _check(q: Tensor, k: Tensor, v: Tensor, chunk: int, q_offset: int | None = None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise BoundpassInputError(f"chunked attention takes [B, heads, L, D] q, k, v; got {tuple(q.shape)}, "
                                  f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3]:
        raise BoundpassInputError(f"chunked attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                                  "do not agree (batch, key/value heads and lengths, q and k head dim)")
    if q.shape[1] % k.shape[1]:
        raise BoundpassInputError(f"chunked attention: {q.shape[1]} query heads are not a multiple of "
                                  f"{k.shape[1]} key/value heads")
    if q_offset is None and q.shape[2] != k.shape[2]:
        raise BoundpassInputError(f"chunked attention: query length {q.shape[2]} != key length {k.shape[2]} "
                                  "(self-attention only)")
    if q_offset is not None and not 0 <= q_offset <= k.shape[2] - q.shape[2]:
        raise BoundpassInputError(f"chunked attention: query rows [{q_offset}, {q_offset + q.shape[2]}) are not "
                                  f"positions of the {k.shape[2]} keys (a query block of one sequence at its offset)")
    if chunk < 1:
        raise BoundpassInputError(f"chunked attention: chunk must be >= 1, got {chunk}")


def _tiles(length: int, chunk: int):
    return [(s, min(s + chunk, length)) for s in range(0, length, chunk)]


def row_tiles(stores, ranges):
    """Per (s, e) of ``ranges``: ((s, e), rows [s, e) of each store): views of whole tensors, or device tiles fetched
    from the host (``host_tiles.HostRows``, the next one prefetched)."""
    if isinstance(stores[0], Tensor):
        return (((s, e), [x[:, :, s:e] for x in stores]) for s, e in ranges)
    return host_tiles.fetch(stores, ranges)


def _tile_rows(x: Tensor, kv_heads: int, start: int, stop: int, dtype: torch.dtype) -> Tensor:
    """Rows [start, stop) of every query head of [B, A_q, L, d], as [B, A_kv, G (stop - start), d] in ``dtype``: the
    G query heads that read one key/value head stacked, so one matmul per key/value head serves them all."""
    b, heads, _, d = x.shape
    return x[:, :, start:stop].to(dtype).reshape(b, kv_heads, heads // kv_heads * (stop - start), d)


def _put_rows(dst: Tensor, rows: Tensor, start: int, stop: int) -> None:
    """The inverse of ``_tile_rows``: [B, A_kv, G n, ...] written into rows [start, stop) of [B, A_q, L, ...]."""
    dst[:, :, start:stop] = rows.reshape(dst.shape[0], dst.shape[1], stop - start, *dst.shape[3:])


def _operand_rows(x: Tensor, kv_heads: int, start: int, stop: int, upcast: Tensor) -> Tensor:
    """Rows [start, stop) of ``x`` as the tile's accumulated products take them (``_product``): in x's own dtype,
    ``upcast`` itself (the same rows in the accumulation dtype) where that is x's dtype."""
    return upcast if x.dtype == upcast.dtype else _tile_rows(x, kv_heads, start, stop, x.dtype)


def _product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` in ``b``'s dtype: a tile's product that is added into an accumulator (dV, dQ, dK). In mixed precision
    (bf16 inputs, fp32 tile math) its operands are the inputs' dtype, as a fused kernel takes them (P and dS rounded
    once), and so is the product, which the accumulator sums in fp32: torch's CPU bf16 matmul runs on the matrix
    units, 5x the fp32 one. The scores and dP = dO V^T, which the softmax reads, stay fp32 products."""
    return torch.matmul(a.to(b.dtype), b)


def _masked(scores: Tensor, q0: int, q1: int, k0: int, causal: bool) -> Tensor:
    """Causal mask of one tile [B, A_kv, G (q1 - q0), m] (in place): key position > query position gets -inf."""
    width = scores.shape[-1]
    if causal and k0 + width - 1 > q0:
        b, kv, gn, _ = scores.shape
        rows = torch.arange(q0, q1, device=scores.device)[:, None]
        cols = torch.arange(k0, k0 + width, device=scores.device)[None, :]
        scores.view(b, kv, gn // (q1 - q0), q1 - q0, width).masked_fill_(cols > rows, float("-inf"))
    return scores


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def fused_tiles(q, v, causal: bool, base: int, chunk: int) -> bool:
    """Whether each forward tile goes through torch's fused CPU kernel (FlashAttention's, one call per (query tile,
    key tile)): on a CPU, with v's head dim at most q's (v is zero-padded to it), and, causal, with the query tiles on
    the key tiles' grid (the one tile that crosses the diagonal is then the kernel's own causal square)."""
    return q.device.type == "cpu" and v.shape[3] <= q.shape[3] and (not causal or base % chunk == 0)


def _for_kernel(t: Tensor, groups: int, width: int) -> Tensor:
    """A tile as the fused kernel takes it: each key / value head repeated for its ``groups`` query heads (GQA),
    zero-padded to ``width`` (a value head narrower than the query's: MLA)."""
    if groups > 1:
        t = t.repeat_interleave(groups, dim=1)
    if t.shape[-1] < width:
        t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))
    return t


def _fused_forward(q, k, v, causal, scale, chunk, base, out, lse, acc) -> None:
    """Each query tile against its key tiles through the fused kernel, the tiles' outputs merged by their
    log-sum-exp in the accumulation dtype (the online softmax across key tiles)."""
    heads, d, dv = q.shape[1], q.shape[3], v.shape[3]
    groups = heads // k.shape[1]
    for q0, q1 in _tiles(q.shape[2], chunk):
        qi = q[:, :, q0:q1]
        o = run = None
        for (k0, k1), (kt, vt) in row_tiles((k, v), _tiles(base + q1 if causal else k.shape[2], chunk)):
            oj, lj = _FLASH(qi, _for_kernel(kt, groups, d), _for_kernel(vt, groups, d), 0.0,
                            causal and k1 > base + q0, scale=scale)
            del kt, vt
            oj = oj[..., :dv].to(acc)
            if o is None:
                o, run = oj, lj.to(acc)
                continue
            new = torch.logaddexp(run, lj)
            o.mul_(torch.exp(run.sub_(new))[..., None]).add_(oj.mul_(torch.exp(lj.sub_(new))[..., None]))
            run = new
            del oj, lj
        out[:, :, q0:q1] = o
        lse[:, :, q0:q1] = run
        del o, run


def chunked_attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None,
                              chunk: int, q_offset: int | None = None) -> tuple[Tensor, Tensor]:
    """(output [B, A_q, L_q, D_v] in q's dtype, log-sum-exp [B, A_q, L_q] in the accumulation dtype).

    q_offset: q is the block of query rows at positions [q_offset, q_offset + L_q) of the sequence whose keys are k
    (None: the whole sequence, L_q = L); causal rows see the keys up to their own position."""
    _check(q, k, v, chunk, q_offset)
    base = q_offset or 0
    bsz, heads, length, _ = q.shape
    kv_heads, dv = k.shape[1], v.shape[3]
    acc = acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    out = q.new_empty((bsz, heads, length, dv))
    lse = q.new_empty((bsz, heads, length), dtype=acc)
    if fused_tiles(q, v, causal, base, chunk):
        _fused_forward(q, k, v, causal, scale, chunk, base, out, lse, acc)
        return out, lse
    for q0, q1 in _tiles(length, chunk):
        qi = _tile_rows(q, kv_heads, q0, q1, acc)                     # [B, A_kv, G n, D]
        run_max = qi.new_full(qi.shape[:-1], float("-inf"))
        run_sum = qi.new_zeros(qi.shape[:-1])
        o = qi.new_zeros((*qi.shape[:-1], dv))
        for (k0, k1), (kt, vt) in row_tiles((k, v), _tiles(base + q1 if causal else k.shape[2], chunk)):
            kj, vj = kt.to(acc), vt.to(acc)                            # [B, A_kv, m, D], [B, A_kv, m, D_v]
            del kt, vt
            s = _masked(torch.matmul(qi, kj.transpose(-1, -2)).mul_(scale), base + q0, base + q1, k0, causal)
            new_max = torch.maximum(run_max, s.amax(-1))
            correction = torch.exp(run_max.sub_(new_max))
            p = torch.exp(s.sub_(new_max[..., None]))
            run_sum.mul_(correction).add_(p.sum(-1))
            o.mul_(correction[..., None]).add_(torch.matmul(p, vj))
            run_max = new_max
            del s, p, kj, vj, correction
        _put_rows(out, o.div_(run_sum[..., None]), q0, q1)
        _put_rows(lse, run_max.add_(torch.log(run_sum)), q0, q1)
        del qi, o, run_max, run_sum
    return out, lse


def chunked_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               causal: bool, scale: float | None, chunk: int, q_offset: int | None = None,
                               into: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the inputs' dtypes; each tile's probabilities recomputed from the saved log-sum-exp.

    q_offset: as ``chunked_attention_forward``. into: (dk, dv) accumulators in the accumulation dtype, shaped as k
    and v, that this block's key / value gradients are added to in place (a schedule walking query blocks keeps one
    pair for the whole sequence); they are returned as they are, not cast."""
    base = q_offset or 0
    length, kv_heads = q.shape[2], k.shape[1]
    acc = acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    if into is None:
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    else:
        dk, dv = into
    for q0, q1 in _tiles(length, chunk):
        qi, goi = _tile_rows(q, kv_heads, q0, q1, acc), _tile_rows(grad_out, kv_heads, q0, q1, acc)
        qn, gon = _operand_rows(q, kv_heads, q0, q1, qi), _operand_rows(grad_out, kv_heads, q0, q1, goi)
        delta = (goi * _tile_rows(out, kv_heads, q0, q1, acc)).sum(-1)   # rowsum(dO * O)
        li = _tile_rows(lse[..., None], kv_heads, q0, q1, acc)            # [B, A_kv, G n, 1]
        dqi = torch.zeros_like(qi)
        for (k0, k1), (kt, vt) in row_tiles((k, v), _tiles(base + q1 if causal else k.shape[2], chunk)):
            kj, vj = kt.to(acc), vt.to(acc)
            s = _masked(torch.matmul(qi, kj.transpose(-1, -2)).mul_(scale), base + q0, base + q1, k0, causal)
            p = torch.exp(s.sub_(li))                                      # the tile's probabilities
            dv[:, :, k0:k1].add_(_product(p.transpose(-1, -2), gon))   # the G query heads summed
            ds = torch.matmul(goi, vj.transpose(-1, -2)).sub_(delta[..., None]).mul_(p).mul_(scale)
            del s, p, vj
            ds = ds.to(q.dtype)   # the products' operand, as the inputs are (``_product``)
            dqi.add_(_product(ds, kt))
            dk[:, :, k0:k1].add_(_product(ds.transpose(-1, -2), qn))
            del ds, kj, kt, vt
        _put_rows(dq, dqi, q0, q1)
        del qi, goi, qn, gon, delta, li, dqi
    if into is not None:
        return dq, dk, dv
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def key_tile_backward(q, grad_out, lse: Tensor, delta: Tensor, kj: Tensor, vj: Tensor, k0: int, causal: bool,
                      scale: float | None, chunk: int, dq, fresh: bool) -> tuple[Tensor, Tensor]:
    """The key / value gradients of keys [k0, k0 + m) alone, in the accumulation dtype, and this key tile's part of
    every query row's dq added into ``dq``: every query tile that sees the key tile walked against it once
    (FlashAttention-2's key-outer order), from the whole sequence's q, output gradient, log-sum-exp and delta =
    rowsum(dO O) [B, A_q, L] (what a query-outer pass leaves). A schedule that makes k and v per key tile (recomputed
    from the block's inputs) finishes each tile's gradients here and never holds them whole. ``dq``: [B, A_q, L, D]
    in the accumulation dtype, on the device or the host (``host_tiles.HostRows``: its tiles fetched with q and dO,
    added to, written back); ``fresh``: its rows hold nothing yet (the first key tile, which every query row sees):
    the parts are written, not added. q and dO are whole tensors or HostRows alike."""
    length, kv_heads, m = q.shape[2], kj.shape[1], kj.shape[2]
    acc = acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    kt, vt = kj.to(acc), vj.to(acc)
    dk, dv = torch.zeros(kj.shape, dtype=acc, device=kj.device), torch.zeros(vj.shape, dtype=acc, device=vj.device)
    # causal: the query rows before the key tile see none of it
    seen = [(q0, q1) for q0, q1 in _tiles(length, chunk) if not (causal and q1 - 1 < k0)]
    on_host = isinstance(dq, host_tiles.HostRows)
    stores = (q, grad_out, dq) if on_host and not fresh else (q, grad_out)
    for (q0, q1), (qt, got, *dqt) in row_tiles(stores, seen):
        qi, goi = _tile_rows(qt, kv_heads, 0, q1 - q0, acc), _tile_rows(got, kv_heads, 0, q1 - q0, acc)
        qn, gon = _operand_rows(qt, kv_heads, 0, q1 - q0, qi), _operand_rows(got, kv_heads, 0, q1 - q0, goi)
        del qt, got
        li = _tile_rows(lse[..., None], kv_heads, q0, q1, acc)
        di = _tile_rows(delta[..., None], kv_heads, q0, q1, acc)
        s = _masked(torch.matmul(qi, kt.transpose(-1, -2)).mul_(scale), q0, q1, k0, causal)
        p = torch.exp(s.sub_(li))
        dv.add_(_product(p.transpose(-1, -2), gon))
        ds = torch.matmul(goi, vt.transpose(-1, -2)).sub_(di).mul_(p).mul_(scale)
        del s, p
        ds = ds.to(kj.dtype)
        dk.add_(_product(ds.transpose(-1, -2), qn))
        del qi, goi, qn, gon, li, di
        part = _product(ds, kj)                       # [B, A_kv, G n, D]: the query heads' rows in order
        part = part.view(part.shape[0], -1, q1 - q0, part.shape[-1])
        del ds
        if on_host:
            if fresh:
                dq.write(q0, q1, part)
            else:
                dq.write(q0, q1, dqt[0].add_(part))
        elif fresh:
            dq[:, :, q0:q1].copy_(part)
        else:
            dq[:, :, q0:q1].add_(part)
        del part, dqt
    return dk, dv


# ---------------------------------------------------------------------------------------------- custom ops
# Opaque ops: Inductor cannot fuse the tile loop back into [L, L] scores, and AOTAutograd takes the backward from
# register_autograd instead of unrolling the loops into the graph.
@torch.library.custom_op("boundpass::chunked_attention_fwd", mutates_args=())
def chunked_attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                          chunk: int) -> tuple[Tensor, Tensor]:
    return chunked_attention_forward(q, k, v, causal, scale if scale > 0 else None, chunk)


@chunked_attention_fwd.register_fake
def _(q, k, v, causal, scale, chunk):
    return (q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype)))


@torch.library.custom_op("boundpass::chunked_attention_bwd", mutates_args=())
def chunked_attention_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          causal: bool, scale: float, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    return chunked_attention_backward(grad_out, q, k, v, out, lse, causal, scale if scale > 0 else None, chunk)


@chunked_attention_bwd.register_fake
def _(grad_out, q, k, v, out, lse, causal, scale, chunk):
    # the real kernel returns fresh contiguous gradients, whatever the inputs' strides (a transposed q, k, v)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, chunk = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1])
    ctx.args = (causal, scale, chunk)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.boundpass.chunked_attention_bwd(grad_out.contiguous(), q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None


chunked_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def chunked_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, scale: float | None = None,
                      chunk: int = 512) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)``, computed in
    tiles of ``chunk`` query x ``chunk`` key rows (differentiable)."""
    _check(q, k, v, chunk)
    return torch.ops.boundpass.chunked_attention_fwd(q, k, v, causal, float(scale or 0.0), int(chunk))[0]


def reference(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, scale: float | None = None) -> Tensor:
    """The schedule it replaces: torch's math path, [B, A_q, L, L] scores."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                                enable_gqa=q.shape[1] != k.shape[1])


# ------------------------------------------------------------------------------------------------ bound
def chunked_attention_bound(part: str = "forward", *, mixed_precision: bool, fused: bool = False, gqa: bool = True,
                            padded: bool = True, rows: int | None = None) -> sympy.Expr:
    """Device bytes of one call: its inputs, its outputs and its largest tile's workspace; N = B L_seq tokens (rows
    of every head), A_q / A_kv heads, head dims D (``D_h``) and D_v, tile C_s; b the inputs' bytes per element,
    b_acc the accumulation's. ``mixed_precision`` (b < b_acc): each tile's key / value rows are upcast copies.

    forward : q, k, v, out (b) + lse (b_acc)
              + a tile of B C_s rows per head: qi, o, p @ vj, and five per-row vectors (b_acc), kj and vj upcast,
              scores and probabilities [B, A_q, C_s, C_s] (b_acc), the causal mask (C_s^2 bytes, two index vectors)
    backward: grad_out, q, k, v, out (b), lse (b_acc) + dq (b) + dk, dv accumulators (b_acc, cast to b when
              narrower) + a tile: qi, dqi (D), goi (D_v), delta and the lse rows (b_acc, every query head), then
              the larger of rowsum(dO O)'s operands (2 D_v) and the key loop's scores, probabilities and dS with one
              [C_s x d] product per key/value head; kj / vj upcast; the causal mask
    """
    N, A_q, A_kv, D, D_v = sym.N, sym.A_q, sym.A_kv, sym.D_h, D_v_sym
    b, b_acc = sym.b, sym.b_acc
    q_bytes, kv_bytes = N * A_q * D * b, N * A_kv * (D + D_v) * b
    out_bytes, lse_bytes = N * A_q * D_v * b, N * A_q * b_acc
    tile = tile_workspace(part, mixed_precision=mixed_precision, batch=N / L_seq_sym, fused=fused, gqa=gqa,
                          padded=padded, rows=rows)
    if part == "forward":
        return q_bytes + kv_bytes + out_bytes + lse_bytes + tile
    inputs = out_bytes + q_bytes + kv_bytes + out_bytes + lse_bytes
    # dq (b), the dk / dv accumulators (b_acc), and their casts to the inputs' dtype when it is narrower
    outputs = q_bytes + N * A_kv * (D + D_v) * b_acc + (kv_bytes if mixed_precision else 0)
    return inputs + outputs + tile


def flash_cpu_workspace(part: str, *, batch_heads, rows, kv_rows, d, width, b, narrow: bool,
                        threads: int | None = None) -> sympy.Expr:
    """What torch's fused CPU attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
    backward) allocates at one call beyond its inputs and outputs, for ``batch_heads`` = B A_q query rows of
    ``rows`` each against ``kv_rows`` keys, head dims ``d`` (q, k) and ``width`` (v), ``b`` bytes per element
    (``narrow``: below fp32). It splits the query rows into blocks of qs (32 below 192 rows, 64 below 768, else 256;
    256 for a symbolic count) and the key rows into blocks of ks = min(512, kv_rows) and allocates per thread, in
    fp32: forward qs ks scores + 2 qs running max / sum + qs width output accumulator (narrow: a narrow copy of the
    scores tile and of a [ks, width] value block, and once an fp32 accumulator of the whole output); backward
    2 qs ks (probabilities, their gradient) + qs (narrow: narrow copies of both tiles and what the kernel allocates
    outside any aten op, bounded by (qs ks + qs d) fp32 + 8 KiB) and once a contiguous copy of the query. Measured
    at torch's allocator (boundpass/measure/aten_contracts.py registers it for SDPA's own calls;
    tests/measure/test_aten_contracts.py)."""
    # (no Piecewise for a symbolic count: the planner's maxima over program points do not take one)
    qs = (32 if rows < 192 else 64 if rows < 768 else 256) if isinstance(rows, int) else 256
    ks = sympy.Min(512, kv_rows)
    threads = torch.get_num_threads() if threads is None else threads
    if part == "forward":
        tile = (qs * ks + 2 * qs + qs * width) * 4 + ((qs * ks * b + ks * width * b) if narrow else 0)
        return threads * tile + (batch_heads * rows * width * 4 if narrow else 0)
    unattributed = (qs * ks + qs * d) * 4 + 8192
    tile = (2 * qs * ks + qs) * 4 + ((2 * qs * ks * b + unattributed) if narrow else 0)
    return threads * tile + batch_heads * rows * d * b


def fused_tile_workspace(*, mixed_precision: bool, batch=None, gqa: bool = True, padded: bool = True,
                         rows: int | None = None) -> sympy.Expr:
    """``tile_workspace`` of the forward where its tiles go through torch's fused kernel (``fused_tiles``): B C_s
    rows of every query head (r); each key / value tile repeated for the query heads (``gqa``) and the value
    zero-padded to D (``padded``: D_v < D), copies of r D in b; the kernel's own workspace (``flash_cpu_workspace``);
    its output (r D in b, r in b_acc); the running output (mixed: the value columns cast, r D_v in b_acc, beside the
    tile's; else the first tile's padded output itself, r D) and four per-row vectors (running and new log-sum-exp,
    two factors). ``rows``: the tile's rows where the call fixes them (the kernel's query split follows them; else
    its widest)."""
    C_s, A_q, D, D_v, b, b_acc = C_s_sym, sym.A_q, sym.D_h, D_v_sym, sym.b, sym.b_acc
    batch = sym.N / L_seq_sym if batch is None else batch
    r = batch * C_s * A_q
    kernel = flash_cpu_workspace("forward", batch_heads=batch * A_q, rows=C_s if rows is None else int(rows),
                                 kv_rows=C_s, d=D, width=D, b=b, narrow=mixed_precision)
    copies = (int(gqa) + int(gqa or padded)) * r * D * b
    running = r * 2 * D_v * b_acc if mixed_precision else r * D * b_acc
    return copies + r * (D * b + b_acc) + running + r * 4 * b_acc + kernel


def tile_workspace(part: str = "forward", *, mixed_precision: bool, batch=None, fused: bool = False,
                   gqa: bool = True, padded: bool = True, rows: int | None = None) -> sympy.Expr:
    """What one tile of the kernels allocates beyond their inputs and outputs (the terms of
    ``chunked_attention_bound`` that do not grow with L): B C_s rows of every head, ``batch`` = B. ``fused``: the
    forward's tiles go through torch's fused kernel (``fused_tile_workspace``); else, and for the backward, the
    kernels' own tile math below. ``part``: "forward", "backward" (the query-outer kernel) or "key"
    (``key_tile_backward``)."""
    if fused and part == "forward":
        return fused_tile_workspace(mixed_precision=mixed_precision, batch=batch, gqa=gqa, padded=padded, rows=rows)
    C_s, A_q, A_kv, D, D_v, b_acc = C_s_sym, sym.A_q, sym.A_kv, sym.D_h, D_v_sym, sym.b_acc
    rows = (sym.N / L_seq_sym if batch is None else batch) * C_s     # B C_s: rows of one tile, per head
    upcast_kv = rows * A_kv * (D + D_v) * b_acc if mixed_precision else 0
    scores = rows * A_q * C_s * b_acc
    mask = C_s * C_s + 16 * C_s
    if part == "forward":
        return rows * A_q * (D + 2 * D_v + 5) * b_acc + upcast_kv + 2 * scores + mask
    kv_rows = rows * A_kv                # B C_s key rows of every key/value head
    # mixed precision: the products' operands q and dO in the inputs' dtype, copies where the G query heads of a
    # key / value head are stacked (GQA); P and dS cast narrow beside the fp32 scores (within the three scores' room),
    # and the narrow matmul's own scratch (``contracts.cpu_batched_matmul_workspace``) beside them
    narrow = rows * A_q * (D + D_v) * sym.b if mixed_precision and gqa else 0
    # the key loop: the scores, probabilities and dS together, or (mixed) the scores and probabilities, P cast narrow
    # and the narrow product's scratch
    scratch = contracts.cpu_batched_matmul_workspace(entry=A_q / A_kv * C_s * C_s * sym.b)
    loop = sympy.Max(3 * scores, 2 * scores + scores * sym.b / b_acc + scratch) if mixed_precision else 3 * scores
    if part == "key":   # key_tile_backward: qi, goi, delta and the lse rows (no dq), then the tile's products
        return rows * A_q * (D + D_v + 2) * b_acc + narrow + upcast_kv + loop + kv_rows * (D + D_v) * b_acc + mask
    held = rows * A_q * (2 * D + D_v + 2) * b_acc + narrow   # qi, dqi, goi, delta, the lse rows
    # rowsum(dO O): O's rows and the product; then the key loop: scores, probabilities and dS live together, beside
    # one [C_s x d] product of a key/value head
    return held + upcast_kv + sympy.Max(rows * A_q * 2 * D_v * b_acc,
                                        loop + kv_rows * (D + D_v) * b_acc + mask)


C_s_sym = sympy.Symbol("C_s", integer=True, positive=True)    # query / key rows per tile
D_v_sym = sympy.Symbol("D_v", integer=True, positive=True)    # value head dim (MLA: differs from D_h)
L_seq_sym = sympy.Symbol("L_seq", integer=True, positive=True)  # sequence length (N = B L_seq)


def bound_values(dtype: torch.dtype, *, batch: int, length: int, heads: int, kv_heads: int, head_dim: int,
                 v_head_dim: int, chunk: int | None = None) -> dict:
    values = {sym.N: batch * length, L_seq_sym: length, sym.A_q: heads, sym.A_kv: kv_heads, sym.D_h: head_dim,
              D_v_sym: v_head_dim, sym.b: dtype.itemsize, sym.b_acc: acc_dtype(dtype).itemsize}
    if chunk is not None:
        values[C_s_sym] = chunk
    return values


# ------------------------------------------------------------------------------------------ memory contract
def _device_bound(a: dict, ctx: dict) -> sympy.Expr:
    q, k, v = a["q"], a["k"], a["v"]
    mixed = acc_dtype(q.dtype) != q.dtype
    part = "backward" if "grad_out" in a else "forward"
    values = bound_values(q.dtype, batch=1, length=1, heads=int(q.shape[1]), kv_heads=int(k.shape[1]),
                          head_dim=int(q.shape[3]), v_head_dim=int(v.shape[3]))
    values[sym.N] = contracts.as_expr(q.shape[0]) * contracts.as_expr(q.shape[2])
    values[L_seq_sym] = contracts.as_expr(q.shape[2])
    values[C_s_sym] = sympy.Min(a["chunk"], contracts.as_expr(q.shape[2])) if a["chunk"] > 0 else C_s_sym
    fused = q.device.type == "cpu" and int(v.shape[3]) <= int(q.shape[3])
    bound = contracts.cached_bound(chunked_attention_bound, part=part, mixed_precision=mixed, fused=fused,
                                   gqa=int(q.shape[1]) != int(k.shape[1]), padded=int(v.shape[3]) < int(q.shape[3]),
                                   rows=min(int(a["chunk"]), q.shape[2])
                                   if a["chunk"] > 0 and isinstance(q.shape[2], int) else None)
    return contracts.substitute(bound, values)


contracts.register_bound(torch.ops.boundpass.chunked_attention_fwd.default, _device_bound)
contracts.register_bound(torch.ops.boundpass.chunked_attention_bwd.default, _device_bound)
