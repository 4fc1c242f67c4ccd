"""The attention sublayer in query blocks (runtime/attention_blocks.py): exact against the sublayer as one piece
(torch's math path between the same query and output programs) forward and backward, causal and full, GQA, MLA's
unequal value head dim, RoPE-like row inputs, ragged blocks, fp64 / bf16; its bound both ways on real tensors at the
op's own scale; its memory contract registered; bad input refused."""
import pytest
import torch
import torch.nn.functional as F

from boundpass.core.errors import BoundpassInputError
from boundpass.testing.whole_step import allocator_peak_of
from boundpass.runtime import attention_blocks as ab
from boundpass.runtime import chunked_attention as ca


class Query(torch.nn.Module):
    """q = RoPE-like rotation of a projection: rows (x [B, L, H], cos [L, D]), a weight; heads A, head dim D."""

    def __init__(self, batch, heads, d):
        super().__init__()
        self.batch, self.heads, self.d = batch, heads, d

    def forward(self, n, x, cos, w):
        q = F.linear(x, w).view(self.batch, n, self.heads, self.d)
        return (q * cos.unsqueeze(1)).transpose(1, 2)


class KV(torch.nn.Module):
    """k = RoPE-like rotation of a projection, v = a projection: from the same rows as the query."""

    def __init__(self, batch, kv_heads, d, dv):
        super().__init__()
        self.batch, self.kv_heads, self.d, self.dv = batch, kv_heads, d, dv

    def forward(self, n, x, cos, wk, wv):
        k = F.linear(x, wk).view(self.batch, n, self.kv_heads, self.d) * cos.unsqueeze(1)
        v = F.linear(x, wv).view(self.batch, n, self.kv_heads, self.dv)
        return k.transpose(1, 2), v.transpose(1, 2)


class Out(torch.nn.Module):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def forward(self, n, o, w):
        return F.linear(o.transpose(1, 2).reshape(self.batch, n, -1), w)


