"""The device peak of a compiled training step, derived from its AOTAutograd forward and backward graphs.

One place computes the peak (docs/design.md §3, the pipeline's peak step). The forward and backward graphs are walked in the order they
execute; every tensor's storage (torch's ``GraphAliasTracker`` from ``torch/_inductor/fx_passes/
memory_estimator.py``: views, aliases and in-place results share one storage and count once) lives from the
node that allocates it to its last use. Bytes are sympy expressions in the graph's symbolic sizes (plain
integers for static shapes). Saved-for-backward tensors live across the forward/backward boundary and, because
boundpass runs both graphs with the boxed calling convention, die at their last use in backward; gradients the
backward returns stay live to its end (autograd accumulates them into ``.grad``). A custom op of boundpass adds
its declared internal workspace at its own node (its sympy bound minus the inputs and outputs the walk already
counts; strip width C and chunk cap c stay free symbols for the planner), and a pass may declare storages the
graph does not show (SCO's prefetched boundary) as ``Held`` intervals.

Why not ``memory_estimator.get_peak_memory`` itself: it ignores CPU storages (every tensor here), takes an int
hint of symbolic sizes, never frees values without users, and has no notion of a custom op's workspace; its alias
tracker is the part that serves, and it is reused as is.
"""
from __future__ import annotations

import operator
import re

from dataclasses import dataclass, field
from typing import Callable

import sympy
import torch
import torch.fx as fx
from torch._inductor.fx_passes.memory_estimator import GraphAliasTracker, StorageKey

from boundpass.measure import aten_contracts
from boundpass.runtime import contracts
from boundpass.runtime.contracts import as_expr  # noqa: F401  (the passes' size expressions)
from boundpass.core.kinds import NamedKind
from boundpass.core.units import format_bytes



@dataclass
class Held:
    """Bytes a runtime holds outside the graph's values, from ``start`` (after it runs) to ``end`` (before it)."""
    start: fx.Node
    end: fx.Node | None
    nbytes: sympy.Expr
    label: str


class StorageKind(NamedKind):
    """What a storage of the step is: a graph input, an activation, a tensor saved for backward, a gradient, an op's
    workspace, or bytes a runtime holds outside the graph's values (SCO's prefetch). A str, as TermKind."""
    INPUT = "input"
    ACTIVATION = "activation"
    SAVED = "saved"
    GRADIENT = "gradient"
    WORKSPACE = "workspace"
    HELD = "held"


@dataclass
class Storage:
    """One storage of the step: what made it, how big it is (sympy bytes) and its life in program points."""
    name: str
    module_path: str
    shape: str
    dtype: str
    nbytes: sympy.Expr
    kind: StorageKind    # what holds it (a StorageKind or its name)
    start: int = 0       # first program point it is live at
    end: int = 1 << 62   # last program point it is live at

    def __post_init__(self):
        self.kind = StorageKind(self.kind)


@dataclass
class ProgramPoint:
    """A moment of the step: the node running, the live bytes then (sympy, persistent state excluded)."""
    index: int
    phase: str           # "forward", "backward"
    node: str
    target: str
    module_path: str
    live: sympy.Expr
    workspace: sympy.Expr = sympy.Integer(0)   # the op's internal bytes (part of live)


