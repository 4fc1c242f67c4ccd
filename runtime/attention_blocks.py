"""The attention sublayer in query blocks: the query path, the attention and the output projection of a block
walked B_q = C_s query rows at a time, so that what the sublayer holds at O(L) is its inputs (the normed hidden
states, k, v), its output and the key / value gradients, never q, the attention output, their gradients or dq.

A *region* is the part of a block between its inputs and the output projection's result, minus the key / value
path (which runs once over the sequence, as the model has it): two position-wise programs (fx.GraphModules the pass
extracts from the model's graph, ``boundpass.passes.attention_region``) and the chunked-attention kernels between
them (runtime/chunked_attention.py, a query block at its offset):

    query(n, *row_inputs[s:s+n], *params)  -> q rows [B, A_q, n, D]   (projections, norms, RoPE at those positions)
    kernel(q rows, k, v, q_offset=s)       -> o rows [B, A_q, n, D_v] and their log-sum-exp
    out(n, o rows, *params)                -> y rows                   (transpose, reshape, the output projection)

Forward: per block, the three steps under no grad, the rows written into y; nothing of a block is kept. Backward:
per block, q and o again (recomputed, FPDT's and FlashAttention's trade), ``out``'s backward, the kernels' backward
adding the block's key / value gradients into one pair of accumulators, ``query``'s backward into the block's rows
of the row inputs' gradients and into the parameters' gradients. Exact up to reordered sums: every row of y is the
same function of the same rows of the inputs and of all of k and v.

The programs are registered here by the pass under a key the op's schema carries (``region``); the op is opaque to
Inductor and AOTAutograd takes its backward from ``register_autograd``. The bound (``attention_blocks_bound``) counts
the inputs, the output, and one block: each program's intermediates at C_s rows (their bytes per row measured on
fake tensors at registration), the kernels' tile and, in the backward, the gradients autograd makes of them.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import sympy
import torch
from torch import Tensor

from boundpass.core.errors import BoundpassInputError
from boundpass.runtime import chunked_attention as ca
from boundpass.runtime import contracts


@dataclass
class Region:
    """One rewritten sublayer: its two programs and how their inputs are cut into query blocks."""
    query: torch.nn.Module          # (n, *row_inputs, *query_params) -> q [B, A_q, n, D]
    out: torch.nn.Module            # (n, o [B, A_q, n, D_v], *out_params) -> y rows
    row_dims: tuple                 # each row input's sequence dim
    query_params: int               # params[:query_params] are the query program's, the rest the output's
    y_shape: tuple                  # y at the length the graph was traced at, its sequence dim at y_dim
    y_dim: int
    y_dtype: torch.dtype
    needs: tuple                    # which inputs (row inputs, params, k, v) take a gradient
    # bytes per query row, measured on fake tensors at registration (``_per_row``)
    query_row_bytes: int = 0        # every tensor the query program makes, q included
    out_row_bytes: int = 0          # every tensor the output program makes, y's rows included
    input_row_bytes: int = 0        # one row of every row input
    heads: int = 0                  # q's heads and head dim (the query program's output)
    d_qk: int = 0


_REGIONS: dict[str, Region] = {}
_KEYS = itertools.count()


def register_region(region: Region, row_examples: list, param_examples: list, o_example: Tensor) -> str:
    """Keep ``region`` for the op's calls; return the key its call sites carry. The examples (fake or real tensors at
    the traced length) give each program's bytes per row."""
    _per_row(region, row_examples, param_examples, o_example)
    key = f"region{next(_KEYS)}"
    _REGIONS[key] = region
    return key


def region_of(key: str) -> Region:
    if key not in _REGIONS:
        raise BoundpassInputError(f"attention blocks: no region {key!r} in this process (the graph that calls it "
                                  "was compiled elsewhere)")
    return _REGIONS[key]


def _new_bytes(values, seen: set) -> int:
    total = 0
    for t in values:
        if isinstance(t, Tensor):
            ref = t.untyped_storage()._cdata
            if ref not in seen:
                seen.add(ref)
                total += t.untyped_storage().nbytes()
    return total


