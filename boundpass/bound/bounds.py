"""Bound terms and the per-rank budget check: every term is a sympy formula, its value here, and its knob."""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from boundpass.core.kinds import NamedKind
from boundpass.core.errors import InfeasibleBudgetError
from boundpass.core import textwidth
from boundpass.core.units import format_bytes


def device_peak(persistent, *phases):
    """The step law, the one place it is written: a step's device peak is its persistent state (parameters, buffers,
    optimizer state) plus the largest of its phases, which never coexist (forward/backward with its activations,
    the optimizer step with the gradients and its workspace, ...). Ints give an int; sympy sizes give the
    expression (the dynamic-shape guard and the composed budget's formula in N)."""
    if any(isinstance(x, sympy.Basic) and not x.is_number for x in (persistent, *phases)):
        return persistent + sympy.Max(*phases)
    return persistent + max(phases)


class TermKind(NamedKind):
    """When a term's bytes are live: the whole step ("persistent": parameters, buffers, optimizer state), in the
    forward/backward phase ("transient"), in the optimizer phase ("step"), or on the host ("host"). A str: the plain
    names compare equal, print and serialise as themselves."""
    PERSISTENT = "persistent"
    TRANSIENT = "transient"
    STEP = "step"
    HOST = "host"


@dataclass
class BoundTerm:
    """One memory term of a training step on one rank (bytes)."""
    name: str
    formula: sympy.Expr          # in the shared vocabulary (boundpass.core.symbols)
    value: int                   # bytes at this launch configuration
    knob: str                    # what a user changes to shrink it
    kind: TermKind | str = TermKind.TRANSIENT  # a TermKind (by name too), or a phase of the composed budget
    counted: bool = True         # False: shown for comparison only (e.g. the schedule a rewrite replaced)
    where: str = ""              # module path of the region it bounds

    def __post_init__(self):
        # the composed budget (bound/composed.py) files its terms under finer phases ("grad_moe", "attention", ...)
        # than a compiled step's four; those stay its names
        if self.kind in TermKind._value2member_map_:
            self.kind = TermKind(self.kind)


@dataclass
class BudgetTable:
    """The composed per-rank budget: terms that are summed, plus terms shown for comparison.

    Device peak = persistent + max(forward/backward transients, optimizer-step transients): the optimizer
    steps after backward has freed its activations. Host terms are checked against the host budget.
    """
    budget: int
    terms: list[BoundTerm] = field(default_factory=list)
    host_budget: int | None = None

    def sum(self, kind: str) -> int:
        """Bytes of the counted terms of one kind ("persistent", "transient", "step", "host")."""
        return sum(t.value for t in self.terms if t.counted and t.kind == kind)

    @property
    def total(self) -> int:
        """Device bytes of the peak phase (bytes)."""
        return device_peak(self.sum("persistent"), self.sum("transient"), self.sum("step"))

    @property
    def host_total(self) -> int:
        """Host bytes (bytes)."""
        return self.sum("host")

    def fits(self) -> bool:
        return self.total <= self.budget and self.host_fits()

    def host_fits(self) -> bool:
        return self.host_budget is None or self.host_total <= self.host_budget

    def breaking_term(self) -> BoundTerm:
        """The largest counted term of the side that does not fit: the device's first, else the host's (a host term
        named for a device that is over its budget sends the user to the wrong knob)."""
        host = self.total <= self.budget and not self.host_fits()
        return max((t for t in self.terms if t.counted and (t.kind == "host") == host), key=lambda t: t.value)

    def render(self, *, formulas: bool = False, width: int = textwidth.WIDTH) -> str:
        """Text table that fits ``width`` columns: term, bytes, share of its budget, then the device peak and the
        verdict. formulas=True adds each term's sympy formula under it (wrapped, never clipped)."""
        rows, formula_of = [("term", "bytes", "share")], {}
        for t in self.terms:
            limit = self.host_budget if t.kind == "host" else self.budget
            share = "(not counted)" if not t.counted else (f"{100 * t.value / limit:.1f}%" if limit else "host")
            name = t.name + (f" @ {t.where}" if t.where else "")
            formula_of[len(rows)] = t.formula
            rows.append((name, format_bytes(t.value), share))
        rows.append(("device peak = persistent + max(fwd/bwd, optimizer step)", format_bytes(self.total),
                     f"{100 * self.total / self.budget:.1f}%"))
        rows.append(("device budget", format_bytes(self.budget),
                     "FITS" if self.total <= self.budget else "DOES NOT FIT"))
        if self.host_total:
            verdict = "not checked" if self.host_budget is None else ("FITS" if self.host_fits() else "DOES NOT FIT")
            rows.append(("host total", format_bytes(self.host_total), ""))
            rows.append(("host budget", format_bytes(self.host_budget) if self.host_budget else "-", verdict))
        lines = textwidth.table(rows, width=width)
        if not formulas:
            return "\n".join(lines)
        out = []
        for i, line in enumerate(lines):
            out.append(line)
            if i in formula_of:
                out += textwidth.wrap(str(formula_of[i]), width=width, first="    = ", rest="      ")
        return "\n".join(out)