@dataclass
class GraphPeak:
    """The program points and storages of one compiled graph's forward + backward."""
    points: list[ProgramPoint] = field(default_factory=list)
    storages: list[Storage] = field(default_factory=list)
    gradient_bytes: sympy.Expr = sympy.Integer(0)   # what backward returns for parameters
    saved_bytes: sympy.Expr = sympy.Integer(0)      # live when forward returns (saved for backward + outputs)
    caller_bytes: sympy.Expr = sympy.Integer(0)     # the batch and the returned outputs: held through the step
    host_bytes: sympy.Expr = sympy.Integer(0)       # the largest host pool a boundpass op declares (contracts)

    def bind(self, values: dict) -> None:
        """Put ``values`` (symbol -> int) into every byte expression, in place: the data-dependent sizes at their
        upper bound (the compiler's data-dependent sizes). Why before any Max is built: those symbols carry no
        sign assumption for sympy, so ``max_of`` cannot prune by dominance and sympy.Max compares the program
        points pairwise (measured: minutes for a plain-PyTorch MoE whose eight expert batches are data-dependent)."""
        if not values:
            return
        for p in self.points:
            p.live, p.workspace = sympy.sympify(p.live).xreplace(values), sympy.sympify(p.workspace).xreplace(values)
        for st in self.storages:
            st.nbytes = sympy.sympify(st.nbytes).xreplace(values)
        self.gradient_bytes, self.saved_bytes, self.caller_bytes, self.host_bytes = (
            sympy.sympify(e).xreplace(values)
            for e in (self.gradient_bytes, self.saved_bytes, self.caller_bytes, self.host_bytes))

    def peak_expr(self) -> sympy.Expr:
        """Max over program points of the live bytes (persistent state excluded), pruned of dominated terms."""
        return max_of(p.live for p in self.points)

    def evaluate(self, values: dict) -> tuple[int, ProgramPoint | None]:
        """(peak bytes, the program point where it is) at concrete symbol values."""
        top, where, cache = -1, None, {}
        for p in self.points:
            if p.live not in cache:
                cache[p.live] = bytes_at(p.live, values)
            if cache[p.live] > top:
                top, where = cache[p.live], p
        return max(top, 0), where

    def live_at(self, point: ProgramPoint, values: dict, top: int = 8) -> list[tuple[Storage, int]]:
        """The largest storages live at ``point`` (bytes evaluated at ``values``), largest first."""
        live = [(s, bytes_at(s.nbytes, values)) for s in self.storages if s.start <= point.index <= s.end]
        return sorted(live, key=lambda x: -x[1])[:top]


def max_of(values) -> sympy.Expr:
    """sympy.Max of byte expressions, the dominated ones dropped before sympy sees them.

    a dominates b when a - b, as a polynomial in nonnegative symbols, has no negative coefficient: then a >= b at
    every launch, and sympy.Max would drop b too, but by pairwise assumption queries that took tens of seconds
    over a block's hundreds of program points (a plan of deepseek_v3 671B) and seconds per dynamic-shape compile.
    An expression that is not such a polynomial (a generator of unknown sign) is never dropped here: sympy.Max
    still decides."""
    exprs = list(dict.fromkeys(sympy.sympify(v) for v in values))
    if not exprs:
        return sympy.Integer(0)
    polys, others = [], []
    for e in exprs:
        terms = _nonneg_polynomial(e)
        (others if terms is None else polys).append((e, terms))
    # most total weight first: a dominating expression is met before what it dominates, unless they are equal
    polys.sort(key=lambda item: -sum(item[1].values()))
    kept: list = []
    for e, terms in polys:
        if not any(_dominates(k, terms) for _, k in kept):
            kept.append((e, terms))
    return sympy.Max(*(e for e, _ in kept), *(e for e, _ in others))


def _nonneg_polynomial(expr: sympy.Expr) -> dict | None:
    """{monomial: rational coefficient} of ``expr`` as a polynomial whose generators (symbols, or subterms such as
    Max(1, s0 - 1)) sympy knows to be nonnegative, else None. Generators may depend on each other: each monomial
    is still a product of nonnegative factors, which is all _dominates needs."""
    if expr.is_Rational:
        return {(): expr}
    if not expr.free_symbols:
        return None
    try:
        poly = sympy.Poly(expr)
    except (sympy.PolynomialError, sympy.GeneratorsNeeded):
        return None
    if not (poly.domain.is_ZZ or poly.domain.is_QQ) or any(g.is_nonnegative is not True for g in poly.gens):
        return None
    names = [str(g) for g in poly.gens]  # monomials by generator text: polynomials over other generators compare
    return {tuple((names[i], e) for i, e in enumerate(monomial) if e): coefficient
            for monomial, coefficient in poly.terms()}


