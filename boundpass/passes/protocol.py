"""The protocol every graph pass follows, and the records it exchanges with the driver (boundpass.passes.pipeline)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch.fx as fx

from boundpass.bound.bounds import Knob


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


class PartitionPass(Protocol):
    """A pass whose regions exist only once AOTAutograd has partitioned the joint graph (SCO: a checkpoint boundary
    is a saved tensor of the forward graph). It finds its regions on the Dynamo graph, the planner chooses how many
    to take (``plan.most`` at most) and it rewrites the partitioned forward / backward for each count tried."""
    name: str

    def enabled(self, config) -> bool: ...

    def find(self, gm: fx.GraphModule, config, *, host_pool: int | None): ...

    def rewrite(self, plan, count: int, joint: fx.GraphModule, fw: fx.GraphModule, bw: fx.GraphModule,
                num_fwd_outputs: int, *, waits: bool) -> list: ...

    def host_terms(self, plan) -> list: ...

    def diagnose(self, plan) -> str | None: ...


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