def _case(dtype, *, batch=2, heads=4, kv_heads=2, length=37, d=8, dv=12, hidden=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(dtype).requires_grad_()  # noqa: E731
    x, wq, wo = t(batch, length, hidden), t(heads * d, hidden), t(hidden, heads * dv)
    cos = torch.randn(length, d, generator=g).to(dtype)          # a row input that takes no gradient
    k, v = t(batch, kv_heads, length, d), t(batch, kv_heads, length, dv)
    grad = torch.randn(batch, length, hidden, generator=g).to(dtype)
    return dict(x=x, cos=cos, wq=wq, wo=wo, k=k, v=v, grad=grad, batch=batch, heads=heads, d=d)


def _walked(c, causal, chunk):
    return ab.sublayer(Query(c["batch"], c["heads"], c["d"]), Out(c["batch"]), [c["x"], c["cos"]], [c["wq"], c["wo"]],
                       c["k"], c["v"], row_dims=(1, 0), query_params=1, causal=causal, chunk=chunk)


def _whole(c, causal):
    length = c["x"].shape[1]
    q = Query(c["batch"], c["heads"], c["d"])(length, c["x"], c["cos"], c["wq"])
    o = ca.reference(q, c["k"], c["v"], causal=causal)
    return Out(c["batch"])(length, o, c["wo"])


def _grads(y, c):
    return (y, *torch.autograd.grad(y, [c["x"], c["wq"], c["wo"], c["k"], c["v"]], c["grad"]))


def _kv_case(dtype, *, batch=2, heads=4, kv_heads=2, length=37, d=8, dv=12, hidden=16, seed=0):
    c = _case(dtype, batch=batch, heads=heads, kv_heads=kv_heads, length=length, d=d, dv=dv, hidden=hidden, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    c["wk"] = (torch.randn(kv_heads * d, hidden, generator=g) / hidden ** 0.5).to(dtype).requires_grad_()
    c["wv"] = (torch.randn(kv_heads * dv, hidden, generator=g) / hidden ** 0.5).to(dtype).requires_grad_()
    c.update(kv_heads=kv_heads, dv=dv)
    return c


def _walked_kv(c, causal, chunk):
    return ab.sublayer(Query(c["batch"], c["heads"], c["d"]), Out(c["batch"]), [c["x"], c["cos"]],
                       [c["wq"], c["wk"], c["wv"], c["wo"]], row_dims=(1, 0), query_params=1,
                       kv=KV(c["batch"], c["kv_heads"], c["d"], c["dv"]), kv_params=2, causal=causal, chunk=chunk)


def _walked_host(c, causal, chunk):
    return ab.sublayer(Query(c["batch"], c["heads"], c["d"]), Out(c["batch"]), [c["x"], c["cos"]],
                       [c["wq"], c["wk"], c["wv"], c["wo"]], row_dims=(1, 0), query_params=1,
                       kv=KV(c["batch"], c["kv_heads"], c["d"], c["dv"]), kv_params=2, causal=causal, chunk=chunk,
                       offload=True)


def _whole_kv(c, causal):
    length = c["x"].shape[1]
    q = Query(c["batch"], c["heads"], c["d"])(length, c["x"], c["cos"], c["wq"])
    k, v = KV(c["batch"], c["kv_heads"], c["d"], c["dv"])(length, c["x"], c["cos"], c["wk"], c["wv"])
    return Out(c["batch"])(length, ca.reference(q, k, v, causal=causal), c["wo"])


def _grads_kv(y, c):
    return (y, *torch.autograd.grad(y, [c["x"], c["wq"], c["wk"], c["wv"], c["wo"]], c["grad"]))


SIDES = {False: (_case, _walked, _whole, _grads),              # k and v the op's inputs
         True: (_kv_case, _walked_kv, _whole_kv, _grads_kv),     # k and v made by the kv program per key tile
         "host": (_kv_case, _walked_host, _whole_kv, _grads_kv)}  # and k, v, q, dO on the host, tiles prefetched
KV_IDS = dict(argnames="kv", argvalues=[False, True, "host"], ids=["kv-inputs", "kv-program", "kv-host"])


@pytest.mark.parametrize(**KV_IDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads,d,dv,length,chunk", [
    (4, 4, 8, 8, 32, 8),      # MHA, the length a multiple of the block
    (4, 2, 8, 12, 37, 8),     # GQA, MLA's value head dim, a ragged last block
    (2, 1, 16, 8, 5, 16),     # one block wider than the sequence
    (4, 2, 8, 8, 19, 1),      # one row per block
])
def test_exact_in_fp64(kv, causal, heads, kv_heads, d, dv, length, chunk):
    """The same values and gradients as the sublayer as one piece; with a kv program, k and v made per key tile and
    their gradients finished key tile by key tile (the key-outer pass)."""
    case, walked, whole, grads = SIDES[kv]
    c = case(torch.float64, heads=heads, kv_heads=kv_heads, d=d, dv=dv, length=length)
    got, want = grads(walked(c, causal, chunk), c), grads(whole(c, causal), c)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(**KV_IDS)
def test_bf16_no_further_from_fp64_than_the_math_path(kv):
    case, walked, whole, grads = SIDES[kv]
    c64 = case(torch.float64, length=96, d=16, dv=24)
    c16 = {n: (t.detach().to(torch.bfloat16).requires_grad_(t.requires_grad) if torch.is_tensor(t) else t)
           for n, t in c64.items()}
    truth = grads(whole(c64, True), c64)
    walked16, math = grads(walked(c16, True, 32), c16), grads(whole(c16, True), c16)
    for t, a, b in zip(truth, walked16, math):
        assert (a.double() - t).abs().max() <= 2 * (b.double() - t).abs().max() + 1e-3


def _measured(part, c, causal, chunk, *, kv=False):
    """The op's forward or backward kernel on real tensors at torch's allocator (the profiler's allocation events:
    the fused kernel's own buffers included; inputs counted from the start), and its registered bound at the same
    call. kv: k and v made by the region's kv program ("host": kept on the host, the pool made before)."""
    x = c["x"]
    weights = [c["wq"], c["wk"], c["wv"], c["wo"]] if kv else [c["wq"], c["wo"]]
    extra = dict(kv=KV(c["batch"], c["kv_heads"], c["d"], c["dv"]), kv_params=2, offload=kv == "host") if kv else {}
    key = ab.make_region(Query(c["batch"], c["heads"], c["d"]), Out(c["batch"]), [x, c["cos"]], weights,
                         None if kv else c["k"], None if kv else c["v"], row_dims=(1, 0), query_params=1, **extra)
    region = ab.region_of(key)
    rows, params = [x.detach(), c["cos"]], [w.detach() for w in weights]
    k, v = (None, None) if kv else (c["k"].detach(), c["v"].detach())
    grad = c["grad"]
    if kv == "host":   # the host pool is made once and kept across calls: host memory, not this call's device bytes
        ab.blocks_backward(grad, rows, params, k, v, region, causal, None, chunk)
    state = [*rows, *params, *([] if kv else [k, v]), *([grad] if part == "backward" else [])]
    if part == "forward":
        _, peak = allocator_peak_of(lambda: ab.blocks_forward(rows, params, k, v, region, causal, None, chunk), state)
    else:
        _, peak = allocator_peak_of(lambda: ab.blocks_backward(grad, rows, params, k, v, region, causal, None, chunk),
                                    state)
    del state
    args = dict(rows=rows, params=params, k=k, v=v, region=key, causal=causal, scale=0.0, chunk=chunk)
    if part == "backward":
        args["grad_y"] = grad
    return peak, int(ab.attention_blocks_bound(args, {}))


CASES = [
    (torch.float32, 4, 2, 32, 32, 64, 2, 1024, 64, True),
    (torch.float32, 8, 8, 48, 32, 128, 1, 2048, 128, True),
    (torch.bfloat16, 4, 1, 32, 48, 64, 2, 1024, 128, True),
    (torch.float32, 4, 4, 32, 32, 64, 1, 600, 64, False),
    (torch.bfloat16, 4, 4, 48, 32, 64, 1, 1024, 128, True),   # MLA's shape class: every tile fused, delta padded
]


@pytest.mark.parametrize(**KV_IDS)
@pytest.mark.parametrize("part", ["forward", "backward"])
@pytest.mark.parametrize("dtype,heads,kv_heads,d,dv,hidden,batch,length,chunk,causal", CASES)
def test_bound_sound_and_tight(kv, part, dtype, heads, kv_heads, d, dv, hidden, batch, length, chunk, causal):
    c = SIDES[kv][0](dtype, batch=batch, heads=heads, kv_heads=kv_heads, d=d, dv=dv, hidden=hidden, length=length)
    measured, bound = _measured(part, c, causal, chunk, kv=kv)
    assert measured <= bound <= 1.25 * measured, (measured, bound, bound / measured)


@pytest.mark.parametrize("part", ["forward", "backward"])
def test_host_pool_is_its_host_bound(part):
    """With k, v (and the backward's q, dO and dq) on the host, the pool holds exactly what the op's host bound says,
    and the device bound no longer holds them: it is below the on-device schedule's by what that schedule's largest
    phase holds whole, less at most the two tiles of each the prefetch keeps on the device while they are read."""
    from boundpass.runtime import contracts, host_tiles
    c = _kv_case(torch.bfloat16, batch=2, heads=4, kv_heads=2, d=32, dv=48, hidden=64, length=1000)
    rows, params = [c["x"].detach(), c["cos"]], [c[w].detach() for w in ("wq", "wk", "wv", "wo")]
    bounds = {}
    for host in (False, True):
        key = ab.make_region(Query(2, 4, 32), Out(2), [c["x"], c["cos"]], [c["wq"], c["wk"], c["wv"], c["wo"]],
                             row_dims=(1, 0), query_params=1, kv=KV(2, 2, 32, 48), kv_params=2, offload=host)
        args = dict(rows=rows, params=params, k=None, v=None, region=key, causal=True, scale=0.0, chunk=100)
        if part == "backward":
            args["grad_y"] = c["grad"]
        host_tiles.clear_pool()
        region = ab.region_of(key)
        if part == "forward":
            ab.blocks_forward(rows, params, None, None, region, True, None, 100)
        else:
            ab.blocks_backward(c["grad"], rows, params, None, None, region, True, None, 100)
        bounds[host] = (int(ab.attention_blocks_bound(args, {})), int(ab.attention_blocks_host_bound(args, {})),
                        host_tiles.pool_bytes())
    assert contracts.has_host_bound(torch.ops.boundpass.attention_blocks_bwd.default)
    kv_row, q_row = 2 * 2 * (32 + 48) * 2, 2 * 4 * (32 + 48) * 2      # bytes of one row of k, v / of q, dO
    dq_row = 2 * 4 * 32 * 4                                            # of the fp32 dq the key-outer pass adds into
    whole = 1000 * kv_row + (1000 * (q_row + dq_row) if part == "backward" else 0)
    assert bounds[False][1:] == (0, 0)
    assert bounds[True][1] == bounds[True][2] == whole
    # on the device the backward's key-outer pass holds q, dO and dq whole (k and v are freed by then), the forward k
    # and v: on the host two tiles of each instead (bf16: both tiles beside fp32 rows)
    row = q_row + dq_row if part == "backward" else kv_row
    moved = bounds[False][0] - bounds[True][0]
    assert 1000 * row - 2 * 100 * row <= moved <= 1000 * row, (moved, row)


def test_what_the_block_holds_does_not_grow_with_the_length():
    """At a fixed block the bound minus the inputs and outputs is the same at every length (the op never holds q,
    the attention output or their gradients whole), and it grows with the block."""
    def workspace(length, chunk, part):
        c = _case(torch.float32, length=length, d=32, dv=32, hidden=64)
        rows, params = [c["x"].detach(), c["cos"]], [c["wq"].detach(), c["wo"].detach()]
        key = ab.make_region(Query(2, 4, 32), Out(2), [c["x"], c["cos"]], [c["wq"], c["wo"]], c["k"], c["v"],
                             row_dims=(1, 0), query_params=1)
        args = dict(rows=rows, params=params, k=c["k"], v=c["v"], region=key, chunk=chunk)
        io = sum(t.numel() * t.element_size() for t in (*rows, *params, c["k"], c["v"], c["grad"]))  # grad: or y
        if part == "backward":
            args["grad_y"] = c["grad"]
            io += sum(t.numel() * 4 for t in (c["x"], c["wq"], c["wo"], c["k"], c["v"]))  # the gradients
        return int(ab.attention_blocks_bound(args, {})) - io
    for part in ("forward", "backward"):
        assert workspace(512, 64, part) == workspace(4096, 64, part) < workspace(512, 128, part)


def test_contract_registered_and_compiles():
    """The op's memory contract is in the registry the step analysis reads, and the op runs under torch.compile
    (its fake kernel) with the eager values and gradients."""
    from boundpass.runtime import contracts
    assert contracts.has_bound(torch.ops.boundpass.attention_blocks_fwd.default)
    assert contracts.has_bound(torch.ops.boundpass.attention_blocks_bwd.default)
    c = _case(torch.float32, length=40)
    eager = _grads(_walked(c, True, 16), c)
    compiled = torch.compile(lambda c: _walked(c, True, 16), backend="aot_eager")
    got = _grads(compiled(c), c)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_input_is_refused():
    c = _case(torch.float32)
    with pytest.raises(BoundpassInputError, match="chunk must be"):
        _walked(c, True, 0)
    with pytest.raises(BoundpassInputError, match="row_dims"):
        ab.sublayer(Query(2, 4, 8), Out(2), [c["x"], c["cos"]], [c["wq"], c["wo"]], c["k"], c["v"],
                    row_dims=(1,), query_params=1)
    with pytest.raises(BoundpassInputError, match="offload keeps"):
        ab.sublayer(Query(2, 4, 8), Out(2), [c["x"], c["cos"]], [c["wq"], c["wo"]], c["k"], c["v"],
                    row_dims=(1, 0), query_params=1, offload=True)
    with pytest.raises(BoundpassInputError, match="no region"):
        ab.region_of("nowhere")
