"""Sequence-chunked attention (runtime/chunked_attention.py): exact against torch's math path forward and backward
(causal and not, GQA, MLA's unequal value head dim, ragged lengths, fp64 / fp32 / bf16), its bound both ways on real
tensors, its registered memory contract, through torch.compile, and bad input refused."""
import pytest
import torch

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError
from boundpass.testing.whole_step import allocator_peak_of
from boundpass.runtime import chunked_attention as ca
from boundpass.runtime import contracts


def _inputs(dtype, *, batch=2, heads=4, kv_heads=2, length=37, d=8, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(batch, kv_heads, length, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(batch, kv_heads, length, dv, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(batch, heads, length, dv, generator=g).to(dtype)
    return q, k, v, grad


def _step(fn, q, k, v, grad, **kw):
    out = fn(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads,d,dv,length,chunk", [
    (4, 4, 8, 8, 32, 8),      # MHA, length a multiple of the chunk
    (4, 2, 8, 8, 37, 8),      # GQA, ragged last tile
    (6, 2, 16, 24, 33, 16),   # MLA-style unequal value head dim
    (4, 1, 8, 8, 21, 64),     # one tile (chunk > L), MQA
    (2, 2, 8, 8, 17, 1),      # one row per tile
])
def test_exact_against_the_math_path_in_fp64(causal, heads, kv_heads, d, dv, length, chunk):
    q, k, v, grad = _inputs(torch.float64, heads=heads, kv_heads=kv_heads, d=d, dv=dv, length=length)
    got = _step(ca.chunked_attention, q, k, v, grad, causal=causal, chunk=chunk)
    want = _step(ca.reference, q, k, v, grad, causal=causal)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_scale_is_passed_through():
    q, k, v, grad = _inputs(torch.float64)
    got = _step(ca.chunked_attention, q, k, v, grad, chunk=8, scale=0.3)
    want = _step(ca.reference, q, k, v, grad, scale=0.3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, None)])
def test_low_precision_is_no_further_from_fp64_than_the_math_path(dtype, tol):
    """fp32: within 2e-5 of fp64. bf16: each output and gradient no further from the fp64 result than torch's math
    path in bf16 is (plus one bf16 ulp at the value's scale): the tolerance class of a fused kernel."""
    q, k, v, grad = _inputs(dtype, heads=6, kv_heads=2, d=16, dv=24, length=50)
    got = _step(ca.chunked_attention, q, k, v, grad, chunk=16)
    exact = _step(ca.reference, *(t.detach().double().requires_grad_() for t in (q, k, v)), grad.double())
    if tol is not None:
        for a, b in zip(got, exact):
            torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)
        return
    math = _step(ca.reference, q, k, v, grad)
    for a, m, b in zip(got, math, exact):
        ours, theirs = (a.double() - b).abs().max(), (m.double() - b).abs().max()
        assert ours <= theirs + b.abs().max() * 2 ** -8, (ours, theirs)


def test_log_sum_exp_is_the_rows():
    q, k, v, _ = _inputs(torch.float64, length=19)
    _, lse = ca.chunked_attention_forward(q.detach(), k.detach(), v.detach(), True, None, 4)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(19, 19, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).detach(), rtol=1e-12, atol=1e-12)


def _measured(part, q, k, v, grad, causal, chunk):
    """The kernel's peak at torch's allocator (the profiler's allocation events: the fused kernel's own buffers,
    allocated below any dispatch mode, included), its inputs counted from the start."""
    if part == "forward":
        _, peak = allocator_peak_of(lambda: ca.chunked_attention_forward(q, k, v, causal, None, chunk), [q, k, v])
        return peak
    out, lse = ca.chunked_attention_forward(q, k, v, causal, None, chunk)
    _, peak = allocator_peak_of(lambda: ca.chunked_attention_backward(grad, q, k, v, out, lse, causal, None, chunk),
                                [grad, q, k, v, out, lse])
    return peak


