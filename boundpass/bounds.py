"""Bound terms and the per-rank budget check: every term is a sympy formula, its value here, and its knob."""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from boundpass.errors import InfeasibleBudgetError
from boundpass.units import format_bytes


@dataclass
class BoundTerm:
    """One memory term of a training step on one rank (bytes)."""
    name: str
    formula: sympy.Expr          # in the shared vocabulary (boundpass.symbols)
    value: int                   # bytes at this launch configuration
    knob: str                    # what a user changes to shrink it
    kind: str = "transient"      # "persistent" state or "transient" peak working set
    counted: bool = True         # False: shown for comparison only (e.g. the schedule a rewrite replaced)
    where: str = ""              # module path of the region it bounds


@dataclass
class BudgetTable:
    """The composed per-rank budget: terms that are summed, plus terms shown for comparison."""
    budget: int
    terms: list[BoundTerm] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Sum of the counted terms (bytes)."""
        return sum(t.value for t in self.terms if t.counted)

    def fits(self) -> bool:
        return self.total <= self.budget

    def render(self) -> str:
        """Text table: term, formula, bytes, share of budget."""
        rows = [("term", "formula", "bytes", "share")]
        for t in self.terms:
            share = f"{100 * t.value / self.budget:.1f}%" if t.counted else "(not counted)"
            name = t.name + (f" @ {t.where}" if t.where else "")
            rows.append((name, _short(t.formula), format_bytes(t.value), share))
        rows.append(("total (counted)", "", format_bytes(self.total), f"{100 * self.total / self.budget:.1f}%"))
        rows.append(("budget", "", format_bytes(self.budget), "FITS" if self.fits() else "DOES NOT FIT"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _short(expr: sympy.Expr, limit: int = 110) -> str:
    text = str(expr)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def raise_infeasible(table: BudgetTable, binding: BoundTerm, *, detail: str = "") -> None:
    """Raise InfeasibleBudgetError naming the binding term, its formula, value, the budget and the knob."""
    others = table.total - binding.value if binding.counted else table.total
    message = (
        f"boundpass: the per-rank budget {format_bytes(table.budget)} ({table.budget} B) cannot be met.\n"
        f"  binding term : {binding.name}" + (f" at {binding.where}" if binding.where else "") + "\n"
        f"  formula      : {binding.formula}\n"
        f"  value here   : {format_bytes(binding.value)} ({binding.value} B)"
        + (f" {detail}" if detail else "") + "\n"
        f"  other terms  : {format_bytes(others)}; total {format_bytes(others + binding.value)}\n"
        f"  to fix       : {binding.knob}\n"
        f"bounds table:\n{table.render()}"
    )
    raise InfeasibleBudgetError(message, term=binding.name, formula=str(binding.formula), value_bytes=binding.value,
                                budget_bytes=table.budget, knob=binding.knob)


def largest_fitting(lo: int, hi: int, cost) -> int | None:
    """Largest integer x in [lo, hi] with cost(x) fitting (cost monotone non-decreasing), else None."""
    if not cost(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
