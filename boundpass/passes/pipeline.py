"""The graph passes behind one protocol, and the driver that runs them on a Dynamo graph.

A graph pass turns the regions of one unbounded peak into a bounded runtime op (vocab: projection -> cross-entropy
=> Ring-DTP; dispatch: routed experts => PipelinedLLEP). Each declares:

- ``name`` and ``enabled(config)``: whether boundpass.Config asks for it;
- ``rewrite(gm, ctx)``: find -> match -> rewrite in place; one region record per region found, rewritten or
  skipped with its reason (``module_path``, ``rewritten``, ``reason``, ``describe()``);
- ``knobs(regions, ctx)``: the schedule parameters its rewritten ops leave open for the planner (``bounds.Knob``:
  symbol, range, knee, the schema argument it is written to), agreed over the ranks that must run the same schedule;
- ``diagnose(knob, where)``: what to tell the user when the narrowest value of its knob does not fit.

Adding an operator: its runtime module (which registers its memory contract, ``boundpass.runtime.contracts``), its
pass with these four members, its tests, and one entry in ``GRAPH_PASSES``. SCO, whose regions only exist once
AOTAutograd has partitioned the joint graph, is the partition-stage pass (``boundpass.passes.sco_pass``);
the optimizer swap acts on the optimizer, before any graph (``boundpass.passes.optimizer_swap``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch.fx as fx

from boundpass.bounds import Knob


@dataclass
class PassContext:
    """What a pass may read of the compile it runs in (and the one fact it hands back: the ring's largest N)."""
    config: object                      # boundpass.Config
    ring_group: object = None           # Ring-DTP's process group (None: one rank)
    group_name: str = ""
    ring_size: int = 1
    ring_rank: int = 0
    drop_logits: bool = False           # training with labels: a logits output only the caller reads is not made
    dispatch_root: object = None        # the module the graph's nn_module_stack paths start at
    max_tokens_per_rank: int | None = None
    autocast: str = ""                  # why no rewrite may run under this graph's autocast ("" when none)
    ring_n_max: int = 0                 # out: the ring's largest N the vocab knobs were chosen for
    fixed: dict = field(default_factory=dict)  # knob name -> value a layout fixes (no planning: MoP)


@dataclass
class Diagnosis:
    """An infeasible knob explained: the fix to offer, the detail line, the name of what binds."""
    fix: str
    detail: str
    name: str


class GraphPass(Protocol):
    name: str

    def enabled(self, config) -> bool: ...

    def rewrite(self, gm: fx.GraphModule, ctx: PassContext) -> list: ...

    def knobs(self, regions: list, ctx: PassContext) -> list[Knob]: ...

    def diagnose(self, knob: Knob, where: str) -> Diagnosis: ...


@dataclass
class SkippedPass:
    """A pass not run on a graph at all, and why (explain lists it as a skipped region)."""
    kind: str
    reason: str
    module_path: str = ""
    rewritten: bool = False
    tokens: object = None

    def describe(self) -> str:
        return f"SKIPPED   {self.kind:<8} (every region): {self.reason}"


@dataclass
class PassRun:
    """What the driver did to one graph: every region of every pass (in pass order) and the knobs left open."""
    regions: list = field(default_factory=list)
    knobs: list[Knob] = field(default_factory=list)
    by_pass: dict = field(default_factory=dict)   # pass name -> its regions

    def rewritten(self, name: str) -> list:
        return [r for r in self.by_pass.get(name, []) if r.rewritten]


def graph_passes() -> tuple:
    """The graph passes, in the order they run (vocab first: its region ends the graph)."""
    from boundpass.passes.dispatch_pass import DispatchPass
    from boundpass.passes.vocab_pass import VocabPass
    return (VocabPass(), DispatchPass())


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes=None, *, plan_knobs: bool = True) -> PassRun:
    """Run every enabled pass on ``gm`` (in place), then open their knobs (``plan_knobs``) for the planner.

    Under an autocast to a lower precision no pass runs: the rewritten ops compute in the dtype they are given, so a
    rewrite would change the numerics eager has (each enabled pass is listed as skipped, with the reason)."""
    run = PassRun()
    for p in graph_passes() if passes is None else passes:
        if not p.enabled(ctx.config):
            continue
        found = [SkippedPass(p.name, ctx.autocast)] if ctx.autocast else p.rewrite(gm, ctx)
        run.by_pass[p.name] = found
        run.regions.extend(found)
        if plan_knobs:
            run.knobs.extend(p.knobs(found, ctx))
    return run


def diagnose(knob: Knob, where: str, passes=None) -> Diagnosis | None:
    """The diagnosis of the pass that owns ``knob`` (None when no pass does)."""
    for p in graph_passes() if passes is None else passes:
        if knob.owner == p.name:
            return p.diagnose(knob, where)
    return None
