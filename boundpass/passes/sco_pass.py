"""SCO pass: offload activation-checkpoint boundaries of a compiled model to host memory under a host budget.

Two stages, because the decision must come before any real compute and the rewrite needs the partitioned graphs:

1. ``find_sco`` (in ``boundpass.compile``'s backend, on the Dynamo graph): every
   ``torch.ops.higher_order.tag_activation_checkpoint`` call is a checkpointed block; its first operand after
   the body is the block input the checkpoint keeps for recomputation (its boundary). Walking the blocks in
   forward order, the greedy prefix that fits the host pool (what the host budget leaves after the optimizer's
   host terms) is the most SCO may offload (``plan.most``) — the same rule as the eager runtime
   (``planned_offloaded_layers``). How many of them are offloaded is the planner's choice
   (``boundpass.planning.planner``): it rewrites the partitioned graphs for a candidate count (``apply_count`` + stage 2)
   and measures the step peak of the rewritten graphs (``boundpass.measure.step_peak``), the prefetched boundary the
   runtime holds between two reloads included (``held_intervals``).
2. ``rewrite_partitioned`` (called by boundpass.compile's planning partitioner, after the stock partitioner, for
   AOTAutograd and Inductor alike): finds each block's boundary in the joint graph (the region's one external,
   computed, floating input; regions are the ``ac_graph_id`` groups, in forward order) among the saved
   tensors and rewrites it:
      forward   x_l saved  ->  token_l = boundpass::sco_offload(x_l, ...) saved instead (kept layers: x_l stays
                saved and a token rides along so the ledger sees x_l's storage)
      backward  x_l placeholder -> boundpass::sco_reload(token_l, after_l, ...), where after_l holds one
                boundpass::sco_done(c) per consumer c of layer l+1's boundary (through views). The reload thus
                data-depends on every use of the previous boundary: no topological reordering (Inductor's
                scheduler, a peak-memory reorder, any pass) can hoist it before layer l+1's boundary is dead,
                and the reload op itself starts layer l−1's prefetch, so ≤ 2 restored boundaries are live.
   Regions whose boundary cannot be found or is not saved exactly once are left alone, with the reason.

Runtime ops, host pool, prefetch and event log: ``boundpass.runtime.sco`` (CompiledSCO). See docs/sco.md.
"""
from __future__ import annotations

import operator as _operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import Tensor

from boundpass.bound.bounds import BoundTerm
from boundpass.passes.graph_edit import descendants
from boundpass.runtime import sco as sco_rt
from boundpass.measure.step_peak import module_path
from boundpass.core.units import format_bytes

ORDER_RELOADS = True  # False only in tests: the negative control that shows what the ordering prevents
_ALIASING = {torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default, torch.ops.aten.detach.default}


@dataclass
class SCORegion:
    """One checkpointed block: where it is, its boundary, and what SCO decided for it."""
    layer: int                      # forward order among eligible blocks (-1: not eligible)
    module_path: str
    boundary_bytes: int = 0
    shape: tuple = ()
    dtype: torch.dtype | None = None
    offloaded: bool = False
    reason: str = ""                # why it is kept / skipped ("" for an offloaded one)
    joint_name: str = ""            # the boundary's node name in the joint / partitioned graphs (stage 2)
    input_index: int = -1           # the boundary is the graph's input at this position (per-block graphs)

    @property
    def eligible(self) -> bool:
        return self.layer >= 0