@pytest.mark.parametrize("part", ["forward", "backward"])
@pytest.mark.parametrize("dtype,heads,kv_heads,d,dv,batch,length,chunk,causal", [
    (torch.float32, 4, 2, 32, 32, 2, 512, 64, True),
    (torch.float32, 8, 8, 48, 32, 1, 1024, 128, True),
    (torch.bfloat16, 4, 1, 32, 48, 2, 512, 128, True),
    (torch.float32, 4, 4, 32, 32, 1, 300, 64, False),
])
def test_bound_sound_and_tight(part, dtype, heads, kv_heads, d, dv, batch, length, chunk, causal):
    q, k, v, grad = (t.detach() for t in _inputs(dtype, batch=batch, heads=heads, kv_heads=kv_heads, d=d, dv=dv,
                                                  length=length))
    measured = _measured(part, q, k, v, grad, causal, chunk)
    values = ca.bound_values(dtype, batch=batch, length=length, heads=heads, kv_heads=kv_heads, head_dim=d,
                             v_head_dim=dv, chunk=chunk)
    # the op's contract: each tile through torch's fused kernel on a CPU where v's head dim is at most q's
    bound = sym.evaluate(ca.chunked_attention_bound(part, mixed_precision=dtype != torch.float32, fused=dv <= d,
                                                    gqa=heads != kv_heads, padded=dv < d), values)
    assert measured <= bound, (measured, bound)
    assert bound <= 1.25 * measured, (measured, bound)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch,heads,rows,cols,width", [
    (2, 1, 512, 128, 48),     # GQA: four query heads' rows stacked on one key / value head
    (1, 16, 256, 256, 192),   # MLA's shape at the knee's tile
    (1, 16, 512, 512, 128),
    (1, 4, 64, 64, 16),
])
def test_narrow_matmul_scratch_is_within_its_contract(threads, batch, heads, rows, cols, width):
    """torch's CPU bf16 matmul allocates scratch per thread beyond its output (the tile's products, P^T dO, dS K,
    dS^T Q): at most ``contracts.cpu_batched_matmul_workspace`` of the larger operand's entry, transposed or not."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        p = torch.randn(batch, heads, rows, cols, generator=g).bfloat16()
        x = torch.randn(batch, heads, rows, width, generator=g).bfloat16()
        k = torch.randn(batch, heads, cols, width, generator=g).bfloat16()
        entry = rows * cols * 2
        bound = int(contracts.cpu_batched_matmul_workspace(entry=entry))
        for fn, operands, out in ((lambda: torch.matmul(p.transpose(-1, -2), x), [p, x], cols * width),
                                  (lambda: torch.matmul(p, k), [p, k], rows * width)):
            state = sum(t.untyped_storage().nbytes() for t in operands)
            _, peak = allocator_peak_of(fn, operands)
            assert peak - state - batch * heads * out * 2 <= bound, (peak - state, bound)
    finally:
        torch.set_num_threads(before)


def test_the_workspace_grows_with_the_chunk_not_with_the_square_of_the_length():
    """At a fixed chunk the tile's workspace is the same at every length: the bound minus the inputs and outputs is
    constant per row of the batch, while the math path's [L, L] scores grow quadratically."""
    def workspace(length, chunk):
        values = ca.bound_values(torch.float32, batch=1, length=length, heads=4, kv_heads=4, head_dim=32,
                                 v_head_dim=32, chunk=chunk)
        io = values[sym.N] * 4 * (32 * 3 + 32) * 4 + values[sym.N] * 4 * 4   # q, k, v, out, lse
        return sym.evaluate(ca.chunked_attention_bound("forward", mixed_precision=False), values) - io
    assert workspace(4096, 128) == workspace(65536, 128)
    assert workspace(4096, 256) > workspace(4096, 128)


def test_contract_registered_and_compiles():
    """The op's memory contract is in the registry the step analysis reads, and the op runs under torch.compile
    (its fake kernel) with the eager values and gradients."""
    assert contracts.has_bound(torch.ops.boundpass.chunked_attention_fwd.default)
    assert contracts.has_bound(torch.ops.boundpass.chunked_attention_bwd.default)
    q, k, v, grad = _inputs(torch.float32, length=40)
    eager = _step(ca.chunked_attention, q, k, v, grad, chunk=16)
    compiled = torch.compile(lambda q, k, v: ca.chunked_attention(q, k, v, chunk=16), backend="aot_eager",
                             fullgraph=True)
    got = _step(lambda q, k, v: compiled(q, k, v), q, k, v, grad)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_input_is_refused_before_any_work():
    q, k, v, _ = _inputs(torch.float32)
    with pytest.raises(BoundpassInputError, match="multiple"):
        ca.chunked_attention(q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1))
    with pytest.raises(BoundpassInputError, match="chunk"):
        ca.chunked_attention(q, k, v, chunk=0)
    with pytest.raises(BoundpassInputError, match="self-attention"):
        ca.chunked_attention(q[:, :, :5], k, v)
    with pytest.raises(BoundpassInputError, match="heads, L, D"):
        ca.chunked_attention(q[0], k[0], v[0])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads,d,dv,length,block,chunk", [
    (4, 2, 8, 8, 37, 10, 4),      # GQA, ragged last block and tile
    (6, 2, 16, 24, 33, 16, 16),   # MLA-style unequal value head dim
    (4, 4, 8, 8, 32, 32, 8),      # one block: the whole sequence
])
def test_query_blocks_at_their_offsets_are_the_sequence(causal, heads, kv_heads, d, dv, length, block, chunk):
    """The kernels on a query block at its offset (what a schedule walking the sequence's query blocks calls): each
    block's rows and log-sum-exp are the whole sequence's rows, and its backward, accumulating dk / dv in place over
    the blocks (``into``), gives the sequence's dq rows, dk and dv (fp64, against torch's math path)."""
    q, k, v, grad = _inputs(torch.float64, heads=heads, kv_heads=kv_heads, length=length, d=d, dv=dv)
    ref = _step(ca.reference, q, k, v, grad, causal=causal)
    _, ref_lse = ca.chunked_attention_forward(q.detach(), k.detach(), v.detach(), causal, None, chunk)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    dk, dv_ = torch.zeros_like(kd), torch.zeros_like(vd)
    outs, dqs = [], []
    for s in range(0, length, block):
        e = min(s + block, length)
        out, lse = ca.chunked_attention_forward(qd[:, :, s:e], kd, vd, causal, None, chunk, q_offset=s)
        torch.testing.assert_close(lse, ref_lse[:, :, s:e], rtol=1e-12, atol=1e-12)
        outs.append(out)
        dq, _, _ = ca.chunked_attention_backward(grad[:, :, s:e], qd[:, :, s:e], kd, vd, out, lse, causal, None,
                                                 chunk, q_offset=s, into=(dk, dv_))
        dqs.append(dq)
    for got, want in zip((torch.cat(outs, 2), torch.cat(dqs, 2), dk, dv_), ref):
        torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    with pytest.raises(BoundpassInputError, match="positions of the"):
        ca.chunked_attention_forward(qd[:, :, :block], kd, vd, causal, None, chunk, q_offset=length - block + 1)
