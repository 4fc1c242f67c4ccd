"""The memory contract of each bounded op, registered by the op's own module beside its fake kernel.

A runtime module that defines a ``boundpass::`` custom op registers, next to its ``register_fake``, the function
that gives the op's whole device bound (its inputs, outputs and workspace) at one call site::

    contracts.register_bound(torch.ops.boundpass.ring_dtp_fwd.default, _ring_dtp_device_bound)

The function takes the call's arguments by their schema names (tensor arguments as their fake values, sizes
possibly symbolic) and the launch facts of the compile (``ctx``: e.g. ``max_tokens_per_rank``), and returns
sympy bytes in the shared vocabulary (``boundpass.core.symbols``) with the op's knob left symbolic. The step analysis
(``boundpass.measure.step_peak``) reads the registry at every op node and subtracts the storages of the node's
own inputs and outputs, which it already counts.

This module is a leaf: torch and sympy only. An op can be in a graph only once its module was imported, so the
registry is complete for every graph without any import done for its side effect.
"""
from __future__ import annotations

import functools
from typing import Callable

import sympy
import torch

_BOUNDS: dict = {}
_HOST: dict = {}


def register_bound(op, fn: Callable[[dict, dict], sympy.Expr]) -> None:
    """Declare ``fn(args_by_schema_name, ctx) -> sympy bytes`` as op overload ``op``'s whole device bound."""
    _BOUNDS[op] = fn


def register_host_bound(op, fn: Callable[[dict, dict], sympy.Expr]) -> None:
    """Declare ``fn(args_by_schema_name, ctx) -> sympy bytes`` as the host memory op overload ``op`` holds at one
    call (a pool it keeps across calls: the step holds the largest call's); the step analysis checks the largest
    against the host budget."""
    _HOST[op] = fn


def host_bound(op, args: dict, ctx: dict) -> sympy.Expr | None:
    fn = _HOST.get(op)
    return None if fn is None else fn(args, ctx)


def has_host_bound(op) -> bool:
    return op in _HOST


def has_bound(op) -> bool:
    return op in _BOUNDS


def call_arguments(op, args: tuple, kwargs: dict, value_of: Callable) -> dict:
    """The call's arguments by schema name, defaults filled in; ``value_of`` maps a graph value (an FX node) to
    what the bound reads (its fake tensor)."""
    out = {}
    for i, schema_arg in enumerate(op._schema.arguments):
        if i < len(args):
            raw = args[i]
        elif schema_arg.name in kwargs:
            raw = kwargs[schema_arg.name]
        else:
            raw = schema_arg.default_value
        out[schema_arg.name] = [value_of(a) for a in raw] if isinstance(raw, (list, tuple)) else value_of(raw)
    return out


def device_bound(op, args: dict, ctx: dict) -> sympy.Expr | None:
    """The op's registered bound at this call (None: the op declares none)."""
    fn = _BOUNDS.get(op)
    return None if fn is None else fn(args, ctx)


# torch's CPU matmul in bf16 / fp16 (oneDNN) allocates workspace through torch's allocator, outside any aten op's
# outputs: packed / converted copies of its operands, in blocks. Measured over M, K in 64..4,096, N in 64..2,048 and
# every transpose of either operand (torch 2.13, one thread), it stays under M K / 2 + 2 K N + M N / 4 + 32 KiB
# when the left operand is row-major, and 4 M K + K N + 128 KiB when it is transposed (its copy), the least such
# forms above every point (tests/runtime/test_row_blocks.py::test_narrow_cpu_matmul_workspace_is_bounded); fp32
# allocates none.
def cpu_matmul_workspace(m, k, n, itemsize: int, batch=1, a_transposed: bool = False):
    """Upper bound of the workspace bytes one CPU matmul [m, k] x [k, n] (``batch`` of them) allocates beside its
    inputs and output: 0 in fp32 and wider."""
    if itemsize >= 4:
        return 0
    one = 4 * m * k + k * n + 131072 if a_transposed else m * k // 2 + 2 * k * n + m * n // 4 + 32768
    return batch * one


def cpu_batched_matmul_workspace(*, entry, threads: int | None = None) -> sympy.Expr:
    """What torch's CPU matmul of two bf16 / fp16 batched operands (oneDNN's) allocates beyond its output, per call:
    scratch per thread, freed when it returns, not per batch entry (``cpu_matmul_workspace``'s per-call bound, for a
    program's linear maps, would count 16 heads' tiles at ~12x this); ``entry`` the bytes of one batch entry of the
    larger operand (an attention tile's probabilities or dS, [G C_s, C_s]). Measured at torch's allocator over tile
    shapes (C_s 64-512, 1-16 heads, the operand transposed or not, 1 and 2 threads;
    tests/runtime/test_chunked_attention.py): at most two entries and 16 KiB per thread."""
    threads = torch.get_num_threads() if threads is None else threads
    return threads * (2 * entry + 16384)


def as_expr(n) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression."""
    return n.node.expr if isinstance(n, torch.SymInt) else sympy.Integer(int(n))


@functools.lru_cache(maxsize=None)
def cached_bound(fn, **flags) -> sympy.Expr:
    """An op's sympy bound for these flags, built once (building one costs ~0.1 s; a graph has one per layer)."""
    return fn(**flags)


@functools.lru_cache(maxsize=None)
def _cached_xreplace(expr, items: tuple) -> sympy.Expr:
    return expr.xreplace(dict(items))


def substitute(expr: sympy.Expr, values: dict) -> sympy.Expr:
    """``expr.xreplace(values)``, memoised (one substitution per distinct layer shape)."""
    return _cached_xreplace(expr, tuple(sorted(values.items(), key=lambda kv: kv[0].name)))
