"""boundpass's passes as Dynamo backends for a layout whose budget is checked before launch: the MoP layout
(recipes/mop.py), whose composed per-rank budget (boundpass.bound.composed, recipes/trainer.py ``check_mop_budget``) is
checked on the meta model before anything is built.

- ``DispatchBlocks``: the backend of torchtitan's per-block compile; every block graph goes through the dispatch pass
  (routed experts -> PipelinedLLEP at the launch's chunk cap c).
- ``RingDTPHeadBackend``: the backend of the head step (the vocab-sharded head gathered, lm_head projection,
  cross-entropy); the vocab pass rewrites it to Ring-DTP on this rank's shard (no rank gathers the weight).

Neither plans a knob: c and the strip width C are the launch's, the ones its composed budget counted. A region the
pass skips is an error, never a fall-back: the layout asked for the operator and its budget counted it. Under the
default layout the same passes run inside ``boundpass.compile`` / ``block_compile.CompiledBlocks``, which also plan
the knobs and check every graph against the step's budget.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from boundpass.core.config import Config, DispatchConfig
from boundpass.core.errors import BoundpassInputError
from boundpass.backend.lowering import lower
from boundpass.passes.pipeline import PassContext, run_passes


class DispatchBlocks:
    """boundpass's per-block compile backend for a launch that checks no budget: each block graph Dynamo hands it
    goes through the dispatch pass (every torchtitan routed-experts region -> ``boundpass::pipelined_llep_fwd`` at
    chunk cap ``cap``), then through the lowering (``inner``: "aot_eager" or "inductor").

    The MoP layout's PipelinedLLEP (recipes/mop.py, ``parallelize_mop`` and the recipe's ``--boundpass.layout mop``):
    the model's own forwards stay torchtitan's and torchtitan's ``apply_compile`` hands every TransformerBlock to this
    backend, as the per-block compile of the default layout hands them to ``block_compile.CompiledBlocks``.
    """

    def __init__(self, layers: nn.ModuleDict, cap: int, inner: str = "aot_eager", borrowed_slots: int | None = None):
        """layers: the model's block container (``model.layers``), read when a graph compiles: by then the blocks in
        it are the modules torchtitan compiled (an activation-checkpoint wrapper around the block, under AC)."""
        if inner not in ("aot_eager", "inductor"):
            raise ValueError(f"DispatchBlocks: inner must be 'aot_eager' or 'inductor', got {inner!r}")
        self.layers = layers
        self.cap = int(cap)
        self.borrowed_slots = borrowed_slots  # s_b (None: e, LLEP's default)
        self.inner = inner
        self.graphs = 0                             # block graphs compiled
        self.regions: list = []                     # every DispatchRegion the pass found, in compile order

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from boundpass.passes.dispatch_pass import DispatchPass
        ctx = PassContext(config=Config(dispatch=DispatchConfig(borrowed_slots=self.borrowed_slots)),
                          dispatch_root=self._root(), fixed={"dispatch_cap": self.cap})
        regions = run_passes(gm, ctx, [DispatchPass()], plan_knobs=False).regions
        skipped = [r for r in regions if not r.rewritten]
        if skipped:
            raise BoundpassInputError("boundpass per-block compile: PipelinedLLEP was asked for, but the dispatch "
                                      "pass skipped " + "; ".join(f"{r.module_path}: {r.reason}" for r in skipped))
        self.graphs += 1
        self.regions.extend(regions)
        return lower(gm, example_inputs, self.inner, functools.partial(_partition, inductor=self.inner == "inductor"))

    def rewritten_paths(self, prefix: str = "layers") -> list[str]:
        """Per block, the model path of each routed-experts module whose region the pass rewrote (``layers.1.moe.
        routed_experts``, ...). One graph serves every block of the same structure, and a region the pass skips is an
        error, so a block's region is on PipelinedLLEP when a graph compiled so far rewrote its module path. Empty
        until the blocks compiled (the first forward)."""
        from torchtitan.models.common.moe import RoutedExperts
        done = {r.module_path.strip(".") for r in self.regions if r.rewritten}
        out = []
        for name, block in self.layers.items():
            for path, module in block.named_modules():
                rel = path.replace("_checkpoint_wrapped_module.", "").replace("_checkpoint_wrapped_module", "")
                if isinstance(module, RoutedExperts) and rel in done:
                    out.append(f"{prefix}.{name}.{rel}")
        return out

    def _root(self) -> nn.Module | None:
        """The module a block graph's paths start at. The pass resolves a region's module (its dispatcher, the EP mesh)
        from them; every MoE block of a model has the same structure and EP mesh, so the first MoE block serves every
        block graph (a dense block's graph has no region to resolve)."""
        from torchtitan.models.common.moe import RoutedExperts
        blocks = list(self.layers.values())
        moe = [b for b in blocks if any(isinstance(m, RoutedExperts) for m in b.modules())]
        return moe[0] if moe else (blocks[0] if blocks else None)

    def __repr__(self) -> str:  # torchtitan logs the backend
        return f"boundpass.DispatchBlocks(cap={self.cap}, borrowed_slots={self.borrowed_slots}, inner={self.inner})"


class RingDTPHeadBackend:
    """The backend of the MoP layout's head step: the vocab pass over the ring ``group`` (the W ranks), strip width
    ``block`` (0: the whole local shard), then aot_eager. The step it compiles computes the standard schedule (the
    vocab-sharded weight all-gathered over the ring, lm_head's projection, torchtitan's cross-entropy); the pass
    recognises the gather of the shard and rewrites projection + loss into ``boundpass::ring_dtp_fwd`` on this rank's
    shard, so the gather and the [N, V] logits never run. Anything else (the region skipped, or no region) is an
    error: the layout's budget counted Ring-DTP."""

    def __init__(self, group, block: int = 0):
        import torch.distributed as dist

        from boundpass.runtime.groups import group_name_of
        self.group_name = group_name_of(group)
        self.ring_size, self.ring_rank = dist.get_world_size(group), dist.get_rank(group)
        self.block = int(block or 0)
        self.regions: list = []  # every VocabRegion the pass found, in compile order

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from boundpass.passes.vocab_pass import VocabPass
        ctx = PassContext(config=Config(), group_name=self.group_name, ring_size=self.ring_size,
                          ring_rank=self.ring_rank, fixed={"vocab_block": self.block})
        regions = run_passes(gm, ctx, [VocabPass()], plan_knobs=False).regions
        self.regions.extend(regions)
        rewritten = [r for r in regions if r.rewritten]
        if len(rewritten) != 1 or len(regions) != 1:
            found = "; ".join(r.describe() for r in regions) or "no lm_head -> cross-entropy region"
            raise BoundpassInputError(f"boundpass MoP head: Ring-DTP was asked for, but the vocab pass found {found}")
        from boundpass.passes.vocab_pass import GATHERS
        left = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in GATHERS]
        if left:  # the gathered [V, H] weight would still be formed: memory the layout's budget does not count
            raise BoundpassInputError(f"boundpass MoP head: the vocab pass rewrote the loss but {len(left)} all-gather(s) "
                                      "of the weight remain in the head's graph")
        for region in rewritten:
            region.block, region.branch = self.block, "auto (per step, from the ring's largest N)"
            region.module_path = "lm_head"  # the head step's projection (its graph has no module around it)
        return lower(gm, example_inputs, "aot_eager", functools.partial(_partition, inductor=False))

    def __repr__(self) -> str:
        return f"boundpass.RingDTPHeadBackend(P={self.ring_size}, C={self.block or 'whole shard'})"


def _partition(joint, joint_inputs, *, inductor: bool, **kwargs):
    """torch's own partitioner (min-cut for Inductor, default for eager kernels), its saved values reordered by the
    AOTAutograd workaround every boundpass block graph needs at EP > 1 under FSDP2 (boundpass/backend/aot_workarounds.py)."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    from boundpass.backend.aot_workarounds import saved_tensors_before_opaque
    fw, bw = (min_cut_rematerialization_partition if inductor else default_partition)(joint, joint_inputs, **kwargs)
    saved_tensors_before_opaque(fw, bw, kwargs["num_fwd_outputs"])
    return fw, bw