def _dominates(a: dict, b: dict) -> bool:
    """Every coefficient of a - b is >= 0 (a and b from _nonneg_polynomial, over the same symbols or fewer)."""
    return all(a.get(m, 0) >= c for m, c in b.items()) and all(c >= 0 for m, c in a.items() if m not in b)


def bytes_at(expr, values: dict) -> int:
    """Bytes of a sympy size at ``values`` (rounded up); ValueError when a size is left free."""
    out = sympy.sympify(expr).xreplace(values) if values else sympy.sympify(expr)
    if out.free_symbols:
        raise ValueError(f"step peak {expr} has free symbols {sorted(map(str, out.free_symbols))}")
    return int(sympy.ceiling(out))


def module_path(node: fx.Node) -> str:
    """The module a node came from (nn_module_stack's innermost entry, or the forward's for a node AOTAutograd made
    in the backward) as a dotted path from the compiled model, or '' (a node of no module)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return pretty_path(str(list(stack.values())[-1][0])) if stack else ""


_CLOSURE_HOP = r"\.forward\.__closure__\[0\]\.cell_contents\.__self__"   # torchtitan's local_map forward wrappers
_MODULES_HOP = r"__dict__(?:\['_modules'\]|\._modules)(?:\['([^']+)'\]|\.([A-Za-z_0-9]+))"  # a child in _modules


def without_hops(path: str) -> str:
    """A Dynamo module source with torchtitan's local_map closure hops dropped and ``_modules`` lookups written as
    the child attributes they are (``__dict__['_modules']['moe']`` -> ``.moe``)."""
    return re.sub(_MODULES_HOP, lambda m: "." + (m.group(1) or m.group(2)), re.sub(_CLOSURE_HOP, "", path))


def pretty_path(path: str) -> str:
    """Dynamo's source of a module (``L['self'].layers['0']``, a checkpoint wrapper's ``__dict__['_modules']``
    lookups, torchtitan's local_map closures) as the dotted path the model's named_modules() gives."""
    for prefix in ("L['self']._model.", "L['self'].", "G['model'].", "L['model']."):
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    path = without_hops(path)
    path = path.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")
    return path.replace("L['self']", "").replace("['", ".").replace("']", "").strip(".")


def _describe(node: fx.Node) -> tuple[str, str]:
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    if isinstance(val, torch.Tensor):
        return str(tuple(val.shape)), str(val.dtype).replace("torch.", "")
    return "", ""


class _Walk:
    """Live storages while walking one graph (or Inductor schedule); records a ProgramPoint per executed node."""

    def __init__(self, result: GraphPeak, live: dict[StorageKey, Storage]):
        self.result, self.live = result, live
        self.total: sympy.Expr = sympy.Integer(0)
        for s in live.values():
            self.total += s.nbytes

    def point(self, phase: str, node: fx.Node, extra: sympy.Expr = sympy.Integer(0)) -> ProgramPoint:
        return self.record(phase, node.name, str(node.target), module_path(node), extra)

    def record(self, phase: str, name: str, target: str, path: str, extra: sympy.Expr = sympy.Integer(0)
               ) -> ProgramPoint:
        """A program point now: the live total plus ``extra`` (an op's workspace) while ``name`` runs."""
        p = ProgramPoint(len(self.result.points), phase, name, target, path, self.total + extra, extra)
        self.result.points.append(p)
        return p

    def note_host(self, node: fx.Node, ctx: dict) -> None:
        """Keep the largest host pool an op declares (``op_host_bound``): one such op runs at a time."""
        host = op_host_bound(node, ctx)
        if host is not None:
            self.result.host_bytes = sympy.Max(self.result.host_bytes, host)

    def add(self, key, storage: Storage) -> None:
        storage.start = len(self.result.points)
        self.live[key] = storage
        self.result.storages.append(storage)
        self.total += storage.nbytes

    def free(self, key) -> None:
        storage = self.live.pop(key, None)
        if storage is not None:
            storage.end = len(self.result.points) - 1
            self.total -= storage.nbytes


def _saved_by_position(out_node: fx.Node, num_user_outputs: int, bw_placeholders: list) -> dict:
    """Backward's saved-tensor placeholders paired with the forward outputs they are, by position: the forward
    returns the saved tensors in the order backward takes them (symbolic sizes, saved after the tensors in forward
    but before them in backward, are left out). Names do not always agree: the partitioner calls a saved RNG state
    rng_state_output_<i> in backward, and SCO's token takes the place of the boundary it offloads."""
    def is_tensor(node):
        return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)
    saved = [o for o in list(out_node.args[0])[num_user_outputs:] if is_tensor(o)]
    taken = [ph for ph in bw_placeholders if not ph.name.startswith("tangents") and is_tensor(ph)]
    if len(saved) != len(taken):
        return {}
    return dict(zip(taken, saved))


