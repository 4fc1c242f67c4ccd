"""The shared sympy vocabulary every bound is written in (docs/design.md §0)."""
from __future__ import annotations

import sympy

_pos = dict(integer=True, positive=True)

N = sympy.Symbol("N", **_pos)          # tokens on this rank (per-rank token ceiling)
N_max = sympy.Symbol("N_max", **_pos)  # largest per-rank token count in a ring / EP group
H = sympy.Symbol("H", **_pos)          # hidden size
V = sympy.Symbol("V", **_pos)          # vocabulary size
P = sympy.Symbol("P", **_pos)          # ring (data-parallel) degree of Ring-DTP
C = sympy.Symbol("C", **_pos)          # vocab sub-block (strip width) of Ring-DTP
E = sympy.Symbol("E", **_pos)          # experts
E_p = sympy.Symbol("E_p", **_pos)      # expert-parallel degree
k = sympy.Symbol("k", **_pos)          # router top-k
c = sympy.Symbol("c", **_pos)          # PipelinedLLEP per-source token cap per chunk
I = sympy.Symbol("I", **_pos)          # expert intermediate size
L = sympy.Symbol("L", **_pos)          # layers
W = sympy.Symbol("W", **_pos)          # ranks
beta = sympy.Symbol("beta", **_pos)    # OffloadStreamAdamW bucket size (parameters)
S = sympy.Symbol("S", **_pos)          # OffloadStreamAdamW staging slots
Theta = sympy.Symbol("Theta", **_pos)  # parameters
b = sympy.Symbol("b", **_pos)          # bytes per element of activations / weights (input dtype)
b_acc = sympy.Symbol("b_acc", **_pos)  # bytes per element of the accumulation dtype (fp32 = 4)
b_idx = sympy.Symbol("b_idx", **_pos)  # bytes per label / index element (int64 = 8)

ALL = {s.name: s for s in (N, N_max, H, V, P, C, E, E_p, k, c, I, L, W, beta, S, Theta, b, b_acc, b_idx)}


def evaluate(expr: sympy.Expr, values: dict) -> int:
    """Evaluate a bound at concrete values (symbols or their names as keys) to an int number of bytes."""
    subs = {ALL[key] if isinstance(key, str) else key: val for key, val in values.items()}
    out = sympy.sympify(expr).subs(subs)
    if out.free_symbols:
        raise ValueError(f"bound {expr} still has free symbols {sorted(map(str, out.free_symbols))}")
    return int(sympy.ceiling(out))


def max_kept(*args) -> sympy.Expr:
    """sympy.Max(*args) built unevaluated: for a bound's Max of large sums none of which dominates another.
    Evaluation compares the arguments pairwise (factor_terms of each difference, assumption queries: up to
    ~0.1 s per Max of the bounds' sums, ~0.5 s of a plan); where it drops none, the unevaluated Max is the same
    expression (same arguments, same order). Each bound built with it is checked against ``evaluated`` of itself
    for every flag it takes (tests/core/test_units_and_symbols.py)."""
    return sympy.Max(*args, evaluate=False)


def evaluated(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` with every Max / Min rebuilt through sympy's evaluation, innermost first (== expr when no
    ``max_kept`` in it left an argument that evaluation would drop)."""
    return expr.replace(lambda e: isinstance(e, (sympy.Max, sympy.Min)), lambda e: e.func(*e.args))


# PipelinedLLEP / EP dispatch (added after ALL: only additions, existing names unchanged)
# counts that may be 0 (no rows received, no borrowed slots): nonnegative, so sympy never simplifies them away
R = sympy.Symbol("R", integer=True, nonnegative=True)    # routes this rank's experts received (realized)
s_b = sympy.Symbol("s_b", integer=True, nonnegative=True)  # borrowed-expert weight slots per EP rank
ALL.update({s.name: s for s in (R, s_b)})

# SCO (selective checkpoint offload): a count that is 0 when the host budget fits no boundary
L_off = sympy.Symbol("L_off", integer=True, nonnegative=True)  # checkpoint boundaries offloaded to the host
ALL.update({s.name: s for s in (L_off,)})

# Attention under the MoP layout (sequence-to-head all-to-all over W ranks)
A_q = sympy.Symbol("A_q", **_pos)      # attention query heads
A_kv = sympy.Symbol("A_kv", **_pos)    # attention key/value heads (GQA: A_kv divides A_q)
D_h = sympy.Symbol("D_h", **_pos)      # attention head dimension
ALL.update({s.name: s for s in (A_q, A_kv, D_h)})

# Composed per-rank budget (boundpass/bound/composed.py, boundpass/planning/full_scale.py)
Theta_blk = sympy.Symbol("Theta_blk", **_pos)  # non-routed-expert parameter elements of the largest block (ZeRO-3 gather)
I_f = sympy.Symbol("I_f", **_pos)              # hidden size of the dense blocks' FFN
I_s = sympy.Symbol("I_s", **_pos)              # hidden size of a MoE block's shared-experts MLP
ALL.update({s.name: s for s in (Theta_blk, I_f, I_s)})
