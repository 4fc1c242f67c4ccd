"""`boundpass.explain` report: what was matched and skipped (and why), the rewritten graphs, the bounds table."""
from __future__ import annotations

from dataclasses import dataclass, field

from boundpass.core import textwidth
from boundpass.core.units import format_bytes
from boundpass.measure.step_peak import bytes_at


@dataclass
class ExplainReport:
    """Everything one boundpass compilation decided; `str(report)` is the human-readable text."""
    budget: int
    regions: list = field(default_factory=list)       # passes' region records (rewritten and skipped)
    table: object = None                              # bounds.BudgetTable
    optimizer: object = None                          # passes.optimizer_swap.OptimizerPlan (None: not given)
    graph_code: str = ""                              # rewritten Dynamo graph (torch IR)
    forward_code: str = ""                            # AOT forward graph (aten)
    backward_code: str = ""                           # AOT backward graph (aten)
    forward_graph: object = field(default=None, repr=False)
    backward_graph: object = field(default=None, repr=False)
    certificate: object = field(default=None, repr=False)  # planning.planner.StepCertificate (None: not planned)
    composed: object = None                           # bound.composed's table of the launch (None: not given)
    sco: object = None                                # passes.sco_pass's plan for this graph
    inference: bool = False                           # a call without a backward (no_grad / eval)
    not_certified: object = None                      # core.errors.NotCertifiedError: code ran between graphs
    step_graphs: list = field(default_factory=list, repr=False)  # every report of the same step, this one included
    running: object = None                            # sizes a dynamic graph's symbolic inputs took at each call

    @property
    def matched(self) -> list:
        """Rewritten regions of every pass (each region has a ``kind``: "vocab", "dispatch")."""
        return [r for r in self.regions if r.rewritten]

    @property
    def skipped(self) -> list:
        return [r for r in self.regions if not r.rewritten]

    def rewritten_of(self, kind: str) -> list:
        return [r for r in self.matched if r.kind == kind]

    def skipped_of(self, kind: str) -> list:
        return [r for r in self.skipped if r.kind == kind]

    def __str__(self) -> str:
        return self.text()

    def text(self, graph: str = "excerpt", *, formulas: bool = False, width: int = textwidth.WIDTH) -> str:
        """Report text, every line within ``width`` columns except the full graph's code.

        graph="excerpt" (default) lists boundpass's ops in the partitioned graphs, each with its knobs and module
        path; "full" also prints the whole rewritten Dynamo graph (torch IR, as ``print_readable`` writes it);
        "none" shows no graph. formulas=True adds each bound term's sympy formula under its row."""
        if graph not in ("full", "excerpt", "none"):
            raise ValueError(f"graph must be 'full', 'excerpt' or 'none', got {graph!r}")
        lines = [f"boundpass report (per-rank budget {format_bytes(self.budget)})"]
        if self.not_certified is not None:
            lines += ["", "NOT CERTIFIED: the step runs code between its compiled graphs that no certificate covers",
                      *(f"  graph break: {r}" for r in self.not_certified.reasons),
                      "  each graph's table below is that graph's own peak, not the step's"]
        graphs = self.step_graphs or []
        if len(graphs) > 1:
            lines += ["", f"graphs of this step ({len(graphs)}; this report is #{graphs.index(self) + 1}):"]
            for i, g in enumerate(graphs, 1):
                regions = ", ".join(f"{r.kind if hasattr(r, 'kind') else 'vocab'} "
                                    f"{'rewritten' if r.rewritten else 'skipped'}" for r in g.regions) or "no regions"
                total = format_bytes(g.table.total) if g.table is not None else "not certified"
                lines.append(f"  #{i}: certified {total}; {regions}")
        if self.inference:
            lines += ["", "inference call (no backward): the graph's forward beside the state it holds"]
        lines += ["", "regions:"]
        if not self.regions:
            lines.append("  (none found: no linear -> cross_entropy in the captured graph; is the loss compiled "
                         "together with the model? pass loss_fn= to boundpass.compile)")
        for r in self.regions:
            if hasattr(r, "describe"):  # passes other than the vocab pass describe their own regions
                lines.append(f"  {r.describe()}")
            elif r.rewritten:
                lines.append(f"  REWRITTEN vocab  {r.module_path}: linear -> cross_entropy => boundpass::ring_dtp "
                             f"(N={r.tokens}, H={r.hidden}, V={r.vocab}, {r.dtype}, branch={r.branch}, C={r.block})")
            else:
                lines.append(f"  SKIPPED   vocab  {r.module_path}: {r.reason}")
        if self.optimizer is not None:
            lines.append(f"  OPTIMIZER {type(self.optimizer.optimizer).__name__}: {self.optimizer.reason}")
        if self.sco is not None:  # passes.sco_pass.SCOPlan: checkpoint boundary offload
            lines += self.sco.lines()
        lines += ["", "bounds (bytes per rank):",
                  self.table.render(formulas=formulas, width=width) if self.table else "  (none)"]
        running = self.running_total()
        if running is not None:
            shape = ", ".join(f"{k}={v}" for k, v in sorted(self.running.items(), key=lambda kv: str(kv[0])))
            verdict = "FITS" if running <= self.budget else "DOES NOT FIT"
            lines.append(f"at the shape that ran last ({shape}): device peak {format_bytes(running)} ({verdict}); "
                         f"the table is at the shape first compiled")
        lines += self._knob_lines()
        lines += self._step_peak_lines()
        if self.composed is not None:  # compile(..., launch=, model_shape=)
            from boundpass.bound.composed import describe
            lines += ["", "composed per-rank budget of the launch configuration (boundpass/bound/composed.py):",
                      self.composed.render(formulas=formulas, width=width), describe(self.composed)]
        if graph != "none":
            ops = op_lines(self.forward_graph, "forward") + op_lines(self.backward_graph, "backward")
            if not ops:  # no partitioned graphs kept (the budget check raised first): the Dynamo graph's ops
                ops = code_op_lines(self.graph_code, "dynamo")
            if ops:
                lines += ["", "boundpass ops (phase, op, module, arguments other than tensors):"]
                lines += ["  " + ln for ln in textwidth.table(ops, width=width - 2, shrink=3)]
        text = "\n".join(ln for line in "\n".join(lines).splitlines() for ln in _fit_line(line, width))
        if graph == "full":
            text += "\n\nrewritten graph (Dynamo, torch IR):\n" + self.graph_code
        return text

    def running_total(self) -> int | None:
        """The certified device peak (bytes) at the sizes the last call of a dynamic graph had; None for a static graph
        (or before it ran)."""
        cert, running = self.certificate, self.running
        if cert is None or not running or cert.planner is None:
            return None
        values = {**cert.values, **running}
        return cert.planner.total(cert.peak.evaluate(values)[0])

    def _knob_lines(self) -> list[str]:
        """The planner's choice per knob: value, why, and what the budget alone would have allowed.

        The graph's knobs (C, c), then OffloadStreamAdamW's β and S (``optimizer_bucket``, ``optimizer_slots``),
        then SCO's offload count (``sco``, the fewest the budget needs; docs/knobs.md)."""
        cert = self.certificate
        knobs = list(cert.planner.knobs) if cert is not None and cert.planner is not None else []
        knobs += list(getattr(self.optimizer, "knobs", None) or [])
        sco = None
        if cert is not None and self.sco is not None:
            from boundpass.planning.planner import sco_knob
            sco = sco_knob(self.sco, cert, self.budget)
        if not knobs and sco is None:
            return []
        lines = ["", "knobs (boundpass/planning/planner.py; rule: docs/knobs.md):"]
        for k in knobs:
            allowed = "nothing fits" if k.widest_fitting is None else f"the budget alone allows {k.widest_fitting}"
            knee = "no time model" if getattr(k, "knee", None) is None else f"knee {k.knee} (boundpass/bound/cost_model.py)"
            lines.append(f"  {k.name} = {k.value} ({k.why}; {knee}; {allowed}; range {k.lo}..{k.hi})")
        if sco is not None:
            allowed = ("the budget alone: not searched" if sco.widest_fitting is None and sco.why == "user" else
                       "nothing fits" if sco.widest_fitting is None else
                       f"the budget alone allows as few as {sco.widest_fitting}")
            lines.append(f"  sco offloaded boundaries = {sco.value} ({sco.why}; knee {sco.knee} (fewest: "
                         f"boundpass/bound/cost_model.py); {allowed}; range {sco.lo}..{sco.hi})")
        return lines

    # ---- the step's predicted memory over time --------------------------------------------------------------
    def timeline(self) -> list[tuple[str, str, str, int]]:
        """Predicted device bytes at every program point of the step, in execution order.

        One ``(phase, node, module_path, bytes)`` per forward / backward program point of the certified graphs
        (persistent state + the live bytes there, at the planner's values; plus what earlier graphs of the step
        saved, when there are graph breaks), then one ``("optimizer", "step", "", persistent + step terms)``.
        Its maximum is the certified device peak ``table.total``. Empty before anything was certified.
        """
        cert = self.certificate
        if cert is None or cert.table is None:
            return []
        table = cert.table
        persistent = table.sum("persistent")
        carry = table.sum("transient") - cert.graph_bytes   # saved tensors of earlier graphs (graph breaks)
        cache: dict = {}
        out = []
        for p in cert.peak.points:
            if p.live not in cache:
                cache[p.live] = bytes_at(p.live, cert.values)
            out.append((p.phase, p.node, p.module_path, persistent + carry + cache[p.live]))
        out.append(("optimizer", "step", "", persistent + table.sum("step")))
        return out

    def _step_peak_lines(self, rows: int = 20, width: int = 24) -> list[str]:
        """The "step peak" section: the peak's program point, its largest tensors, a sampled timeline."""
        cert = self.certificate
        line = self.timeline()
        if cert is None or not line:
            return []
        from boundpass.measure.step_peak import render_point
        lines = ["", "step peak (predicted, device bytes per rank):"]
        if cert.point is not None:
            lines += ["  " + ln for ln in render_point(cert.peak, cert.point, cert.values)]
        peak_i = max(range(len(line)), key=lambda i: line[i][3])
        n = len(line)
        picks = sorted({round(k * (n - 1) / (rows - 1)) for k in range(rows)} | {peak_i}) if n > 1 else [0]
        top = line[peak_i][3]
        scale = self.budget if top * 4 >= self.budget else top   # a tiny step against a huge budget: scale to peak
        lines.append(f"  timeline: {len(picks)} of {n} program points; bar {width} cols = "
                     f"{'budget' if scale == self.budget else 'peak'} {format_bytes(scale)}")
        for i in picks:
            phase, node, module, nbytes = line[i]
            bar = "#" * min(width, round(width * nbytes / scale)) if scale else ""
            mark = "> " if i == peak_i else "  "
            lines.append(f"{mark}{phase[:9]:<9} {_clip(node, 20):<20} {_clip(module, 20):<20} "
                         f"{format_bytes(nbytes):>10}  {bar}" + (" <- peak" if i == peak_i else ""))
        return lines

    def plot(self, path, *, measured=None, reference=None):
        """Draw the predicted (and, given, measured) live bytes over the step to ``path`` (PNG, SVG, ...).

        x is the position in the step (0..1 over its program points; ``measured`` samples, e.g. from
        ``boundpass.testing.whole_step.measured_step_timeline``, are spread over 0..1 likewise), y is MiB,
        with the budget line and the certified peak marked. ``reference`` (the uncompiled step: another
        ExplainReport, or a ``(predicted, measured)`` pair, either side None; predicted may be an ExplainReport
        or a list of bytes) is drawn in a left panel beside this one. Returns ``path``.
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg   # Agg, whatever pyplot's backend is
        from matplotlib.figure import Figure

        panels = []
        if reference is not None:
            ref_pred, ref_meas = (reference, None) if isinstance(reference, ExplainReport) else reference
            panels.append(("uncompiled", ref_pred, ref_meas))
        panels.append(("boundpass", self, measured))
        fig = Figure(figsize=(7 * len(panels), 4.5))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
        top = max(_draw(ax, title, pred, meas, self.budget) for ax, (title, pred, meas) in zip(axes, panels))
        mib = 2.0 ** 20
        if top and self.budget <= 4 * top:
            axes[0].set_ylim(0, 1.08 * max(top, self.budget) / mib)
        elif top:  # a budget far above the step: keep the curves readable, the budget is named in the legend
            axes[0].set_ylim(0, 1.15 * top / mib)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return path


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "~"


def _spread(n: int) -> list[float]:
    return [i / (n - 1) for i in range(n)] if n > 1 else [0.0] * n


def _draw(ax, title: str, pred, meas, budget: int) -> int:
    """One panel: predicted timeline (with phases and the certified peak), measured samples, budget line.

    Returns the largest byte count drawn (predicted or measured)."""
    mib = 2.0 ** 20
    phases = []
    if isinstance(pred, ExplainReport):
        line = pred.timeline()
        ys = [b for *_, b in line]
        phases = [ph for ph, *_ in line]
        budget = pred.budget
    else:
        ys = list(pred or [])
    if ys:  # program point i spans [i/n, (i+1)/n)
        n = len(ys)
        ax.step([i / n for i in range(n + 1)], [y / mib for y in ys + ys[-1:]], where="post", color="tab:blue",
                label="predicted")
        top = max(range(n), key=ys.__getitem__)
        ax.plot([(top + 0.5) / n], [ys[top] / mib], "v", color="tab:red",
                label=f"certified peak {ys[top] / mib:,.1f} MiB" if phases else f"peak {ys[top] / mib:,.1f} MiB")
    if meas:
        ax.plot(_spread(len(meas)), [m / mib for m in meas], color="tab:orange", alpha=0.8, lw=1,
                label=f"measured (peak {max(meas) / mib:,.1f} MiB)")
    top = max(ys + list(meas or []) or [0])
    if budget <= 4 * top or not top:
        ax.axhline(budget / mib, color="tab:gray", ls="--", label=f"budget {budget / mib:,.0f} MiB")
    else:
        ax.plot([], [], color="tab:gray", ls="--", label=f"budget {budget / mib:,.0f} MiB (off the scale)")
    names = []
    if phases:  # shade and name the phases: forward, backward, optimizer
        n, start = len(phases), 0
        for i in range(1, n + 1):
            if i == n or phases[i] != phases[start]:
                lo, hi = start / n, i / n
                if phases[start] != "forward":
                    ax.axvspan(lo, hi, color="tab:gray" if phases[start] == "optimizer" else "tab:blue", alpha=0.07)
                names.append(phases[start])
                start = i
    ax.set_title(f"{title}: " + (" -> ".join(names) if names else "forward -> backward -> optimizer"))
    ax.set_xlabel("position in the step (0 = start, 1 = end of optimizer step)")
    ax.set_ylabel("live device bytes (MiB)")
    ax.set_xlim(0, 1)
    ax.legend(loc="upper left", fontsize=8)
    return top


def _fit_line(line: str, width: int) -> list[str]:
    """One report line as terminal lines: wrapped at words, continuation lines indented 4 past the line's own."""
    if len(line) <= width:
        return [line]
    pad = " " * (len(line) - len(line.lstrip()))
    return textwidth.wrap(line.strip(), width=width, first=pad, rest=pad + "    ")


