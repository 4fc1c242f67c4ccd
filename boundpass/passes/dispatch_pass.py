"""Dispatch pass: find torchtitan's routed-experts region (token dispatch -> grouped experts -> combine) in a
Dynamo graph and rewrite it to the PipelinedLLEP custom op, whose peak is fixed by launch configuration.

The region is every node traced inside a `RoutedExperts` module (torchtitan `models/common/moe.py`): the local
reorder, the count exchange and `.tolist()` host sync, the token all-to-all, the grouped SwiGLU experts, the
combine all-to-all and the score-weighted scatter-add. Its interface is small and fixed: x, top-k scores, top-k
expert ids and per-expert counts in; one [.., H] tensor out. The rewrite keeps that interface and replaces the
body with `boundpass::pipelined_llep_fwd` (its backward comes from the op's registered autograd).

What is checked before rewriting (each failure is a reported skip, never a silent one):
- the module resolves, its dispatcher is torchtitan's `LocalTokenDispatcher` (EP = 1) or
  `AllToAllTokenDispatcher` (EP > 1) exactly: subclasses (DeepEP, HybridEP, TorchAO padding) differ in what they
  move and are not ours to reinterpret;
- the experts are the SwiGLU grouped experts: three `_grouped_mm`s shaped silu(x w1) * (x w3) -> w2, no bias;
  the dtype of their operands is the compute dtype the op reproduces (torchtitan casts to bf16);
- the region has exactly the four activation inputs above, the three weights, and one output.
Regions inside activation-checkpoint bodies (torchtitan FullAC / SelectiveAC) are found in the HOP subgraphs.

Routed experts outside RoutedExperts (any top-k whose ids group tokens and combine them back) are found by
structure (``_routed_by_structure``): rewritten at EP = 1 when they compute what the op computes
(passes/dispatch_structure.py), reported SKIPPED with the reason otherwise.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from boundpass.passes.graph_edit import example_value as _val
from boundpass.passes.graph_edit import concrete_size, graph_modules, node_adder, op_arg, set_op_arg
# PipelinedLLEP planner defaults (LLEP's public defaults: docs/design.md §6); the cap c is set by the budget
from boundpass.core import symbols as sym
from boundpass.bound.bounds import Knob
from boundpass.passes.protocol import Diagnosis
from boundpass.measure.step_peak import pretty_path, without_hops
from boundpass.runtime.llep_plan import DEFAULT_ALPHA, DEFAULT_IMBALANCE, DEFAULT_MIN_PIECE
from boundpass.runtime.groups import group_name_of
from boundpass.core.units import format_bytes


@dataclass
class DispatchRegion:
    """One routed-experts region: where it is, and what happened to it."""
    module_path: str
    rewritten: bool
    reason: str = ""
    kind: str = "dispatch"
    tokens: object = None            # T, tokens on this rank at the region (int or SymInt)
    hidden: int = 0
    inter: int = 0                   # expert intermediate size I
    experts: int = 0                 # E (global)
    local_experts: int = 0           # e = E / E_p
    top_k: int = 0
    ep_size: int = 1
    group_name: str = ""
    dtype: torch.dtype | None = None
    compute_dtype: torch.dtype | None = None
    cap: int = 0                     # c chosen by the budget
    form: str = "token dispatch -> grouped experts -> combine"   # what was matched (torchtitan's, or by structure)
    op_node: fx.Node | None = field(default=None, repr=False)

    @property
    def borrowed_slots(self) -> int:
        """s_b, the borrowed-expert slots the op was given (dispatch.borrowed_slots; _op_args)."""
        return op_arg(self.op_node, "max_borrowed") if self.op_node is not None else 0

    def describe(self) -> str:
        if not self.rewritten:
            return f"SKIPPED   dispatch {self.module_path}: {self.reason}"
        return (f"REWRITTEN dispatch {self.module_path}: {self.form} => "
                f"boundpass::pipelined_llep (T={self.tokens}, H={self.hidden}, I={self.inter}, E={self.experts}, "
                f"k={self.top_k}, E_p={self.ep_size}, {self.dtype}, experts in {self.compute_dtype}, c={self.cap}, "
                f"s_b={self.borrowed_slots})")


def _stack(node: fx.Node) -> list[tuple[str, type]]:
    return [(v[0], v[1]) for v in (node.meta.get("nn_module_stack") or {}).values()]


def _routed_experts_classes():
    from torchtitan.models.common.moe import RoutedExperts
    return RoutedExperts


def _region_key(node: fx.Node, routed_cls) -> str | None:
    for path, cls in _stack(node):
        if isinstance(cls, type) and issubclass(cls, routed_cls):
            return path
    return None




def _resolve(root: torch.nn.Module, path: str):
    """The module a Dynamo nn_module_stack path names, or None.

    Paths start at the compiled frame's ``self``: ``L['self'].model...`` under boundpass.compile, a bare
    ``__dict__['_modules']['_checkpoint_wrapped_module'].moe...`` under a per-block compile of a checkpointed block.
    The closure hops of torchtitan's local_map wrappers and ``_modules`` lookups are walked as the children they are.
    """
    path = without_hops(path)
    if path.startswith("L['self']"):
        path = path[len("L['self']"):]
    if "__" in path or path.startswith("L["):
        return None
    mod = root
    for tok in path.replace("['", ".").replace("']", "").split("."):
        if not tok:
            continue
        nxt = getattr(mod, tok, None) if not tok.isdigit() else None
        if nxt is None and isinstance(mod, torch.nn.Module):
            nxt = mod._modules.get(tok)
        if nxt is None:
            return None
        mod = nxt
    return mod


def _find_module(root, stack, key, routed_cls):
    """The RoutedExperts instance of a region: its own path, or the one child of the deepest resolvable parent."""
    paths = [p for p, _ in stack]
    upto = paths[: paths.index(key) + 1]
    for path in reversed(upto):
        mod = _resolve(root, path)
        if mod is None:
            continue
        if isinstance(mod, routed_cls):
            return mod
        found = [m for m in mod.modules() if isinstance(m, routed_cls)]
        return found[0] if len(found) == 1 else None
    return None


def _pretty(path: str) -> str:
    """A region's path from the model (BoundedModule's ``model.`` left out, as torchtitan names its modules)."""
    return pretty_path(path[len("L['self'].model."):] if path.startswith("L['self'].model.") else path)


def _is(node, kind, target) -> bool:
    return isinstance(node, fx.Node) and node.op == kind and node.target == target


def _weight_source(node: fx.Node, region: set) -> fx.Node | None:
    """Walk a grouped-mm weight operand back through casts / transpose / to_local to its graph input."""
    while isinstance(node, fx.Node) and node in region and node.op == "call_method" and node.target in (
            "bfloat16", "float", "half", "to", "transpose", "to_local", "contiguous"):
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node not in region else None


def _match_experts(nodes: list[fx.Node], region: set):
    """(w1, w2, w3 graph inputs, compute dtype) of a SwiGLU grouped-experts body, or (None, reason)."""
    mms = [n for n in nodes if n.op == "call_function" and n.target is torch._grouped_mm]
    if len(mms) != 3:
        return None, f"expected the 3 grouped matmuls of SwiGLU experts, found {len(mms)}"
    gate, up, down = mms
    mul = down.args[0]
    ok = (isinstance(mul, fx.Node) and mul.op == "call_function" and mul.target is operator.mul
          and {a for a in mul.args if isinstance(a, fx.Node)} >= {up}
          and any(_is(a, "call_function", F.silu) and a.args[0] is gate for a in mul.args))
    if not ok or any(len(m.args) > 3 or m.kwargs.get("bias") is not None for m in mms):
        return None, "the experts are not silu(x w1) * (x w3) -> w2 (e.g. biases or another activation)"
    weights = [_weight_source(m.args[1], region) for m in (gate, down, up)]
    if any(w is None or w.op != "placeholder" for w in weights):
        return None, "expert weights do not come straight from parameters"
    return (tuple(weights), _val(gate.args[0]).dtype), ""


def _classify_inputs(externals: list[fx.Node], weights: tuple, hidden: int):
    """x, top-k scores, top-k ids from the region's non-weight inputs (counts are recomputed by the op)."""
    x = scores = ids = None
    for node in externals:
        if node in weights:
            continue
        val = _val(node)
        if isinstance(val, torch.SymInt):
            continue  # a size the region reads (symbolic once Dynamo recompiles for a new length): the op takes
            #           its sizes from its tensors
        if not isinstance(val, torch.Tensor):
            return None, f"unrecognised region input {node.name} ({type(val).__name__})"
        if val.is_floating_point() and val.shape[-1] == hidden and x is None:
            x = node
        elif val.is_floating_point() and scores is None:
            scores = node
        elif not val.is_floating_point() and val.dim() >= 2 and ids is None:
            ids = node
        elif not val.is_floating_point() and val.dim() == 1:
            continue  # per-expert counts: the op derives them from the ids
        else:
            return None, f"unrecognised region input {node.name} {tuple(val.shape)} {val.dtype}"
    if x is None or scores is None or ids is None or _val(scores).shape != _val(ids).shape:
        return None, "could not identify x, top-k scores and top-k ids among the region inputs"
    return (x, scores, ids), ""