def _tuple_values(graph: fx.Graph) -> None:
    """Give a multi-output node without a value (``run_and_save_rng_state``, which a checkpoint that preserves the
    RNG state wraps around an op: its RNG state and the op's outputs) the tuple its getitems read, so its outputs are
    allocations of that node; without it the saved RNG states (5,056 B each on CPU) were never counted."""
    for node in graph.nodes:
        if node.op != "call_function" or node.meta.get("val") is not None or not node.users:
            continue
        items = {}
        for user in node.users:
            if user.op != "call_function" or user.target is not operator.getitem or not isinstance(user.args[1], int):
                items = None
                break
            items[user.args[1]] = user.meta.get("val")
        if items:
            node.meta["val"] = tuple(items.get(i) for i in range(max(items) + 1))


def _storage_bytes(key: StorageKey) -> sympy.Expr:
    return as_expr(key.storage.nbytes())


def _walk_graph(walk: _Walk, graph: fx.Graph, phase: str, *, counted: Callable[[StorageKey], bool],
                keep: set, kind: Callable[[fx.Node], str], held: list[Held], ctx: dict) -> GraphAliasTracker:
    """Walk ``graph``'s nodes: allocate fresh storages, add workspace, free at last use (unless in ``keep``)."""
    nodes = list(graph.nodes)
    alias = GraphAliasTracker(nodes)
    ends = {h.end: h for h in held if h.end is not None}
    starts: dict[fx.Node, list[Held]] = {}
    for h in held:
        starts.setdefault(h.start, []).append(h)
    for node in nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if node in ends:  # the runtime hands its held buffer over to this node's output
            walk.free(("held", id(ends[node])))
        shape, dtype = _describe(node)
        for key in alias.get_fresh_allocations(node):
            if counted(key) and key not in walk.live:
                walk.add(key, Storage(node.name, module_path(node), shape, dtype, _storage_bytes(key), kind(node)))
        walk.point(phase, node, _workspace(node, alias, ctx))
        walk.note_host(node, ctx)
        for key in alias.get_fresh_allocations(node):  # never read again: FX frees it right away
            if key not in alias.storage_to_uses and key not in keep:
                walk.free(key)
        for key in alias.get_storages_last_used(node):
            if key not in keep:
                walk.free(key)
        for h in starts.get(node, ()):
            walk.add(("held", id(h)), Storage(h.label, module_path(node), "", "", h.nbytes, "held"))
    return alias


aten_contracts.register()  # torch kernels' hidden workspaces (measure/aten_contracts.py)


def op_bound(node: fx.Node, ctx: dict) -> sympy.Expr | None:
    """The whole device bound a boundpass op declares at this node (boundpass.runtime.contracts), or None."""
    if not contracts.has_bound(node.target):
        return None
    if not ctx.get("kernel_workspace", True) and not str(node.target).startswith("boundpass."):
        return None  # a caller that measures tensors only (plan's block traces) leaves torch kernels' workspace out
    return contracts.device_bound(node.target, _arguments(node), ctx)


