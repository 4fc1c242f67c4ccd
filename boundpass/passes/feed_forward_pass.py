"""Feed-forward regions => boundpass::row_blocks (runtime/row_blocks.py): a block's dense MLP, or an MoE block's
shared experts, walked C_r rows of the sequence at a time and recomputed per block in the backward, so that its
intermediates ([rows, inter], several, and their gradients) are never whole.

Found by structure, not by name: a *down projection* (a linear map) whose input is computed, through nodes no other
part of the graph reads, from one or more *up projections* (linear maps) of one tensor x, at least one of them wider
than x (SwiGLU's w1 / w3 -> silu * -> w2, a GELU MLP's fc1 -> gelu -> fc2). Where x itself is made by a norm (and
the elementwise ops of a hand-written one) that only the region reads, the norm joins it and the row input is the
norm's input (the residual stream). Every node must be position-wise along the sequence
(``attention_region._Follow``'s rules), or the region is skipped with the reason; a symbolic sequence length is
skipped too. C_r is the knob (``feed_forward_chunk``): the planner takes min(the widest that fits, the knee of
``cost_model.row_blocks_seconds``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from boundpass.bound.bounds import Knob
from boundpass.measure.step_peak import module_path
from boundpass.passes import attention_region as ar
from boundpass.passes.graph_edit import graph_modules, node_adder, sequence_range
from boundpass.passes.graph_edit import example_value as _val
from boundpass.passes.protocol import Diagnosis
from boundpass.runtime import row_blocks as rb

MIN_ROWS = 64         # narrower blocks only add launches; below this, the sequence itself must shrink
_MOST_NODES = 96      # a region is a sublayer: a walk back from a linear that grows past this is not one


@dataclass
class FeedForwardRegion:
    """One feed-forward region: where it is, and what happened to it."""
    module_path: str
    rewritten: bool
    reason: str = ""
    kind: str = "feed_forward"
    tokens: object = None          # rows of the sequence (all batch rows of a position count as one)
    length: object = None          # L
    width: int = 0                 # the widest intermediate's last dim
    norm: bool = False             # the norm before it joined the region
    readers: int = 0               # a norm alone (its result read by this many nodes outside any region), or 0
    chunk: int = 0                 # C_r chosen by the budget
    flops_per_row: float = 0.0
    bytes_per_row: float = 0.0     # a norm alone: its elementwise ops' memory traffic (the cost model's work)
    ops: int = 0                   # the program's nodes
    op_node: fx.Node | None = field(default=None, repr=False)

    def describe(self) -> str:
        if not self.rewritten:
            return f"SKIPPED   feed_forward {self.module_path}: {self.reason}"
        if self.readers:
            return (f"REWRITTEN feed_forward {self.module_path}: norm alone (its result read by {self.readers} "
                    f"nodes) => boundpass::row_blocks, C_r rows at a time (L={self.length}, C_r={self.chunk})")
        what = "norm + " if self.norm else ""
        return (f"REWRITTEN feed_forward {self.module_path}: {what}up projections + activation + down projection => "
                f"boundpass::row_blocks, C_r rows at a time (L={self.length}, widest {self.width}, "
                f"C_r={self.chunk})")


def _linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in ar._LINEAR


def _input(node: fx.Node) -> bool:
    return node.op in ("placeholder", "get_attr")


def _activation(node: fx.Node) -> bool:
    """What lies between the up projections and the down one: elementwise ops (the activation, the gate's product,
    casts) and the split of a fused up projection."""
    if node.op == "call_method":
        return node.target in ar._ELEMENTWISE_METHODS or node.target in ("split", "chunk")
    return node.target in ar._ELEMENTWISE_FUNCTIONS or node.target in ar._SPLITS or node.target is operator.getitem


def _core(down: fx.Node):
    """(the nodes from the up projections to ``down``, the up projections' one input x) or None: the walk back
    from ``down``'s input stops at linear maps (the up projections, kept) and at the graph's inputs (weights), and
    passes only the activation's ops (``_activation``)."""
    path, ups, stack = set(), [], [down.args[0]]
    while stack:
        n = stack.pop()
        if n in path:
            continue
        if _input(n) or n.op not in ("call_function", "call_method") or len(path) >= _MOST_NODES:
            return None
        path.add(n)
        if _linear(n):
            ups.append(n)
            continue
        if not _activation(n):
            return None
        stack.extend(a for a in n.all_input_nodes if not _input(a))
    xs = {u.args[0] for u in ups}
    if not ups or len(xs) != 1 or len(path) == len(ups):   # no activation between: two linear maps in a row
        return None
    return path | {down}, xs.pop()


def _order(node: fx.Node):
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return order.__getitem__


def _rows_dim(value) -> tuple[int, int] | None:
    """(the sequence dim of a [..., rows, width] result, its length): the longest dim before the last."""
    shape = tuple(value.shape)
    if len(shape) < 2:
        return None
    dim = max(range(len(shape) - 1), key=lambda i: shape[i] if isinstance(shape[i], int) else 1 << 62)
    return dim, shape[dim]


def _flops_per_row(path: list, length: int) -> float:
    flops = 0.0
    for n in path:
        if _linear(n):
            weight = _val(n.args[1])
            flops += 2 * _val(n).numel() / length * weight.shape[-1]
    return flops


def _try(sub: fx.GraphModule, down: fx.Node, chunk: int):
    """Rewrite the region ending at ``down``: (its record's fields, the op node) or (why not, None); None when
    ``down`` ends no feed-forward region."""
    core = _core(down)
    if core is None:
        return None
    path, x = core
    ups = [n for n in path if _linear(n) and n is not down]
    width = max(int(_val(u).shape[-1]) for u in ups)
    if width <= int(_val(x).shape[-1]):
        return {"reason": f"no intermediate wider than its input ({width} <= {int(_val(x).shape[-1])}): nothing "
                          "whole to save", "width": width}, None
    inside = path - {down}
    outside = [(n, u) for n in inside for u in n.users if u not in path]
    if outside:
        n, u = outside[0]
        return {"reason": f"{n.name} is used outside the region (by {u.name})", "width": width}, None
    y = _val(down)
    found = _rows_dim(y)
    if found is None:
        return {"reason": f"the down projection's result {tuple(y.shape)} has no rows", "width": width}, None
    y_dim, length = found
    if not isinstance(length, int):
        return {"reason": "the sequence length is symbolic in this graph", "width": width}, None
    if length <= 1:
        return None
    norm = ar.norm_joining(path)
    why = ""
    for nodes in ([path | norm] if norm else []) + [path]:
        fields, op = _rewrite(sub, nodes, down, y_dim, length, chunk)
        if op is None:
            why = why or fields
            continue
        fields.update(width=width, norm=nodes is not path)
        return fields, op
    return {"reason": why, "width": width}, None


def _rewrite(sub: fx.GraphModule, nodes: set, y_node: fx.Node, y_dim: int, length: int, chunk: int):
    """``nodes`` (ending at ``y_node``, its sequence dim ``y_dim``) replaced by one boundpass::row_blocks call: (its
    record's fields, the op node), or (why not, None)."""
    ordered = sorted(nodes, key=_order(y_node))
    inputs = ar.inputs_of(ordered)
    try:
        dims, walker = ar.follow_inputs(ordered, inputs, length, [(y_node, y_dim)])
    except ar.NotPositionwise as e:
        return str(e), None
    if not all(isinstance(_val(i), torch.Tensor) for i in inputs):
        return "an input that is not a tensor", None
    rows = [i for i in inputs if dims[i] is not None]
    params = [i for i in inputs if dims[i] is None]
    y = _val(y_node)
    program = ar.program(ordered, rows + params, y_node, walker)
    region = rb.Region(program=program, row_dims=tuple(dims[i] for i in rows), y_shape=tuple(y.shape),
                       y_dim=y_dim, y_dtype=y.dtype,
                       needs=tuple(bool(getattr(_val(i), "requires_grad", False)) for i in rows + params))
    try:
        key = rb.register_region(region, [_val(i) for i in rows], [_val(i) for i in params])
    except Exception as e:  # a program that still makes a sequence-long dim at a block's rows
        return f"the region does not run on a block of rows ({type(e).__name__}: {e})", None
    fields = {"length": length, "tokens": length, "flops_per_row": _flops_per_row(ordered, length),
              "ops": len(ordered)}
    add = node_adder(sub.graph, y.fake_mode, module_stack_of=y_node, trace_of=y_node)
    with sub.graph.inserting_before(y_node):
        op = add(torch.ops.boundpass.row_blocks_fwd.default, rows, params, key, int(chunk))
    y_node.replace_all_uses_with(op)
    for n in sorted(nodes, key=_order(y_node), reverse=True):
        sub.graph.erase_node(n)
    return fields, op


def _try_norm(sub: fx.GraphModule, node: fx.Node, chunk: int):
    """A norm no region took (an MoE block's, whose result the router, the routed experts and the shared experts all
    read; the final one) in row blocks alone: its result stays whole, its intermediates (an RMSNorm's fp32 copy of
    its input and normalised product, saved whole for its backward) exist a block at a time, and its backward
    recomputes them from its input. (record fields, op), or None when ``node`` ends no norm over rows."""
    nodes = ar.norm_ending_at(node)
    if nodes is None:
        return None
    y = _val(node)
    found = _rows_dim(y) if isinstance(y, torch.Tensor) else None
    if found is None or not isinstance(found[1], int) or found[1] <= 1:
        return None
    y_dim, length = found
    readers = len(node.users)
    fields, op = _rewrite(sub, nodes, node, y_dim, length, chunk)
    if op is None:
        return {"reason": fields, "width": int(y.shape[-1])}, None
    # no matmul: its memory traffic (an element read, its fp32 copy and product written and read, the result
    # written: ~24 B) against the launches sets its knee where no feed-forward's does (FeedForwardPass.knobs)
    fields.update(width=int(y.shape[-1]), readers=readers, bytes_per_row=24.0 * int(y.shape[-1]))
    return fields, op


def rewrite_feed_forward_regions(gm: fx.GraphModule, chunk: int = 0) -> list[FeedForwardRegion]:
    """Rewrite every feed-forward region in place (``chunk`` rows per block; 0: left for the planner); return every
    region found, rewritten or skipped with its reason."""
    regions = []
    for sub in list(graph_modules(gm)):   # checkpointed blocks keep theirs in the HOP's body
        touched = False
        # the feed-forwards first (a norm only one reads joins it), then the norms left, alone
        walks = ((lambda: reversed([n for n in sub.graph.nodes if _linear(n)]), _try),
                 (lambda: [n for n in sub.graph.nodes if ar.is_norm_op(n)], _try_norm))
        for candidates, attempt in walks:
            for node in candidates():
                if getattr(node, "_erased", False):   # inside a region rewritten already
                    continue
                found = attempt(sub, node, chunk)
                if found is None:
                    continue
                fields, op = found
                path = module_path(op if op is not None else node) or "<top level>"
                regions.append(FeedForwardRegion(module_path=path, rewritten=op is not None, chunk=int(chunk),
                                                 op_node=op, **fields))
                touched = touched or op is not None
        if touched:
            sub.graph.lint()
            sub.recompile()
    return regions


class FeedForwardPass:
    """Feed-forward regions => row blocks (boundpass.passes.pipeline's protocol); its knob: C_r."""
    name = "feed_forward"

    def enabled(self, config) -> bool:
        return config.feed_forward.enable

    def rewrite(self, gm: fx.GraphModule, ctx) -> list[FeedForwardRegion]:
        return rewrite_feed_forward_regions(gm, ctx.fixed.get("feed_forward_chunk", 0))

    def knobs(self, regions: list, ctx) -> list[Knob]:
        from boundpass.bound import cost_model
        rewritten, lengths, lo, hi = sequence_range(regions, MIN_ROWS)
        if not rewritten:
            return []
        costs = cost_model.costs_for(_val(rewritten[0].op_node).device.type)
        # a norm alone is launch-bound (no matmul): it takes the rows the feed-forwards' knee gives, where there are any
        timed = [(r, n) for r, n in zip(rewritten, lengths) if not r.readers] or list(zip(rewritten, lengths))
        knee = max(cost_model.row_blocks_knee(lo=lo, hi=hi, L=n, flops_per_row=r.flops_per_row, ops=r.ops,
                                              costs=costs, bytes_per_row=r.bytes_per_row) for r, n in timed)
        return [Knob("feed_forward_chunk", rb.C_r_sym, lo=lo, hi=hi, arg="chunk",
                     ops=(torch.ops.boundpass.row_blocks_fwd.default, torch.ops.boundpass.row_blocks_bwd.default),
                     user=ctx.config.feed_forward.chunk, regions=rewritten, knee=knee, owner=self.name)]

    def diagnose(self, knob: Knob, where: str) -> Diagnosis:
        region = knob.regions[0] if knob.regions else None
        length = region.length if region is not None else "?"
        return Diagnosis(fix=f"reduce the sequence length L (now {length}) or the micro-batch, or raise the budget: "
                             f"even the narrowest block C_r={knob.lo} rows does not fit beside its input and output",
                         detail=f"at C_r={knob.value}", name=f"feed-forward (row blocks, C_r={knob.value}){where}")