def _per_row(region: Region, rows: list, params: list, o: Tensor, n: int = 4) -> None:
    """Set the region's bytes per query row of every tensor each program makes (its intermediates' storages, counted
    once), of one row of the row inputs, and q's heads and head dim. The programs are position-wise, so their bytes
    are multiples of the rows; they run on fake tensors here (no memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    counts = []
    for program in (region.query, region.out):
        seen: set = set()
        with mode:
            if program is region.query:
                cut = [torch.empty(_rows_shape(t, d, n), dtype=t.dtype) if d is not None else
                       torch.empty(t.shape, dtype=t.dtype) for t, d in zip(rows, region.row_dims)]
                inputs = [*cut, *[torch.empty(p.shape, dtype=p.dtype) for p in params[:region.query_params]]]
            else:
                shape = list(o.shape)
                shape[2] = n
                inputs = [torch.empty(shape, dtype=o.dtype),
                          *[torch.empty(p.shape, dtype=p.dtype) for p in params[region.query_params:]]]
            _new_bytes(inputs, seen)
            interp = _Counting(program, seen)
            result = interp.run(n, *inputs)
        if program is region.query:
            region.heads, region.d_qk = int(result.shape[1]), int(result.shape[3])
        counts.append(-(-interp.made // n))
    region.query_row_bytes, region.out_row_bytes = counts
    region.input_row_bytes = sum(t.dtype.itemsize * (t.numel() // t.shape[d])
                                 for t, d in zip(rows, region.row_dims) if d is not None)


def _rows_shape(t, dim: int, n: int) -> list:
    shape = list(t.shape)
    shape[dim] = n
    return shape


class _Counting(torch.fx.Interpreter):
    """Runs a program and adds up the storages its nodes make."""

    def __init__(self, module, seen: set):
        super().__init__(module)
        self.seen, self.made = seen, 0

    def run_node(self, node):
        out = super().run_node(node)
        if node.op not in ("placeholder", "output"):
            self.made += _new_bytes(torch.utils._pytree.tree_leaves(out), self.seen)
        return out


def _blocks(length: int, rows: int):
    return [(s, min(s + rows, length)) for s in range(0, length, rows)]


def _length(region: Region, rows: list) -> int:
    for t, d in zip(rows, region.row_dims):
        if d is not None:
            return int(t.shape[d])
    raise BoundpassInputError("attention blocks: no input carries the sequence")


def _cut(region: Region, rows: list, s: int, e: int) -> list:
    return [t.narrow(d, s, e - s) if d is not None else t for t, d in zip(rows, region.row_dims)]


def blocks_forward(rows: list, params: list, k: Tensor, v: Tensor, region: Region, causal: bool,
                   scale: float | None, chunk: int) -> Tensor:
    length = _length(region, rows)
    shape = list(region.y_shape)
    shape[region.y_dim] = length
    y = k.new_empty(shape, dtype=region.y_dtype)
    qp, op = params[:region.query_params], params[region.query_params:]
    with torch.no_grad():
        for s, e in _blocks(length, chunk):
            q = region.query(e - s, *_cut(region, rows, s, e), *qp)
            o, _ = ca.chunked_attention_forward(q, k, v, causal, scale, chunk, q_offset=s)
            del q
            y.narrow(region.y_dim, s, e - s).copy_(region.out(e - s, o, *op))
            del o
    return y


@contextlib.contextmanager
def _autograd_in_kernel():
    """Autograd back on inside an op's kernel: a custom op runs below the Autograd dispatch keys (they are in the
    thread's exclude set there), and the backward takes each block's vjp through the programs with autograd."""
    excluded = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradCPU)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


def blocks_backward(grad_y: Tensor, rows: list, params: list, k: Tensor, v: Tensor, region: Region, causal: bool,
                    scale: float | None, chunk: int) -> list[Tensor]:
    """The gradients of the inputs ``region.needs`` names, in input order (row inputs, params, k, v)."""
    length = _length(region, rows)
    n_rows, n_params = len(rows), len(params)
    need_rows, need_params = region.needs[:n_rows], region.needs[n_rows:n_rows + n_params]
    acc = ca._acc_dtype(k.dtype)
    d_rows = [torch.zeros_like(t) if need else None for t, need in zip(rows, need_rows)]
    d_params = [torch.zeros_like(p) if need else None for p, need in zip(params, need_params)]
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    nq = region.query_params
    for s, e in _blocks(length, chunk):
        with _autograd_in_kernel():
            cut = [t.detach().requires_grad_(need) for t, need in zip(_cut(region, rows, s, e), need_rows)]
            qp = [p.detach().requires_grad_(need) for p, need in zip(params[:nq], need_params[:nq])]
            q = region.query(e - s, *cut, *qp)
        with torch.no_grad():
            o, lse = ca.chunked_attention_forward(q.detach(), k, v, causal, scale, chunk, q_offset=s)
        with _autograd_in_kernel():
            o.requires_grad_()
            op = [p.detach().requires_grad_(need) for p, need in zip(params[nq:], need_params[nq:])]
            y = region.out(e - s, o, *op)
            wanted = [o, *[p for p in op if p.requires_grad]]
            grads = torch.autograd.grad(y, wanted, grad_y.narrow(region.y_dim, s, e - s), allow_unused=True)
        del y
        _add(d_params[nq:], [p.requires_grad for p in op], grads[1:])
        dq, _, _ = ca.chunked_attention_backward(grads[0], q.detach(), k, v, o.detach(), lse, causal, scale, chunk,
                                                 q_offset=s, into=(dk, dv))
        del grads, o, lse
        leaves = [t for t in (*cut, *qp) if t.requires_grad]
        if leaves and q.requires_grad:
            with _autograd_in_kernel():
                got = iter(torch.autograd.grad(q, leaves, dq, allow_unused=True))
            for i, t in enumerate(cut):
                if t.requires_grad:
                    g = next(got)
                    if g is not None:
                        d_rows[i].narrow(region.row_dims[i], s, e - s).copy_(g) if region.row_dims[i] is not None \
                            else d_rows[i].add_(g)
            _add(d_params[:nq], [p.requires_grad for p in qp], list(got))
        del q, dq, cut, qp
    out = [g for g in (*d_rows, *d_params) if g is not None]
    need_k, need_v = region.needs[-2:]
    if need_k:
        out.append(dk.to(k.dtype) if dk.dtype != k.dtype else dk)
    if need_v:
        out.append(dv.to(v.dtype) if dv.dtype != v.dtype else dv)
    return out


def _add(dst: list, took: list, grads) -> None:
    grads = iter(grads)
    for i, t in enumerate(took):
        if t:
            g = next(grads)
            if g is not None:
                dst[i].add_(g)


# ---------------------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("boundpass::attention_blocks_fwd", mutates_args=())
def attention_blocks_fwd(rows: list[Tensor], params: list[Tensor], k: Tensor, v: Tensor, region: str, causal: bool,
                         scale: float, chunk: int) -> Tensor:
    return blocks_forward(rows, params, k, v, region_of(region), causal, scale if scale > 0 else None, chunk)


@attention_blocks_fwd.register_fake
def _(rows, params, k, v, region, causal, scale, chunk):
    r = region_of(region)
    shape = list(r.y_shape)
    shape[r.y_dim] = _length(r, rows)
    return k.new_empty(shape, dtype=r.y_dtype)


@torch.library.custom_op("boundpass::attention_blocks_bwd", mutates_args=())
def attention_blocks_bwd(grad_y: Tensor, rows: list[Tensor], params: list[Tensor], k: Tensor, v: Tensor, region: str,
                         causal: bool, scale: float, chunk: int) -> list[Tensor]:
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


# ------------------------------------------------------------------------------------------------ bound
def attention_blocks_bound(a: dict, ctx: dict) -> sympy.Expr:
    """Device bytes of one call, C_s symbolic (``ca.C_s_sym``; the call's chunk when the pass fixed one):

    forward : the inputs (row inputs, parameters, k, v) + y
              + one block of n = min(C_s, L) rows: the query program's tensors (q among them), o (b) and its
                log-sum-exp (b_acc), the output program's tensors, and the kernels' forward tile
    backward: grad_y and the inputs + the gradients it returns (the row inputs', the parameters', dk / dv in b_acc and
              their casts when narrower)
              + one block: the query program's tensors twice (kept for its backward, then their gradients) and the
                gradients of its row inputs' rows, o and its log-sum-exp, the output program's tensors twice and
                o's gradient, dq, every parameter's gradient of this block (autograd returns them whole before they
                are added), and the larger of the kernels' forward and backward tiles
    Each program's bytes per row are measured on fake tensors when the region is registered; they are counted all
    alive at once (an upper bound of the program's own peak)."""
    r = region_of(a["region"])
    k, v, rows, params = a["k"], a["v"], a["rows"], a["params"]
    backward = "grad_y" in a
    length = next(contracts.as_expr(t.shape[d]) for t, d in zip(rows, r.row_dims) if d is not None)
    n = sympy.Min(ca.C_s_sym, length) if a["chunk"] <= 0 else sympy.Min(int(a["chunk"]), length)
    tile_chunk = ca.C_s_sym if a["chunk"] <= 0 else sympy.Integer(int(a["chunk"]))

    def nbytes(t) -> sympy.Expr:
        count = sympy.Integer(1)
        for s in t.shape:
            count *= contracts.as_expr(s)
        return count * t.dtype.itemsize

    b = k.dtype.itemsize
    acc = ca._acc_dtype(k.dtype).itemsize
    mixed = acc != b
    batch = int(k.shape[0])
    y_row = sympy.Integer(r.y_dtype.itemsize) * (sympy.prod([int(s) for s in r.y_shape]) // int(r.y_shape[r.y_dim]))
    inputs = sum((nbytes(t) for t in (*rows, *params, k, v)), sympy.Integer(0))
    heads, d_qk, d_v = r.heads, r.d_qk, int(v.shape[3])
    values = {ca.sym.A_q: heads, ca.sym.A_kv: int(k.shape[1]), ca.sym.D_h: d_qk, ca.D_v_sym: d_v,
              ca.sym.b_acc: acc, ca.C_s_sym: tile_chunk}
    tile_f = ca.tile_workspace("forward", mixed_precision=mixed, batch=batch).xreplace(values)
    o_rows = batch * heads * (d_v * b + acc)                 # o and its log-sum-exp, per query row
    if not backward:
        return inputs + length * y_row + n * (r.query_row_bytes + r.out_row_bytes + o_rows) + tile_f
    tile_b = ca.tile_workspace("backward", mixed_precision=mixed, batch=batch).xreplace(values)
    n_rows = len(rows)
    needs = r.needs
    outputs = sum((nbytes(t) for t, need in zip((*rows, *params), needs) if need), sympy.Integer(0))
    kv_acc = (nbytes(k) + nbytes(v)) * acc / b
    outputs += kv_acc + ((nbytes(k) + nbytes(v)) if mixed else 0)
    param_grads = sum((nbytes(p) for p, need in zip(params, needs[n_rows:-2]) if need), sympy.Integer(0))
    block = (n * (2 * r.query_row_bytes + r.input_row_bytes + o_rows + 2 * r.out_row_bytes
                  + batch * heads * (d_v + d_qk) * b)
             + param_grads + sympy.Max(tile_f, tile_b))
    return length * y_row + inputs + outputs + block


contracts.register_bound(torch.ops.boundpass.attention_blocks_fwd.default, attention_blocks_bound)
contracts.register_bound(torch.ops.boundpass.attention_blocks_bwd.default, attention_blocks_bound)