def op_host_bound(node: fx.Node, ctx: dict) -> sympy.Expr | None:
    """The host pool a boundpass op declares at this node (boundpass.runtime.contracts), or None."""
    if not contracts.has_host_bound(node.target):
        return None
    return contracts.host_bound(node.target, _arguments(node), ctx)


def _arguments(node: fx.Node) -> dict:
    """The op call's arguments by schema name, graph values as their fake tensors."""
    return contracts.call_arguments(node.target, node.args, node.kwargs,
                                    lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a)


def _workspace(node: fx.Node, alias: GraphAliasTracker, ctx: dict) -> sympy.Expr:
    """A boundpass custom op's bound minus the storages of its own inputs and outputs (never below 0)."""
    bound = op_bound(node, ctx)
    if bound is None:
        return sympy.Integer(0)
    io = set(alias.get_storage_uses(node)) | set(alias.node_to_output_storages.get(node, ()))
    for user in node.users:  # tuple outputs are read through getitem nodes
        io |= set(alias.node_to_output_storages.get(user, ()))
    io_bytes = sum((_storage_bytes(k) for k in io), sympy.Integer(0))
    return sympy.Max(0, bound - io_bytes)


def analyze_graphs(fw: fx.GraphModule, bw: fx.GraphModule | None, *, static_inputs: set[int],
                   num_user_outputs: int, held: list[Held] = (), ctx: dict | None = None) -> GraphPeak:
    """Program points of one graph's forward, then its backward (None: inference), persistent state excluded.

    static_inputs: forward placeholder indices that are parameters / buffers (counted as persistent state by
    the caller, never here). num_user_outputs: leading forward outputs returned to the caller (kept live by it
    through backward). Host memory never appears as a graph value here: SCO's host copies live inside its op, and an
    op's own host pool is its declared host bound (``GraphPeak.host_bytes``: the largest, checked as a host term).
    ctx: launch facts the workspace bounds need (e.g. max_tokens_per_rank).
    """
    ctx = ctx or {}
    for graph in (fw, bw) if bw is not None else (fw,):
        _tuple_values(graph.graph)
    result = GraphPeak()
    placeholders = fw.graph.find_nodes(op="placeholder")
    fw_alias_probe = GraphAliasTracker(list(fw.graph.nodes))
    persistent: set = set()
    inputs: dict = {}
    for i, node in enumerate(placeholders):
        for key in fw_alias_probe.get_fresh_allocations(node):
            if i in static_inputs:
                persistent.add(key)
            else:
                shape, dtype = _describe(node)
                inputs[key] = Storage(node.name, "", shape, dtype, _storage_bytes(key), "input")
    out_node = fw.graph.find_nodes(op="output")[0]
    outputs = [o for o in out_node.args[0] if isinstance(o, fx.Node)]
    out_keys = set()
    for o in outputs:
        out_keys |= set(fw_alias_probe.node_to_output_storages.get(o, ()))

    walk = _Walk(result, dict(inputs))
    for s in inputs.values():
        result.storages.append(s)
    fw_alias = _walk_graph(walk, fw.graph, "forward", counted=lambda k: k not in persistent,
                           keep=out_keys | set(inputs), kind=lambda n: "activation", held=list(held), ctx=ctx)
    if bw is None:
        return result
    # Into backward: the caller holds the user outputs and inputs; saved tensors are backward's placeholders.
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    user_keys = set()
    for o in list(out_node.args[0])[:num_user_outputs]:
        if isinstance(o, fx.Node):
            user_keys |= set(fw_alias.node_to_output_storages.get(o, ()))
    result.caller_bytes = sum((walk.live[k].nbytes for k in (user_keys | set(inputs)) if k in walk.live),
                              sympy.Integer(0))
    saved_keys = set()
    bw_placeholders = bw.graph.find_nodes(op="placeholder")
    bw_probe = GraphAliasTracker(list(bw.graph.nodes))
    paired = _saved_by_position(out_node, num_user_outputs, bw_placeholders)
    for ph in bw_placeholders:
        src = paired.get(ph) or fw_nodes.get(ph.name)
        if src is not None:
            saved_keys |= set(fw_alias.node_to_output_storages.get(src, ()))
    for key in list(walk.live):  # forward outputs neither returned nor saved die when forward returns
        if key in out_keys and key not in user_keys and key not in saved_keys and key not in inputs:
            walk.free(key)
    for s in walk.live.values():
        if s.kind == "activation":
            s.kind = "saved"
    result.saved_bytes = walk.total - sum((s.nbytes for s in inputs.values()), sympy.Integer(0))
    caller_held = user_keys | set(inputs)
    if ctx.get("per_block"):
        # one block of a per-block compile: the caller (the trunk's loop) passes the output on to the next block
        # and drops the input; in backward only what this graph saved is left of them (the composition counts the
        # output as this block's saved bytes while later blocks run: boundpass/backend/block_compile.py)
        caller_held = set()
        result.caller_bytes = sympy.Integer(0)
        for key in list(walk.live):
            if key in (user_keys | set(inputs)) and key not in saved_keys:
                walk.free(key)
    bw_out = bw.graph.find_nodes(op="output")[0]
    grad_keys, param_grad_keys = set(), set()
    for i, o in enumerate(bw_out.args[0]):
        if isinstance(o, fx.Node):
            keys = set(bw_probe.node_to_output_storages.get(o, ()))
            grad_keys |= keys
            if i in static_inputs:
                param_grad_keys |= keys
    # each storage once: a gradient that is a view keeps its whole base alive (AccumulateGrad steals it), and two
    # gradients viewing one base hold it once
    result.gradient_bytes = sum((_storage_bytes(k) for k in param_grad_keys), sympy.Integer(0))
    # bw placeholders carry the same fake tensors as the forward outputs they are (the partitioner copies meta)
    keep = grad_keys | caller_held
    for ph in bw_placeholders:  # autograd's engine holds the incoming gradients until backward returns
        if ph.name.startswith("tangents"):
            for key in bw_probe.get_fresh_allocations(ph):
                shape, dtype = _describe(ph)
                walk.add(key, Storage(ph.name, "", shape, dtype, _storage_bytes(key), "input"))
                keep.add(key)
    for ph in bw_placeholders:  # a saved tensor no backward node reads dies as backward starts (boxed call)
        for key in bw_probe.node_to_output_storages.get(ph, ()):
            if key in saved_keys and key not in bw_probe.storage_to_uses and key not in keep:
                walk.free(key)
    _walk_graph(walk, bw.graph, "backward",
                counted=lambda k: k not in persistent and k not in saved_keys,
                keep=keep, kind=lambda n: "gradient" if n in bw_out.args[0] else "activation", held=list(held), ctx=ctx)
    return result


def render_point(gp: GraphPeak, point: ProgramPoint, values: dict, top: int = 8) -> list[str]:
    """Lines naming a program point and its largest live storages (module path, shape, bytes)."""
    lines = [f"peak at {point.phase} node {point.node} ({point.target})"
             + (f" in {point.module_path}" if point.module_path else "")]
    workspace = bytes_at(point.workspace, values)
    if workspace:
        lines.append(f"  {format_bytes(workspace):>10}  workspace  inside {point.target} (its declared bound minus "
                     f"its inputs and outputs)")
    for s, n in gp.live_at(point, values, top):
        where = f" @ {s.module_path}" if s.module_path else ""
        formula = "" if s.nbytes.is_number else f" = {s.nbytes}"
        lines.append(f"  {format_bytes(n):>10}  {s.kind:<10} {s.name}{where} {s.shape} {s.dtype}{formula}")
    return lines


def int_or_hint(expr, backed: dict) -> int:
    """A byte count (int or sympy) at the backed sizes ``backed``; 0 where a size is still free."""
    out = sympy.sympify(expr).xreplace(backed)
    return int(out) if out.is_number else 0
