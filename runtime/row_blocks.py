"""A position-wise sublayer walked C_r rows at a time: a block's feed-forward (its norm, up projections, activation
and down projection) computed on blocks of rows of the sequence, never whole, and recomputed block by block in the
backward, so that its intermediates ([rows, inter] each, several of them, and their gradients) exist for C_r rows
only. The attention sublayer's op (runtime/attention_blocks.py) walks its programs with the helpers defined here.

A *region* is one program, an fx.GraphModule the pass extracts from the model's graph
(``boundpass.passes.feed_forward_pass``), proved position-wise along the sequence: every row of its result depends
on the same row of its row inputs and on the weights only:

    program(n, *rows[s:s+n], *params) -> y rows

Forward: per block of C_r rows the program under no grad, the rows written into y; nothing of a block is kept.
Backward: per block, the program again under autograd on the block's rows, its vjp into the block's rows of the row
inputs' gradients and into the weights' gradients, accumulated over the blocks in fp32 where the weights are
narrower (one rounding at the end, as a whole-sequence matmul rounds once). Exact up to the reordered sums of the
weights' gradients: every row of y, and of the rows' gradients, is the same function of the same rows.

The op is opaque to Inductor; AOTAutograd takes its backward from ``register_autograd``, so a checkpointed block
recomputes the op's forward (blocks, nothing kept) and runs its backward (blocks again). The bound
(``row_blocks_bound``) counts the inputs, the output, the gradients and one block's program, measured on fake
tensors at registration as bytes made per row plus a fixed part (the weights' per-block gradients).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass

import sympy
import torch
from torch import Tensor

from boundpass.core.errors import BoundpassInputError
from boundpass.runtime import contracts

C_r_sym = sympy.Symbol("C_r", integer=True, positive=True)    # rows per block of a position-wise sublayer


# ------------------------------------------------------------------------- walking programs on blocks of rows
def blocks(length: int, rows: int) -> list[tuple[int, int]]:
    return [(s, min(s + rows, length)) for s in range(0, length, rows)]


def cut(row_dims: tuple, rows: list, s: int, e: int) -> list:
    """Rows s..e of every row input (views), the inputs without a sequence dim whole."""
    return [t.narrow(d, s, e - s) if d is not None else t for t, d in zip(rows, row_dims)]


def length_of(row_dims: tuple, rows: list) -> int:
    for t, d in zip(rows, row_dims):
        if d is not None:
            return int(t.shape[d])
    raise BoundpassInputError("row blocks: no input carries the sequence")


def length_expr(row_dims: tuple, rows: list) -> sympy.Expr:
    """The sequence length of a call's rows (possibly symbolic), as the bounds read it."""
    return next(contracts.as_expr(t.shape[d]) for t, d in zip(rows, row_dims) if d is not None)


@contextlib.contextmanager
def autograd_in_kernel():
    """Autograd back on inside an op's kernel: a custom op runs below the Autograd dispatch keys (they are in the
    thread's exclude set there), and the backward takes each block's vjp through the programs with autograd."""
    excluded = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradCPU)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


def leaves(tensors: list, needs: list) -> list:
    return [t.detach().requires_grad_(need) for t, need in zip(tensors, needs)]


def vjp(outputs, inputs: list, grads) -> list:
    """The gradients of the inputs that require one (None for the others and for the unused ones)."""
    wanted = [t for t in inputs if t.requires_grad]
    if not wanted:
        return [None] * len(inputs)
    with autograd_in_kernel():
        got = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
    return [next(got) if t.requires_grad else None for t in inputs]


def add_rows(d_rows: list, row_dims: tuple, grads: list, s: int, e: int) -> None:
    """Add a block's gradients into rows s..e of the row inputs' gradients (whole for an input without rows)."""
    for dst, g, d in zip(d_rows, grads, row_dims):
        if g is not None and dst is not None:
            (dst if d is None else dst.narrow(d, s, e - s)).add_(g)


def add(dst: list, grads: list) -> None:
    for acc, g in zip(dst, grads):
        if g is not None and acc is not None:
            acc.add_(g)


def new_bytes(values, seen: dict) -> int:
    """Bytes of the storages among ``values`` not in ``seen`` (which gains them, and keeps them alive: a freed
    storage's address is reused by the next one, which would then look seen)."""
    total = 0
    for t in values:
        if isinstance(t, Tensor):
            storage = t.untyped_storage()
            if storage._cdata not in seen:
                seen[storage._cdata] = storage
                total += storage.nbytes()
    return total


class Counting(torch.utils._python_dispatch.TorchDispatchMode):
    """Adds up the storages every aten op makes while a program runs (the copies inside composite ops too: a
    linear's input made contiguous is what autograd saves)."""

    def __init__(self, seen: dict):
        super().__init__()
        self.seen, self.made = seen, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += new_bytes(torch.utils._pytree.tree_leaves(out), self.seen)
        return out


