"""`boundpass.compile`: capture model + loss with torch.compile, rewrite bounded regions, check the budget first.

Pipeline (DESIGN.md): Dynamo graph -> match + rewrite (passes/) -> sympy bounds -> budget check (raise
before any real compute) -> aot_autograd -> eager kernels ("aot_eager") or Inductor ("inductor").
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import sympy
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from boundpass import symbols as sym
from boundpass.bounds import BoundTerm, BudgetTable, largest_fitting, raise_infeasible
from boundpass.errors import BoundpassError, BoundpassInputError
from boundpass.explain import ExplainReport
from boundpass.passes import sco_pass
from boundpass.passes.dispatch_pass import rewrite_dispatch_regions
from boundpass.passes.optimizer_swap import plan_optimizer
from boundpass.passes.vocab_pass import VocabRewriteConfig, rewrite_vocab_regions
from boundpass.runtime.pipelined_llep import bound_values as dispatch_bound_values
from boundpass.runtime.pipelined_llep import pipelined_llep_bound, standard_ep_bound
from boundpass.runtime import ring_dtp
from boundpass.units import parse_bytes

INNER_COMPILERS = ("aot_eager", "inductor")
MIN_VOCAB_BLOCK = 128  # narrower strips only add per-strip overhead; below this, change P or N instead


class BoundedModule(nn.Module):
    """A model (and its loss) compiled by boundpass; call it like `loss = bm(inputs, labels, *loss_args)`."""

    def __init__(self, model: nn.Module, loss_fn, *, budget: int, ring_group, vocab_block: int | None,
                 max_tokens_per_rank: int | None, inner: str, fullgraph: bool, dynamic, state_terms, optimizer_plan,
                 host_budget: int | None, sco="auto", dispatch: bool = True, dispatch_cap: int | None = None,
                 composed_table=None):
        super().__init__()
        self.composed_table = composed_table  # the launch configuration's composed budget (None: not given)
        self.dispatch, self.dispatch_cap = dispatch, dispatch_cap  # PipelinedLLEP rewrite on/off, cap c (None: auto)
        self.sco = sco                          # SCO mode; self.sco_plans: one per compiled graph
        self.sco_plans: list = []
        self.model = model
        self.loss_fn = loss_fn
        self.budget = budget
        self.host_budget = host_budget
        self.state_terms = state_terms          # parameters, gradients, optimizer: fixed before any graph
        self.optimizer_plan = optimizer_plan
        self.optimizer = optimizer_plan.optimizer if optimizer_plan else None  # the one to step
        self.ring_group = ring_group
        self.vocab_block = vocab_block
        self.max_tokens_per_rank = max_tokens_per_rank
        self.inner = inner
        self.reports: list[ExplainReport] = []
        self._compiled = torch.compile(self._step, backend=self._backend, fullgraph=fullgraph, dynamic=dynamic)

    def _step(self, inputs, labels=None, *loss_args, **model_kwargs):
        out = self.model(inputs, **model_kwargs)
        if self.loss_fn is None:
            return out
        return self.loss_fn(out, labels, *loss_args)

    def forward(self, inputs, labels=None, *loss_args, **model_kwargs):
        # suppress_errors=True would make Dynamo swallow a budget error and run eagerly: force errors through.
        with torch._dynamo.config.patch(suppress_errors=False):
            try:
                return self._compiled(inputs, labels, *loss_args, **model_kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as exc:
                inner = getattr(exc, "inner_exception", None)
                if isinstance(inner, BoundpassError):
                    raise inner.with_traceback(None) from None
                raise

    # ------------------------------------------------------------------------------------ backend
    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        report = ExplainReport(budget=self.budget)
        self.reports.append(report)  # kept even when the budget check raises: explain() shows why
        ring_size, ring_rank, group_name = 1, 0, ""
        if self.ring_group is not None:
            ring_size, ring_rank = dist.get_world_size(self.ring_group), dist.get_rank(self.ring_group)
            group_name = ring_dtp.group_name_of(self.ring_group)
        config = VocabRewriteConfig(group_name=group_name, ring_size=ring_size, ring_rank=ring_rank)
        # the pass rewrites every eligible region; the bounds below then fix each op's strip width and branch
        regions = rewrite_vocab_regions(gm, config)
        report.regions.extend(regions)
        dispatch_regions = rewrite_dispatch_regions(gm, self) if self.dispatch else []
        report.regions.extend(dispatch_regions)
        table = report.table = BudgetTable(budget=self.budget, host_budget=self.host_budget)
        table.terms.extend(self.state_terms)
        report.optimizer = self.optimizer_plan
        report.composed = self.composed_table
        # SCO first: its boundary term is fixed by the host budget, the vocab strip then fits what is left
        sco_plan = report.sco = sco_pass.plan_sco(gm, self.sco, table=table, budget=self.budget,
                                                   host_budget=self.host_budget)
        self.sco_plans.append(sco_plan)
        partitioner = sco_pass.partition_fn(sco_plan, self.inner)
        # Dispatch and vocab share what state and SCO leave: the vocab strip may take at most half of that
        # slack while a dispatch term exists (which keeps its minimum c=1 reserved meanwhile), then the
        # dispatch cap c takes the widest that fits the rest.
        dispatch = self._dispatch_bound([r for r in dispatch_regions if r.rewritten], table)
        for region in regions:
            if region.rewritten:
                self._bound_vocab_region(gm, region, table, ring_size,
                                         share=dispatch.vocab_share if dispatch is not None else None)
        if dispatch is not None:
            self._choose_dispatch_cap(dispatch, table)
        gm.recompile()
        report.graph_code = gm.print_readable(print_output=False)

        def record(graph, is_backward: bool) -> None:
            code = graph.print_readable(print_output=False)
            if is_backward:
                report.backward_code, report.backward_graph = code, graph
            else:
                report.forward_code, report.forward_graph = code, graph

        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner_compile(graph, inputs, **kwargs):
                record(graph, kwargs.get("is_backward", False))
                return compile_fx_inner(graph, inputs, **kwargs)
            # Inductor runs its own aot_autograd with its decompositions; our op stays one opaque extern call.
            patches = {} if partitioner is None else {"custom_partitioner_fn": partitioner}
            return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)

        def eager_compiler(is_backward):
            def compile_graph(graph, inputs):
                record(graph, is_backward)
                return sco_pass.eager_callable(graph)  # make_boxed_func, or boxed codegen after SCO
            return compile_graph

        # aot_autograd is required even for eager kernels: torchtitan's MoE mutates a buffer in forward.
        extra = {} if partitioner is None else {"partition_fn": partitioner}
        return aot_autograd(fw_compiler=eager_compiler(False), bw_compiler=eager_compiler(True),
                            **extra)(gm, example_inputs)

    def _dispatch_bound(self, regions, table: BudgetTable):
        """Add the dispatch term at its minimum (c = 1) and the standard schedule it replaces; None: no region.

        Layers run their dispatch one at a time and free it before the next, so one term covers all of them:
        the regions of one graph share T, H, I, E, k and E_p (checked).
        """
        if not regions:
            return None
        first = regions[0]
        shapes = {(str(r.tokens), r.hidden, r.inter, r.experts, r.top_k, r.ep_size, r.dtype, r.compute_dtype)
                  for r in regions}
        if len(shapes) != 1:
            raise BoundpassInputError(f"MoE layers of one graph differ in dispatch shape {sorted(shapes)}; "
                                      "boundpass bounds one dispatch term per graph")
        shape_env = _shape_env(first.op_node)
        tokens_here = _concrete(_as_expr(first.tokens), shape_env)
        tokens = max(self.max_tokens_per_rank or 0, tokens_here)
        values = dispatch_bound_values(first.dtype, N=tokens, H=first.hidden, I=first.inter, E=first.experts,
                                      E_p=first.ep_size, k=first.top_k, s_b=first.local_experts)
        values.pop(sym.c)
        values.pop(sym.R)
        mixed = torch.promote_types(first.dtype, torch.float32) != first.dtype
        fixed = {s: values[s] for s in (sym.E, sym.E_p, sym.k, sym.s_b, sym.b, sym.b_acc, sym.b_idx)}
        formula = pipelined_llep_bound(mixed_precision=mixed, narrow_compute=first.compute_dtype != first.dtype,
                                               count_own_weights=False).subs(fixed)
        where = f"{first.module_path} (+{len(regions) - 1} more MoE layers, one at a time)" if len(regions) > 1 \
            else first.module_path
        term = BoundTerm(_dispatch_term_name(first), formula, sym.evaluate(formula, {**values, sym.c: 1}),
                         where=where, knob="")
        table.terms.append(term)
        worst = {**values, sym.R: first.ep_size * tokens * first.top_k, sym.c: 1}  # every route to this rank
        ref = standard_ep_bound().subs(fixed)
        table.terms.append(BoundTerm("dispatch, standard EP at worst-case routing (replaced)", ref,
                                     sym.evaluate(ref, worst), counted=False, where=where,
                                     knob="boundpass rewrites it"))
        persistent, transient = (table.sum(kind) for kind in ("persistent", "transient"))
        return _DispatchBound(regions, formula, values, tokens, term,
                              vocab_share=max(0, (self.budget - persistent - transient) // 2))

    def _choose_dispatch_cap(self, dispatch: "_DispatchBound", table: BudgetTable) -> None:
        """Set c on every dispatch op: the user's, or the widest whose term fits what the table leaves."""
        term, tokens = dispatch.term, dispatch.tokens
        table.terms.remove(term)
        persistent, transient, step = (table.sum(kind) for kind in ("persistent", "transient", "step"))

        def fits(cap: int) -> bool:
            return persistent + max(transient + dispatch.cost(cap), step) <= self.budget

        if self.dispatch_cap is not None:
            cap = min(self.dispatch_cap, tokens)
        else:
            cap = largest_fitting(1, tokens, fits) or 1
        term.value = dispatch.cost(cap)
        table.terms.append(term)
        term.knob = "boundpass.compile(..., dispatch_cap=c), more EP ranks, or fewer tokens per rank"
        if not table.fits():
            best = largest_fitting(1, tokens, fits)
            if self.dispatch_cap is not None and best is not None:
                term.knob = f"use dispatch_cap <= {best} (now {cap})"
            else:
                term.knob = (f"reduce tokens per rank N (now {tokens}) or raise the budget: even c=1 token per source "
                             f"per chunk does not fit beside the other terms")
            raise_infeasible(table, term, detail=f"at c={cap}, N={tokens}")
        for region in dispatch.regions:
            region.op_node.update_arg(7, cap)
            region.cap = cap

    def _bound_vocab_region(self, gm, region, table: BudgetTable, ring_size: int, share: int | None = None) -> None:
        """Choose the strip width C (and branch) for one region so the budget holds, or raise.

        share: bytes the vocab term may take at most while a dispatch term still waits for its cap (None: no limit;
        the narrowest strip is always allowed, so the budget check, not the share, decides feasibility).
        """
        tokens = _as_expr(region.tokens)
        shape_env = _shape_env(region.op_node)
        tokens_here = _concrete(tokens, shape_env)
        max_tokens = self.max_tokens_per_rank or tokens_here
        if max_tokens < tokens_here:
            raise BoundpassInputError(f"max_tokens_per_rank={max_tokens} but this rank holds {tokens_here} tokens "
                                      f"at the vocab projection ({region.module_path})")
        branch = ring_dtp.choose_branch(max_tokens, region.vocab, ring_size)
        mixed = torch.promote_types(region.dtype, torch.float32) != region.dtype
        values = ring_dtp.bound_values(region.dtype, N=tokens_here, H=region.hidden, V=region.vocab, P=ring_size,
                                       N_max=max_tokens)
        values.pop(sym.C)
        # P and the element sizes are fixed by this launch: fold them in so the formula reads in N, H, V, C.
        fixed = {s: values[s] for s in (sym.P, sym.b, sym.b_acc, sym.b_idx)}
        formula = ring_dtp.ring_dtp_bound(branch, mixed_precision=mixed, count_weight_shard=False).subs(fixed)
        shard_rows = -(-region.vocab // ring_size)
        # the vocab term is a forward/backward transient: it adds to the other transients, and the device
        # peak is persistent + max(transients, optimizer step)
        persistent, transient, step = (table.sum(kind) for kind in ("persistent", "transient", "step"))

        def cost(block: int) -> int:
            return sym.evaluate(formula, {**values, sym.C: block})


        def fits(block: int) -> bool:
            within_share = share is None or cost(block) <= share or block == min(MIN_VOCAB_BLOCK, shard_rows)
            return within_share and persistent + max(transient + cost(block), step) <= self.budget

        name = f"vocab (Ring-DTP, {branch}, P={ring_size})"
        if self.vocab_block is not None:
            block = min(self.vocab_block, shard_rows)
        else:
            block = largest_fitting(min(MIN_VOCAB_BLOCK, shard_rows), shard_rows, fits) \
                or min(MIN_VOCAB_BLOCK, shard_rows)
        term = BoundTerm(name, formula, cost(block), where=region.module_path, knob="")
        table.terms.append(term)
        ref_formula = ring_dtp.reference_bound(mixed_precision=mixed).subs(fixed)
        table.terms.append(BoundTerm("vocab, standard schedule (replaced)", ref_formula,
                                     sym.evaluate(ref_formula, {**values, sym.C: block}), counted=False,
                                     where=region.module_path, knob="boundpass rewrites it"))
        if not table.fits():
            best = largest_fitting(1, shard_rows, fits)
            if self.vocab_block is not None and best is not None:
                term.knob = f"use vocab_block <= {best} (now {block})"
            else:
                term.knob = (f"increase the ring size P (boundpass.compile(..., ring_group=<group of more ranks>)) or "
                             f"reduce tokens per rank N (now {tokens_here}); the narrowest strip C={block} does not fit")
            if persistent + step > self.budget or persistent + transient > self.budget:
                raise_infeasible(table, _binding_state_term(table, self.budget))
            raise_infeasible(table, term, detail=f"at C={block}, N={tokens_here}, N_max={max_tokens}")
        # A dynamic N must not grow past what was checked: guard the graph on the budget inequality.
        # Without a declared max_tokens_per_rank, N_max is this rank's N, and grows with it.
        symbolic = {**values, sym.C: block, sym.N: tokens}
        if self.max_tokens_per_rank is None:
            symbolic[sym.N_max] = tokens
        total_expr = persistent + sympy.Max(transient + formula.subs(symbolic), step)
        if shape_env is not None and total_expr.free_symbols:
            shape_env.evaluate_expr(sympy.Le(total_expr, self.budget))
        term.knob = "boundpass.compile(..., vocab_block=C) or a larger ring (ring_group)"
        region.op_node.update_arg(5, block)
        region.op_node.update_arg(7, branch)
        region.block, region.branch = block, branch


class _DispatchBound:
    """The dispatch term of a graph while its cap c is being chosen."""

    def __init__(self, regions, formula, values, tokens, term, vocab_share):
        self.regions, self.formula, self.values, self.tokens, self.term = regions, formula, values, tokens, term
        self.vocab_share = vocab_share  # the most the vocab term may take meanwhile (half the slack)

    def cost(self, cap: int) -> int:
        return sym.evaluate(self.formula, {**self.values, sym.c: cap})


def _dispatch_term_name(region) -> str:
    return f"dispatch (PipelinedLLEP, E_p={region.ep_size}, k={region.top_k})"


def _binding_state_term(table: BudgetTable, budget: int) -> BoundTerm:
    """The state term to name when state alone breaks the budget: one whose knob removes it, else the largest."""
    state = [t for t in table.terms if t.counted and t.kind in ("persistent", "step")]
    for term in state:
        if term.name.startswith("optimizer state") and table.total - term.value <= budget:
            return term
    return max(state, key=lambda t: t.value)


def _state_terms(model: nn.Module, optimizer, *, budget: int, host_budget, offload, bucket, slots):
    """Parameters, gradients and the optimizer's terms (deciding its offload), checked before any graph exists."""
    # this rank's bytes: a DTensor parameter (FSDP2 / EP shard) holds only its local shard here
    params = [(getattr(p, "_local_tensor", p), p.requires_grad) for p in model.parameters()]
    param_bytes = sum(t.numel() * t.element_size() for t, _ in params)
    grad_bytes = sum(t.numel() * t.element_size() for t, trained in params if trained)
    terms = [BoundTerm("parameters", sym.Theta * sym.b, param_bytes, kind="persistent",
                       knob="shard parameters over more ranks (FSDP2 / ZeRO-3) or raise the budget"),
             BoundTerm("gradients", sym.Theta * sym.b, grad_bytes, kind="persistent",
                       knob="shard gradients over more ranks (FSDP2 / ZeRO-3) or raise the budget")]
    plan = None
    if optimizer is not None:
        plan = plan_optimizer(optimizer, budget=budget, persistent=param_bytes + grad_bytes, offload=offload,
                              bucket=bucket, slots=slots, host_budget=host_budget)
        terms += plan.terms
    table = BudgetTable(budget=budget, terms=terms, host_budget=host_budget)
    if not table.host_fits():
        raise_infeasible(table, max((t for t in terms if t.kind == "host"), key=lambda t: t.value))
    if table.total > budget:
        raise_infeasible(table, _binding_state_term(table, budget))
    return terms, plan


def _as_expr(value):
    return value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(int(value))


def _shape_env(node):
    val = node.meta.get("example_value") if node is not None else None
    if isinstance(val, (tuple, list)):
        val = val[0]
    mode = getattr(val, "fake_mode", None)
    return getattr(mode, "shape_env", None)


def _concrete(expr, shape_env) -> int:
    if expr.free_symbols and shape_env is not None:
        expr = expr.xreplace(shape_env.backed_var_to_val)
    return int(expr)


def compile(model: nn.Module, *, budget, loss_fn=None, ring_group=None, vocab_block: int | None = None,
            max_tokens_per_rank: int | None = None, optimizer=None, offload_optimizer="auto",
            optimizer_bucket: int | None = None, optimizer_slots: int | None = None, host_budget=None,
            inner: str = "aot_eager", fullgraph: bool = True, dynamic=False, sco="auto", dispatch: bool = True,
            dispatch_cap: int | None = None, launch=None, model_shape=None) -> BoundedModule:
    """Compile `model` (+ `loss_fn(model_out, labels, *loss_args)`) so every bounded region fits `budget` bytes.

    budget / host_budget: per-rank device / host bytes ("60GiB", 2**30, ...). ring_group: the process group
    Ring-DTP rotates vocab shards/batches over (None: one device, P = 1). vocab_block: strip width C (None: the
    widest that fits). max_tokens_per_rank: the largest N any ring rank will hold (None: this rank's N).
    optimizer: a torch AdamW or torchtitan OptimizersContainer; offload_optimizer ("auto", True, False) swaps it
    for OffloadStreamAdamW (state migrated; step `compiled.optimizer` and build LR schedulers on it) with
    buckets of optimizer_bucket elements (None: the largest that fits) and optimizer_slots staging slots (None: 2,
    or 1 when two useful slots do not fit).
    sco ("auto", True, False): selective checkpoint offload of activation-checkpoint boundaries to host memory
    (docs/sco.md). The host pool is what host_budget leaves after the optimizer's host terms; True offloads
    the longest forward-order prefix of boundaries that fits it, "auto" the shortest prefix the device budget
    needs (none when it fits), False none. Needs checkpointed blocks (e.g. torchtitan FullAC / SelectiveAC).
    dispatch: rewrite torchtitan's routed-experts regions (token dispatch -> grouped experts -> combine) to
    PipelinedLLEP, whose peak is set by launch configuration, not by the router (docs/pipelined_llep.md);
    dispatch_cap: its per-source token cap per chunk c (None: the widest that fits the budget).
    launch (boundpass.composed.Launch) + model_shape (boundpass.composed.ModelShape, e.g.
    boundpass.plan.model_shape("deepseek_v3", "671B")): also check the composed per-rank budget of that launch
    configuration (every term of a step, docs/plan.md) here, before any graph; explain() shows its table.
    Raises InfeasibleBudgetError here when the state alone cannot fit, else on the first call before any real
    compute.
    """
    budget_bytes = parse_bytes(budget, what="budget")
    host_bytes = None if host_budget is None else parse_bytes(host_budget, what="host_budget")
    if not isinstance(model, nn.Module):
        raise BoundpassInputError(f"boundpass.compile expects an nn.Module, got {type(model).__name__}")
    if inner not in INNER_COMPILERS:
        raise BoundpassInputError(f"inner must be one of {INNER_COMPILERS}, got {inner!r}")
    for name, value in (("vocab_block", vocab_block), ("optimizer_bucket", optimizer_bucket),
                        ("dispatch_cap", dispatch_cap)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BoundpassInputError(f"{name} must be a positive int, got {value!r}")
    if optimizer_slots is not None and (isinstance(optimizer_slots, bool) or not isinstance(optimizer_slots, int)
                                        or optimizer_slots < 1):
        raise BoundpassInputError(f"optimizer_slots must be a positive int, got {optimizer_slots!r}")
    sco_pass.check_mode(sco)
    if ring_group is not None and not dist.is_initialized():
        raise BoundpassInputError("ring_group given but torch.distributed is not initialised")
    composed_table = None
    if launch is not None or model_shape is not None:
        if launch is None or model_shape is None:
            raise BoundpassInputError("the composed budget needs both launch= (boundpass.composed.Launch) and "
                                      "model_shape= (e.g. boundpass.plan.model_shape(model, flavor))")
        from boundpass import composed
        composed_table = composed.check(model_shape, launch, budget=budget_bytes, host_budget=host_bytes)
    state_terms, plan = _state_terms(model, optimizer, budget=budget_bytes, host_budget=host_bytes,
                                     offload=offload_optimizer, bucket=optimizer_bucket, slots=optimizer_slots)
    return BoundedModule(model, loss_fn, budget=budget_bytes, ring_group=ring_group, vocab_block=vocab_block,
                         max_tokens_per_rank=max_tokens_per_rank, inner=inner, fullgraph=fullgraph,
                         dynamic=dynamic, state_terms=state_terms, optimizer_plan=plan, host_budget=host_bytes,
                         sco=sco, dispatch=bool(dispatch), dispatch_cap=dispatch_cap, composed_table=composed_table)


def explain(compiled: BoundedModule) -> ExplainReport:
    """The report of the most recent compilation: regions matched/skipped, rewritten graphs, bounds table."""
    if not isinstance(compiled, BoundedModule):
        raise BoundpassInputError(f"boundpass.explain expects what boundpass.compile returned, got {type(compiled).__name__}")
    if not compiled.reports:
        raise BoundpassInputError("nothing compiled yet: boundpass compiles on the first call; call the module once "
                                  "(e.g. one training step), then explain it")
    return compiled.reports[-1]
