"""`boundpass.compile`: capture model + loss with torch.compile, rewrite bounded regions, check the budget first.

Pipeline (docs/design.md §3): Dynamo graph -> find + match + replace (passes/) -> aot_autograd partition -> the step's
peak from the forward and backward graphs (step_peak.py) -> the planner chooses the knobs against it and checks
the budget (planner.py; raises before any real compute) -> eager kernels ("aot_eager") or Inductor ("inductor").
"""
from __future__ import annotations

import hashlib
import time
import types
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import sympy

from boundpass.measure import inductor_peak
from boundpass.backend.aot_workarounds import saved_tensors_before_opaque, static_placeholders
from boundpass.core import symbols as sym
from boundpass.bound.bounds import BoundTerm, BudgetTable, blas_workspace_bytes, raise_infeasible
from boundpass.core.config import Config, config_from
from boundpass.core.errors import BoundpassError, BoundpassInputError, NotCertifiedError
from boundpass.planning.explain import ExplainReport
from boundpass.backend.lowering import lower
from boundpass.passes.optimizer_swap import plan_optimizer
from boundpass.passes.pipeline import SCO, PassContext, run_passes
from boundpass.planning.planner import Knob, StepPlanner, binding_state_term, infeasible, raise_step_infeasible
from boundpass.runtime.agreement import agree, fail_together
from boundpass.runtime.groups import group_name_of
from boundpass.measure.step_peak import analyze_graphs, int_or_hint, module_path
from boundpass.core.units import format_bytes