# ------------------------------------------------------------------------------------------------ the region
@dataclass
class Region:
    """One rewritten position-wise sublayer: its program and how its inputs are cut into blocks."""
    program: torch.nn.Module        # (n, *rows, *params) -> y rows
    row_dims: tuple                 # each row input's sequence dim (None: read whole by every block)
    y_shape: tuple                  # y at the length the graph was traced at, its sequence dim at y_dim
    y_dim: int
    y_dtype: torch.dtype
    needs: tuple                    # which inputs (rows, params) take a gradient
    # measured at registration (``_measure``): the bytes alive on a block of n rows = max over (row, fixed) pairs
    # of row * n + fixed, beyond the block's inputs
    forward: tuple = ((0, 0),)      # the program without grad (the op's forward)
    backward: tuple = ((0, 0),)     # the program under autograd and its vjp (the op's backward, per block)
    input_row_bytes: int = 0        # one row of every row input


class Registry:
    """An op's regions by the key its call sites carry (a str argument of its schema: a GraphModule is not one)."""

    def __init__(self, prefix: str, what: str):
        self.prefix, self.what, self.regions, self.keys = prefix, what, {}, itertools.count()

    def add(self, region) -> str:
        key = f"{self.prefix}{next(self.keys)}"
        self.regions[key] = region
        return key

    def get(self, key: str):
        if key not in self.regions:
            raise BoundpassInputError(f"{self.what}: no region {key!r} in this process (the graph that calls it was "
                                      "compiled elsewhere)")
        return self.regions[key]


_REGIONS = Registry("rows", "row blocks")


def register_region(region: Region, row_examples: list, param_examples: list) -> str:
    """Keep ``region`` for the op's calls; return the key its call sites carry. The examples (fake or real tensors at
    the traced length) give the program's bytes per row; a program that does not run on a block's rows raises."""
    _measure(region, row_examples, param_examples)
    return _REGIONS.add(region)


def region_of(key: str) -> Region:
    return _REGIONS.get(key)


_MATMULS = {torch.ops.aten.mm.default: 0, torch.ops.aten.addmm.default: 1, torch.ops.aten.bmm.default: 0,
            torch.ops.aten.baddbmm.default: 1}


def _matmul_workspace(func, args) -> int:
    """What a narrow CPU matmul allocates beside its output (``contracts.cpu_matmul_workspace``); 0 for other ops."""
    at = _MATMULS.get(func)
    if at is None:
        return 0
    a, b = args[at], args[at + 1]
    if a.device.type != "cpu":
        return 0
    batch = int(a.shape[0]) if a.dim() == 3 else 1
    return contracts.cpu_matmul_workspace(int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1]), a.element_size(),
                                          batch, a_transposed=a.stride(-1) != 1 and a.shape[-1] != 1)