def rewrite_dispatch_regions(gm: fx.GraphModule, root: torch.nn.Module,
                             borrowed_slots: int | None = None) -> list[DispatchRegion]:
    """Rewrite every eligible routed-experts region (cap left at 0; the compiler sets it); return all found.
    ``borrowed_slots``: Config's dispatch.borrowed_slots (s_b; None: e, LLEP's default)."""
    try:
        routed_cls = _routed_experts_classes()
    except ImportError:  # no torchtitan: no torchtitan MoE regions to find, only the ones found by structure
        routed_cls = None
    # routed experts outside torchtitan's RoutedExperts, found by what they compute; before torchtitan's rewrite
    # below, which replaces the nodes this tells apart from them
    unmatched = _routed_by_structure(gm, routed_cls)
    if routed_cls is None:
        for graph_module in graph_modules(gm):
            graph_module.graph.lint()
            graph_module.recompile()
        return unmatched
    # group by the module itself: one module can appear under several stack paths (wrappers, local_map)
    groups: dict[object, list[tuple[fx.GraphModule, str, object, list[fx.Node]]]] = {}
    for graph_module in list(graph_modules(gm)):
        modules: dict[str, object] = {}
        here: dict[object, tuple] = {}
        for node in graph_module.graph.nodes:
            if node.op not in ("call_function", "call_method", "get_attr"):
                continue
            key = _region_key(node, routed_cls)
            if key is None:
                continue
            if key not in modules:
                modules[key] = _find_module(root, _stack(node), key, routed_cls)
            module = modules[key]
            ident = id(module) if module is not None else key
            here.setdefault(ident, (graph_module, key, module, []))[3].append(node)
        for ident, group in here.items():
            groups.setdefault(ident, []).append(group)
    regions = []
    for parts in groups.values():
        graph_module, key, module, nodes = parts[0]
        reason = unsupported_reason(module)
        if reason:
            regions.append(DispatchRegion(module_path=_pretty(key), rewritten=False, reason=reason))
            continue
        if len(parts) > 1:  # e.g. part of the experts traced into a nested HOP body: no single region to replace
            regions.append(DispatchRegion(module_path=_pretty(key), rewritten=False,
                                          reason=f"the region is split across {len(parts)} nested graphs"))
            continue
        regions.append(_rewrite_one(graph_module, key, module, nodes, borrowed_slots))
    for graph_module in graph_modules(gm):
        graph_module.graph.lint()
        graph_module.recompile()
    return regions + unmatched