def _module_of(node) -> str:
    """Module path of a partitioned-graph node (AOTAutograd keeps the forward's stack on backward nodes)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return "-"
    path = list(stack.values())[-1][0]
    for prefix in ("L['self'].", "G['model'].", "L['model'].", "L['self']._model."):
        path = path.replace(prefix, "")
    return path.replace("L['self']", "<model>").replace("['", ".").replace("']", "")


def _show(value) -> str | None:
    """A non-tensor op argument for the excerpt; None leaves it out (an empty group name or list)."""
    if value in ("", [], ()):
        return None
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(str, value))}]" if len(value) <= 4 else f"[{len(value)} values]"
    return str(value)


def _is_tensor_argument(argument) -> bool:
    return "Tensor" in str(argument.type)


# the arguments the planner or a pass chooses (Ring-DTP's strip C and branch, PipelinedLLEP's cap c and borrowed
# slots, SCO's layer and whether it offloads): shown first, before the fixed settings, so a clipped row keeps them
_CHOSEN = ("block", "branch", "cap", "max_borrowed", "layer", "offload")


def _knobs(schema, args, kwargs) -> str:
    shown = []
    for i, argument in enumerate(schema.arguments):
        if _is_tensor_argument(argument):
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name, argument.default_value)
        text = _show(value)
        if text is not None:
            shown.append((argument.name not in _CHOSEN, f"{argument.name}={text}"))
    return " ".join(text for _, text in sorted(shown, key=lambda item: item[0]))


def op_lines(graph_module, phase: str) -> list[tuple[str, str, str, str]]:
    """(phase, op, module path, knobs) of every boundpass custom op in a partitioned graph, in order."""
    if graph_module is None:
        return []
    rows = []
    for node in graph_module.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.name.startswith("boundpass::"):
            continue
        rows.append((phase, schema.name.split("::")[1], _module_of(node), _knobs(schema, node.args, node.kwargs)))
    return rows


def code_op_lines(code: str, phase: str) -> list[tuple[str, str, str, str]]:
    """The same rows read from graph code text (``name = torch.ops.boundpass.op.default(args)``): tensor
    arguments are names there, the others literals; the module path is not in the text ("-")."""
    import ast

    import torch

    rows = []
    for line in code.splitlines():
        text = line.strip().split(";  ")[0]
        if "torch.ops.boundpass." not in text or "=" not in text:
            continue
        call = text.split("=", 1)[1].strip()
        op = call.split("torch.ops.boundpass.", 1)[1].split(".", 1)[0]
        try:
            tree = ast.parse(call, mode="eval").body
            schema = getattr(torch.ops.boundpass, op).default._schema
            args = [ast.literal_eval(a) if isinstance(a, (ast.Constant, ast.List, ast.Tuple, ast.UnaryOp))
                    else ast.unparse(a) for a in tree.args]
            knobs = _knobs(schema, args, {})
        except (SyntaxError, ValueError, AttributeError, RuntimeError):
            knobs = "(arguments not readable from the code text)"
        rows.append((phase, op, "-", knobs))
    return rows
