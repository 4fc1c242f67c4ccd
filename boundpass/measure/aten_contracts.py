"""Memory contracts of torch kernels that allocate workspace no graph value shows, registered with the same registry
the bounded ops use (``boundpass.runtime.contracts``), so the step analysis counts them.

torch's CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: SDPA's fused
path on a CPU) splits the query rows into blocks of qs (32 below 192 rows, 64 below 768, else 256) and the key rows
into blocks of ks = min(512, L_kv), and allocates, per thread, in fp32:
  forward : qs ks scores + 2 qs running max / sum + qs D_v output accumulator
  backward: 2 qs ks (probabilities, their gradient) + qs
and once a contiguous copy of the query's size (backward, in the inputs' dtype). Inputs narrower than fp32 (bf16,
fp16) add, forward, an fp32 accumulator of the whole output [B, A_q, L, D_v] and per thread a narrow copy of the
scores tile and of a [ks, D_v] value block; backward, per thread, narrow copies of both tiles and what the kernel
allocates outside any aten op (17-202 KB per thread measured at L = 100-2,048, no formula found: bounded by
(qs ks + qs D) fp32 + 8 KiB, above every measured case). Measured at torch's allocator (torch
2.13, one and two threads, L = 600-2,048, D = 16-192, GQA and not; fp32 and bf16): the figures above to the byte but
for the unattributed backward bytes (bf16 backward: contract 1.00-1.03x measured). Found twice: a small fp32 attention-only
step measured 0.2-1.5 MiB above its certificate; then bf16's forward measured 1.46x the fp32 formula (the output
accumulator) while a blanket doubling overcounted its backward by 1.33x (tests/measure/test_aten_contracts.py).
"""
from __future__ import annotations

import sympy
import torch

from boundpass.runtime import chunked_attention as ca
from boundpass.runtime import contracts
from boundpass.runtime.contracts import as_expr


def _nbytes(t) -> sympy.Expr:
    if not isinstance(t, torch.Tensor):
        return sympy.Integer(0)
    out = sympy.Integer(t.element_size())
    for d in t.shape:
        out = out * as_expr(d)
    return out


def flash_cpu_bound(a: dict, ctx: dict) -> sympy.Expr:
    """Inputs, outputs and the kernel's own workspace (``chunked_attention.flash_cpu_workspace``, the one formula the
    attention kernels' fused tiles use too)."""
    q, k, v = a["query"], a["key"], a["value"]
    backward = "grad_out" in a
    rows, kv_rows = q.shape[2], k.shape[2]
    batch_heads = as_expr(q.shape[0]) * as_expr(q.shape[1])
    b = q.element_size()
    dv = as_expr(v.shape[3])
    if backward:
        io = sum((_nbytes(a[n]) for n in ("grad_out", "query", "key", "value", "out", "logsumexp")), sympy.Integer(0))
        io = io + _nbytes(q) + _nbytes(k) + _nbytes(v)                       # grad_query, grad_key, grad_value
    else:
        io = _nbytes(q) + _nbytes(k) + _nbytes(v) + batch_heads * as_expr(rows) * (dv * b + 4)   # out, lse
    work = ca.flash_cpu_workspace("backward" if backward else "forward", batch_heads=batch_heads,
                                  rows=rows if isinstance(rows, int) else as_expr(rows), kv_rows=as_expr(kv_rows),
                                  d=as_expr(q.shape[3]), width=dv, b=b, narrow=q.element_size() < 4)
    return io + work


def register() -> None:
    """Register the contracts above (idempotent)."""
    contracts.register_bound(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, flash_cpu_bound)
    contracts.register_bound(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                             flash_cpu_bound)