# what routed experts do after the top-k, whatever module computes them: group tokens by expert, combine back
_ROUTING_TARGETS = {torch.where, torch.nonzero, torch.argsort, torch.sort, torch.bincount, torch.histc,
                    torch.index_add, torch.scatter_add, F.one_hot, torch._grouped_mm}
_ROUTING_METHODS = {"index_add_", "index_add", "scatter_add_", "scatter_add", "nonzero", "argsort", "sort",
                    "bincount", "histc"}


def _gathers_experts(node: fx.Node) -> bool:
    """P[ids] of a 3-D parameter P (one [out, in] weight per expert) at indices computed from a top-k: each route's
    expert weights gathered (HF's batched_mm experts)."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return False
    base, index = node.args
    val = _val(base) if isinstance(base, fx.Node) else None
    return isinstance(index, fx.Node) and isinstance(base, fx.Node) and base.op == "placeholder" \
        and val is not None and val.dim() == 3


def _routed_by_structure(gm: fx.GraphModule, routed_cls) -> list[DispatchRegion]:
    """Every top-k whose results route tokens (grouped by expert, then combined) outside torchtitan's
    RoutedExperts: a MoE block written another way (a Mixtral-style block in plain PyTorch, another library's).
    When it computes what PipelinedLLEP computes (passes/dispatch_structure.py) it is rewritten at EP = 1;
    otherwise it is reported SKIPPED with the reason, so the user knows its dispatch is not bounded by the op."""
    from boundpass.passes.dispatch_structure import Skip, match_routed_experts
    from boundpass.passes.sorted_experts import match_sorted_experts
    out, seen = [], set()
    for graph_module in list(graph_modules(gm)):
        routed_nodes = {n for n in graph_module.graph.nodes
                        if routed_cls is not None and _region_key(n, routed_cls) is not None}
        for node in list(graph_module.graph.nodes):
            if node.graph is not graph_module.graph:
                continue  # erased by an earlier rewrite in this graph
            is_topk = (node.op == "call_function" and node.target is torch.topk) or \
                      (node.op == "call_method" and node.target == "topk")
            if not is_topk:
                continue
            routes, torchtitan = False, False
            stack, visited = list(node.users), set()
            while stack:  # everything computed from the top-k
                user = stack.pop()
                if user in visited:
                    continue
                visited.add(user)
                if user in routed_nodes:
                    torchtitan = True  # torchtitan's router feeding its RoutedExperts: reported by the pass above
                    break
                routes |= (user.op == "call_function" and user.target in _ROUTING_TARGETS) or \
                          (user.op == "call_method" and user.target in _ROUTING_METHODS) or _gathers_experts(user)
                stack.extend(user.users)
            if torchtitan or not routes:
                continue  # not routing (e.g. top-k sampling), or torchtitan's own
            stack_paths = [p for p, _ in _stack(node)]
            path = _pretty(stack_paths[-1]) if stack_paths else "(top level)"
            try:
                matched = match_routed_experts(graph_module.graph, node, routed_nodes)
            except Skip as why:
                try:  # the sorted grouped-matmul form (Hugging Face's grouped_mm experts)
                    sorted_match = match_sorted_experts(graph_module.graph, node)
                except Skip as also:
                    why = f"{why}; as sorted grouped-matmul experts: {also}"
                else:
                    seen.add(path)
                    experts = [p for p, _ in _stack(sorted_match["out"])]  # name the experts, not the router
                    out.append(_rewrite_sorted(graph_module, sorted_match, _pretty(experts[-1]) if experts else path))
                    continue
                if path not in seen:
                    seen.add(path)
                    out.append(DispatchRegion(module_path=path, rewritten=False, reason=(
                        f"routed experts (top-k -> tokens grouped by expert -> combine) that PipelinedLLEP does not "
                        f"compute: {why}; not torchtitan's RoutedExperts either, so this dispatch is not bounded "
                        f"by PipelinedLLEP; the step peak counts its buffers as traced, each data-dependent size at "
                        f"its upper bound")))
                continue
            seen.add(path)
            out.append(_rewrite_structural(graph_module, matched, path))
    # a top-k of a MoE block whose experts were rewritten through another top-k (GLM-4-MoE's group selection before
    # its expert selection) routes nothing of its own: not a skipped region
    done = {r.module_path.rpartition(".")[0] for r in out if r.rewritten}
    return [r for r in out if r.rewritten or r.module_path.rpartition(".")[0] not in done]


def _rewrite_structural(graph_module: fx.GraphModule, matched: dict, path: str) -> DispatchRegion:
    """One routed-experts region found by structure, rewritten at EP = 1 (cap left at 0: the compiler sets it)."""
    from boundpass.passes.dispatch_structure import rewrite_routed_experts
    e = matched["experts"]
    dtype = _val(matched["x"]).dtype
    # EP = 1, no group; the experts run in x's dtype (the block's linears do)
    fused = rewrite_routed_experts(graph_module, matched, functools.partial(
        _op_args, group_name="", local_experts=e, ep_size=1, compute_dtype=dtype))
    return DispatchRegion(module_path=path, rewritten=True, form=STRUCTURAL_FORM, tokens=_val(fused.args[0]).shape[0],
                          hidden=matched["hidden"], inter=matched["inter"], experts=e, local_experts=e,
                          top_k=matched["top_k"], ep_size=1, group_name="", dtype=dtype, compute_dtype=dtype,
                          op_node=fused)


STRUCTURAL_FORM = "top-k -> tokens grouped by expert -> per-expert SwiGLU linears -> weighted index_add"


def _rewrite_sorted(graph_module: fx.GraphModule, matched: dict, path: str) -> DispatchRegion:
    """Sorted grouped-matmul experts (Hugging Face's grouped_mm), rewritten at EP = 1 on views of their weights."""
    from boundpass.passes.sorted_experts import FORMS, rewrite_sorted_experts
    e = matched["experts"]
    dtype = _val(matched["x"]).dtype
    fused = rewrite_sorted_experts(graph_module, matched, functools.partial(
        _op_args, group_name="", local_experts=e, ep_size=1, compute_dtype=dtype))
    return DispatchRegion(module_path=path, rewritten=True, form=FORMS[matched["kind"]], tokens=_val(fused.args[0]).shape[0],
                          hidden=matched["hidden"], inter=matched["inter"], experts=e, local_experts=e,
                          top_k=matched["top_k"], ep_size=1, group_name="", dtype=dtype, compute_dtype=dtype,
                          op_node=fused)


# torchtitan 0.3.0's other dispatchers, and why they are not rewritten. Only LocalTokenDispatcher (EP = 1) and
# AllToAllTokenDispatcher (EP > 1: functional all_to_all_single, gloo on CPU) run on a CPU; the rest need CUDA.
_DISPATCHER_REASONS = {
    "TorchAOTokenDispatcher": "it pads each expert's token group for torchao's quantized (FP8 / MXFP8) grouped "
                              "GEMMs, whose numerics PipelinedLLEP's mm does not reproduce (torchao's permute is "
                              "Triton: CUDA only)",
    "DeepEPTokenDispatcher": "DeepEP's NVLink / RDMA buffers move the tokens (CUDA only)",
    "HybridEPTokenDispatcher": "HybridEP's kernels move the tokens, and may drop tokens past its capacity factor "
                               "(CUDA only)",
    "MinimalAsyncEPTokenDispatcher": "fixed-size symmetric-memory buffers move the tokens (CUDA only)",
}


def unsupported_reason(module) -> str:
    """Why a RoutedExperts module's semantics are not the ones the op reproduces ('' when they are). Shared by
    this pass (a reported skip) and the MoP layout's eager swap (recipes/mop.py: a refusal)."""
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
    if module is None:
        return "could not resolve the RoutedExperts module from the graph"
    dispatcher = module.token_dispatcher
    if type(dispatcher) not in (LocalTokenDispatcher, AllToAllTokenDispatcher):
        name = type(dispatcher).__name__
        why = _DISPATCHER_REASONS.get(name, "a subclass that may move or pad tokens differently")
        return (f"token dispatcher {name} is not one boundpass recognises (LocalTokenDispatcher, "
                f"AllToAllTokenDispatcher): {why}")
    experts = module.inner_experts
    if not isinstance(experts, GroupedExperts) or type(experts).forward is not GroupedExperts.forward:
        return (f"experts {type(experts).__name__} compute something other than torchtitan's SwiGLU "
                f"GroupedExperts (e.g. biases or another activation)")
    return ""


def _op_args(tokens, ids, scores, w1, w2, w3, *, group_name: str, local_experts: int, ep_size: int,
             compute_dtype, borrowed_slots: int | None = None) -> tuple:
    """``pipelined_llep_fwd``'s arguments as both rewrites give them: cap 0 (the compiler sets it), LLEP's planner
    defaults, strided chunks, and borrowed-weight slots s_b: ``borrowed_slots`` (None: e, LLEP's default), at most the
    (E_p - 1) e experts the other ranks own (a slot no expert can fill would still be counted), none on one rank:
    there is no rank to borrow from, and the bound would count s_b experts' weights and gradients that never exist.
    With a static token count T, s_b is also at most what LLEP's planner lends one helper for any routing of T k
    routes per rank (``llep_plan.lendable_experts``), which changes no plan. The op's planner enforces the slots
    (llep_plan.plan_llep's max_borrowed), so the bound holds for any routing."""
    from boundpass.runtime.pipelined_llep import borrowed_slot_count
    shape = getattr(_val(ids), "shape", None)  # [T, k]: a static T gives the slots LLEP's planner can ever fill
    routes = int(shape[0]) * int(shape[1]) if shape is not None and all(isinstance(d, int) for d in shape) else None
    borrowed = borrowed_slot_count(borrowed_slots, local_experts, ep_size, routes, DEFAULT_ALPHA)
    return (tokens, ids, scores, w1, w2, w3, group_name, 0, DEFAULT_ALPHA, DEFAULT_MIN_PIECE, DEFAULT_IMBALANCE,
            borrowed, True, [], compute_dtype)


def _rewrite_one(gm, key, module, nodes, borrowed_slots: int | None = None) -> DispatchRegion:
    path = _pretty(key)
    skip = lambda why: DispatchRegion(module_path=path, rewritten=False, reason=why)  # noqa: E731
    dispatcher = module.token_dispatcher
    region = set(nodes)
    matched, reason = _match_experts(nodes, region)
    if matched is None:
        return skip(reason)
    weights, compute_dtype = matched
    externals = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in region))
    w1_val = _val(weights[0])
    local_w1 = w1_val.to_local() if hasattr(w1_val, "to_local") else w1_val
    e, inter, hidden = (int(d) for d in local_w1.shape)
    inputs, reason = _classify_inputs(externals, weights, hidden)
    if inputs is None:
        return skip(reason)
    x, scores, ids = inputs
    outputs = [n for n in nodes if any(u not in region for u in n.users)]
    if len(outputs) != 1 or _val(outputs[0]) is None or _val(outputs[0]).shape != _val(x).shape:
        return skip(f"the region has {len(outputs)} outputs; expected one shaped like its input x")
    mesh = getattr(dispatcher, "ep_mesh", None)
    group = mesh.get_group() if mesh is not None else None
    ep_size = mesh.size() if mesh is not None else 1
    counts = [n for n in externals if n not in inputs and n not in weights  # per-expert route counts [E]
              and isinstance(_val(n), torch.Tensor)]
    num_experts = int(_val(counts[0]).shape[0]) if counts else e * ep_size
    if num_experts != e * ep_size:
        return skip(f"{num_experts} experts routed but {e} local experts x EP {ep_size}")
    x_val, k = _val(x), int(_val(ids).shape[-1])
    group_name = group_name_of(group)
    out_node = outputs[0]
    first_user = min(out_node.users)  # fx nodes of one graph order by position
    fake_mode = x_val.fake_mode
    graph = gm.graph

    add = node_adder(graph, fake_mode, module_stack_of=out_node, trace_of=out_node)

    with graph.inserting_before(first_user):
        tokens = add("reshape", x, -1, hidden, kind="call_method")
        flat_ids = add("reshape", ids, -1, k, kind="call_method")
        flat_scores = add("reshape", scores, -1, k, kind="call_method")
        local = [add("to_local", w, kind="call_method") if hasattr(_val(w), "to_local") else w for w in weights]
        fused = add(torch.ops.boundpass.pipelined_llep_fwd.default,
                    *_op_args(tokens, flat_ids, flat_scores, *local, group_name=group_name, local_experts=e,
                              ep_size=ep_size, compute_dtype=compute_dtype, borrowed_slots=borrowed_slots))
        out = add(operator.getitem, fused, 0)
        out = add("view_as", out, x, kind="call_method")
    out_node.replace_all_uses_with(out)
    for node in reversed(nodes):  # consumers first; side-effect nodes (asserts, setitem) go with their region
        graph.erase_node(node)
    return DispatchRegion(module_path=path, rewritten=True, tokens=_val(tokens).shape[0], hidden=hidden, inter=inter,
                          experts=e * ep_size, local_experts=e, top_k=k, ep_size=ep_size, group_name=group_name,
                          dtype=x_val.dtype, compute_dtype=compute_dtype, op_node=fused)


