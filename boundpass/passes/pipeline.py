"""The graph passes behind one protocol, and the driver that runs them on a Dynamo graph.

A graph pass turns the regions of one unbounded peak into a bounded runtime op (vocab: projection -> cross-entropy
=> Ring-DTP; dispatch: routed experts => PipelinedLLEP; attention: scaled_dot_product_attention => chunked
attention; feed_forward: a block's MLP => row blocks). Each declares:

- ``name`` and ``enabled(config)``: whether boundpass.Config asks for it;
- ``rewrite(gm, ctx)``: find -> match -> rewrite in place; one region record per region found, rewritten or
  skipped with its reason (``module_path``, ``rewritten``, ``reason``, ``describe()``);
- ``knobs(regions, ctx)``: the schedule parameters its rewritten ops leave open for the planner (``bounds.Knob``:
  symbol, range, knee, the schema argument it is written to), agreed over the ranks that must run the same schedule;
- ``diagnose(knob, where)``: what to tell the user when the narrowest value of its knob does not fit.

Adding an operator: its runtime module (which registers its memory contract, ``boundpass.runtime.contracts``), its
pass with these four members, its tests, and one entry in ``GRAPH_PASSES``. SCO, whose regions only exist once
AOTAutograd has partitioned the joint graph, is the partition-stage pass ``SCO`` (``protocol.PartitionPass``:
find on the Dynamo graph, rewrite the partitioned graphs for each offload count the planner tries, its host rows,
its fix); the optimizer swap acts on the optimizer, before any graph (``boundpass.passes.optimizer_swap``).
"""
from __future__ import annotations

import torch.fx as fx

from boundpass.bound.bounds import Knob
from boundpass.passes.attention_pass import AttentionPass
from boundpass.passes.dispatch_pass import DispatchPass
from boundpass.passes.feed_forward_pass import FeedForwardPass
from boundpass.passes.protocol import Diagnosis, PassContext, PassRun, SkippedPass
from boundpass.passes.sco_pass import SCOPass
from boundpass.passes.vocab_pass import VocabPass

# the graph passes, in the order they run (vocab first: its region ends the graph); adding an operator adds a line
GRAPH_PASSES = (VocabPass(), DispatchPass(), AttentionPass(), FeedForwardPass())
# the partition-stage pass: checkpoint boundaries, found before AOTAutograd, rewritten after it partitions
SCO = SCOPass()


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes=None, *, plan_knobs: bool = True) -> PassRun:
    """Run every enabled pass on ``gm`` (in place), then open their knobs (``plan_knobs``) for the planner.

    Under an autocast to a lower precision no pass runs: the rewritten ops compute in the dtype they are given, so a
    rewrite would change the numerics eager has (each enabled pass is listed as skipped, with the reason)."""
    run = PassRun()
    for p in GRAPH_PASSES if passes is None else passes:
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
    for p in GRAPH_PASSES if passes is None else passes:
        if knob.owner == p.name:
            return p.diagnose(knob, where)
    return None