@dataclass
class SCOPlan:
    """What SCO decided for one compiled graph (explain() prints ``lines()``)."""
    mode: object
    regions: list[SCORegion] = field(default_factory=list)
    host_pool: int | None = None     # bytes the host budget leaves after the optimizer (None: not checked)
    offloaded: int = 0               # L_off
    reason: str = ""                 # why SCO offloads nothing at all ("" when it offloads)
    runtime: sco_rt.CompiledSCO | None = None
    rewritten: bool = False          # stage 2 ran and rewrote the partitioned graphs
    rewrite_notes: list[str] = field(default_factory=list)
    most: int = 0                    # boundaries the host pool can take (a prefix); the planner picks how many
    capped: bool = False             # ``most`` is sco.max_layers (sco_max_layers=), not what the host pool holds
    device: torch.device | None = None
    # per-block compile (find_block_sco): the boundary is the graph's input, one graph serves several blocks, and
    # the shared runtime (BlockSCO) decides per block at run time; ``offloaded`` is the blocks' prefix count
    dynamic: bool = False

    @property
    def eligible(self) -> list[SCORegion]:
        return [r for r in self.regions if r.eligible]

    @property
    def offloaded_bytes(self) -> int:
        return sum(r.boundary_bytes for r in self.regions if r.offloaded)

    def lines(self) -> list[str]:
        if self.dynamic and self.eligible and self.runtime is not None:
            r, total = self.eligible[0], len(self.runtime.plan)
            count = self.runtime.offload_count
            pool = "unchecked (no host_budget)" if self.host_pool is None else format_bytes(self.host_pool)
            what = (f"blocks 0..{count - 1} of {total} OFFLOADED, the rest kept" if count else
                    f"none of {total} blocks offloaded ({self.reason or 'not needed'})")
            out = [f"  SCO       per-block (mode={self.mode!r}): boundary = the block graph's input {tuple(r.shape)} "
                   f"{r.dtype} {format_bytes(r.boundary_bytes)}; {what}; host pool {pool} (holds {self.most})"
                   + ("" if self.rewritten else "; NOT rewritten")]
            return out + [f"    note: {n}" for n in self.rewrite_notes]
        head = (f"  SCO       mode={self.mode!r}: {len(self.eligible)} checkpointed blocks, {self.offloaded} "
                f"boundaries offloaded ({format_bytes(self.offloaded_bytes)}), host pool "
                + ("unchecked (no host_budget)" if self.host_pool is None else format_bytes(self.host_pool)))
        out = [head + (f"; {self.reason}" if self.reason else "")]
        for r in self.regions:
            what = "OFFLOADED" if r.offloaded else ("KEPT     " if r.eligible else "SKIPPED  ")
            size = f"{tuple(r.shape)} {r.dtype} {format_bytes(r.boundary_bytes)}" if r.shape else ""
            out.append(f"    {what} sco   {r.module_path} boundary {size}" + (f": {r.reason}" if r.reason else ""))
        out += [f"    note: {n}" for n in self.rewrite_notes]
        return out


