"""`boundpass.explain` report: what was matched and skipped (and why), the rewritten graphs, the bounds table."""
from __future__ import annotations

from dataclasses import dataclass, field

from boundpass.units import format_bytes


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
        return self.text(graph="full")

    def text(self, graph: str = "full") -> str:
        """Report text; graph="full" prints the rewritten graph, "excerpt" only its boundpass lines, "none" skips it."""
        lines = [f"boundpass report (per-rank budget {format_bytes(self.budget)})", "", "regions:"]
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
        if getattr(self, "sco", None) is not None:  # passes.sco_pass.SCOPlan: checkpoint boundary offload
            lines += self.sco.lines()
        lines += ["", "bounds (bytes per rank):", self.table.render() if self.table else "  (none)"]
        if getattr(self, "composed", None) is not None:  # compile(..., launch=, model_shape=)
            from boundpass.composed import describe
            lines += ["", "composed per-rank budget of the launch configuration (boundpass/composed.py):",
                      self.composed.render(), describe(self.composed)]
        if graph == "full":
            lines += ["", "rewritten graph (Dynamo, torch IR):", self.graph_code]
        elif graph == "excerpt":
            ops = [ln.strip() for ln in self.graph_code.splitlines() if "boundpass." in ln]
            lines += ["", "rewritten graph, boundpass ops only (Dynamo, torch IR):"] + [f"  {ln}" for ln in ops]
        return "\n".join(lines)