class Timeline(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes alive after every aten op, of the storages made under the mode (each freed when its last tensor
    dies), a narrow CPU matmul's workspace added at its own op; storages that exist before (``given``) are not
    counted."""

    def __init__(self, given: list):
        super().__init__()
        self.keys = {t.untyped_storage()._cdata for t in given if isinstance(t, Tensor)}
        self.live, self.samples = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self.keys:
                    self.keys.add(storage._cdata)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, storage._cdata, storage.nbytes()).atexit = False
        self.samples.append(self.live + _matmul_workspace(func, args))
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.keys.discard(key)
        self.live -= nbytes


def _envelope(small: list, large: list, n_small: int, n_large: int) -> tuple:
    """The bytes alive at each op as row * n + fixed (exact: a position-wise program's tensors are affine in its
    rows, and both runs issue the same ops), reduced to the pairs no other pair dominates: their max is the peak at
    any n."""
    pairs = set()
    for lo, hi in zip(small, large):
        row = max(0, -(-(hi - lo) // (n_large - n_small)))
        pairs.add((row, max(0, lo - n_small * row, hi - n_large * row)))
    return tuple(sorted(p for p in pairs if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in pairs)))


def _measure(region: Region, rows: list, params: list) -> None:
    """The bytes alive while the program runs on n rows without grad (the op's forward) and under autograd through
    its vjp (the op's backward, per block), as ``_envelope`` pairs: run on fake blocks of 8 and 16 rows, views of
    whole inputs as the op cuts them (a program that needs them contiguous copies them, and the copy is counted),
    the output gradient a view of a whole one too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    timelines = {}
    sizes = (8, 16)
    for n in sizes:
        with FakeTensorMode():
            cut_rows = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).narrow(d, 0, n) if d is not None
                        else torch.empty(t.shape, dtype=t.dtype) for t, d in zip(rows, region.row_dims)]
            weights = [torch.empty(p.shape, dtype=p.dtype) for p in params]
            for grad in (False, True):
                inputs = [t.detach().requires_grad_(grad and need and t.is_floating_point())
                          for t, need in zip([*cut_rows, *weights], region.needs)]
                shape = list(region.y_shape)
                shape[region.y_dim] = max(n, int(shape[region.y_dim]))
                grad_y = torch.empty(shape, dtype=region.y_dtype).narrow(region.y_dim, 0, n)
                timeline = Timeline([*inputs, grad_y])
                with torch.set_grad_enabled(grad), timeline:
                    y = region.program(n, *inputs)
                    if grad:
                        wanted = [t for t in inputs if t.requires_grad]
                        got = torch.autograd.grad(y, wanted, grad_y, allow_unused=True) \
                            if wanted and y.requires_grad else ()
                        del got
                    del y
                timelines[(n, grad)] = timeline.samples
    for grad, name in ((False, "forward"), (True, "backward")):
        small, large = timelines[(sizes[0], grad)], timelines[(sizes[1], grad)]
        if len(small) != len(large):
            raise BoundpassInputError(f"row blocks: the program issues {len(small)} ops on {sizes[0]} rows and "
                                      f"{len(large)} on {sizes[1]}: it is not position-wise")
        setattr(region, name, _envelope(small, large, *sizes) or ((0, 0),))
    region.input_row_bytes = sum(t.dtype.itemsize * (t.numel() // t.shape[d])
                                 for t, d in zip(rows, region.row_dims) if d is not None)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype


def rows_forward(rows: list, params: list, region: Region, chunk: int) -> Tensor:
    length = length_of(region.row_dims, rows)
    shape = list(region.y_shape)
    shape[region.y_dim] = length
    y = rows[0].new_empty(shape, dtype=region.y_dtype)
    with torch.no_grad():
        for s, e in blocks(length, chunk):
            y.narrow(region.y_dim, s, e - s).copy_(region.program(e - s, *cut(region.row_dims, rows, s, e), *params))
    return y


def rows_backward(grad_y: Tensor, rows: list, params: list, region: Region, chunk: int) -> list[Tensor]:
    """The gradients of the inputs ``region.needs`` names, in input order (rows, params)."""
    length = length_of(region.row_dims, rows)
    n_rows = len(rows)
    need_rows, need_params = list(region.needs[:n_rows]), list(region.needs[n_rows:])
    d_rows = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) if need else None
              for t, need in zip(rows, need_rows)]
    d_params = [torch.zeros(p.shape, dtype=_acc_dtype(p.dtype), device=p.device) if need else None
                for p, need in zip(params, need_params)]
    for s, e in blocks(length, chunk):
        with autograd_in_kernel():
            block = leaves(cut(region.row_dims, rows, s, e), need_rows)
            weights = leaves(params, need_params)
            y = region.program(e - s, *block, *weights)
        grads = vjp(y, [*block, *weights], grad_y.narrow(region.y_dim, s, e - s))
        del y
        add_rows(d_rows, region.row_dims, grads[:n_rows], s, e)
        add(d_params, grads[n_rows:])
        del grads, block, weights
    d_params = [g.to(p.dtype) if g is not None and g.dtype != p.dtype else g for g, p in zip(d_params, params)]
    return [g for g in (*d_rows, *d_params) if g is not None]


# ---------------------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("boundpass::row_blocks_fwd", mutates_args=())
def row_blocks_fwd(rows: list[Tensor], params: list[Tensor], region: str, chunk: int) -> Tensor:
    return rows_forward(rows, params, region_of(region), chunk)


@row_blocks_fwd.register_fake
def _(rows, params, region, chunk):
    r = region_of(region)
    shape = list(r.y_shape)
    shape[r.y_dim] = length_of(r.row_dims, rows)
    return rows[0].new_empty(shape, dtype=r.y_dtype)


@torch.library.custom_op("boundpass::row_blocks_bwd", mutates_args=())
def row_blocks_bwd(grad_y: Tensor, rows: list[Tensor], params: list[Tensor], region: str,
                   chunk: int) -> list[Tensor]:
    return rows_backward(grad_y, rows, params, region_of(region), chunk)


@row_blocks_bwd.register_fake
def _(grad_y, rows, params, region, chunk):
    r = region_of(region)
    return [torch.empty_like(t, memory_format=torch.contiguous_format)
            for t, need in zip((*rows, *params), r.needs) if need]


def _setup_context(ctx, inputs, output):
    rows, params, region, chunk = inputs
    ctx.save_for_backward(*rows, *params)
    ctx.n_rows = len(rows)
    ctx.args = (region, chunk)


