"""boundpass::row_blocks (runtime/row_blocks.py): a position-wise program walked C_r rows at a time, recomputed per
block in the backward. Exact against the program run whole (forward and backward, ragged last blocks, one row per
block, a block wider than L, an input read whole, weights without grad; bf16 no further from fp64 than the whole
program in bf16); the bound sound and within 1.25x at torch's allocator; what a block holds does not grow with L."""
import pytest
import sympy
import torch
import torch.nn.functional as F

from boundpass.core.errors import BoundpassInputError
from boundpass.runtime import row_blocks as rb
from boundpass.testing.whole_step import allocator_peak_of


def swiglu(n, x, norm_w, w1, w3, w2):
    """torchtitan's dense block feed-forward with the norm before it."""
    h = F.rms_norm(x, (x.shape[-1],), norm_w, 1e-6)
    return F.linear(F.silu(F.linear(h, w1)) * F.linear(h, w3), w2)


def gelu_mlp(n, x, scale, w1, b1, w2, b2):
    """A GELU MLP with biases, its input scaled by a tensor read whole by every block ([H], no rows)."""
    return F.linear(F.gelu(F.linear(x * scale, w1, b1)), w2, b2)


def _case(kind, dtype, batch, length, hidden, inter, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    x = t(batch, length, hidden).requires_grad_()
    if kind == "swiglu":
        params = [t(hidden) + 1, t(inter, hidden, scale=hidden ** -0.5), t(inter, hidden, scale=hidden ** -0.5),
                  t(hidden, inter, scale=inter ** -0.5)]
        return swiglu, [x], [p.requires_grad_() for p in params], (1,)
    scale = t(hidden).requires_grad_()
    params = [t(inter, hidden, scale=hidden ** -0.5), t(inter), t(hidden, inter, scale=inter ** -0.5), t(hidden)]
    params[1].requires_grad_(False)   # a weight without grad: no gradient made or returned for it
    return gelu_mlp, [x, scale], [p.requires_grad_(p is not params[1]) for p in params], (1, None)


def _run(program, rows, params, row_dims, chunk, grad_y, blocked=True):
    y = rb.row_blocks(program, rows, params, row_dims=row_dims, chunk=chunk) if blocked else \
        program(rows[0].shape[1], *rows, *params)
    wanted = [t for t in (*rows, *params) if t.requires_grad]
    return y, torch.autograd.grad(y, wanted, grad_y)


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
@pytest.mark.parametrize("length,chunk", [(300, 64), (256, 256), (37, 1), (50, 128)])
def test_exact_in_fp64(kind, length, chunk):
    program, rows, params, dims = _case(kind, torch.float64, 2, length, 16, 48)
    grad_y = torch.randn(2, length, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y, grads = _run(program, rows, params, dims, chunk, grad_y)
    ref_y, ref = _run(program, rows, params, dims, chunk, grad_y, blocked=False)
    torch.testing.assert_close(y, ref_y, rtol=0, atol=1e-12)
    assert len(grads) == len(ref)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_bf16_no_further_from_fp64_than_the_whole_program(kind):
    program, rows, params, dims = _case(kind, torch.float64, 1, 1000, 64, 256, seed=1)
    grad_y = torch.randn(1, 1000, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref_y, ref = _run(program, rows, params, dims, 128, grad_y, blocked=False)
    low = [t.detach().bfloat16().requires_grad_(t.requires_grad) for t in rows]
    low_p = [t.detach().bfloat16().requires_grad_(t.requires_grad) for t in params]
    y, grads = _run(program, low, low_p, dims, 128, grad_y.bfloat16())
    whole_y, whole = _run(program, low, low_p, dims, 128, grad_y.bfloat16(), blocked=False)
    for a, b, r in zip((y, *grads), (whole_y, *whole), (ref_y, *ref)):
        err, base = (a.double() - r).abs().max().item(), (b.double() - r).abs().max().item()
        assert err <= 2 * base + 1e-6, (err, base)


def _measured(part, kind, dtype, length, chunk, batch=1, hidden=64, inter=512):
    program, rows, params, dims = _case(kind, dtype, batch, length, hidden, inter)
    key = rb.make_region(program, rows, params, row_dims=dims)
    region = rb.region_of(key)
    rows, params = [t.detach() for t in rows], [t.detach() for t in params]
    grad = torch.randn(batch, length, hidden, dtype=dtype)
    state = [*rows, *params] + ([grad] if part == "backward" else [])
    if part == "forward":
        _, peak = allocator_peak_of(lambda: rb.rows_forward(rows, params, region, chunk), state)
    else:
        _, peak = allocator_peak_of(lambda: rb.rows_backward(grad, rows, params, region, chunk), state)
    del state
    args = dict(rows=rows, params=params, region=key, chunk=chunk)
    if part == "backward":
        args["grad_y"] = grad
    return peak, int(rb.row_blocks_bound(args, {}))


@pytest.mark.parametrize("part", ["forward", "backward"])
@pytest.mark.parametrize("kind,dtype,batch,length,chunk", [
    ("swiglu", torch.float32, 1, 2048, 128),
    ("swiglu", torch.bfloat16, 2, 1500, 256),
    ("gelu", torch.float32, 2, 1000, 64),
    ("gelu", torch.bfloat16, 1, 4096, 256),
])
def test_bound_sound_and_tight(part, kind, dtype, batch, length, chunk):
    measured, bound = _measured(part, kind, dtype, length, chunk, batch=batch)
    assert measured <= bound <= 1.25 * measured, (measured, bound, bound / measured)


def test_what_a_block_holds_does_not_grow_with_the_length():
    """Beyond its inputs, its output and the gradients it returns, the op's bound is the same at L = 512 and 8,192:
    the intermediates exist for C_r rows only."""
    held = {}
    for length in (512, 8192):
        program, rows, params, dims = _case("swiglu", torch.float32, 1, length, 64, 512)
        key = rb.make_region(program, rows, params, row_dims=dims)
        args = dict(rows=rows, params=params, region=key, chunk=128, grad_y=torch.empty(1, length, 64))
        # the inputs and their gradients (fp32: no accumulators), the output gradient
        held[length] = int(rb.row_blocks_bound(args, {})) - (2 * sum(t.nbytes for t in (*rows, *params))
                                                             + length * 64 * 4)
    assert held[512] == held[8192], held


def test_the_bound_is_symbolic_in_the_rows_per_block():
    program, rows, params, dims = _case("swiglu", torch.float32, 1, 1024, 32, 128)
    key = rb.make_region(program, rows, params, row_dims=dims)
    bound = rb.row_blocks_bound(dict(rows=rows, params=params, region=key, chunk=0), {})
    assert rb.C_r_sym in bound.free_symbols
    assert bound.subs(rb.C_r_sym, 64) < bound.subs(rb.C_r_sym, 512)
    assert bound.subs(rb.C_r_sym, 4096) == bound.subs(rb.C_r_sym, 1024)   # a block is at most the sequence
    assert isinstance(bound.subs(rb.C_r_sym, 64), sympy.Integer)


def test_bad_input_is_refused_before_any_compute():
    program, rows, params, dims = _case("swiglu", torch.float32, 1, 64, 16, 32)
    with pytest.raises(BoundpassInputError, match="chunk must be >= 1"):
        rb.row_blocks(program, rows, params, row_dims=dims, chunk=0)
    with pytest.raises(BoundpassInputError, match="row_dims"):
        rb.row_blocks(program, rows, params, row_dims=(None,), chunk=16)
    with pytest.raises(BoundpassInputError, match="no region"):
        rb.region_of("rows-unknown")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_narrow_cpu_matmul_workspace_is_bounded(dtype):
    """What torch's CPU matmul allocates beside its output (oneDNN's packed operands in bf16) stays under the formula
    the op's measure adds at every matmul (``contracts.cpu_matmul_workspace``), every transpose of either operand."""
    from boundpass.runtime import contracts
    for m, k, n in ((64, 64, 64), (64, 1024, 64), (256, 1024, 64), (512, 2048, 64), (2048, 64, 512),
                    (1024, 1024, 2048), (4096, 4096, 512)):
        for ta in (False, True):
            for tb in (False, True):
                a = torch.randn(k, m, dtype=dtype).t() if ta else torch.randn(m, k, dtype=dtype)
                b = torch.randn(n, k, dtype=dtype).t() if tb else torch.randn(k, n, dtype=dtype)
                out, peak = allocator_peak_of(lambda: a.mm(b), [a, b])
                workspace = peak - a.nbytes - b.nbytes - out.nbytes
                assert workspace <= contracts.cpu_matmul_workspace(m, k, n, dtype.itemsize, a_transposed=ta), (m, k, n, ta, tb)
