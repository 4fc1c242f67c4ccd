"""Adding nodes to a Dynamo graph the way the passes need: with the graph's own fake values and provenance."""
from __future__ import annotations

import torch.fx as fx


def example_value(node):
    """The fake value Dynamo recorded for a node (None for non-nodes and nodes without one)."""
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def node_adder(graph: fx.Graph, fake_mode, *, module_stack_of: fx.Node, trace_of: fx.Node):
    """add(target, *args, kind=...) -> a new node whose example_value is computed under the graph's fake mode.

    fake_mode must be the one of the graph's own example values (the backend's differs: mixing them fails,
    docs/design.md §3). The new nodes carry the nn_module_stack / stack_trace of the nodes they stand
    for, so the rewritten graph prints where they came from.
    """
    def add(target, *node_args, kind="call_function"):
        node = graph.create_node(kind, target, node_args)
        node.meta["nn_module_stack"] = dict(module_stack_of.meta.get("nn_module_stack", {}))
        node.meta["stack_trace"] = trace_of.meta.get("stack_trace")
        vals = fx.node.map_arg(node_args, example_value)  # nested too: torch.stack takes a list of nodes
        with fake_mode:
            node.meta["example_value"] = (getattr(vals[0], target)(*vals[1:]) if kind == "call_method"
                                          else target(*vals))
        return node
    return add


def sweep_dead_nodes(graph: fx.Graph, keep) -> None:
    """Erase the nodes of this one graph that nobody uses and ``keep(node)`` does not hold on to.

    Not ``fx.Graph.eliminate_dead_code``: in torch 2.13 it also sweeps every subgraph the graph calls (the bodies of
    activation-checkpoint and other higher-order ops), and there with FX's default purity test instead of the one it
    was given. A checkpointed hand-written MoE's ``out.index_add_(...)`` (an in-place method without users) was erased
    that way, so the checkpointed block's output lost every expert's contribution and its parameters their gradients
    (tests/passes/test_dispatch_structure.py, the checkpointed case). The passes only edit the graph they sweep.
    """
    graph.lint()  # topological order: a reverse walk sees every user before what it uses
    for node in reversed(graph.nodes):
        if not node.users and not keep(node):
            graph.erase_node(node)


def descendants(*nodes: fx.Node) -> set:
    """Every node computed from ``nodes`` (their users, transitively), ``nodes`` themselves excluded unless reached."""
    return _closure([u for n in nodes for u in n.users], lambda node: node.users)


def ancestors(*nodes: fx.Node) -> set:
    """Every node ``nodes`` are computed from (their inputs, transitively), ``nodes`` themselves excluded."""
    return _closure([a for n in nodes for a in n.all_input_nodes], lambda node: node.all_input_nodes)


def _closure(start: list, step) -> set:
    out, stack = set(), list(start)
    while stack:
        node = stack.pop()
        if node not in out:
            out.add(node)
            stack.extend(step(node))
    return out


def set_op_arg(node: fx.Node, name: str, value) -> None:
    """Set an op node's argument by its schema name (positional or keyword)."""
    index = [a.name for a in node.target._schema.arguments].index(name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


def op_arg(node: fx.Node, name: str):
    """An op node's argument by its schema name (positional or keyword, else the schema's default)."""
    for index, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            if index < len(node.args):
                return node.args[index]
            return node.kwargs.get(name, arg.default_value)
    raise KeyError(f"{node.target} has no argument {name!r}")


def concrete_size(size, node: fx.Node | None) -> int:
    """A size a pass recorded (int or SymInt) at its value in the shape environment of ``node``'s graph."""
    import sympy
    import torch
    expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))
    val = node.meta.get("example_value") if node is not None else None
    if isinstance(val, (tuple, list)):
        val = val[0]
    shape_env = getattr(getattr(val, "fake_mode", None), "shape_env", None)
    if expr.free_symbols and shape_env is not None:
        expr = expr.xreplace(shape_env.backed_var_to_val)
    return int(expr)


def graph_modules(gm: fx.GraphModule):
    """The root graph and every subgraph body (activation-checkpoint HOPs keep theirs as submodules)."""
    yield gm
    for _, sub in gm.named_modules():
        if sub is not gm and isinstance(sub, fx.GraphModule):
            yield sub


def sequence_range(regions: list, floor: int) -> tuple[list, list[int], int, int]:
    """A sequence-chunk knob's range from a pass's regions: (the rewritten ones, their lengths L as ints, lo =
    min(floor, the longest L), hi = the longest L); ([], [], 0, 0) when none was rewritten."""
    rewritten = [r for r in regions if r.rewritten]
    if not rewritten:
        return [], [], 0, 0
    lengths = [concrete_size(r.length, r.op_node) for r in rewritten]
    hi = max(lengths)
    return rewritten, lengths, min(floor, hi), hi
