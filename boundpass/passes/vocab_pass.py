"""Vocab pass: find `linear -> (float/view/flatten/reshape) -> cross_entropy` in a Dynamo graph and rewrite it
to the Ring-DTP custom op, so no [N, V] logits tensor exists in forward or backward.

Matching happens on the Dynamo (pre-autograd) graph: there `linear` and `cross_entropy` are still single
nodes with `nn_module_stack` meta, and AOTAutograd derives the backward from the op's registered autograd.
Regions that cannot be rewritten exactly are skipped with a reason, never silently.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from boundpass.passes.graph_edit import example_value as _val
from boundpass.passes.graph_edit import node_adder
from boundpass.runtime import ring_dtp

_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
# methods / functions that only reshape or upcast the logits on their way to cross_entropy
_PASS_THROUGH_METHODS = {"float", "view", "reshape", "flatten", "contiguous", "to"}
_PASS_THROUGH_FUNCS = {torch.flatten, torch.reshape}


@dataclass
class VocabRegion:
    """One linear -> cross_entropy region: where it is, and what happened to it."""
    module_path: str
    rewritten: bool
    reason: str = ""
    kind: str = "vocab"
    tokens: object = None          # N (int or SymInt) of the rewritten op
    hidden: int = 0
    vocab: int = 0
    dtype: torch.dtype | None = None
    block: int = 0                 # strip width C chosen by the budget
    branch: str = ""               # Ring-DTP branch chosen for the launch configuration
    op_node: fx.Node | None = field(default=None, repr=False)


@dataclass
class VocabRewriteConfig:
    """What the rewritten op is told: ring group, strip width (0 = whole shard), branch."""
    group_name: str = ""
    ring_size: int = 1
    ring_rank: int = 0
    block: int = 0
    branch: str = "auto"


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top level>"
    path = list(stack.values())[-1][0]
    for prefix in ("L['self'].", "G['model'].", "L['model'].", "L['self']._model."):
        path = path.replace(prefix, "")
    return path.replace("L['self']", "<model>").replace("['", ".").replace("']", "")


def _is_pass_through(node: fx.Node) -> bool:
    if node.op == "call_method" and node.target in _PASS_THROUGH_METHODS:
        if node.target == "to":  # only dtype casts, not device moves
            return all(isinstance(a, torch.dtype) for a in node.args[1:]) and not node.kwargs
        return True
    return node.op == "call_function" and node.target in _PASS_THROUGH_FUNCS


def _find_linear(ce_input: fx.Node) -> tuple[fx.Node | None, str]:
    """Walk back from the CE input through reshapes/casts to the linear; reason when it cannot."""
    node = ce_input
    while isinstance(node, fx.Node) and _is_pass_through(node):
        if len(node.users) != 1:
            return None, f"intermediate logits ({node.name}) have other users {sorted(u.name for u in node.users)}"
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _LINEAR_TARGETS:
        what = getattr(node, "target", node)
        return None, f"cross_entropy input does not come from a linear projection (found {what})"
    if len(node.users) != 1:
        return None, f"logits ({node.name}) are used elsewhere too ({sorted(u.name for u in node.users)}): [N, V] must exist"
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if bias is not None:
        return None, "the output projection has a bias (not supported by Ring-DTP)"
    return node, ""


def _skip_reason(ce: fx.Node) -> str:
    try:
        bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    except TypeError as exc:
        return f"cannot read cross_entropy arguments: {exc}"
    args = bound.arguments
    if args.get("weight") is not None:
        return "class weights are used"
    if args.get("label_smoothing", 0.0) not in (0, 0.0):
        return "label smoothing is used"
    if args.get("size_average") is not None or args.get("reduce") is not None:
        return "legacy size_average/reduce arguments are used"
    if args.get("reduction", "mean") not in ("mean", "sum"):
        return f"reduction={args['reduction']!r} returns per-token losses"
    logits, target = _val(args["input"]), _val(args["target"])
    if logits is None or target is None or logits.dim() != 2 or target.dim() != 1:
        return "cross_entropy input is not [N, V] logits with [N] class-index targets"
    return ""


def rewrite_vocab_regions(gm: fx.GraphModule, config: VocabRewriteConfig) -> list[VocabRegion]:
    """Rewrite every eligible region in place; return all regions found (rewritten and skipped)."""
    regions = []
    for ce in list(gm.graph.nodes):
        if ce.op != "call_function" or ce.target is not F.cross_entropy:
            continue
        reason = _skip_reason(ce)
        args = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs).arguments if not reason.startswith("cannot") else {}
        linear = None
        if not reason:
            linear, reason = _find_linear(args["input"])
        path = _module_path(linear if linear is not None else ce)
        if not reason:
            h_val, w_val, logits_val = _val(linear.args[0]), _val(linear.args[1]), _val(args["input"])
            acc = torch.promote_types(h_val.dtype, torch.float32)
            if logits_val.dtype != acc:
                reason = (f"cross_entropy runs on {logits_val.dtype} logits of a {h_val.dtype} projection; "
                          f"Ring-DTP accumulates in {acc}, which would change the numerics")
        if reason:
            regions.append(VocabRegion(module_path=path, rewritten=False, reason=reason))
            continue
        regions.append(_rewrite(gm, ce, linear, args, config, path))
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return regions


def _rewrite(gm, ce, linear, args, config, path) -> VocabRegion:
    h, weight = linear.args[0], linear.args[1]
    h_val, w_val = _val(h), _val(weight)
    vocab, hidden = int(w_val.shape[0]), int(w_val.shape[1])
    fake_mode = _val(ce).fake_mode  # the graph's own fake mode (the backend's differs: notes §2)
    ignore_index = int(args.get("ignore_index", -100))
    graph = gm.graph

    add = node_adder(graph, fake_mode, module_stack_of=linear, trace_of=ce)

    with graph.inserting_before(ce):
        tokens = add("reshape", h, -1, hidden, kind="call_method")
        labels = add("reshape", args["target"], -1, kind="call_method")
        shard = weight
        if config.ring_size > 1:
            # replicated weight: this rank folds only its own rows; the gradient of the other rows comes
            # from their owners, so summing gradients over the ring (data-parallel all-reduce) is exact.
            start, stop = ring_dtp.vocab_shard_range(vocab, config.ring_size, config.ring_rank)
            shard = add(operator.getitem, weight, slice(start, stop))
        fused = add(torch.ops.boundpass.ring_dtp_fwd.default, tokens, shard, labels, vocab, config.group_name,
                    config.block, ignore_index, config.branch, [])
        loss = add(operator.getitem, fused, 0)
        if args.get("reduction", "mean") == "mean":
            valid = add(operator.ne, labels, ignore_index)
            count = add("sum", valid, kind="call_method")
            loss = add(operator.truediv, loss, count)
    ce.replace_all_uses_with(loss)
    graph.erase_node(ce)
    return VocabRegion(module_path=path, rewritten=True, tokens=_val(tokens).shape[0], hidden=hidden,
                       vocab=vocab, dtype=h_val.dtype, op_node=fused)


# ------------------------------------------------------------------------------- step-peak workspace
def _ring_size(group_name: str) -> int:
    if not group_name:
        return 1
    import torch.distributed as dist
    return dist.get_world_size(dist.distributed_c10d._resolve_process_group(group_name))


def ring_dtp_peak(node: fx.Node, ctx: dict):
    """Ring-DTP's whole bound (inputs, outputs, workspace) at one fwd/bwd node; strip width C stays symbolic."""
    import sympy
    from boundpass import symbols as sym
    from boundpass.step_peak import as_expr
    forward = node.target is torch.ops.boundpass.ring_dtp_fwd.default
    h, w = (node.args[0], node.args[1]) if forward else (node.args[1], node.args[2])
    rest = node.args[3:] if forward else node.args[5:]
    vocab, group_name, branch = rest[0], rest[1], rest[4]
    h_val, w_val = h.meta["val"], w.meta["val"]
    ring = _ring_size(group_name)
    tokens = as_expr(h_val.shape[0])
    # the ring's largest N: at least this rank's (symbolic under dynamic shapes, so the budget guard sees it grow)
    declared = ctx.get("max_tokens_per_rank")
    n_max = tokens if not declared else sympy.Max(int(declared), tokens)
    if branch == "auto":
        branch = ring_dtp.choose_branch(int(n_max) if sympy.sympify(n_max).is_number else 1 << 62, vocab, ring)
    mixed = torch.promote_types(h_val.dtype, torch.float32) != h_val.dtype
    values = ring_dtp.bound_values(h_val.dtype, N=1, H=int(w_val.shape[1]), V=vocab, P=ring)
    values.update({sym.N: tokens, sym.N_max: n_max})
    values.pop(sym.C)
    from boundpass.passes.dispatch_pass import _cached_bound, _cached_xreplace
    bound = _cached_bound(ring_dtp.ring_dtp_bound, branch=branch, mixed_precision=mixed, count_weight_shard=True)
    return _cached_xreplace(bound, tuple(sorted(values.items(), key=lambda kv: kv[0].name)))


def _register_workspace() -> None:
    from boundpass.step_peak import register_workspace
    register_workspace(torch.ops.boundpass.ring_dtp_fwd.default, ring_dtp_peak)
    register_workspace(torch.ops.boundpass.ring_dtp_bwd.default, ring_dtp_peak)


_register_workspace()