def _backward(ctx, grad_y):
    saved = ctx.saved_tensors
    rows, params = list(saved[:ctx.n_rows]), list(saved[ctx.n_rows:])
    got = iter(torch.ops.boundpass.row_blocks_bwd(grad_y.contiguous(), rows, params, *ctx.args))
    grads = [next(got) if need else None for need in region_of(ctx.args[0]).needs]
    return grads[:ctx.n_rows], grads[ctx.n_rows:], None, None


row_blocks_fwd.register_autograd(_backward, setup_context=_setup_context)


def make_region(program, rows: list[Tensor], params: list[Tensor], *, row_dims: tuple) -> str:
    """Register the region of ``row_blocks``' arguments; return its key."""
    if len(row_dims) != len(rows) or all(d is None for d in row_dims):
        raise BoundpassInputError(f"row blocks: row_dims {row_dims} must give each of the {len(rows)} row inputs "
                                  "its sequence dim (at least one)")
    if not isinstance(program, torch.fx.GraphModule):
        program = torch.fx.symbolic_trace(program)
    length = length_of(tuple(row_dims), rows)
    with torch.device("meta"):
        y = program(length, *[torch.empty(t.shape, dtype=t.dtype) for t in (*rows, *params)])
    y_dim = [i for i, s in enumerate(y.shape) if s == length]
    if len(y_dim) != 1:
        raise BoundpassInputError(f"row blocks: the output {tuple(y.shape)} has no one sequence dim of {length}")
    region = Region(program=program, row_dims=tuple(row_dims), y_shape=tuple(y.shape), y_dim=y_dim[0],
                    y_dtype=y.dtype, needs=tuple(t.requires_grad for t in (*rows, *params)))
    return register_region(region, list(rows), list(params))


def row_blocks(program, rows: list[Tensor], params: list[Tensor], *, row_dims: tuple, chunk: int = 256) -> Tensor:
    """``program(L, *rows, *params)`` walked in blocks of ``chunk`` rows (differentiable), without the compiler.
    ``program`` is a position-wise callable fx.symbolic_trace can trace (its first argument the rows in the block);
    ``row_dims`` each row input's sequence dim. Registers one region per call (the pass registers one per graph)."""
    if chunk < 1:
        raise BoundpassInputError(f"row blocks: chunk must be >= 1, got {chunk}")
    key = make_region(program, rows, params, row_dims=row_dims)
    return torch.ops.boundpass.row_blocks_fwd(list(rows), list(params), key, int(chunk))


# ------------------------------------------------------------------------------------------------ bound
def row_blocks_bound(a: dict, ctx: dict) -> sympy.Expr:
    """Device bytes of one call, C_r symbolic (``C_r_sym``; the call's chunk when the pass fixed one). With n =
    min(C_r, L) rows per block and F_n, B_n the most bytes alive while the program runs on n rows without grad, and
    under autograd through its vjp (the block's saved tensors, the intermediates' gradients, the block's gradients
    of its rows and weights; measured op by op at registration on fake tensors, ``_measure``):

    forward : the inputs (rows, weights) + y + F_n
    backward: grad_y and the inputs + the gradients it returns (the rows', the weights') + the weights' fp32
              accumulators where they are narrower + B_n"""
    r = region_of(a["region"])
    rows, params = a["rows"], a["params"]
    length = length_expr(r.row_dims, rows)
    n = sympy.Min(C_r_sym, length) if a["chunk"] <= 0 else sympy.Min(int(a["chunk"]), length)
    zero = sympy.Integer(0)

    def nbytes(t, itemsize: int | None = None) -> sympy.Expr:
        count = sympy.Integer(1)
        for s in t.shape:
            count *= contracts.as_expr(s)
        return count * (itemsize or t.dtype.itemsize)

    def alive(pairs: tuple) -> sympy.Expr:
        return sympy.Max(*(row * n + fixed for row, fixed in pairs))

    y_row = sympy.Integer(r.y_dtype.itemsize) * (sympy.prod([int(s) for s in r.y_shape]) // int(r.y_shape[r.y_dim]))
    inputs = sum((nbytes(t) for t in (*rows, *params)), zero)
    if "grad_y" not in a:
        return inputs + length * y_row + alive(r.forward)
    n_rows = len(rows)
    outputs = sum((nbytes(t) for t, need in zip((*rows, *params), r.needs) if need), zero)
    accumulators = sum((nbytes(p, _acc_dtype(p.dtype).itemsize) for p, need in zip(params, r.needs[n_rows:])
                        if need and _acc_dtype(p.dtype) != p.dtype), zero)
    return length * y_row + inputs + outputs + accumulators + alive(r.backward)


contracts.register_bound(torch.ops.boundpass.row_blocks_fwd.default, row_blocks_bound)
contracts.register_bound(torch.ops.boundpass.row_blocks_bwd.default, row_blocks_bound)
