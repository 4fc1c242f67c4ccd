"""Memory contracts of torch kernels that allocate workspace no graph value shows, registered with the same registry
the bounded ops use (``boundpass.runtime.contracts``), so the step analysis counts them.

torch's CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: SDPA's fused
path on a CPU) splits the query rows into blocks of qs (32 below 192 rows, 64 below 768, else 256) and the key rows
into blocks of ks = min(512, L_kv), and allocates, per thread, in the accumulation dtype:
  forward : qs ks scores + 2 qs running max / sum + qs D_v output accumulator
  backward: 2 qs ks (probabilities, their gradient) + qs, and one [B, A_q, L, D] accumulator of the query gradient
Measured at torch's allocator (torch 2.13, fp32, one thread, L = 512-2,048, D = 16 / 64, GQA and not: the figures
above to the byte); found because a step with a small attention-only model measured 0.2-1.5 MiB above its
certificate. Other dtypes stage reduced-precision copies as well: their terms are doubled (an upper bound, not
measured).
"""
from __future__ import annotations

import sympy
import torch

from boundpass.runtime import contracts
from boundpass.runtime.contracts import as_expr


def _q_split(rows) -> int:
    if not isinstance(rows, int):
        return 256
    return 32 if rows < 192 else 64 if rows < 768 else 256


def _nbytes(t) -> sympy.Expr:
    if not isinstance(t, torch.Tensor):
        return sympy.Integer(0)
    out = sympy.Integer(t.element_size())
    for d in t.shape:
        out = out * as_expr(d)
    return out


def _flash_cpu_bound(a: dict, ctx: dict) -> sympy.Expr:
    q, k, v = a["query"], a["key"], a["value"]
    backward = "grad_out" in a
    rows, kv_rows = q.shape[2], k.shape[2]
    qs = _q_split(rows if isinstance(rows, int) else None)
    ks = sympy.Min(512, as_expr(kv_rows))
    acc = torch.promote_types(q.dtype, torch.float32).itemsize * (1 if q.dtype in (torch.float32, torch.float64) else 2)
    threads = torch.get_num_threads()
    if backward:
        io = sum((_nbytes(a[n]) for n in ("grad_out", "query", "key", "value", "out", "logsumexp")), sympy.Integer(0))
        io = io + _nbytes(q) + _nbytes(k) + _nbytes(v)                       # grad_query, grad_key, grad_value
        work = threads * (2 * qs * ks + qs) * acc + _nbytes(q) // q.element_size() * acc
    else:
        b, heads, _, dv = (as_expr(d) for d in (q.shape[0], q.shape[1], q.shape[2], v.shape[3]))
        io = _nbytes(q) + _nbytes(k) + _nbytes(v) + b * heads * as_expr(rows) * (dv * q.element_size() + 4)
        work = threads * (qs * ks + 2 * qs + qs * as_expr(v.shape[3])) * acc
    return io + work


def register() -> None:
    """Register the contracts above (idempotent)."""
    contracts.register_bound(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, _flash_cpu_bound)
    contracts.register_bound(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                             _flash_cpu_bound)
