"""The attention sublayer in query blocks: the query path, the attention and the output projection of a block
walked C_s query rows at a time, so that q, the attention output, their gradients and dq are never whole; where the
key / value path is position-wise too, k and v are made key tile by key tile as well and their gradients are
finished tile by tile, so that neither k, v nor their fp32 gradient accumulators are ever held.

A *region* is the part of a block between its inputs and the output projection's result: position-wise programs
(fx.GraphModules the pass extracts from the model's graph, ``boundpass.passes.attention_region``) and the
chunked-attention kernels between them (runtime/chunked_attention.py):

    query(n, *rows[s:s+n], *params)   -> q rows [B, A_q, n, D]            (projections, norms, RoPE at the positions)
    kv(n, *rows[s:s+n], *params)      -> k, v rows [B, A_kv, n, D / D_v]  (optional: else k and v are op inputs)
    kernel(q rows, k, v, q_offset=s)  -> o rows [B, A_q, n, D_v] and their log-sum-exp
    out(n, o rows, *params)           -> y rows                           (transpose, reshape, output projection)

Forward: (k and v made per key tile into whole buffers, freed at the end) per query block the three steps under no
grad, the rows written into y; nothing of a block is kept. Backward without a kv program (k, v inputs), query-outer:
per block, q and o again (recomputed), ``out``'s vjp, the kernels' backward for dq and into one pair of fp32 dk / dv
accumulators, ``query``'s vjp into the block's rows of the row inputs' gradients and into the weights'. With a kv
program, three passes: query-outer, q (no grad) and o again and ``out``'s vjp, keeping q, the output gradient, the
log-sum-exp and rowsum(dO O) of every row; key-outer, each key tile made again under autograd, walked once against
every query tile that sees it (``ca.key_tile_backward``: its own gradients finished, its part of every row's dq added
into one fp32 dq), ``kv``'s vjp; query-outer again, ``query``'s vjp with the block's rows of dq. Exact up to
reordered sums: every row of y is the same function of the same rows of the inputs and of all keys and values.

Host (``Region.host``, ``attention.offload``; FPDT's schedule): with a kv program, the whole k and v the forward
and the query-outer pass make, the q and output gradient the key-outer pass reads and the dq it adds into, are
written to host buffers (runtime/host_tiles.py) as they are made and read back one tile at a time, the next tile's
copy started before the current one is used: the device holds two tiles of each instead of the sequence. The
kernels' tiles go through torch's fused CPU kernel where it applies (``ca.fused_tiles``).

The programs are registered here by the pass under a key the op's schema carries (``region``); the op is opaque to
Inductor and AOTAutograd takes its backward from ``register_autograd``. The bound (``attention_blocks_bound``) counts
the inputs, the output, what the schedule keeps whole, and one block's phases; the host bound
(``attention_blocks_host_bound``) the pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch import Tensor

from boundpass.core.errors import BoundpassInputError
from boundpass.runtime import chunked_attention as ca
from boundpass.runtime import contracts
from boundpass.runtime import host_tiles
from boundpass.runtime import row_blocks as rb


@dataclass
class Region:
    """One rewritten sublayer: its programs and how their inputs are cut into blocks."""
    query: torch.nn.Module          # (n, *rows, *query weights) -> q [B, A_q, n, D]
    out: torch.nn.Module            # (n, o [B, A_q, n, D_v], *output weights) -> y rows
    row_dims: tuple                 # each row input's sequence dim (None: read whole by every block)
    query_params: int               # params = [query's | kv's | output's]
    y_shape: tuple                  # y at the length the graph was traced at, its sequence dim at y_dim
    y_dim: int
    y_dtype: torch.dtype
    needs: tuple                    # which inputs (rows, params, k, v) take a gradient
    kv: torch.nn.Module | None = None   # (n, *rows, *kv weights) -> (k, v) rows; None: k and v are op inputs
    kv_params: int = 0
    host: bool = False              # (with a kv program) k, v and the key-outer pass's q, dO on the host, tile by tile
    # measured at registration (``_per_row``): bytes per row of every tensor a program makes, and shapes
    query_row_bytes: int = 0
    kv_row_bytes: int = 0
    out_row_bytes: int = 0
    input_row_bytes: int = 0        # one row of every row input
    batch: int = 0                  # q's batch, heads and head dim
    heads: int = 0
    d_qk: int = 0
    kv_shape: tuple = ()            # (A_kv, D, D_v, dtype) of the kv program's k and v

    def split(self, params: list) -> tuple[list, list, list]:
        a, b = self.query_params, self.query_params + self.kv_params
        return list(params[:a]), list(params[a:b]), list(params[b:])


_REGIONS = rb.Registry("region", "attention blocks")


def register_region(region: Region, row_examples: list, param_examples: list, o_example: Tensor) -> str:
    """Keep ``region`` for the op's calls; return the key its call sites carry. The examples (fake or real tensors at
    the traced length) give each program's bytes per row; a program that does not run on a block's rows raises."""
    _per_row(region, row_examples, param_examples, o_example)
    return _REGIONS.add(region)


def region_of(key: str) -> Region:
    return _REGIONS.get(key)


def _per_row(region: Region, rows: list, params: list, o: Tensor, n: int = 4) -> None:
    """Set the region's bytes per row of every tensor each program makes (its intermediates' storages, counted once;
    the larger of a run without grad, as the forward runs it, and one with, as the backward does: matmul copies a
    non-contiguous input only when it requires grad), of one row of the row inputs, and the shapes the programs
    make. The programs are position-wise, so their bytes are multiples of the rows; they run on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    n_rows = len(rows)
    need_rows, need_params = region.needs[:n_rows], region.needs[n_rows:n_rows + len(params)]
    qp, kvp, op = region.split(params)
    nq, nkv = len(qp), len(kvp)
    programs = [("query", region.query), ("kv", region.kv), ("out", region.out)]
    counts = {}
    for grad in (False, True):
        mode = FakeTensorMode()
        for name, program in programs:
            if program is None:
                continue
            seen: dict = {}
            with mode, torch.set_grad_enabled(grad):
                if name == "out":
                    leaves = [torch.empty((*o.shape[:2], n, *o.shape[3:]), dtype=o.dtype),
                              *[torch.empty(p.shape, dtype=p.dtype) for p in op]]
                    needs = [True, *need_params[nq + nkv:]]
                else:
                    # a block's rows are views of the whole inputs, as the op cuts them: a program that needs them
                    # contiguous copies them, and that copy is counted
                    cut = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).narrow(d, 0, n) if d is not None
                           else torch.empty(t.shape, dtype=t.dtype) for t, d in zip(rows, region.row_dims)]
                    weights, wneeds = (qp, need_params[:nq]) if name == "query" else (kvp, need_params[nq:nq + nkv])
                    leaves = [*cut, *[torch.empty(p.shape, dtype=p.dtype) for p in weights]]
                    needs = [*need_rows, *wneeds]
                inputs = [t.requires_grad_(grad and need and t.is_floating_point()) if t.is_leaf else t
                          for t, need in zip(leaves, needs)]
                rb.new_bytes(inputs, seen)
                with rb.Counting(seen) as counting:
                    result = program(n, *inputs)
            if name == "query":
                region.batch, region.heads, region.d_qk = (int(result.shape[i]) for i in (0, 1, 3))
            if name == "kv":
                k, v = result
                region.kv_shape = (int(k.shape[1]), int(k.shape[3]), int(v.shape[3]), k.dtype)
            counts[name] = max(counts.get(name, 0), -(-counting.made // n))
    region.query_row_bytes, region.out_row_bytes = counts["query"], counts["out"]
    region.kv_row_bytes = counts.get("kv", 0)
    region.input_row_bytes = sum(t.dtype.itemsize * (t.numel() // t.shape[d])
                                 for t, d in zip(rows, region.row_dims) if d is not None)


def _whole_kv(region: Region, rows: list, kvp: list, length: int, chunk: int):
    """k and v of the whole sequence, made key tile by key tile (no grad): the kv program's intermediates are never
    whole, only its results; on the host (``host_tiles.HostRows``) when the region says so."""
    k = v = None
    with torch.no_grad():
        for s, e in rb.blocks(length, chunk):
            kj, vj = region.kv(e - s, *rb.cut(region.row_dims, rows, s, e), *kvp)
            if k is None:
                k, v = _stores(region, ("k", "v"), (kj, vj), length)
            _write(k, s, e, kj)
            _write(v, s, e, vj)
            del kj, vj
    return k, v


def _stores(region: Region, roles: tuple, blocks: tuple, length: int) -> list:
    """Whole-sequence tensors shaped as ``blocks`` (one block's rows each) at ``length`` rows: on the host (the
    pool's buffers of ``roles``) when the region says so, else on the device."""
    shapes = [(*t.shape[:2], length, t.shape[3]) for t in blocks]
    if region.host:
        return [host_tiles.HostRows(role, shape, t.dtype, t.device) for role, shape, t in zip(roles, shapes, blocks)]
    return [t.new_empty(shape) for shape, t in zip(shapes, blocks)]


def _write(dst, s: int, e: int, rows: Tensor) -> None:
    if isinstance(dst, host_tiles.HostRows):
        dst.write(s, e, rows)
    else:
        dst[:, :, s:e].copy_(rows)


def blocks_forward(rows: list, params: list, k: Tensor | None, v: Tensor | None, region: Region, causal: bool,
                   scale: float | None, chunk: int) -> Tensor:
    length = rb.length_of(region.row_dims, rows)
    shape = list(region.y_shape)
    shape[region.y_dim] = length
    qp, kvp, op = region.split(params)
    if region.kv is not None:
        k, v = _whole_kv(region, rows, kvp, length, chunk)
    y = rows[0].new_empty(shape, dtype=region.y_dtype)
    with torch.no_grad():
        for s, e in rb.blocks(length, chunk):
            q = region.query(e - s, *rb.cut(region.row_dims, rows, s, e), *qp)
            o, _ = ca.chunked_attention_forward(q, k, v, causal, scale, chunk, q_offset=s)
            del q
            y.narrow(region.y_dim, s, e - s).copy_(region.out(e - s, o, *op))
            del o
    return y


def blocks_backward(grad_y: Tensor, rows: list, params: list, k: Tensor | None, v: Tensor | None, region: Region,
                    causal: bool, scale: float | None, chunk: int) -> list[Tensor]:
    """The gradients of the inputs ``region.needs`` names, in input order (rows, params, k, v)."""
    n_rows, n_params = len(rows), len(params)
    need_rows, need_params = list(region.needs[:n_rows]), list(region.needs[n_rows:n_rows + n_params])
    d_rows = [torch.zeros_like(t) if need else None for t, need in zip(rows, need_rows)]
    d_params = [torch.zeros_like(p) if need else None for p, need in zip(params, need_params)]
    if region.kv is None:
        dk, dv = _backward_kv_inputs(grad_y, rows, params, k, v, region, causal, scale, chunk, d_rows, d_params)
        cast = lambda g, t: g.to(t.dtype) if g.dtype != t.dtype else g  # noqa: E731  (only the ones returned)
        need_k, need_v = region.needs[-2:]
        out_kv = ([cast(dk, k)] if need_k else []) + ([cast(dv, v)] if need_v else [])
    else:
        _backward_kv_program(grad_y, rows, params, region, causal, scale, chunk, d_rows, d_params)
        out_kv = []
    return [g for g in (*d_rows, *d_params) if g is not None] + out_kv


def _out_vjp(region: Region, grad_y: Tensor, q: Tensor, k, v, op: list, need_op: list, d_op: list, causal: bool,
             scale: float | None, chunk: int, s: int, e: int):
    """One query block's o recomputed (no grad) and the output program's vjp: (o, its log-sum-exp, o's gradient);
    the output weights' gradients added into ``d_op``."""
    with torch.no_grad():
        o, lse = ca.chunked_attention_forward(q, k, v, causal, scale, chunk, q_offset=s)
    with rb.autograd_in_kernel():
        o.requires_grad_()
        ow = rb.leaves(op, need_op)
        y = region.out(e - s, o, *ow)
    grad_o, *from_out = rb.vjp(y, [o, *ow], grad_y.narrow(region.y_dim, s, e - s))
    rb.add(d_op, from_out)
    return o.detach(), lse, grad_o


def _backward_kv_inputs(grad_y, rows, params, k, v, region, causal, scale, chunk, d_rows, d_params):
    """k and v are the op's inputs: per query block, q again under autograd, o again, the output program's vjp, the
    kernels' backward into dq and into one pair of fp32 dk / dv accumulators, the query program's vjp. Returns the
    accumulators."""
    length = rb.length_of(region.row_dims, rows)
    n_rows = len(rows)
    need_rows, need_params = list(region.needs[:n_rows]), list(region.needs[n_rows:n_rows + len(params)])
    qp, _, op = region.split(params)
    nq = len(qp)
    d_qp, d_op = d_params[:nq], d_params[nq:]
    acc = ca.acc_dtype(k.dtype)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for s, e in rb.blocks(length, chunk):
        with rb.autograd_in_kernel():
            cut = rb.leaves(rb.cut(region.row_dims, rows, s, e), need_rows)
            qw = rb.leaves(qp, need_params[:nq])
            q = region.query(e - s, *cut, *qw)
        o, lse, grad_o = _out_vjp(region, grad_y, q.detach(), k, v, op, need_params[nq:], d_op, causal, scale, chunk,
                                  s, e)
        dq, _, _ = ca.chunked_attention_backward(grad_o, q.detach(), k, v, o, lse, causal, scale, chunk, q_offset=s,
                                                 into=(dk, dv))
        del grad_o, o, lse
        grads = rb.vjp(q, [*cut, *qw], dq)
        del q, dq
        rb.add_rows(d_rows, region.row_dims, grads[:n_rows], s, e)
        rb.add(d_qp, grads[n_rows:])
        del grads, cut, qw
    return dk, dv


def _backward_kv_program(grad_y, rows, params, region, causal, scale, chunk, d_rows, d_params) -> None:
    """k and v made by the kv program. Three passes:
    query-outer: per query block q (no grad) and o again, the output program's vjp; q, o's gradient, the
        log-sum-exp and rowsum(dO O) of every row kept (q, dO on the host with the region), k and v freed;
    key-outer: per key tile its k, v made under autograd, the kernels' walk over the query tiles that see it
        (``ca.key_tile_backward``: its dk, dv finished, its part of every row's dq added into one fp32 dq, on the host
        with the region), the kv program's vjp;
    query-outer: per query block q again under autograd and the query program's vjp with its rows of dq.
    Each tile's scores are made once in the backward."""
    length = rb.length_of(region.row_dims, rows)
    n_rows = len(rows)
    need_rows, need_params = list(region.needs[:n_rows]), list(region.needs[n_rows:n_rows + len(params)])
    qp, kvp, op = region.split(params)
    nq, nkv = len(qp), len(kvp)
    d_qp, d_kvp, d_op = d_params[:nq], d_params[nq:nq + nkv], d_params[nq + nkv:]
    k, v = _whole_kv(region, rows, kvp, length, chunk)
    acc = ca.acc_dtype(k.dtype)
    stash_q = stash_go = None
    stash_lse = torch.empty((k.shape[0], region.heads, length), dtype=acc, device=rows[0].device)
    stash_delta = torch.empty_like(stash_lse)
    for s, e in rb.blocks(length, chunk):
        with torch.no_grad():
            q = region.query(e - s, *rb.cut(region.row_dims, rows, s, e), *qp)
        o, lse, grad_o = _out_vjp(region, grad_y, q, k, v, op, need_params[nq + nkv:], d_op, causal, scale, chunk,
                                  s, e)
        if stash_q is None:
            stash_q, stash_go = _stores(region, ("q", "dO"), (q, grad_o), length)
        _write(stash_q, s, e, q)
        _write(stash_go, s, e, grad_o)
        stash_lse[:, :, s:e].copy_(lse)
        stash_delta[:, :, s:e].copy_((grad_o.to(acc) * o.to(acc)).sum(-1))
        del q, o, lse, grad_o
    del k, v
    shape, device = (stash_lse.shape[0], region.heads, length, region.d_qk), rows[0].device
    dq = host_tiles.HostRows("dq", shape, acc, device) if region.host else torch.empty(shape, dtype=acc, device=device)
    for s, e in rb.blocks(length, chunk):   # key-outer: each key tile's gradients finished, then kv's vjp
        with rb.autograd_in_kernel():
            cut = rb.leaves(rb.cut(region.row_dims, rows, s, e), need_rows)
            kw = rb.leaves(kvp, need_params[nq:nq + nkv])
            kj, vj = region.kv(e - s, *cut, *kw)
        dkj, dvj = ca.key_tile_backward(stash_q, stash_go, stash_lse, stash_delta, kj.detach(), vj.detach(), s,
                                        causal, scale, chunk, dq, fresh=s == 0)
        grads = rb.vjp((kj, vj), [*cut, *kw], (dkj.to(kj.dtype), dvj.to(vj.dtype)))
        del kj, vj, dkj, dvj
        rb.add_rows(d_rows, region.row_dims, grads[:n_rows], s, e)
        rb.add(d_kvp, grads[n_rows:])
        del grads, cut, kw
    del stash_q, stash_go, stash_lse, stash_delta
    for (s, e), (dq_rows,) in ca.row_tiles((dq,), rb.blocks(length, chunk)):   # the query program's vjp
        with rb.autograd_in_kernel():
            cut = rb.leaves(rb.cut(region.row_dims, rows, s, e), need_rows)
            qw = rb.leaves(qp, need_params[:nq])
            q = region.query(e - s, *cut, *qw)
        grads = rb.vjp(q, [*cut, *qw], dq_rows.to(q.dtype))
        del q, dq_rows
        rb.add_rows(d_rows, region.row_dims, grads[:n_rows], s, e)
        rb.add(d_qp, grads[n_rows:])
        del grads, cut, qw


# ---------------------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("boundpass::attention_blocks_fwd", mutates_args=())
def attention_blocks_fwd(rows: list[Tensor], params: list[Tensor], k: Tensor | None, v: Tensor | None, region: str,
                         causal: bool, scale: float, chunk: int) -> Tensor:
    return blocks_forward(rows, params, k, v, region_of(region), causal, scale if scale > 0 else None, chunk)


@attention_blocks_fwd.register_fake
def _(rows, params, k, v, region, causal, scale, chunk):
    r = region_of(region)
    shape = list(r.y_shape)
    shape[r.y_dim] = rb.length_of(r.row_dims, rows)
    return rows[0].new_empty(shape, dtype=r.y_dtype)


@torch.library.custom_op("boundpass::attention_blocks_bwd", mutates_args=())
def attention_blocks_bwd(grad_y: Tensor, rows: list[Tensor], params: list[Tensor], k: Tensor | None,
                         v: Tensor | None, region: str, causal: bool, scale: float, chunk: int) -> list[Tensor]:
    return blocks_backward(grad_y, rows, params, k, v, region_of(region), causal, scale if scale > 0 else None, chunk)


@attention_blocks_bwd.register_fake
def _(grad_y, rows, params, k, v, region, causal, scale, chunk):
    r = region_of(region)
    return [torch.empty_like(t, memory_format=torch.contiguous_format)
            for t, need in zip((*rows, *params, k, v), r.needs) if need]


def _setup_context(ctx, inputs, output):
    rows, params, k, v, region, causal, scale, chunk = inputs
    ctx.save_for_backward(*rows, *params, k, v)
    ctx.counts = (len(rows), len(params))
    ctx.args = (region, causal, scale, chunk)


def _backward(ctx, grad_y):
    saved = ctx.saved_tensors
    n_rows, n_params = ctx.counts
    rows, params, (k, v) = list(saved[:n_rows]), list(saved[n_rows:n_rows + n_params]), saved[-2:]
    got = iter(torch.ops.boundpass.attention_blocks_bwd(grad_y.contiguous(), rows, params, k, v, *ctx.args))
    grads = [next(got) if need else None for need in region_of(ctx.args[0]).needs]
    return grads[:n_rows], grads[n_rows:n_rows + n_params], grads[-2], grads[-1], None, None, None, None


attention_blocks_fwd.register_autograd(_backward, setup_context=_setup_context)


def sublayer(query, out, rows: list[Tensor], params: list[Tensor], k: Tensor | None = None, v: Tensor | None = None,
             *, row_dims: tuple, query_params: int, kv=None, kv_params: int = 0, causal: bool = True,
             scale: float | None = None, chunk: int = 256, offload: bool = False) -> Tensor:
    """``out(L, attention(query(L, *rows, *q weights), k, v), *out weights)`` walked in query blocks of ``chunk``
    rows (differentiable), without the compiler. ``query``, ``kv`` and ``out`` are position-wise callables that
    fx.symbolic_trace can trace (their first argument the rows in the block); ``params`` = [query's | kv's | out's]
    weights (``query_params``, ``kv_params`` of them); ``kv(n, *rows, *kv weights) -> (k, v)`` makes k and v from
    the rows (then k and v are not given); ``row_dims`` each row input's sequence dim. Registers one region per
    call (the pass registers one per graph). ``offload`` (with ``kv``): k, v and the backward's q, dO, dq on the host,
    read back a tile at a time (runtime/host_tiles.py)."""
    if chunk < 1:
        raise BoundpassInputError(f"attention blocks: chunk must be >= 1, got {chunk}")
    if (kv is None) == (k is None or v is None):
        raise BoundpassInputError("attention blocks: give either k and v or a kv program, not both or neither")
    if offload and kv is None:
        raise BoundpassInputError("attention blocks: offload keeps the k and v a kv program makes on the host; given "
                                  "k and v are the caller's tensors (pass kv=, or offload=False)")
    key = make_region(query, out, rows, params, k, v, row_dims=row_dims, query_params=query_params, kv=kv,
                      kv_params=kv_params, offload=offload)
    return torch.ops.boundpass.attention_blocks_fwd(list(rows), list(params), k, v, key, causal, float(scale or 0.0),
                                                    int(chunk))


def make_region(query, out, rows: list[Tensor], params: list[Tensor], k: Tensor | None = None,
                v: Tensor | None = None, *, row_dims: tuple, query_params: int, kv=None, kv_params: int = 0,
                offload: bool = False) -> str:
    """Register the region of ``sublayer``'s arguments; return its key."""
    if len(row_dims) != len(rows) or all(d is None for d in row_dims):
        raise BoundpassInputError(f"attention blocks: row_dims {row_dims} must give each of the {len(rows)} row "
                                  "inputs its sequence dim (at least one)")
    trace = lambda f: f if f is None or isinstance(f, torch.fx.GraphModule) else torch.fx.symbolic_trace(f)  # noqa
    query, kv, out = trace(query), trace(kv), trace(out)
    length = next(int(t.shape[d]) for t, d in zip(rows, row_dims) if d is not None)
    weights = [params[:query_params], params[query_params:query_params + kv_params], params[query_params + kv_params:]]
    with torch.device("meta"):
        meta = lambda t: torch.empty(t.shape, dtype=t.dtype)  # noqa: E731
        q = query(length, *[meta(t) for t in rows], *[meta(p) for p in weights[0]])
        if kv is not None:
            k, v = kv(length, *[meta(t) for t in rows], *[meta(p) for p in weights[1]])
        o = torch.empty((*q.shape[:3], v.shape[3]), dtype=q.dtype)
        y = out(length, o, *[meta(p) for p in weights[2]])
    y_dim = [i for i, s in enumerate(y.shape) if s == length]
    if len(y_dim) != 1:
        raise BoundpassInputError(f"attention blocks: the output {tuple(y.shape)} has no one sequence dim of {length}")
    needs = tuple(t.requires_grad for t in (*rows, *params)) + ((False, False) if kv is not None else
                                                                   (k.requires_grad, v.requires_grad))
    region = Region(query=query, out=out, kv=kv, row_dims=tuple(row_dims), query_params=query_params,
                    kv_params=kv_params, y_shape=tuple(y.shape), y_dim=y_dim[0], y_dtype=y.dtype, needs=needs,
                    host=offload and kv is not None)
    return register_region(region, list(rows), list(params), o)


# ------------------------------------------------------------------------------------------------ bound
def attention_blocks_bound(a: dict, ctx: dict) -> sympy.Expr:
    """Device bytes of one call, C_s symbolic (``ca.C_s_sym``; the call's chunk when the pass fixed one). With n =
    min(C_s, L) rows per block, q_n / o_n one block's q and o (b), lse_n its log-sum-exp (b_acc), Q_n / KV_n / O_n
    every tensor the query / kv / output program makes on a block (measured per row on fake tensors at registration;
    all counted alive, an upper bound of each program's own peak), X_n one block's rows of the row inputs, KV the
    whole k and v a kv program makes (0 when they are inputs; on the host: two key tiles of them, the one read and
    the next), S what the key-outer pass reads of every row (q and the output gradient in b, the log-sum-exp and
    rowsum(dO O) in b_acc; on the host: two query tiles of q and dO, the log-sum-exp and delta whole), DQ the fp32 dq
    the key-outer pass adds into (whole on the device; on the host: two query tiles of it in the passes that read
    it). The kernels' tile workspace is the fused kernel's where the tiles go through it
    (``ca.tile_workspace(fused=...)``):

    forward : the inputs (rows, weights, k, v) + y + KV
              + max(KV_n, Q_n, q_n + o_n + lse_n + the kernels' forward tile, o_n + O_n)
    backward: grad_y and the inputs + the gradients it returns (the rows', the weights', and without a kv program
              dk / dv in b_acc and their casts when narrower)
              + k, v inputs: Q_n (kept for the query program's vjp) + o_n + lse_n
                    + max(the kernels' forward tile                    (o recomputed)
                          2 O_n + o's gradient + the output projection's weight gradients (whole, from autograd),
                          o's gradient + dq + the kernels' backward tile,
                          dq + Q_n (the query program's gradients) + X_n + the query path's weight gradients)
              + a kv program: max(KV + KV_n + S                          (k, v made)
                    KV + S + max(Q_n, q_n + o_n + lse_n                (query-outer: q, o recomputed,
                      + max(the kernels' forward tile, 2 O_n + o's gradient + the output weights' gradients,
                            o's gradient + 3 o_n in b_acc)),            out's vjp, rowsum(dO O))
                    DQ + S + KV_n + X_n + the kv weights' gradients    (key-outer: one key tile under autograd,
                    + max(its gradients in b_acc + the key tile's workspace  then the kernel's walk over the
                          + (host) the q / dO / dq tiles it reads,      query tiles, or the program's vjp)
                          KV_n + its gradients in b_acc and b),
                    DQ + 2 Q_n + q_n + X_n + the query weights' gradients)   (the query program's vjp)"""
    r = region_of(a["region"])
    k, v, rows, params = a["k"], a["v"], a["rows"], a["params"]
    length = rb.length_expr(r.row_dims, rows)
    n = sympy.Min(ca.C_s_sym, length) if a["chunk"] <= 0 else sympy.Min(int(a["chunk"]), length)
    tile_chunk = ca.C_s_sym if a["chunk"] <= 0 else sympy.Integer(int(a["chunk"]))
    zero = sympy.Integer(0)

    def nbytes(t) -> sympy.Expr:
        if t is None:
            return zero
        count = sympy.Integer(1)
        for s in t.shape:
            count *= contracts.as_expr(s)
        return count * t.dtype.itemsize

    walk_kv = r.kv is not None
    kv_heads, d_v, kv_dtype = (r.kv_shape[0], r.kv_shape[2], r.kv_shape[3]) if walk_kv else \
        (int(k.shape[1]), int(v.shape[3]), k.dtype)
    b = kv_dtype.itemsize
    acc = ca.acc_dtype(kv_dtype).itemsize
    mixed = acc != b
    batch = r.batch
    heads, d_qk = r.heads, r.d_qk
    y_row = sympy.Integer(r.y_dtype.itemsize) * (sympy.prod([int(s) for s in r.y_shape]) // int(r.y_shape[r.y_dim]))
    inputs = sum((nbytes(t) for t in (*rows, *params, k, v)), zero)
    values = {ca.sym.A_q: heads, ca.sym.A_kv: kv_heads, ca.sym.D_h: d_qk, ca.D_v_sym: d_v,
              ca.sym.b: b, ca.sym.b_acc: acc, ca.C_s_sym: tile_chunk}
    # the forward tiles through torch's fused kernel on a CPU (the blocks are on the key tiles' grid: ca.fused_tiles)
    fused = rows[0].device.type == "cpu" and d_v <= d_qk
    # the tile's rows where the call fixes them (the fused kernel's query split follows them)
    shape = dict(gqa=heads != kv_heads, padded=d_v < d_qk,
                 rows=min(int(a["chunk"]), int(length)) if a["chunk"] > 0 and length.is_number else None)
    tile_f = ca.tile_workspace("forward", mixed_precision=mixed, batch=batch, fused=fused, **shape).xreplace(values)
    q_n, o_n, lse_n = n * batch * heads * d_qk * b, n * batch * heads * d_v * b, n * batch * heads * acc
    Q_n, O_n, KV_n = n * r.query_row_bytes, n * r.out_row_bytes, n * r.kv_row_bytes
    host = walk_kv and r.host
    # k, v whole on the device, or (host) two key tiles of them: the one the kernels read and the next, prefetched
    whole_kv = (2 * n if host else length) * batch * kv_heads * (d_qk + d_v) * b if walk_kv else zero
    held_kv, kernel_kv = (zero, whole_kv) if host else (whole_kv, zero)   # (host: only while the kernels read them)
    if "grad_y" not in a:
        return inputs + length * y_row + held_kv + sympy.Max(KV_n, Q_n, q_n + o_n + lse_n + tile_f + kernel_kv,
                                                             o_n + O_n)
    tile_b = ca.tile_workspace("backward", mixed_precision=mixed, batch=batch, gqa=shape["gqa"]).xreplace(values)
    tile_k = ca.tile_workspace("key", mixed_precision=mixed, batch=batch, gqa=shape["gqa"]).xreplace(values)
    n_rows, needs = len(rows), r.needs
    outputs = sum((nbytes(t) for t, need in zip((*rows, *params), needs) if need), zero)
    if not walk_kv:
        outputs += (nbytes(k) + nbytes(v)) * acc / b + ((nbytes(k) + nbytes(v)) if mixed else 0)
    param_needs = needs[n_rows:n_rows + len(params)]
    nq, nkv = r.query_params, r.kv_params
    weights = [sum((nbytes(p) for p, need in zip(params[lo:hi], param_needs[lo:hi]) if need), zero)
               for lo, hi in ((0, nq), (nq, nq + nkv), (nq + nkv, len(params)))]
    # the key-outer pass's q and dO whole, or (host) two query tiles of them, the one read and the next (the tile
    # math's rows in the accumulation dtype are the one read); the log-sum-exp and delta stay
    stash_rows = (2 * n if mixed else n) if host else length
    kept = length * batch * heads * 2 * acc if walk_kv else zero
    read = stash_rows * batch * heads * (d_qk + d_v) * b if walk_kv else zero
    # on the host, q and dO are on the device only while the key-outer pass reads them, and k, v only while the
    # kernels read them; whole on the device, from when they are made
    stash = kept + (zero if host else read)
    if not walk_kv:   # per query block: q kept for its vjp, o again, the output program's vjp, the kernels, q's vjp
        query_outer = Q_n + o_n + lse_n + sympy.Max(
            tile_f, 2 * O_n + o_n + weights[2], o_n + q_n + tile_b, q_n + Q_n + n * r.input_row_bytes + weights[0])
        return length * y_row + inputs + outputs + query_outer
    delta = 2 * o_n + 3 * n * batch * heads * d_v * acc
    # the fp32 dq the key-outer pass adds into: whole on the device, or (host) two of its query tiles, the one read
    # and the next
    dq = (2 * n if host else length) * batch * heads * d_qk * acc
    held_dq, tile_dq = (zero, dq) if host else (dq, zero)
    phases = [
        held_kv + KV_n + stash,                       # k, v made
        # query-outer: q (no grad), o again, the output program's vjp, rowsum(dO O); q, dO, lse and delta kept
        held_kv + stash + sympy.Max(Q_n, q_n + o_n + lse_n + sympy.Max(tile_f + kernel_kv, 2 * O_n + o_n + weights[2],
                                                                        delta)),
    ]
    # key-outer, one key tile: its kv program under autograd (KV_n), then either the kernel's walk over the query
    # tiles (its fp32 dk / dv, the tile workspace, the q / dO / dq rows it reads) or the program's vjp (dk / dv,
    # their casts, the program's gradients <= KV_n); q / dO whole on the device are read through both
    tile_grads = n * batch * kv_heads * (d_qk + d_v)
    walk = tile_grads * acc + tile_k + ((read + tile_dq) if host else zero)
    vjp = KV_n + tile_grads * (acc + b)
    phases.append(held_dq + stash + KV_n + n * r.input_row_bytes + weights[1] + sympy.Max(walk, vjp))
    # query-outer again: q under autograd, its rows of dq (fetched: two tiles on the host) cast to q's dtype, the
    # query program's vjp (its gradients <= Q_n, the rows' and the query weights' gradients)
    phases.append(held_dq + tile_dq + 2 * Q_n + q_n + n * r.input_row_bytes + weights[0])
    return length * y_row + inputs + outputs + sympy.Max(*phases)


def attention_blocks_host_bound(a: dict, ctx: dict) -> sympy.Expr:
    """Host bytes of one call (``host_tiles``' pool): with the region on the host, k and v of the whole sequence
    ([B, A_kv, L, D + D_v] in b), and in the backward the key-outer pass's q and dO ([B, A_q, L, D + D_v] in b) and
    the dq it adds into ([B, A_q, L, D] in the accumulation dtype); else 0."""
    r = region_of(a["region"])
    if r.kv is None or not r.host:
        return sympy.Integer(0)
    length = rb.length_expr(r.row_dims, a["rows"])
    kv_heads, d_v, dtype = r.kv_shape[0], r.kv_shape[2], r.kv_shape[3]
    kv = length * r.batch * kv_heads * (r.d_qk + d_v) * dtype.itemsize
    if "grad_y" not in a:
        return kv
    return kv + length * r.batch * r.heads * ((r.d_qk + d_v) * dtype.itemsize + r.d_qk * ca.acc_dtype(dtype).itemsize)


contracts.register_bound(torch.ops.boundpass.attention_blocks_fwd.default, attention_blocks_bound)
contracts.register_bound(torch.ops.boundpass.attention_blocks_bwd.default, attention_blocks_bound)
contracts.register_host_bound(torch.ops.boundpass.attention_blocks_fwd.default, attention_blocks_host_bound)
contracts.register_host_bound(torch.ops.boundpass.attention_blocks_bwd.default, attention_blocks_host_bound)