# ------------------------------------------------------------------------------------------ stage 1: plan
def _is_param_placeholder(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "placeholder" and ("_parameters_" in node.name
                                                                       or "_buffers_" in node.name)


def find_checkpoint_regions(gm: fx.GraphModule, *, input_boundary: bool = False) -> list[SCORegion]:
    """Checkpointed blocks of a Dynamo graph in forward order, with their boundaries (or why not eligible).

    ``input_boundary``: the graph is one block of a per-block compile, whose boundary is the graph's input; the
    caller (the trunk's loop) drops it once the block has run, so offloading it does free the device copy.
    """
    regions = []
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.higher_order.tag_activation_checkpoint:
            continue
        path = module_path(node) or "<top level>"
        operands = [a for a in node.args[1:] if isinstance(a, fx.Node)
                    and isinstance(a.meta.get("example_value"), Tensor) and not _is_param_placeholder(a)]
        region = SCORegion(layer=-1, module_path=path)
        regions.append(region)
        if not operands:
            region.reason = "no activation operand (only parameters)"
            continue
        boundary = operands[0]
        val = boundary.meta["example_value"]
        region.shape, region.dtype = tuple(val.shape), val.dtype
        if any(isinstance(d, torch.SymInt) for d in val.shape):
            region.reason = "dynamic shape: SCO plans static boundary sizes (compile with dynamic=False)"
            continue
        region.boundary_bytes = val.numel() * val.element_size()
        if not val.is_floating_point():
            region.reason = f"boundary is {val.dtype}, not a floating activation"
        elif boundary.op == "placeholder" and not input_boundary:
            region.reason = "boundary is a graph input: the caller holds it, offloading would free nothing"
        elif boundary.op != "placeholder" and input_boundary:
            region.reason = ("the boundary is computed inside the block graph: per-block SCO offloads a block's "
                             "input (its checkpoint wraps the whole block)")
        else:
            region.input_index = inputs.index(boundary) if boundary.op == "placeholder" else -1
            region.layer = sum(r.eligible for r in regions)
    return regions


def host_term(plan: SCOPlan) -> BoundTerm:
    """The host pool the offloaded boundaries take (bytes), checked against the host budget."""
    return BoundTerm(f"SCO boundary pool on host (L_off={plan.offloaded})", sco_rt.sco_host_bound(),
                     plan.offloaded_bytes, kind="host",
                     knob="boundpass.compile(..., host_budget=<larger>) or sco_enable=False")


class SCOPass:
    """Selective checkpoint offload as a partition-stage pass (``boundpass.passes.protocol.PartitionPass``)."""
    name = "sco"

    def enabled(self, config) -> bool:
        return config.sco.enable is not False

    def find(self, gm: fx.GraphModule, config, *, host_pool: int | None) -> SCOPlan:
        """Every checkpointed block of a whole-model graph, and the most the host pool (and sco.max_layers) takes."""
        plan = find_sco(gm, config.sco.enable, host_pool=host_pool)
        cap_plan(plan, plan.most, config.sco.max_layers)
        return plan

    def find_block(self, gm: fx.GraphModule, config, *, runtime: sco_rt.BlockSCO) -> SCOPlan:
        """The one boundary of a per-block graph (its input), through the runtime every block graph shares."""
        return find_block_sco(gm, config.sco.enable, runtime=runtime, most=0)

    def rewrite(self, plan: SCOPlan, count: int, joint, fw: fx.GraphModule, bw: fx.GraphModule,
                num_fwd_outputs: int, *, waits: bool) -> list:
        """Offload the first ``count`` boundaries (the planner's L_off) in the partitioned graphs, in place; returns
        the intervals the runtime holds a prefetched boundary outside the graphs (for the step analysis).
        ``waits``: the graphs are lowered by Inductor (see CompiledSCO.offload_waits)."""
        if not plan.eligible:
            return []
        apply_count(plan, count)
        if not plan.dynamic and not count:  # per-block graphs always go through the shared runtime
            return []
        if waits:
            plan.runtime.offload_waits = True
        if plan.dynamic:
            rewrite_block_boundary(plan, joint, fw, bw, num_fwd_outputs)
            return []
        rewrite_partitioned(plan, joint, fw, bw, num_fwd_outputs)
        return held_intervals(plan, bw)

    def host_terms(self, plan: SCOPlan) -> list[BoundTerm]:
        """The host pool of a whole-model graph's offloaded boundaries (per-block: one row of the composition)."""
        return [host_term(plan)] if plan.offloaded and not plan.dynamic else []

    def diagnose(self, plan: SCOPlan) -> str | None:
        """The fix to offer when saved boundaries bind and more offload could help (None when it cannot: every
        eligible boundary the host could take is offloaded already)."""
        if not plan.eligible or (plan.mode is not False and plan.most >= len(plan.eligible)):
            return None
        if plan.mode is False:
            return "boundpass.compile(..., sco_enable='auto', host_budget=<host bytes>) offloads checkpoint boundaries"
        if plan.capped:
            return (f"boundpass.compile(..., sco_max_layers=<larger>): {plan.most} of {len(plan.eligible)} checkpoint "
                    f"boundaries may be offloaded")
        return (f"boundpass.compile(..., host_budget=<larger>): the host pool holds {plan.most} of "
                f"{len(plan.eligible)} checkpoint boundaries")


def cap_plan(plan: SCOPlan, most: int, cap: int | None) -> None:
    """The most boundaries SCO may offload (``plan.most``): what the host pool holds, at most sco.max_layers."""
    plan.most, plan.capped = (most, False) if cap is None or most <= cap else (cap, True)


def find_sco(gm: fx.GraphModule, mode, *, host_pool: int | None) -> SCOPlan:
    """Checkpointed blocks of the Dynamo graph and the most SCO may offload (``plan.most``); the planner picks."""
    plan = SCOPlan(mode=mode)
    if mode is False:
        plan.reason = "off (sco_enable=False)"
        return plan
    plan.regions = find_checkpoint_regions(gm)
    eligible = plan.eligible
    if not plan.regions:
        plan.reason = "no checkpointed blocks in the graph (apply activation checkpointing, e.g. torchtitan FullAC)"
        return plan
    if not eligible:
        plan.reason = "no checkpointed block has an offloadable boundary"
        return plan
    plan.host_pool = host_pool
    pool = host_pool if host_pool is not None else sum(r.boundary_bytes for r in eligible)
    plan.most = sco_rt.planned_offloaded_layers([r.boundary_bytes for r in eligible], pool)
    plan.device = boundary_device(gm)
    return plan


def find_block_sco(gm: fx.GraphModule, mode, *, runtime: sco_rt.BlockSCO, most: int) -> SCOPlan:
    """SCO of one block graph of a per-block compile: its one checkpoint boundary is the graph's input.

    ``runtime`` is shared by every block graph of the model; ``most`` is how many blocks (a forward prefix) the host
    pool takes. The graph is rewritten whatever is offloaded (the runtime decides per block at run time); how many
    blocks are offloaded is the composition's choice (boundpass/backend/block_compile.py), the planner's scan of
    ``1..most`` included.
    """
    plan = SCOPlan(mode=mode, dynamic=True)
    if mode is False:
        plan.reason = "off (sco_enable=False)"
        return plan
    plan.regions = find_checkpoint_regions(gm, input_boundary=True)
    if not plan.regions:
        plan.reason = ("the block graph has no checkpoint (apply activation checkpointing: "
                       "--activation_checkpoint.mode full or selective)")
        return plan
    if len(plan.eligible) != 1:
        plan.reason = f"{len(plan.eligible)} offloadable boundaries in one block graph (per-block SCO expects one)"
        for region in plan.eligible:
            region.layer, region.reason = -1, plan.reason
        return plan
    plan.host_pool, plan.most, plan.runtime = runtime.host_budget, most, runtime
    plan.device = runtime.device
    return plan


def apply_count(plan: SCOPlan, count: int) -> None:
    """Offload the first ``count`` eligible boundaries (a forward-order prefix); build the runtime for them."""
    if plan.dynamic:  # per-block: ``count`` is the blocks' prefix; the shared runtime is set by the composition
        plan.offloaded = count
        plan.reason = "" if count else ("not needed: the device budget fits with every boundary on the device "
                                        "(sco_enable='auto')" if plan.most else "the host pool takes no boundary")
        return
    plan.offloaded = count
    plan.rewritten, plan.rewrite_notes = False, []
    for region in plan.eligible:
        region.offloaded = region.layer < count
        region.reason = "" if region.offloaded else (
            "the device budget fits without offloading it (sco_enable='auto')"
            if plan.mode == "auto" and count < plan.most
            else f"past sco_max_layers={plan.most}" if plan.capped
            else "does not fit the host pool (the offloaded set is a prefix)")
    if count == 0:
        plan.runtime = None
        plan.reason = ("host budget fits none of the boundaries" if plan.most == 0
                       else "not needed: the device budget fits with every boundary on the device (sco_enable='auto')")
        return
    plan.reason = ""
    plan.runtime = sco_rt.CompiledSCO([r.offloaded for r in plan.eligible],
                                      plan.host_pool if plan.host_pool is not None else plan.offloaded_bytes,
                                      plan.device)


def held_intervals(plan: SCOPlan, bw: fx.GraphModule) -> list:
    """The prefetched boundary the runtime holds outside the graph: from reload l (which starts l-1's copy)
    to reload l-1 (which returns it)."""
    from boundpass.measure.step_peak import Held
    import sympy
    reloads = {n.args[3]: n for n in bw.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.boundpass.sco_reload.default}
    out = []
    for layer, node in reloads.items():
        if layer - 1 in reloads:
            size = plan.eligible[layer - 1].boundary_bytes
            out.append(Held(node, reloads[layer - 1], sympy.Integer(size), f"SCO prefetch of boundary {layer - 1}"))
    return out


def boundary_device(gm) -> torch.device:
    for node in gm.graph.nodes:
        val = node.meta.get("example_value")
        if isinstance(val, Tensor) and val.is_floating_point():
            return val.device
    return torch.device("cpu")


# ------------------------------------------------------------------------------------- stage 2: rewrite
def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _joint_boundaries(joint: fx.GraphModule) -> list[list[fx.Node]]:
    """Per checkpoint region of the joint graph (forward order): its external, computed, floating inputs."""
    members: dict[object, set] = {}
    order = []
    for node in joint.graph.nodes:
        region = node.meta.get("ac_graph_id")
        if region is None:
            continue
        if region not in members:
            members[region] = set()
            order.append(region)
        members[region].add(node)
    out = []
    for region in order:
        seen = []
        for node in joint.graph.nodes:
            if node not in members[region]:
                continue
            for arg in node.all_input_nodes:
                val = _val(arg)
                if (arg not in members[region] and arg not in seen and arg.op != "placeholder"
                        and isinstance(val, Tensor) and val.is_floating_point()):
                    seen.append(arg)
        out.append(seen)
    return out


def _fake_call(fake_mode, target, *args):
    def one(x):
        return _val(x) if isinstance(x, fx.Node) else x
    vals = [[one(a) for a in x] if isinstance(x, list) else one(x) for x in args]
    with fake_mode:
        return target(*vals)


def _add(graph: fx.Graph, fake_mode, target, *args) -> fx.Node:
    node = graph.call_function(target, tuple(args))
    node.meta["val"] = _fake_call(fake_mode, target, *args)
    return node


def _consumers(node: fx.Node) -> list[fx.Node]:
    """Nodes that read ``node``'s memory: its users, looking through views (a view keeps the storage alive)."""
    out, stack, seen = [], list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen or user.op == "output":
            continue
        seen.add(user)
        target = user.target
        if isinstance(target, torch._ops.OpOverload) and (target.is_view or target in _ALIASING):
            stack.extend(user.users)
        else:
            out.append(user)
    return out


def rewrite_partitioned(plan: SCOPlan, joint, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Rewrite the partitioned graphs in place for ``plan`` (regions that cannot be matched are kept, noted)."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    runtime = plan.runtime
    eligible = plan.eligible
    joint_regions = _joint_boundaries(joint)
    all_regions = plan.regions
    if len(joint_regions) != len(all_regions):
        plan.rewrite_notes.append(f"the joint graph has {len(joint_regions)} checkpoint regions, the Dynamo graph "
                                  f"{len(all_regions)}: nothing offloaded")
        _keep_all(plan)
        return
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    bw_placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    out_node = fw.graph.find_nodes(op="output")[0]
    outputs = list(out_node.args[0])
    matched: dict[int, tuple[fx.Node, fx.Node]] = {}  # layer -> (fw node, bw placeholder)
    for region, candidates in zip(all_regions, joint_regions):
        if not region.eligible:
            continue
        fits = [c for c in candidates if _val(c).numel() * _val(c).element_size() == region.boundary_bytes]
        why = ""
        if len(fits) != 1:
            why = f"{len(fits)} candidate boundaries of {region.boundary_bytes} B in the joint graph"
        else:
            name = fits[0].name
            node, placeholder = fw_nodes.get(name), bw_placeholders.get(name)
            slots = [i for i, o in enumerate(outputs) if o is node]
            if node is None or placeholder is None or len(slots) != 1 or slots[0] < num_fwd_outputs:
                why = "the partitioner does not save the boundary exactly once for backward"
            else:
                region.joint_name = name
                matched[region.layer] = (node, placeholder)
        if why:
            plan.rewrite_notes.append(f"{region.module_path}: kept on device, {why}")
    # the offloaded set must stay a prefix: stop at the first offloaded layer that could not be matched
    for region in eligible:
        if region.offloaded and region.layer not in matched:
            for later in eligible[region.layer:]:
                if later.offloaded:
                    later.offloaded = False
                    later.reason = "kept: an earlier boundary could not be matched in the partitioned graph"
    runtime.plan = runtime.offloaded = [r.offloaded for r in eligible]
    if sum(runtime.plan) < plan.offloaded:
        _replan(plan, sum(runtime.plan))
    if not matched:
        return
    fake_mode = next(_val(n) for n in fw.graph.nodes if isinstance(_val(n), Tensor)).fake_mode
    offload_op, reload_op, done_op = (torch.ops.boundpass.sco_offload.default, torch.ops.boundpass.sco_reload.default,
                                      torch.ops.boundpass.sco_done.default)
    # forward: a token per matched boundary, right after it is produced
    new_outputs = list(outputs)
    restored: dict[int, fx.Node] = {}  # layer -> what backward reads for the boundary
    inserts = []                       # (fw slot after which a kept token goes, bw placeholder after which)
    for layer, (node, placeholder) in sorted(matched.items()):
        offload = eligible[layer].offloaded
        with fw.graph.inserting_after(node):
            token = _add(fw.graph, fake_mode, offload_op, node, runtime.sco_id, layer, offload)
        slot = new_outputs.index(node)
        if offload:
            new_outputs[slot] = token
            placeholder.meta["val"] = token.meta["val"]
        else:
            inserts.append((node, token, placeholder))
        restored[layer] = placeholder
    for node, token, placeholder in inserts:  # kept: the token rides along as one more saved tensor
        new_outputs.insert(new_outputs.index(node) + 1, token)
        with bw.graph.inserting_after(placeholder):
            extra = bw.graph.placeholder(f"sco_keep_token_{token.args[2]}")
        extra.meta["val"] = token.meta["val"]
    out_node.args = (tuple(new_outputs),)
    # backward: reload each offloaded boundary after every consumer of the next layer's boundary
    readers = {layer: _consumers(ph) for layer, ph in restored.items()}
    downstream = {layer: descendants(ph) for layer, ph in restored.items()}
    for layer in sorted(matched, reverse=True):
        if not eligible[layer].offloaded:
            continue
        placeholder = restored[layer]
        users = list(placeholder.users)
        val = _val(matched[layer][0])
        after = []
        ahead = [c for c in readers.get(layer + 1, []) if c not in downstream[layer]]
        if len(ahead) < len(readers.get(layer + 1, [])):  # a reader that needs this boundary cannot precede it
            plan.rewrite_notes.append(f"layer {layer}: {len(readers[layer + 1]) - len(ahead)} readers of the next "
                                      f"boundary depend on this one and do not order its reload")
        for consumer in ahead if ORDER_RELOADS else []:
            for anchor in _tensor_outputs(consumer):  # a multi-output reader (native_layer_norm) through its getitems
                with bw.graph.inserting_after(anchor):
                    after.append(_add(bw.graph, fake_mode, done_op, anchor))
        if layer + 1 < len(eligible) and layer + 1 not in readers:
            plan.rewrite_notes.append(f"layer {layer}: the next boundary was not matched; its reload is ordered "
                                      f"by data flow only")
        first = min(users, key=_order(bw.graph)) if users else None
        with bw.graph.inserting_before(first) if first is not None else bw.graph.inserting_after(placeholder):
            reload = _add(bw.graph, fake_mode, reload_op, placeholder, after, runtime.sco_id, layer,
                          list(val.shape), list(val.stride()), val.dtype)
        placeholder.replace_all_uses_with(reload, delete_user_cb=lambda user: user is not reload)
        _refresh_views(reload, fake_mode)
    stable_topological_sort(bw.graph)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    plan.rewritten = True


def rewrite_block_boundary(plan: SCOPlan, joint, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int):
    """Per-block SCO: the block graph's input boundary is saved as a token, read back in backward.

        forward   token = sco_offload(x, sco_id, -1, True)     saved instead of x (the runtime offloads it, or keeps
                                                               it on the device, for the block that runs)
        backward  x = sco_reload(token, [], sco_id, -1, ...)   before x's first use; starts the previous block's
                                                               prefetch (the next graph to run backward)
    Graph inputs are the joint graph's primals in Dynamo's placeholder order. Nothing else in the graph changes.
    """
    region = plan.eligible[0]
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
    why = ""
    if not 0 <= region.input_index < len(primals):
        why = "its input is not among the joint graph's primals"
    else:
        primal = primals[region.input_index]
        val = _val(primal)
        if not isinstance(val, Tensor) or tuple(val.shape) != tuple(region.shape) or val.dtype != region.dtype:
            why = f"the joint graph's input {primal.name} is not the boundary ({tuple(region.shape)} {region.dtype})"
        else:
            node = next((n for n in fw.graph.nodes if n.op == "placeholder" and n.name == primal.name), None)
            placeholder = next((n for n in bw.graph.nodes if n.op == "placeholder" and n.name == primal.name), None)
            out_node = fw.graph.find_nodes(op="output")[0]
            outputs = list(out_node.args[0])
            slots = [i for i, o in enumerate(outputs) if o is node]
            if node is None or placeholder is None or len(slots) != 1 or slots[0] < num_fwd_outputs:
                why = "the partitioner does not save the boundary exactly once for backward"
    if why:
        plan.rewrite_notes.append(f"{region.module_path or 'block'}: kept on device, {why}")
        plan.rewritten = False
        return
    region.joint_name = primal.name
    runtime = plan.runtime
    fake_mode = next(_val(n) for n in fw.graph.nodes if isinstance(_val(n), Tensor)).fake_mode
    last_input = [n for n in fw.graph.nodes if n.op == "placeholder"][-1]
    with fw.graph.inserting_after(last_input):
        token = _add(fw.graph, fake_mode, torch.ops.boundpass.sco_offload.default, node, runtime.sco_id, -1, True)
    outputs[slots[0]] = token
    out_node.args = (tuple(outputs),)
    placeholder.meta["val"] = token.meta["val"]
    # backward's saved inputs are matched to forward's outputs by name (boundpass.measure.step_peak): the placeholder now
    # receives the token; with the old name the analysis would keep the forward's input alive into backward
    placeholder._rename(token.name)
    users = list(placeholder.users)
    first = min(users, key=_order(bw.graph)) if users else None
    with bw.graph.inserting_before(first) if first is not None else bw.graph.inserting_after(placeholder):
        reload = _add(bw.graph, fake_mode, torch.ops.boundpass.sco_reload.default, placeholder, [], runtime.sco_id, -1,
                      list(val.shape), list(val.stride()), val.dtype)
    placeholder.replace_all_uses_with(reload, delete_user_cb=lambda user: user is not reload)
    _refresh_views(reload, fake_mode)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    plan.rewritten = True


def _tensor_outputs(node: fx.Node) -> list[fx.Node]:
    """The nodes that hold ``node``'s tensor results: itself, or for a multi-output op (``native_layer_norm`` and its
    backward return tuples) the getitem users that read a tensor out of it."""
    if isinstance(_val(node), Tensor):
        return [node]
    return [u for u in node.users if u.op == "call_function" and u.target is _operator.getitem
            and isinstance(_val(u), Tensor)]


def _is_alias(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and (
        target.is_view or target in _ALIASING)


def _refresh_views(reload: fx.Node, fake_mode) -> None:
    """Re-derive the fake values of the views read through ``reload``: they were views of the boundary the
    partitioner saved, and the step analysis tracks storages by their fake values, so a stale view would
    make the restored boundary look dead at its first view (and the weight gradient that reads it later free)."""
    stack = [u for u in reload.users if _is_alias(u)]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        args = torch.fx.node.map_arg(node.args, _val)
        kwargs = torch.fx.node.map_arg(node.kwargs, _val)
        with fake_mode:
            node.meta["val"] = node.target(*args, **kwargs)
        stack.extend(u for u in node.users if _is_alias(u))


def _order(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: index[n]


def _keep_all(plan: SCOPlan) -> None:
    for region in plan.eligible:
        region.offloaded = False
    if plan.runtime is not None:
        plan.runtime.plan = plan.runtime.offloaded = [False] * len(plan.eligible)
    _replan(plan, 0)


def _replan(plan: SCOPlan, offloaded: int) -> None:
    """The partitioned graph allowed fewer offloads than planned: the analysis of the rewritten graphs sees it."""
    plan.offloaded = offloaded


# ----------------------------------------------------------------------------------- compiler plumbing
def eager_callable(graph: fx.GraphModule):
    """A boxed callable for the eager (aot_eager) inner compiler.

    Every graph runs with the boxed calling convention (as torch's own aot_eager does), so each input — a saved
    tensor of backward among them — is freed after its last use instead of living until the graph returns: the
    lifetimes the step analysis (boundpass.measure.step_peak) assumes.
    """
    from torch.fx.graph import _BoxedCodeGen
    graph.graph.set_codegen(_BoxedCodeGen())
    graph.recompile()

    def run(args):
        return graph(args)
    run._boxed_call = True
    return run


