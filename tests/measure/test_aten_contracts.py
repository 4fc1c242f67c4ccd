"""torch's CPU flash attention kernels' memory contracts (boundpass/measure/aten_contracts.py) against torch's
allocator: forward and backward, fp32 and bf16, one and two threads, the query-row split's three regimes: sound, and
tight (the forward's bound is its measured peak to the byte; the backward's too but for the bytes bf16's allocates
outside any aten op, which the contract bounds: within 1.10x at these small shapes, 1.003-1.017x at L = 2,048)."""
import pytest
import torch

from boundpass.measure import aten_contracts
from boundpass.testing.whole_step import allocator_peak_of


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length,d,heads,kv_heads", [(600, 64, 16, 16), (2048, 192, 16, 16), (160, 16, 4, 2)])
def test_flash_attention_contracts_sound_and_tight(threads, dtype, length, d, heads, kv_heads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, length, d, generator=g).to(dtype)
        k, v = (torch.randn(1, kv_heads, length, d, generator=g).to(dtype) for _ in range(2))
        if kv_heads != heads:   # the fused kernel takes GQA as key / value heads repeated
            k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
        (out, lse, *_), forward = allocator_peak_of(
            lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True), [q, k, v])
        grad = torch.randn(out.shape, generator=g).to(dtype)
        _, backward = allocator_peak_of(
            lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0,
                                                                                        True),
            [q, k, v, out, lse, grad])
        bound_f = int(aten_contracts.flash_cpu_bound(dict(query=q, key=k, value=v), {}))
        bound_b = int(aten_contracts.flash_cpu_bound(dict(grad_out=grad, query=q, key=k, value=v, out=out,
                                                           logsumexp=lse), {}))
    finally:
        torch.set_num_threads(before)
    assert forward <= bound_f <= 1.02 * forward, (forward, bound_f)
    assert backward <= bound_b <= 1.10 * backward, (backward, bound_b)