# ------------------------------------------------------------------------------------------------ the pass
class DispatchPass:
    """routed experts => PipelinedLLEP (boundpass.passes.pipeline's protocol); its knob: the chunk cap c."""
    name = "dispatch"

    def enabled(self, config) -> bool:
        return config.dispatch.enable

    def rewrite(self, gm: fx.GraphModule, ctx) -> list[DispatchRegion]:
        regions = rewrite_dispatch_regions(gm, ctx.dispatch_root, ctx.config.dispatch.borrowed_slots)
        if "dispatch_cap" in ctx.fixed:  # a layout's cap (its composed budget counted it): nothing to plan
            for region in regions:
                if region.rewritten:
                    region.cap = ctx.fixed["dispatch_cap"]
                    set_op_arg(region.op_node, "cap", region.cap)
            for graph_module in graph_modules(gm):
                graph_module.recompile()
        return regions

    def knobs(self, regions: list, ctx) -> list[Knob]:
        """Open the chunk cap c of every PipelinedLLEP op for the planner (one cap: layers run one at a time)."""
        from boundpass.bound import cost_model
        from boundpass.runtime.agreement import global_max_tokens
        rewritten = [r for r in regions if r.rewritten]
        if not rewritten:
            return []
        tokens = max(concrete_size(r.tokens, r.op_node) for r in rewritten)
        # c and the chunk count must agree over the EP group: its range comes from the group's largest N
        tokens = max(ctx.max_tokens_per_rank or 0, global_max_tokens(tokens, rewritten[0].group_name))

        def knee_of(region) -> int:
            # the knee of the op's modelled time over c: a function of launch shapes and the group's largest N only,
            # so every rank of the EP group gets the same c
            val = region.op_node.args[0].meta.get("val") if region.op_node is not None and region.op_node.args else None
            device = getattr(getattr(val, "device", None), "type", "cpu")
            return cost_model.pipelined_llep_knee(lo=1, hi=max(1, int(tokens)), N=max(1, int(tokens)), H=region.hidden,
                                                  I=region.inter, E=region.experts, E_p=region.ep_size, k=region.top_k,
                                                  b=(region.dtype or torch.float32).itemsize,
                                                  costs=cost_model.costs_for(device))
        return [Knob("dispatch_cap", sym.c, lo=1, hi=tokens, arg="cap",
                     ops=(torch.ops.boundpass.pipelined_llep_fwd.default, torch.ops.boundpass.pipelined_llep_bwd.default),
                     user=ctx.config.dispatch.cap, regions=rewritten, knee=max(knee_of(r) for r in rewritten),
                     owner=self.name, agree_over=rewritten[0].group_name)]

    def diagnose(self, knob: Knob, where: str):
        tokens = knob.regions[0].tokens if knob.regions else "?"
        return Diagnosis(fix=dispatch_fix(knob.regions[0] if knob.regions else None, tokens),
                         detail=f"at c={knob.value}", name=f"dispatch (PipelinedLLEP, c={knob.value}){where}")


def dispatch_fix(region, tokens) -> str:
    """What to change when the PipelinedLLEP op binds even at c = 1: the tokens, the EP degree, and, while LLEP may
    lend this rank other ranks' experts, fewer borrowed-expert slots (each holds an expert's weights and gradients)."""
    fix = (f"reduce tokens per rank N (now {tokens}) or raise the budget: even c=1 token per source per chunk does not "
           "fit beside the rest of the step (more EP ranks shrink the experts each rank holds)")
    slots = region.borrowed_slots if region is not None else 0
    if slots > 0:
        from boundpass.runtime.pipelined_llep import expert_bytes
        slot_bytes = 2 * expert_bytes(H=region.hidden, I=region.inter, b=(region.dtype or torch.float32).itemsize)
        fix += (f"; or lend fewer borrowed-expert slots (dispatch_borrowed_slots, now {slots}: "
                f"{format_bytes(slot_bytes)} each)")
    return fix
