"""The one planner: picks the strip width C, the chunk cap c and the SCO offload count against the step's peak.

The peak comes from one place (``boundpass.measure.step_peak``): the program points of the partitioned forward and
backward graphs, with each custom op's workspace in its knob's symbol. The device peak of the step is

    persistent state + max(graph peak (+ held gradients when accumulating), gradients + optimizer step)

with persistent state = parameters, buffers and optimizer state on this rank. The planner evaluates that
expression, never a sum written elsewhere: SCO offloads the fewest checkpoint boundaries that make the step fit
(sco_enable="auto"; every boundary the host pool holds for sco_enable=True), then each knob takes the widest value
that still fits, but never past the knob's knee (the smallest value within a few percent of its best modelled time,
``boundpass/bound/cost_model.py``; docs/knobs.md), the user's value when given. The knobs of different ops sit at
different program points, so each is chosen with the others at their narrowest. The planner writes the chosen values into the graphs' op nodes by
argument name and raises InfeasibleBudgetError, before any real compute, when even the narrowest setting of
every knob does not fit.

The composed (analytic) budget of ``boundpass.bound.composed`` is planned here too, by the same rules: the longest
tokens per rank it fits (``largest_tokens``: plan --solve), and at a launch PipelinedLLEP's chunk cap c
(``composed_dispatch_cap``) and OffloadStreamAdamW's bucket beta (``composed_bucket``), both through ``planned_launch``
(plan's table and the torchtitan recipe's MoP layout), each with ``largest_fitting`` and ``Knob.settle``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import sympy
import torch

from boundpass.bound.bounds import BoundTerm, BudgetTable, Knob, device_peak, largest_fitting  # noqa: F401
from boundpass.passes.graph_edit import set_op_arg
from boundpass.passes.pipeline import SCO, diagnose
from boundpass.core.errors import InfeasibleBudgetError
from boundpass.measure.step_peak import GraphPeak, ProgramPoint, bytes_at, render_point
from boundpass.core.units import format_bytes


@dataclass
class StepCertificate:
    """What the planner certified for one graph: the values, the peak, where it is, and the table."""
    values: dict
    peak: GraphPeak
    point: ProgramPoint | None
    graph_bytes: int             # the graph's peak live bytes (persistent state excluded)
    table: BudgetTable
    accumulation_total: int      # device peak when gradients from an earlier backward are still held
    sco_count: int = 0
    planner: "StepPlanner | None" = None
    sco_trials: dict = field(default_factory=dict)  # L_off tried -> device peak at the narrowest knobs (bytes)
    analysis_s: float = 0.0      # seconds spent walking the graphs
    planning_s: float = 0.0      # seconds in the planning partitioner (partitions, rewrites, walks, knobs)
    source: str = "partitioned FX graphs"   # what the peak was read from (Inductor: its final schedule)
    before_fusion: int | None = None        # Inductor: the graph peak the FX walk gave before fusion (bytes)
    inference: bool = False      # a call without a backward (no_grad / eval): one graph, no gradients made

    def total_at(self, **knobs) -> int:
        """The certified device peak (bytes) had the knobs been ``knobs`` (e.g. dispatch_cap=8)."""
        values = dict(self.values)
        for knob in self.planner.knobs:
            if knob.name in knobs:
                values[knob.symbol] = knobs[knob.name]
        return self.planner.total(self.peak.evaluate(values)[0])


class StepPlanner:
    """Chooses knobs for one compiled graph against its GraphPeak and the step's state terms."""

    def __init__(self, *, budget: int, host_budget: int | None, state_terms: list[BoundTerm], knobs: list[Knob],
                 symbol_values: dict, carry: int = 0):
        self.budget, self.host_budget = budget, host_budget
        self.state_terms = state_terms
        self.knobs = knobs
        self.symbol_values = symbol_values     # backed sizes of the graph's symbolic dims
        self.carry = carry                     # saved bytes of earlier graphs of the same step (graph breaks)
        # the rows that make up ``carry`` when its owner names them (per-block compile: the other blocks' saved
        # tensors, FSDP2's gathered units, ...); None: one row "saved tensors of earlier graphs"
        self.carry_terms: list[BoundTerm] | None = None
        self.caller = 0                        # batch + returned outputs the caller holds through optimizer.step
        self.held_grads = 0                    # gradients an earlier backward left (accumulation at compile time)
        # gradient storage the backward leaves beyond the parameters' own bytes (the "gradients" state term): a
        # gradient that is a view of a larger buffer keeps all of it until zero_grad (torchtitan's gpt_oss expert
        # biases: an [E, n] view of an [E + 1, n] buffer)
        self.grad_excess = 0

    # -------------------------------------------------------------------------------------------- totals
    def _sum(self, kind: str) -> int:
        return sum(t.value for t in self.state_terms if t.counted and t.kind == kind)

    def optimizer_phase(self) -> int:
        """Device bytes above the persistent state while the optimizer steps: gradients, its workspace, the batch
        the caller holds through the step, gradient storage beyond the parameters' bytes."""
        return self._sum("step") + self.caller + self.grad_excess

    def total(self, graph_bytes):
        """Device peak of the step (bytes) when the graph's own peak is ``graph_bytes`` (an int, or a sympy
        expression in the graph's sizes: then the peak as an expression, for the dynamic-shape guard)."""
        return device_peak(self._sum("persistent"), self.carry + self.held_grads + graph_bytes,
                           self.optimizer_phase())

    def values(self, **knob_values) -> dict:
        out = dict(self.symbol_values)
        for knob in self.knobs:
            out[knob.symbol] = knob_values.get(knob.name, knob.lo)
        return out

    def fits(self, peak: GraphPeak, values: dict) -> bool:
        return self.total(peak.evaluate(values)[0]) <= self.budget

    # ----------------------------------------------------------------------------------------- choosing
    def choose(self, peak: GraphPeak) -> dict:
        """Knob values: the user's, else min(the widest that fits with the other knobs at their narrowest, knee).

        A knob never grows past its knee because the budget allows it: wider strips / chunks than the knee cost
        memory and buy (by the time model) less than KNEE_TOLERANCE of step time. ``why`` says which bound it:
        "user", "knee" (the budget allows more), "budget" (the budget allows less than the knee), or "widest"
        for a knob without a time model whose range fits whole.
        """
        chosen = {}
        for knob in self.knobs:
            if knob.user is not None:
                chosen[knob.name], knob.why = min(max(knob.user, 1), knob.hi), "user"
        for knob in sorted(self.knobs, key=lambda k: k.user is not None):
            others = {k: v for k, v in chosen.items() if k != knob.name}

            def fits(v: int, knob=knob, others=others) -> bool:
                return self.fits(peak, self.values(**{**others, knob.name: v}))

            chosen[knob.name] = knob.settle(largest_fitting(knob.lo, knob.hi, fits))
        self.agree()
        return self.values(**{k.name: k.value for k in self.knobs})

    def choose_sco_count(self, plan, count: int, peak: GraphPeak, attempt) -> tuple[int, dict, bool]:
        """SCO's offload count L_off: ``count`` (sco_enable=True: every boundary the host pool holds; False: none),
        or under sco_enable="auto", when the narrowest schedule does not fit with none offloaded, the fewest
        boundaries that make it fit (else the count whose peak is least). A linear scan, because the peak is not
        monotone in L_off: offloading the last boundary makes backward reload it at once (with a prefetch).
        ``attempt(n)`` rewrites the graphs for n boundaries and returns their peak. Returns (count, device peak at
        the narrowest knobs per count tried, whether the scan ran: the graphs then hold the last count tried)."""
        trials = {count: self.total(peak.evaluate(self.values())[0])}
        if plan.mode != "auto" or not plan.most or self.fits(peak, self.values()):
            return count, trials, False
        chosen = None
        for trial_count in range(1, plan.most + 1):
            trials[trial_count] = self.total(attempt(trial_count).evaluate(self.values())[0])
            if trials[trial_count] <= self.budget:
                chosen = trial_count
                break
        return (chosen if chosen is not None else min(trials, key=trials.get)), trials, True

    def fit_offload_bucket(self, optimizer_plan) -> None:
        """OffloadStreamAdamW's bucket beta once the graph shows what the optimizer phase leaves (the batch the caller
        holds through the step included): min(the widest that fits now, the knee), never wider than compile() chose
        (``optimizer_swap.narrow_bucket``, docs/knobs.md)."""
        from boundpass.core import symbols as sym
        from boundpass.passes.optimizer_swap import narrow_bucket
        from boundpass.runtime import offload_adamw as oa
        if optimizer_plan is None or not optimizer_plan.offloaded:
            return
        inner = list(getattr(optimizer_plan.optimizer, "optimizers", [optimizer_plan.optimizer]))
        staging = [t for t in self.state_terms if t.name.startswith("optimizer staging")]
        if len(inner) != 1 or len(staging) != 1 or not isinstance(inner[0], oa.OffloadStreamAdamW):
            return
        opt, term = inner[0], staging[0]
        room = self.budget - self._sum("persistent") - (self.optimizer_phase() - term.value)
        values = oa.bound_values(b=4, Theta=opt.numel, beta=1, S=opt.staging_slots)
        widest = max(1, room // sym.evaluate(term.formula, values))
        knob = next((k for k in getattr(optimizer_plan, "knobs", []) if k.name == "optimizer_bucket"), None)
        beta = narrow_bucket(knob, widest) if knob is not None else min(opt.bucket_params, widest)
        if beta != opt.bucket_params:
            opt.bucket_params = beta
            term.value = sym.evaluate(term.formula, {**values, sym.beta: beta})
            term.name = f"optimizer staging (OffloadStreamAdamW, beta={beta}, S={opt.staging_slots})"

    def agree(self) -> None:
        """Every rank of a knob's group runs the same schedule: the narrowest value any rank's budget allows (one
        all-reduce per knob that names a group)."""
        from boundpass.runtime.agreement import global_max_tokens
        for knob in self.knobs:
            if not knob.agree_over:
                continue
            agreed = -global_max_tokens(-knob.value, knob.agree_over)  # max of the negatives: the group's minimum
            if agreed != knob.value:
                knob.value, knob.why = agreed, "narrowest over the group"

    def write_knobs(self, *graphs: torch.fx.GraphModule) -> None:
        """The chosen values written into every graph's op nodes (and the regions explain shows) by argument name."""
        for knob in self.knobs:
            for graph in graphs:
                for node in graph.graph.nodes:
                    if node.op == "call_function" and node.target in knob.ops:
                        set_op_arg(node, knob.arg, knob.value)
            for region in knob.regions:
                set_op_arg(region.op_node, knob.arg, knob.value)
                setattr(region, knob.attr, knob.value)
        for graph in graphs:
            graph.recompile()

    def guard(self, peak: GraphPeak, shape_env, *, inputs: set, backed: dict) -> None:
        """A dynamic size the caller controls (``inputs``) must not grow past what was checked: the step's peak as
        an expression in those sizes, guarded on the budget in Dynamo's shape environment (a larger call
        recompiles and is checked again); every other size at its value."""
        total = sympy.sympify(self.total(peak.peak_expr().xreplace({k.symbol: k.value for k in self.knobs})))
        total = total.xreplace({s: v for s, v in backed.items() if s not in inputs})
        if total.free_symbols:
            shape_env.evaluate_expr(sympy.Le(total, self.budget))

    def certify(self, peak: GraphPeak, values: dict, *, extra_terms: list[BoundTerm], sco_count: int = 0
                ) -> StepCertificate:
        """The table of the chosen plan; raises InfeasibleBudgetError (with the peak's program point) if it breaks."""
        graph_bytes, point = peak.evaluate(values)
        table = BudgetTable(budget=self.budget, host_budget=self.host_budget)
        table.terms += self.state_terms + extra_terms
        where = ""
        if point is not None:
            where = f"{point.phase} {point.node}" + (f" @ {point.module_path}" if point.module_path else "")
        formula = peak.peak_expr().xreplace({k: v for k, v in values.items() if isinstance(k, sympy.Symbol)
                                             and k.name in {kn.symbol.name for kn in self.knobs}})
        graph_term = BoundTerm(f"activations + op workspace (graph peak at {where})", formula, graph_bytes,
                               kind="transient", knob="")
        table.terms.append(graph_term)
        host = bytes_at(peak.host_bytes, values)
        if host:
            table.terms.append(BoundTerm("attention k / v and the backward's q / dO on host (attention blocks)",
                                         sympy.sympify(peak.host_bytes), host, kind="host",
                                         knob="a larger host budget, or attention.offload=False (k, v on the device)"))
        if self.caller:
            table.terms.append(BoundTerm("batch and outputs the caller holds through the optimizer step",
                                         sympy.Integer(self.caller), self.caller, kind="step", knob=""))
        if self.grad_excess:
            table.terms.append(BoundTerm("gradient storage beyond the parameters' bytes (views of larger buffers)",
                                         sympy.Integer(self.grad_excess), self.grad_excess, kind="step", knob=""))
        if self.held_grads:
            table.terms.append(BoundTerm("gradients held from the previous backward (accumulation)",
                                         sympy.Integer(self.held_grads), self.held_grads, kind="transient", knob=""))
        if self.carry_terms is not None:
            table.terms += [t for t in self.carry_terms if t.value]
        elif self.carry:
            table.terms.append(BoundTerm("saved tensors of earlier graphs of this step (graph breaks)",
                                         sympy.Integer(self.carry), self.carry, kind="transient", knob=""))
        grads = sum(t.value for t in self.state_terms if t.name == "gradients") + self.grad_excess
        cert = StepCertificate(values, peak, point, graph_bytes, table,
                               accumulation_total=self.total(graph_bytes + (0 if self.held_grads else grads)),
                               sco_count=sco_count,
                               planner=self)
        return cert


def largest_tokens(shape, launch, *, budget: int, host_budget: int | None = None, multiple: int = 1,
                   limit: int = 1 << 34) -> int:
    """Largest tokens per rank N (a multiple of ``multiple``) whose composed budget fits device and host; 0 if none.

    The composed device peak is monotone in N (every term is a sum of N-linear pieces, maxima of such, and ceilings;
    the SCO host subset L_off shrinks as N grows, which moves bytes back to the device), so the range is found by
    doubling and the answer by ``largest_fitting`` on the fast evaluation, then checked exactly at N and N + multiple
    (float rounding at the edge). The knobs the planner narrows until a size fits (``narrowest_knobs``) are at their
    narrowest: a size fits exactly when it fits there."""
    from boundpass.bound import composed
    launch = narrowest_knobs(launch)

    def fits(units: int, fast: bool = True) -> bool:
        trial = dataclasses.replace(launch, tokens_per_rank=units * multiple)
        return composed.compose(shape, trial, budget=budget, host_budget=host_budget, fast=fast).fits()

    if not fits(1, fast=False):
        return 0
    hi = 2
    while fits(hi):
        if 2 * hi * multiple > limit:
            return hi * multiple
        hi *= 2
    units = largest_fitting(hi // 2, hi - 1, fits)
    while units > 0 and not fits(units, fast=False):
        units -= 1
    while fits(units + 1, fast=False):
        units += 1
    return units * multiple


def _plans_dispatch_cap(launch) -> bool:
    return "pipelined_llep" in launch.operators and launch.dispatch_cap is None


def narrowest_knobs(launch):
    """``launch`` with the knobs the planner chooses for a composed budget at their narrowest: OffloadStreamAdamW's
    bucket (beta = 1) when the optimizer is offloaded and no bucket is given, PipelinedLLEP's chunk cap (c = 1) when
    the op is on and no cap is given. Each is narrowed until the step fits (``planned_launch``) and every term only
    grows with it, so a size fits exactly when it fits here."""
    changes = {}
    if "offload_adamw" in launch.operators and launch.optimizer_bucket is None:
        changes["optimizer_bucket"] = 1
    if _plans_dispatch_cap(launch):
        changes["dispatch_cap"] = 1
    return dataclasses.replace(launch, **changes) if changes else launch


def planned_launch(shape, launch, *, budget: int, host_budget: int | None, device: str = "cpu"):
    """``launch`` with the knobs the planner chooses for a composed budget, where not given: PipelinedLLEP's chunk
    cap c (``composed_dispatch_cap``, the knee of ``device``'s dispatch time model when the budget allows it), then
    OffloadStreamAdamW's bucket (when the optimizer is offloaded) at ``composed_bucket``'s value, up to the default
    bucket. The recipe's MoP layout and ``plan`` both take their knobs from here."""
    if _plans_dispatch_cap(launch) and shape.moe_layers:
        launch = dataclasses.replace(launch, dispatch_cap=composed_dispatch_cap(
            shape, launch, budget=budget, host_budget=host_budget, device=device))
    if "offload_adamw" not in launch.operators or launch.optimizer_bucket is not None:
        return launch
    beta = composed_bucket(shape, lambda b: dataclasses.replace(launch, optimizer_bucket=b), budget=budget,
                           host_budget=host_budget, hi=launch.resolved("optimizer_bucket"))
    return dataclasses.replace(launch, optimizer_bucket=beta)


def composed_dispatch_cap(shape, launch, *, budget: int, host_budget: int | None, device: str = "cpu") -> int:
    """PipelinedLLEP's chunk cap c for a composed launch, by the knob rule (``Knob.settle``): the widest c in [1, N]
    whose budget fits with the optimizer's bucket at its narrowest, but never past the knee of the dispatch time
    model (``cost_model.pipelined_llep_knee`` with ``device``'s constants; docs/knobs.md); 1 when none fits, so that
    the check that follows names what binds at the narrowest chunk. Every rank of a MoP launch holds the same N and
    so computes the same c (the op's agreement checks it at run time)."""
    from boundpass.bound import composed, cost_model
    from boundpass.core import symbols as sym
    N = launch.tokens_per_rank
    knee = cost_model.pipelined_llep_knee(lo=1, hi=N, N=N, H=shape.hidden, I=max(shape.expert_hidden, 1),
                                          E=max(shape.experts, 1), E_p=launch.ep, k=max(shape.top_k, 1), b=launch.b,
                                          costs=cost_model.costs_for(device))
    knob = Knob("dispatch_cap", sym.c, lo=1, hi=N, arg="cap", ops=(), knee=knee)
    narrow = narrowest_knobs(launch)
    return knob.settle(largest_fitting(1, N, lambda c: composed.compose(
        shape, dataclasses.replace(narrow, dispatch_cap=c), budget=budget, host_budget=host_budget,
        fast=True).fits()))


def composed_bucket(shape, launch_at, *, budget: int, host_budget: int | None, hi: int) -> int:
    """OffloadStreamAdamW's bucket beta for a composed launch (``launch_at(beta)``): the widest in [1, hi] whose
    budget fits, settled by the knob rule (``Knob.settle``); 1 when none fits, so that the check that follows names
    what binds at the narrowest bucket."""
    from boundpass.bound import composed
    from boundpass.core import symbols as sym
    knob = Knob("optimizer_bucket", sym.beta, lo=1, hi=hi, arg="bucket_params", ops=())
    return knob.settle(largest_fitting(1, hi, lambda beta: composed.compose(
        shape, launch_at(beta), budget=budget, host_budget=host_budget, fast=True).fits()))


def sco_knob(plan, cert: StepCertificate, budget: int) -> Knob | None:
    """The SCO offload count as a knob, for explain: value, why and what the budget alone needs.

    The count's "knee" is the fewest boundaries (``cost_model.sco_knee``: offloading adds transfer time that
    recompute does not hide, and never saves any), so sco_enable="auto" offloads more only when the budget requires it:
    why = "knee" when nothing is offloaded, "budget" when the budget needed ``value`` (the fewest of the counts
    tried that fit), "user" for sco_enable=True (every boundary the host pool holds) and False (none).
    ``widest_fitting`` here is the fewest offloaded boundaries that fit among the counts the planner tried
    (None: none fit, or only the user's count was tried).
    """
    if plan is None or not getattr(plan, "eligible", None):
        return None
    from boundpass.bound import cost_model
    from boundpass.core import symbols as sym
    knob = Knob("sco", sym.L_off, lo=0, hi=plan.most, arg="", ops=(),
                user=None if plan.mode == "auto" else plan.offloaded, value=plan.offloaded)
    knob.knee = cost_model.sco_knee(plan.most, boundary_bytes=max((r.boundary_bytes for r in plan.eligible),
                                                                  default=0))
    trials = cert.sco_trials or {}
    fitting = [n for n, total in sorted(trials.items()) if total <= budget]
    contiguous = sorted(trials) == list(range(min(trials), max(trials) + 1)) if trials else False
    knob.widest_fitting = fitting[0] if fitting and (contiguous and min(trials) == 0 or fitting[0] == 0) else None
    if plan.mode != "auto":
        knob.why = "user"
    else:
        knob.why = "knee" if plan.offloaded <= knob.knee else "budget"
    return knob


def infeasible(cert: StepCertificate, *, knob: str, binding: BoundTerm | None = None, detail: str = "",
               name: str = "") -> None:
    """Raise InfeasibleBudgetError naming the peak's program point, its largest tensors, the total and the knob."""
    table = cert.table
    budget = table.budget
    lines = [f"boundpass: the per-rank device budget {format_bytes(budget)} ({budget} B) cannot be met: "
             f"the step peaks at {format_bytes(table.total)} ({table.total} B)."]
    term = binding
    if term is None:
        term = next(t for t in table.terms if t.name.startswith("activations + op workspace"))
        if cert.point is not None:
            lines += [f"  {ln}" for ln in render_point(cert.peak, cert.point, cert.values)]
    else:
        lines.append(f"  binding term : {term.name}: {term.formula} = {format_bytes(term.value)}")
    if detail:
        lines.append(f"  {detail}")
    lines += [f"  to fix       : {knob}", "bounds table:", table.render(formulas=True)]
    term.knob = knob
    raise InfeasibleBudgetError("\n".join(lines), term=name or term.name, formula=str(term.formula),
                                value_bytes=term.value, budget_bytes=budget, knob=knob)


def raise_step_infeasible(cert: StepCertificate, knobs: list[Knob], plan, *, optimizer_plan=None) -> None:
    """Name the knob that would help most at the peak's program point (never one that cannot help)."""
    table, point = cert.table, cert.point
    budget = table.budget
    persistent, step = table.sum("persistent"), table.sum("step")
    if persistent + step > budget or persistent > budget:
        binding = binding_state_term(table, budget)
        infeasible(cert, knob=binding.knob, binding=binding,
                   detail="parameters, gradients and the optimizer alone exceed the budget")
    target = point.target if point is not None else ""
    where = f" at {point.phase} {point.node}" + (f" @ {point.module_path}" if point.module_path else "") \
        if point is not None else ""
    for knob in knobs:
        if not any(target == str(op) for op in knob.ops):
            continue
        if knob.user is not None and knob.widest_fitting is not None:
            infeasible(cert, knob=f"use {knob.name} <= {knob.widest_fitting} (now {knob.user})",
                       name=f"{knob.name}={knob.user}{where}")
        diagnosis = diagnose(knob, where)
        if diagnosis is not None:
            infeasible(cert, knob=diagnosis.fix, detail=diagnosis.detail, name=diagnosis.name)
    saved = sum(n for s, n in cert.peak.live_at(point, cert.values, top=10**6) if s.kind == "saved") if point else 0
    sco_fix = SCO.diagnose(plan) if saved else None  # more offload helps only while boundaries stay on the device
    if sco_fix is not None:
        infeasible(cert, knob=sco_fix)
    opt = optimizer_plan
    if opt is not None and not opt.offloaded and any(t.name.startswith("optimizer state") for t in table.terms):
        state = sum(t.value for t in table.terms if t.name.startswith("optimizer state") and t.counted)
        if table.total - state <= budget:
            infeasible(cert, knob="boundpass.compile(..., optimizer_offload=True) moves the optimizer state to the "
                                  "host")
    hint = "" if plan.regions or saved == 0 else " or checkpoint activations (e.g. torchtitan FullAC) and let SCO offload"
    infeasible(cert, knob=f"reduce tokens per rank (micro-batch x sequence length){hint}, or raise the budget")


def binding_state_term(table: BudgetTable, budget: int) -> BoundTerm:
    """The state term to name when state alone breaks the budget: one whose knob removes it, else the largest."""
    state = [t for t in table.terms if t.counted and t.kind in ("persistent", "step")]
    for term in state:
        if term.name.startswith("optimizer state") and table.total - term.value <= budget:
            return term
    return max(state, key=lambda t: t.value)