class BoundedModule(nn.Module):
    """A model (and its loss) compiled by boundpass.

    Without `loss_fn` it is called exactly like the model: `bm(*args, **kwargs)` is `model(*args, **kwargs)`,
    every positional and keyword argument passed through and the model's own outputs returned (a loss computed
    in the model's forward is then inside the captured graph). With `loss_fn` (torchtitan's loss outside the
    model): `bm(inputs, labels, *loss_args, **model_kwargs)` is `loss_fn(model(inputs, **model_kwargs), labels,
    *loss_args)`.
    """

    def __init__(self, model: nn.Module, loss_fn, config: Config, *, state_terms, optimizer_plan, ring_group=None,
                 fullgraph: bool = True, dynamic=False, composed_table=None):
        super().__init__()
        # every knob (boundpass/core/config.py): read from here, never copied. Not `.config`: that name is the model's
        # (an HF model's config, which HF's Trainer reads through this module; see __getattr__)
        self.boundpass_config = config
        self.composed_table = composed_table  # the launch configuration's composed budget (None: not given)
        self.sco_plans: list = []               # SCO's plan, one per compiled graph
        self.model = model
        # also an instance attribute: `self.model` then never reaches __getattr__ below, which Dynamo would trace
        # into (its node paths would read __dict__._modules.model instead of model)
        self.__dict__["model"] = model
        self.loss_fn = loss_fn
        if isinstance(loss_fn, nn.Module):
            self.__dict__["loss_fn"] = loss_fn
        self.budget = config.budget_bytes       # bytes (config.budget may be "60GiB")
        self.host_budget = config.host_budget_bytes
        self.state_terms = state_terms          # parameters, gradients, optimizer: fixed before any graph
        self.optimizer_plan = optimizer_plan
        self.optimizer = optimizer_plan.optimizer if optimizer_plan else None  # the one to step
        # β fixed for this module (the user's, or one a trunk's owner fitted): None lets the planner narrow it (StepPlanner.fit_offload_bucket)
        self.optimizer_bucket = config.optimizer.bucket
        self.ring_group = ring_group
        self.fullgraph = fullgraph
        self.reports: list[ExplainReport] = []
        self.certificates: list = []            # planner.StepCertificate per compiled graph
        self.ring_n_max = 0                     # the ring's largest N at the last compile (Ring-DTP's N_max)
        self.saved_of_earlier_graphs: list[int] = []  # graph breaks: what each graph's forward leaves for backward
        self.dynamic = dynamic
        # Ranks compile together (see forward): one compiled step per combination of every rank's input signature
        self.ep_groups: list[str] = []          # EP groups of the rewritten dispatch regions (known after a compile)
        self._by_key: dict = {}                 # every rank's signatures -> compiled step (its own code object)
        self._first_signature = None            # this rank's signature at a compile before any group was known
        self._group_compiles = 0                # compiles every rank of the groups made together after the first
        self.not_certified: NotCertifiedError | None = None  # set when a step ran code no certificate saw
        self.last_report: ExplainReport | None = None  # the report of the graph that ran last (explain shows it)
        self._compiled = self._new_compiled()

    def __getattr__(self, name: str):
        """Attributes the compiled module does not have are the model's, as for torch.compile's OptimizedModule
        (an HF model's config, generation_config, main_input_name, ... for code written against the model)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self._modules.get("model")
            if model is None or name.startswith("_"):  # torch's own probes (_orig_mod, _fsdp_*, ...) stay ours
                raise
            return getattr(model, name)

    @property
    def inner(self) -> str:
        return self.boundpass_config.inner

    @property
    def max_tokens_per_rank(self) -> int | None:
        return self.boundpass_config.max_tokens_per_rank

    def _step(self, inputs, labels=None, *loss_args, **model_kwargs):
        """What is compiled with `loss_fn`: the model on `inputs`, then the loss outside it."""
        return self.loss_fn(self.model(inputs, **model_kwargs), labels, *loss_args)

    def _call_model(self, *args, **kwargs):
        """What is compiled without `loss_fn`: the model called exactly as the caller called this module."""
        return self.model(*args, **kwargs)

    def _new_compiled(self):
        """A torch.compile of `_step` over a code object and a backend object of its own: Dynamo keeps compiled
        graphs per code object and reuses them only under the backend that compiled them, so a new copy compiles
        afresh on every rank (graph-break pieces in the model's own code included) and never reuses another's."""
        f = BoundedModule._call_model if self.loss_fn is None else BoundedModule._step
        fn = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__)

        # the backend holds this module weakly: Dynamo keeps compiled functions as globals of the traced code's
        # module (torch._dynamo.reset() leaves them), and through them a strong reference kept the last model
        # compiled alive after its owner let go (docs/results/test_times.md)
        owner = weakref.ref(self)

        def backend(gm, example_inputs):
            module = owner()
            if module is None:
                raise RuntimeError("boundpass: a graph was compiled for a BoundedModule that no longer exists")
            return _running_sizes(module._backend(gm, example_inputs), gm, module.reports[-1], owner)
        return torch.compile(types.MethodType(fn, self), backend=backend, fullgraph=self.fullgraph,
                             dynamic=self.dynamic)

    def _agreement_groups(self) -> list:
        """The groups whose ranks must compile together: the ring, and the EP groups a compile found."""
        if not dist.is_initialized():
            return []
        groups = [self.ring_group] if self.ring_group is not None else []
        groups += [dist.distributed_c10d._resolve_process_group(name) for name in self.ep_groups]
        out = []
        for group in groups:
            if dist.get_world_size(group) > 1 and str(dist.get_backend(group)).lower() != "fake" \
                    and all(group is not g for g in out):
                out.append(group)
        return out

    def _select_compiled(self, args, model_kwargs):
        """The compiled step for this call, chosen the same way on every rank of the ring / EP groups.

        A compile runs collectives (the ring's N_max, the EP group's token count, the narrowest cap), so every
        rank must compile at the same call. One all-gather per call and group of this rank's input signature
        (shapes, dtypes, Python scalars: what Dynamo guards on): each combination of the group's signatures gets
        its own compiled step (its own code object), compiled at the first call that shows it on every rank at
        once. A rank whose N grows never recompiles alone; a rank whose inputs did not change compiles with it.
        """
        groups = self._agreement_groups()
        if not groups:
            if self._first_signature is None:
                self._first_signature = _signature(args, model_kwargs)
            return self._compiled
        sig, first = _signature(args, model_kwargs), self._first_signature
        view, first_ok = [], True
        for group in groups:
            rows = agree("boundpass.compile", group, dist.get_rank(group), dist.get_world_size(group), (),
                         payload=[sig, int(first is None or first == sig)], what="ring/EP group")
            view.append(tuple(row[0] for row in rows))
            first_ok = first_ok and all(row[1] for row in rows)
        view = tuple(view)
        # the compile made before any group was known (EP groups appear at the first compile) serves this view
        # when every rank's signature is the one it compiled with
        adopt = not self._by_key and (first is None or first_ok)
        new = view not in self._by_key and not adopt
        if len(groups) > 1:  # ring x EP: whoever compiles makes every rank it shares a group with compile too
            flag = torch.tensor([int(new)], dtype=torch.int64)
            for group in groups:
                if "nccl" in str(dist.get_backend(group)).lower():
                    flag = flag.to(torch.device("cuda", torch.cuda.current_device()))
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            new = bool(flag.item())
        if new:
            limit = torch._dynamo.config.recompile_limit
            if self._group_compiles >= limit:  # the same count on every rank: every rank compiled each time
                raise BoundpassInputError(
                    f"boundpass.compile: the ranks' input shapes changed {self._group_compiles} times under a ring / "
                    f"EP group, and each new combination compiles on every rank (at most torch._dynamo.config."
                    f"recompile_limit={limit}): pad batches to a few fixed shapes")
            self._group_compiles += 1
            self._by_key[view] = self._new_compiled()
        elif view not in self._by_key:
            self._by_key[view] = self._compiled
        if self._first_signature is None:
            self._first_signature = sig
        return self._by_key[view]

    def forward(self, *args, **kwargs):
        """`model(*args, **kwargs)` without `loss_fn`; `loss_fn(model(inputs, **kwargs), labels, *loss_args)` with it
        (args = inputs, labels, *loss_args). Every tensor argument, keyword ones included, is a graph input."""
        if self.loss_fn is not None and not args:
            raise BoundpassInputError("with loss_fn= the compiled module is called as bm(inputs, labels, *loss_args, "
                                      "**model_kwargs): the model's inputs are missing")
        # suppress_errors=True would make Dynamo swallow a budget error and run eagerly: force errors through.
        if self.certificates and self._grads_held():
            self.check_accumulation()
        if self.not_certified and not self.boundpass_config.allow_uncertified:
            raise self.not_certified
        compiled = self._select_compiled(args, kwargs)
        reports, breaks = len(self.reports), _graph_breaks()
        with torch._dynamo.config.patch(suppress_errors=False, ignore_logger_methods=_ignored_loggers()):
            try:
                out = compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as exc:
                inner = getattr(exc, "inner_exception", None)
                if isinstance(inner, BoundpassError):
                    raise inner.with_traceback(None) from None
                raise
            except (torch._dynamo.exc.UserError, torch._dynamo.exc.Unsupported) as exc:
                if not self.fullgraph:
                    raise
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                hint = (" Hugging Face's experts_implementation='eager' loops over the experts a batch hit: build the "
                        "model with config._experts_implementation = 'grouped_mm' (the default) or 'batched_mm', "
                        "which boundpass rewrites to PipelinedLLEP." if "expert" in str(exc) else "")
                raise BoundpassInputError(
                    f"boundpass: torch.compile cannot capture this step in one graph (fullgraph=True): {first}.{hint} "
                    f"Otherwise remove the data-dependent code, or compile with fullgraph=False: the step is then "
                    f"refused as not certified unless allow_uncertified=True.") from exc
        if len(self.reports) > reports:  # this call compiled: the graphs it made are one step's
            self._step_compiled(self.reports[reports:], _graph_breaks() - breaks)
        return out

    def _step_compiled(self, reports: list, breaks) -> None:
        """A call compiled ``reports``' graphs. More than one graph, or any graph break, means code ran between them
        that no certificate saw: the step is not certified, and is refused unless ``allow_uncertified``."""
        for report in reports:
            report.step_graphs = reports
        if self.fullgraph or (len(reports) == 1 and not breaks):
            return
        reasons = [" (".join(ln.strip().removeprefix("Explanation: ") for ln in reason.strip().splitlines()[:2])
                   + (")" if len(reason.strip().splitlines()) > 1 else "") for reason in breaks] or [
            f"Dynamo compiled {len(reports)} graphs for one call (its break reasons were not recorded)"]
        graphs = [r.table.total if r.table is not None else None for r in reports]
        listed = ", ".join(f"#{i} {format_bytes(g) if g is not None else 'not certified'}"
                           for i, g in enumerate(graphs, 1))
        message = (f"boundpass: this step is NOT CERTIFIED: Dynamo split it into {len(reports)} graph(s) at "
                   f"{len(breaks) or 'unrecorded'} graph break(s), and the code that runs between them (eager, "
                   f"with its own activations) is in no certificate, so no budget check of the whole step can be "
                   f"honest.\n  graph breaks: " + "; ".join(dict.fromkeys(reasons)) +
                   f"\n  each compiled graph's certificate (its own peak, not the step's): {listed}"
                   f"\n  to fix       : remove the graph break(s) (boundpass.compile(..., fullgraph=True) shows where), "
                   f"or pass allow_uncertified=True to run with per-graph certificates only (explain says NOT "
                   f"CERTIFIED)")
        self.not_certified = NotCertifiedError(message, reasons=list(dict.fromkeys(reasons)), graphs=graphs)
        for report in reports:
            report.not_certified = self.not_certified
        if not self.boundpass_config.allow_uncertified:
            raise self.not_certified

    # ------------------------------------------------------------------------------------ backend
    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        report = ExplainReport(budget=self.budget)
        self.reports.append(report)  # kept even when the budget check raises: explain() shows why
        ring_size, ring_rank, group_name = 1, 0, ""
        if self.ring_group is not None:
            ring_size, ring_rank = dist.get_world_size(self.ring_group), dist.get_rank(self.ring_group)
            group_name = group_name_of(self.ring_group)
        # training (Liger-Kernel's convention for HF models): a logits output only the caller reads is not made
        ctx = PassContext(config=self.boundpass_config, ring_group=self.ring_group, group_name=group_name,
                          ring_size=ring_size, ring_rank=ring_rank,
                          drop_logits=not self.boundpass_config.vocab.keep_logits and self.model.training
                          and torch.is_grad_enabled(),
                          dispatch_root=self.dispatch_root(), max_tokens_per_rank=self.max_tokens_per_rank,
                          ring_n_max=self.ring_n_max, autocast=_autocast_reason(gm))
        run = run_passes(gm, ctx)  # find -> match -> rewrite; the knobs they leave open (C, c) are the planner's
        self.ring_n_max = ctx.ring_n_max
        report.regions.extend(run.regions)
        for knob in run.knobs:  # later calls agree over these groups before compiling (forward)
            if knob.agree_over and knob.agree_over not in self.ep_groups:
                self.ep_groups.append(knob.agree_over)
        report.optimizer = self.optimizer_plan
        report.composed = self.composed_table
        knobs = run.knobs
        optimizer_host = sum(t.value for t in self.state_terms if t.counted and t.kind == "host")
        host_pool = None if self.host_budget is None else max(self.host_budget - optimizer_host, 0)
        sco_plan = report.sco = self._find_sco(gm, host_pool)
        self.sco_plans.append(sco_plan)
        gm.recompile()
        partitioner = _PlanningPartitioner(self, report, knobs, sco_plan, gm)
        if self.inner != "inductor":
            return lower(gm, example_inputs, "aot_eager", partitioner, on_inference=partitioner.plan_inference)
        # Inductor: the budget is checked on the kernels it emits (after fusion), once both graphs are lowered
        with inductor_peak.recording() as schedules:
            compiled = lower(gm, example_inputs, "inductor", partitioner, on_inference=partitioner.plan_inference)
        partitioner.finish_inductor(schedules)
        return compiled

    def _find_sco(self, gm: torch.fx.GraphModule, host_pool: int | None):
        """SCO's plan for this graph (the partition-stage pass); per-block compile overrides it."""
        return SCO.find(gm, self.boundpass_config, host_pool=host_pool)

    def _grads_held(self) -> bool:
        return any(p.grad is not None for p in self.model.parameters())

    def dispatch_root(self) -> nn.Module:
        """The module the graph's nn_module_stack paths start at (Dynamo's ``L['self']``: this module)."""
        return self

    def carry_terms(self, peak, backed: dict) -> list[BoundTerm] | None:
        """What the rest of the step holds while a graph of this module runs, as table rows; None: the default
        (nothing under fullgraph; under graph breaks, every earlier graph's saved tensors in one row).
        Overridden where boundpass knows the step's structure (boundpass/backend/block_compile.py); a head compiled after a
        trunk of compiled blocks (``self.trunk``) runs with every block's saved tensors held."""
        trunk = getattr(self, "trunk", None)
        return trunk.head_carry_terms() if trunk is not None else None

    def check_accumulation(self) -> None:
        """Gradients from an earlier backward are held through this step: its peak must still fit."""
        for cert in self.certificates:
            if cert.accumulation_total > self.budget and not cert.planner.held_grads:
                grads = sum(t.value for t in self.state_terms if t.name == "gradients")
                cert.table.terms.append(BoundTerm("gradients held from the previous backward (accumulation)",
                                                  sym.Theta * sym.b, grads, kind="transient", knob=""))
                infeasible(cert, knob="zero the gradients (optimizer.zero_grad(set_to_none=True)) before this step, "
                           "or compile for accumulation with a larger budget / fewer tokens per micro-batch",
                           detail=f"gradient accumulation: the {format_bytes(grads)} of gradients an earlier "
                                  f"backward left are held through this step: {format_bytes(cert.accumulation_total)}")


class _PlanningPartitioner:
    """AOTAutograd's partition step with the planner inside it: partition, (SCO rewrite), analyse, choose, check.

    Runs before any graph is lowered or executed, so an infeasible budget raises before any real compute.
    """

    def __init__(self, owner: "BoundedModule", report: ExplainReport, knobs: list[Knob], sco_plan, gm):
        self.owner, self.report, self.knobs, self.sco_plan = owner, report, knobs, sco_plan
        self.gm = gm  # the rewritten Dynamo graph: shown by explain with the chosen knobs

    def __call__(self, joint: torch.fx.GraphModule, joint_inputs, **kwargs):
        from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
        owner, plan = self.owner, self.sco_plan
        base = min_cut_rematerialization_partition if owner.inner == "inductor" else default_partition
        static = static_placeholders(joint, kwargs.get("static_lifetime_input_indices") or ())
        outputs = kwargs["num_fwd_outputs"]
        ctx = {"max_tokens_per_rank": owner.max_tokens_per_rank or owner.ring_n_max or None,
               "per_block": getattr(owner, "per_block", False)}  # step_peak.analyze_graphs: the caller's lifetimes
        timing = {"analysis": 0.0}
        begun = time.perf_counter()

        def attempt(count: int):
            nonlocal held
            fw, bw = base(joint, joint_inputs, **kwargs)
            saved_tensors_before_opaque(fw, bw, outputs)
            held = SCO.rewrite(plan, count, joint, fw, bw, outputs, waits=owner.inner == "inductor")
            start = time.perf_counter()
            peak = analyze_graphs(fw, bw, static_inputs=static, num_user_outputs=outputs, held=held, ctx=ctx)
            timing["analysis"] += time.perf_counter() - start
            if shape_env is not None:  # partitioning may add symbols (e.g. a saved RNG state's size)
                backed.update(shape_env.backed_var_to_val)
                upper = _data_dependent_sizes(shape_env, peak, (fw, bw), backed, self.knobs)
                backed.update(upper)
                peak.bind(upper)  # the bound holds for any routing: those sizes at their largest, from here on
            # what the rest of the step holds while this graph runs (other graphs' saved tensors, ...): the owner's
            terms = owner.carry_terms(peak, backed)
            if terms is not None:
                # host rows (SCO's pool across blocks) are checked against the host budget, not carried on the device
                planner.carry_terms, planner.carry = terms, sum(t.value for t in terms if t.kind != "host")
            return fw, bw, peak

        held: list = []
        shape_env = _graph_shape_env(joint)
        backed = dict(shape_env.backed_var_to_val) if shape_env is not None else {}
        # fullgraph: one graph per step (a recompile replaces it). Otherwise the graphs of one step run forward
        # in order and backward in reverse, so what earlier graphs saved is live here: counted, conservatively
        # for every graph compiled before (a recompile is counted as if it were another piece of the step).
        carry = 0 if owner.fullgraph else sum(owner.saved_of_earlier_graphs)
        planner = StepPlanner(budget=owner.budget, host_budget=owner.host_budget, state_terms=owner.state_terms,
                              knobs=self.knobs, symbol_values=backed, carry=carry)
        count = 0 if plan.mode != True else plan.most  # noqa: E712 (sco may be the string "auto")
        fw, bw, peak = attempt(count)
        planner.caller = int_or_hint(peak.caller_bytes, backed)
        grad_terms = [t.value for t in owner.state_terms if t.name == "gradients"]
        # the backward's gradient storages, each once, against the parameters' bytes counted before any graph (a
        # per-block graph's gradients are FSDP2's unsharded ones, reduce-scattered in their own phase: not here)
        if grad_terms and not getattr(owner, "per_block", False):
            planner.grad_excess = max(0, int_or_hint(peak.gradient_bytes, backed) - sum(grad_terms))
        if owner._grads_held():  # compiled in the middle of gradient accumulation: certify that step
            planner.held_grads = sum(grad_terms) + planner.grad_excess
        if owner.optimizer_bucket is None:  # the user's (or a trunk owner's) beta stays
            planner.fit_offload_bucket(owner.optimizer_plan)
        count, trials, scanned = planner.choose_sco_count(plan, count, peak, lambda n: attempt(n)[2])
        if scanned:  # the graphs of the count chosen (the scan left the last count tried in them)
            fw, bw, peak = attempt(count)
        values = planner.choose(peak)
        # per-block SCO: the host pool of every block is one row of the composition (block_compile.carry_terms)
        extra = SCO.host_terms(plan)
        cert = planner.certify(peak, values, extra_terms=extra, sco_count=plan.offloaded)
        cert.sco_trials = trials
        cert.analysis_s = timing["analysis"]                   # the graph walks (every SCO candidate)
        cert.planning_s = time.perf_counter() - begun          # partitions, SCO rewrites, walks, knob search
        self.report.table, self.report.certificate = cert.table, cert
        owner.certificates.append(cert)
        planner.write_knobs(fw, bw)
        self.report.graph_code = self.gm.print_readable(print_output=False)
        self.report.forward_code = fw.print_readable(print_output=False)
        self.report.backward_code = bw.print_readable(print_output=False)
        self.report.forward_graph, self.report.backward_graph = fw, bw
        self.pending = types.SimpleNamespace(fw=fw, bw=bw, planner=planner, values=values, extra=extra, held=held,
                                             static=static, outputs=outputs, ctx=ctx, shape_env=shape_env,
                                             backed=backed, carry=planner.carry, cert=cert)
        if owner.inner != "inductor":
            self._check(cert, peak, self.pending)
        # Inductor: checked in finish_inductor, on the schedule it emits for both graphs (still before any compute)
        return fw, bw

    def plan_inference(self, graph: torch.fx.GraphModule, static_indices) -> None:
        """Certify and check a call without a backward (``torch.no_grad()``, eval): one graph, no SCO (nothing is
        saved for a backward), the state the call holds (parameters, buffers, optimizer state, gradients an earlier
        backward left) beside the graph's peak, the knobs chosen and written into it. Raises before it runs."""
        owner = self.owner
        outputs = len(graph.graph.find_nodes(op="output")[0].args[0])
        ctx = {"max_tokens_per_rank": owner.max_tokens_per_rank or owner.ring_n_max or None}
        begun = time.perf_counter()
        peak = analyze_graphs(graph, None, static_inputs=set(static_indices), num_user_outputs=outputs, ctx=ctx)
        analysis = time.perf_counter() - begun
        shape_env = _graph_shape_env(graph)
        backed = dict(shape_env.backed_var_to_val) if shape_env is not None else {}
        if shape_env is not None:
            upper = _data_dependent_sizes(shape_env, peak, (graph,), backed, self.knobs)
            backed.update(upper)
            peak.bind(upper)
        # no gradients are made and no optimizer steps: the step terms do not exist in this call, except the
        # gradients an earlier backward left (held until zero_grad)
        state = [t for t in owner.state_terms if t.kind != "step"]
        planner = StepPlanner(budget=owner.budget, host_budget=owner.host_budget, state_terms=state,
                              knobs=self.knobs, symbol_values=backed,
                              carry=0 if owner.fullgraph else sum(owner.saved_of_earlier_graphs))
        if owner._grads_held():
            planner.held_grads = sum(t.value for t in owner.state_terms if t.name == "gradients")
        values = planner.choose(peak)
        cert = planner.certify(peak, values, extra_terms=[])
        cert.inference = True
        cert.analysis_s = analysis
        cert.planning_s = time.perf_counter() - begun
        self.report.table, self.report.certificate = cert.table, cert
        self.report.inference = True
        owner.certificates.append(cert)
        planner.write_knobs(graph)
        self.report.graph_code = self.gm.print_readable(print_output=False)
        self.report.forward_code = graph.print_readable(print_output=False)
        self.report.forward_graph = graph
        pending = types.SimpleNamespace(fw=graph, bw=None, planner=planner, values=values, extra=[], held=[],
                                        static=set(static_indices), outputs=outputs, ctx=ctx, shape_env=shape_env,
                                        backed=backed, carry=planner.carry, cert=cert)
        self._check(cert, peak, pending)

    def finish_inductor(self, schedules) -> None:
        """Certify the step on Inductor's final schedules of the forward and backward just lowered, and check it.

        The graph walk before fusion chose the knobs (usually above the schedule's peak, not always: a peak the
        scheduler's reordering raised is caught here); the certificate and the budget check use what the kernels keep
        live.
        """
        p = getattr(self, "pending", None)
        if p is None:
            return  # no backward graph was partitioned (inference): nothing was planned
        self.pending = None
        fw_s, bw_s = inductor_peak.schedule_for(schedules, p.fw), inductor_peak.schedule_for(schedules, p.bw)
        cert = p.cert
        try:
            if fw_s is None or bw_s is None:
                raise LookupError("Inductor did not lower the partitioned graphs while boundpass recorded")
            start = time.perf_counter()
            peak = inductor_peak.analyze_schedules(fw_s, bw_s, p.fw, p.bw, static_inputs=p.static,
                                                   num_user_outputs=p.outputs, held=p.held, ctx=p.ctx)
            analysis = time.perf_counter() - start
            refined = p.planner.certify(peak, p.values, extra_terms=p.extra, sco_count=cert.sco_count)
        except LookupError as exc:  # the pre-fusion certificate stands (not proven for Inductor's order); explain says why
            cert.source = f"FX graphs before fusion (Inductor's schedule unreadable: {exc})"
            self._check(cert, cert.peak, p)
            return
        refined.sco_trials, refined.planning_s = cert.sco_trials, cert.planning_s
        refined.analysis_s = cert.analysis_s + analysis
        refined.source = "Inductor's final schedule"
        refined.before_fusion = cert.graph_bytes
        owner = self.owner
        owner.certificates[owner.certificates.index(cert)] = refined
        self.report.table, self.report.certificate = refined.table, refined
        self._check(refined, peak, p)

    def _check(self, cert, peak, p) -> None:
        """Raise if the certified step does not fit, on every rank of the ring / EP groups together (a rank whose
        check passed would otherwise wait for a refused one in the step's collectives); guard a dynamic size on the
        budget; record what it saves."""
        error = None
        try:
            self._check_here(cert, peak, p)
        except BoundpassError as exc:
            error = exc
        groups = self.owner._agreement_groups() + [g for g in self._region_groups() if g is not None]
        groups = [g for i, g in enumerate(groups) if all(g is not h for h in groups[:i])]
        fail_together("boundpass.compile", groups, error, numbers=(cert.table.total, self.owner.budget))

    def _region_groups(self) -> list:
        """The EP groups of this graph's rewritten dispatch regions (its ring is the owner's)."""
        if not dist.is_initialized():
            return []
        names = {r.group_name for k in self.knobs for r in k.regions if getattr(r, "group_name", "")}
        return [dist.distributed_c10d._resolve_process_group(name) for name in sorted(names)]

    def _check_here(self, cert, peak, p) -> None:
        owner = self.owner
        planner = cert.planner
        if not cert.table.host_fits():
            raise_infeasible(cert.table, max((t for t in cert.table.terms if t.kind == "host"), key=lambda t: t.value))
        if not cert.table.fits():
            raise_step_infeasible(cert, self.knobs, self.sco_plan, optimizer_plan=owner.optimizer_plan)
        if p.shape_env is not None:  # a dynamic N must not grow past what was checked: guard on the budget
            planner.guard(peak, p.shape_env, inputs=input_symbols(p.fw), backed=p.backed)
        owner.saved_of_earlier_graphs.append(int_or_hint(peak.saved_bytes, p.backed))


def _signature(args, model_kwargs) -> int:
    """A deterministic int63 of what Dynamo guards a call on: tensor shapes / dtypes / devices / requires_grad and
    Python scalars (the same on every process, unlike hash())."""
    def describe(x):
        if isinstance(x, torch.Tensor):
            return f"T{tuple(x.shape)}{x.dtype}{x.device.type}{int(x.requires_grad)}"
        if x is None or isinstance(x, (bool, int, float, str)):
            return f"{type(x).__name__}:{x!r}"
        if isinstance(x, (tuple, list)):
            return f"{type(x).__name__}[" + ",".join(describe(y) for y in x) + "]"
        if isinstance(x, dict):
            return "{" + ",".join(f"{k!r}:{describe(v)}" for k, v in sorted(x.items(), key=lambda kv: repr(kv[0]))) + "}"
        return type(x).__qualname__
    text = describe(tuple(args)) + describe(dict(model_kwargs))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _autocast_reason(gm) -> str:
    """Why the rewrites must not run under the autocast this graph was captured in ("" when none applies): autocast
    at capture (the caller's ``with torch.autocast(...)``) or entered inside the graph, to a lower precision."""
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in _LOW_PRECISION:
            dtype = torch.get_autocast_dtype(device)
            return (f"the step runs under torch.autocast({device!r}, {dtype}): eager computes the region in {dtype}, "
                    f"the rewritten op would compute it in the model's dtype (left as written, so the numerics are "
                    f"autocast's; cast the model to {dtype} instead to have it rewritten)")
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_enter_autocast" \
                and len(node.args) >= 3 and node.args[1] in _LOW_PRECISION and node.args[2]:
            return (f"the model enters torch.autocast({node.args[0]!r}, {node.args[1]}) in its forward: the rewritten "
                    f"ops would not follow autocast's dtype (left as written)")
    return ""


def _running_sizes(compiled, gm, report, owner):
    """``compiled`` recording, at every call, the sizes its symbolic inputs take (a dynamic graph's certificate is
    symbolic: explain() shows its figure at the shape that ran last), and which graph ran last."""
    where = []  # (input index, dim or None for a SymInt input, symbol)
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        val = node.meta.get("example_value")
        dims = [(None, val)] if isinstance(val, torch.SymInt) else \
            list(enumerate(val.shape)) if isinstance(val, torch.Tensor) else []
        where += [(i, d, size.node.expr) for d, size in dims
                  if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol]

    # weakly: Dynamo keeps this function as long as the process, and the report leads to the graphs (and through
    # them to the model's parameters); the module's reports list owns it
    report = weakref.ref(report)

    def run(*args):  # Dynamo calls a backend's result with the graph's inputs as positional arguments
        module, made = owner(), report()
        if module is not None and made is not None:
            made.running = {symbol: int(args[i] if d is None else args[i].shape[d]) for i, d, symbol in where}
            module.last_report = made
        return compiled(*args)
    return run


def _ignored_loggers() -> set:
    """Logger methods Dynamo may skip instead of breaking the graph: Hugging Face's ``warning_once`` (transformers
    patches it onto logging.Logger), which its models call inside forward (gradient checkpointing with
    ``use_cache=True``: the model sets ``use_cache=False`` itself and says so; under torch.compile that sentence
    would stop the capture with torch's error)."""
    import logging
    out = set(torch._dynamo.config.ignore_logger_methods)
    once = getattr(logging.Logger, "warning_once", None)
    if once is not None:
        out.add(once)
    return out


def _graph_breaks():
    """Dynamo's graph breaks so far, by reason (a Counter: subtracting two gives the breaks in between)."""
    from collections import Counter
    return Counter(torch._dynamo.utils.counters["graph_break"])


def _graph_shape_env(gm):
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        mode = getattr(val, "fake_mode", None)
        if mode is not None:
            return mode.shape_env
    return None


def _data_dependent_sizes(shape_env, peak, graphs, known: dict, knobs) -> dict:
    """Each data-dependent size in the peak (an unbacked symbol: the rows ``torch.where`` / ``nonzero`` / a
    boolean selection return, e.g. the tokens a hand-written MoE routes to one expert) at its largest value.

    The bound must hold for any routing, so it takes the size's upper bound from the ShapeEnv (torch gives
    ``nonzero`` the input's numel); a size without one cannot be certified and is refused, naming its node.
    """
    knob_symbols = {k.symbol for k in knobs}
    free = set()
    for point in peak.points:
        free |= sympy.sympify(point.live).free_symbols
    out = {}
    for symbol in sorted(free - set(known) - knob_symbols, key=str):
        bound = shape_env.var_to_range.get(symbol)
        upper = getattr(bound, "upper", None)
        # an integer, not torch's int_oo (an IntInfinity whose is_finite / is_number do not say it is unbounded)
        if upper is not None and getattr(upper, "is_Integer", False):
            out[symbol] = int(upper)
            continue
        made_by = next((f"{n.name} ({n.target}) in {module_path(n) or 'the model'}" for g in graphs for n in g.graph.nodes
                        if isinstance(n.meta.get("val"), torch.Tensor)
                        and symbol in {d for size in n.meta["val"].shape if isinstance(size, torch.SymInt)
                                       for d in size.node.expr.free_symbols}), "a node of the graph")
        raise BoundpassInputError(
            f"boundpass: the step's peak depends on a data-dependent size {symbol} (made by {made_by}) that has no "
            f"upper bound, so no budget can be certified for every input: bound it where it is made "
            f"(torch._check({symbol} <= n), or compute it with a size fixed by the launch, e.g. a capacity)")
    return out


def input_symbols(fw) -> set:
    """The symbols in the forward graph's input sizes (what a new batch shape changes)."""
    out = set()
    for node in fw.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        for dim in getattr(val, "shape", ()) if isinstance(val, torch.Tensor) else ():
            if isinstance(dim, torch.SymInt):
                out |= dim.node.expr.free_symbols
    return out


def state_terms_of(model: nn.Module, optimizer, *, budget: int, host_budget, knobs):
    """Parameters, gradients and the optimizer's terms (deciding its offload), checked before any graph exists."""
    # this rank's bytes: a DTensor parameter (FSDP2 / EP shard) holds only its local shard here
    params = [(getattr(p, "_local_tensor", p), p.requires_grad) for p in model.parameters()]
    param_bytes = sum(t.numel() * t.element_size() for t, _ in params)
    grad_bytes = sum(t.numel() * t.element_size() for t, trained in params if trained)
    buffers = [getattr(t, "_local_tensor", t) for t in model.buffers()]
    buffer_bytes = sum(t.numel() * t.element_size() for t in buffers)
    # gradients live from the backward that writes them to the optimizer step (zero_grad(set_to_none=True)):
    # inside backward the graph analysis counts them as they are produced; here they join the optimizer phase
    terms = [BoundTerm("parameters", sym.Theta * sym.b, param_bytes, kind="persistent",
                       knob="shard parameters over more ranks (FSDP2 / ZeRO-3) or raise the budget"),
             BoundTerm("gradients", sym.Theta * sym.b, grad_bytes, kind="step",
                       knob="shard gradients over more ranks (FSDP2 / ZeRO-3) or raise the budget")]
    if buffer_bytes:
        terms.append(BoundTerm("buffers", sympy.Integer(buffer_bytes), buffer_bytes, kind="persistent",
                               knob="shard the model over more ranks or raise the budget"))
    devices = {t.device for t, _ in params} | {t.device for t in buffers}
    blas = sum(blas_workspace_bytes(d) for d in devices)
    if blas:  # allocated by the first matmul of the stream and kept: device memory of every step
        terms.append(BoundTerm("cuBLAS + cuBLASLt workspaces", sympy.Integer(blas), blas, kind="persistent",
                               knob="CUBLAS_WORKSPACE_CONFIG / CUBLASLT_WORKSPACE_SIZE set smaller, or raise the budget"))
    plan = None
    if optimizer is not None:
        plan = plan_optimizer(optimizer, budget=budget, persistent=param_bytes + grad_bytes + buffer_bytes,
                              knobs=knobs, host_budget=host_budget)
        terms += plan.terms
    table = BudgetTable(budget=budget, terms=terms, host_budget=host_budget)
    if not table.host_fits():
        raise_infeasible(table, max((t for t in terms if t.kind == "host"), key=lambda t: t.value))
    if table.total > budget:
        raise_infeasible(table, binding_state_term(table, budget))
    return terms, plan


def compile(model: nn.Module, config: Config | None = None, *, loss_fn=None, ring_group=None, optimizer=None,
            launch=None, model_shape=None, fullgraph: bool = True, dynamic=False, **knobs) -> BoundedModule:
    """Compile `model` (+ `loss_fn(model_out, labels, *loss_args)`) so every bounded region fits the budget.

    The result is called exactly like `model` when `loss_fn` is None (`step(*args, **kwargs)` returns what
    `model(*args, **kwargs)` returns; a loss computed in the forward is matched in-graph), and as
    `step(inputs, labels, *loss_args, **model_kwargs)` = `loss_fn(model(inputs, **model_kwargs), labels, *loss_args)`
    when `loss_fn` is given (torchtitan computes its loss outside the model).

    The knobs: a `boundpass.Config` (`config`), or its flat keywords (`budget="60GiB"`, `vocab_block=`,
    `dispatch_cap=`, `sco_enable=`, `optimizer_offload=`, ...: each `<section>_<field>` of Config; docs/config.md has
    every one with its default and meaning), or both: a keyword wins over the Config's value. `budget` is required.
    Under a ring or EP group every compile runs on every rank at once: each call all-gathers the ranks' input
    signatures first (docs/compile.md, "Ranks holding different N").

    What is not a knob of Config: ring_group: the process group Ring-DTP rotates vocab shards/batches over (None:
    one device, P = 1). optimizer: a torch AdamW or torchtitan OptimizersContainer (optimizer.offload may swap it for
    OffloadStreamAdamW, state migrated: step `compiled.optimizer` and build LR schedulers on it). launch
    (boundpass.bound.composed.Launch) + model_shape (boundpass.bound.composed.ModelShape, e.g. boundpass.plan.model_shape(
    "deepseek_v3", "671B")): also check the composed per-rank budget of that launch configuration (every term of a
    step, docs/plan.md) here, before any graph; explain() shows its table. fullgraph / dynamic: torch.compile's own
    flags for the capture, kept out of Config on purpose: they change how Dynamo captures the step (graph breaks, a
    symbolic N guarded on the budget), not what boundpass bounds; tests and block_compile set them.
    Raises InfeasibleBudgetError here when the state alone cannot fit, else on the first call before any real
    compute; BoundpassInputError for a bad or unknown knob.
    """
    config = config_from(config, **knobs)
    if isinstance(model, BoundedModule):
        raise BoundpassInputError("boundpass.compile: this model is already compiled by boundpass; compile the "
                                  "original model (its .model) once, with every knob you need")
    if not isinstance(model, nn.Module):
        raise BoundpassInputError(f"boundpass.compile expects an nn.Module, got {type(model).__name__}")
    if config.budget is None:
        raise BoundpassInputError("boundpass.compile needs a budget: budget=\"60GiB\" (bytes or a size), or "
                                  "boundpass.Config(budget=...)")
    if ring_group is not None and not dist.is_initialized():
        raise BoundpassInputError("ring_group given but torch.distributed is not initialised")
    budget_bytes, host_bytes = config.budget_bytes, config.host_budget_bytes
    composed_table = None
    if launch is not None or model_shape is not None:
        if launch is None or model_shape is None:
            raise BoundpassInputError("the composed budget needs both launch= (boundpass.bound.composed.Launch) and "
                                      "model_shape= (e.g. boundpass.plan.model_shape(model, flavor))")
        from boundpass.bound import composed
        composed_table = composed.check(model_shape, launch, budget=budget_bytes, host_budget=host_bytes)
    error = state_terms = plan = None
    try:
        state_terms, plan = state_terms_of(model, optimizer, budget=budget_bytes, host_budget=host_bytes,
                                         knobs=config.optimizer)
    except BoundpassError as exc:
        error = exc
    _agree_at_compile(ring_group, error)
    return BoundedModule(model, loss_fn, config, ring_group=ring_group, fullgraph=fullgraph, dynamic=dynamic,
                         state_terms=state_terms, optimizer_plan=plan, composed_table=composed_table)


def _agree_at_compile(ring_group, error) -> None:
    """Every rank of the job compiles together: each learns whether any rank's state check failed and whether the
    ranks agree on having a ring (a ring on one rank only leaves the others waiting in their next collective).
    One small all-gather over the default group when torch.distributed runs several real ranks; then every rank
    raises together (its own error, or PeerRefusedError), never a process-group timeout."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or str(dist.get_backend()).lower() == "fake":
        if error is not None:
            raise error
        return
    world = dist.group.WORLD
    ring = dist.get_world_size(ring_group) if ring_group is not None else 0
    agree("boundpass.compile", world, dist.get_rank(), dist.get_world_size(),
          [("ring_group given (its size; 0: none)", "int", ring)], what="job")
    fail_together("boundpass.compile", [world], error)


def explain(compiled: BoundedModule) -> ExplainReport:
    """The report of the most recent compilation: regions matched/skipped, rewritten graphs, bounds table."""
    if not isinstance(compiled, BoundedModule):
        raise BoundpassInputError(f"boundpass.explain expects what boundpass.compile returned, got {type(compiled).__name__}")
    if not compiled.reports:
        raise BoundpassInputError("nothing compiled yet: boundpass compiles on the first call; call the module once "
                                  "(e.g. one training step), then explain it")
    return compiled.last_report or compiled.reports[-1]