@dataclass
class Knob:
    """A schedule parameter of the rewritten ops: its symbol in the workspace bounds and its range. The pass that
    rewrote the ops opens it (``owner``), the planner chooses its value and writes it into every op node by schema
    argument name (``arg``) and into the pass's region records (the attribute of the same name)."""
    name: str                    # the boundpass.compile argument that overrides it
    symbol: sympy.Symbol
    lo: int
    hi: int
    arg: str                     # schema argument name on the ops below
    ops: tuple                   # op overloads whose nodes carry it
    user: int | None = None
    value: int = 0
    why: str = ""                # "knee" / "budget" / "user" ("widest": no time model, the budget allows hi)
    widest_fitting: int | None = None  # what the budget alone allows (None: not even the narrowest)
    knee: int | None = None      # the time model's knee (boundpass/bound/cost_model.py); None: no model, the widest
    regions: list = field(default_factory=list)   # pass region records, updated with the value
    owner: str = ""              # the pass that opened it (its diagnosis names the fix)
    agree_over: str = ""         # a process group's name whose ranks must run the same value ("": none)

    @property
    def attr(self) -> str:
        """The region records' attribute that shows the value (the schema argument's name)."""
        return self.arg

    def settle(self, widest: int | None) -> int:
        """The knee rule, the one place it is written (docs/knobs.md), given the widest value the budget allows
        (None: not even ``lo``): the user's value; else the knee when the budget allows it ("knee"); else the widest
        that fits ("budget"; "widest" for a knob without a time model whose whole range fits; ``lo`` when nothing
        fits). A knob written into op arguments keeps a user's value within its range. Returns the value."""
        self.widest_fitting = widest
        if self.user is not None:
            self.value, self.why = (min(max(self.user, 1), self.hi) if self.ops else self.user), "user"
        elif widest is None:
            self.value, self.why = self.lo, "budget"
        elif self.knee is not None and self.knee <= widest:
            self.value, self.why = max(self.lo, self.knee), "knee"
        else:
            self.value = widest
            self.why = "widest" if self.knee is None and widest == self.hi else "budget"
        return self.value


def raise_infeasible(table: BudgetTable, binding: BoundTerm, *, detail: str = "") -> None:
    """Raise InfeasibleBudgetError naming the binding term, its formula, value, the budget and the knob."""
    host = binding.kind == "host"
    budget, total = (table.host_budget, table.host_total) if host else (table.budget, table.total)
    others = total - binding.value if binding.counted else total
    message = (
        f"boundpass: the per-rank {'host' if host else 'device'} budget {format_bytes(budget)} ({budget} B) "
        f"cannot be met.\n"
        f"  binding term : {binding.name}" + (f" at {binding.where}" if binding.where else "") + "\n"
        f"  formula      : {binding.formula}\n"
        f"  value here   : {format_bytes(binding.value)} ({binding.value} B)"
        + (f" {detail}" if detail else "") + "\n"
        f"  other terms  : {format_bytes(others)}; total {format_bytes(others + binding.value)}\n"
        f"  to fix       : {binding.knob}\n"
        f"bounds table:\n{table.render(formulas=True)}"
    )
    raise InfeasibleBudgetError(message, term=binding.name, formula=str(binding.formula), value_bytes=binding.value,
                                budget_bytes=budget, knob=binding.knob)


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


def blas_workspace_bytes(device) -> int:
    """Device bytes cuBLAS and cuBLASLt hold as workspaces once a matmul has run on ``device``'s stream (0 off CUDA).

    torch allocates them through its caching allocator on the first matmul of a stream and keeps them (they count in
    ``torch.cuda.max_memory_allocated``), so they are device memory of every step: 64 MiB on an H200 under torch 2.11
    (measured as the one term the Ring-DTP GPU check exceeded its op bound by, 67,077,112 B with 31,752 B of slack).
    The sizes are torch's own (``CUBLAS_WORKSPACE_CONFIG`` / ``CUBLASLT_WORKSPACE_SIZE`` respected); where torch
    shares one workspace between the two libraries this counts it twice, an upper bound."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    total = 0
    for name in ("_cuda_getCublasWorkspaceSize", "_cuda_getCublasLtWorkspaceSize"):
        getter = getattr(torch._C, name, None)
        total += int(getter()) if getter is not None else 32 << 20  # torch's Hopper default where not exposed
    return total
