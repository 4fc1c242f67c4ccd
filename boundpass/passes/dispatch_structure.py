"""Routed experts found by what they compute (not torchtitan's RoutedExperts), rewritten to PipelinedLLEP at EP = 1.

The form (a Mixtral-style block in plain PyTorch, ``boundpass/testing/mixtral_lm.py``):

    scores, ids = topk(router probs, k)                       ids [T, k], one E-way router
    S = f(scores)                                             any [T, k] weights (renormalised, cast, ...)
    out = zeros_like(x)                                       x [T, H]
    for each expert e:                                        unrolled by Dynamo, one branch per expert
        token, slot = <the routes of e, from ids alone>       where / nonzero / one_hot / sort / ...
        y = linear(silu(linear(x[token], W1_e)) * linear(x[token], W3_e), W2_e)     no bias
        out.index_add_(0, token, y * S[token, slot, None])
    -> out

which is exactly PipelinedLLEP's contract at E_p = 1: out[t] = sum_s S[t, s] * expert_{ids[t, s]}(x[t]), with
expert j's weights w1[j] = W1_j ([I, H], nn.Linear's layout is GroupedExperts' w1 [e, I, H]), w2[j] = W2_j
([H, I]), w3[j] = W3_j. The per-expert weights are stacked in the graph into the op's [E, ...] layout (a real
copy, counted by the step analysis); experts held as P[e] of one [E, out, in] parameter pass P itself.

How it is recognised: the experts and the combine structurally (linear / silu / mul / index_add: the reasons to
refuse are named: biases, another activation, weights computed in the graph, unweighted or differently weighted
combine); the grouping of tokens by expert and the weight each route gets by evaluating those nodes of the graph
on probe routings (round-robin, random, all routes on the first k experts): each branch must pick exactly the
routes of one expert, every expert exactly once, and weight each by S[t, s]. So any spelling of the grouping
(where on a one_hot mask, nonzero on ids == e, a sort) is accepted when it computes that, and nothing else is.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from boundpass.passes.graph_edit import example_value as _val
from boundpass.passes.graph_edit import descendants, node_adder, sweep_dead_nodes

_COMBINES = {"index_add_", "index_add", "scatter_add_", "scatter_add", "index_put_", "index_put"}
_MULS = (operator.mul, torch.mul)
_BATCHED = (torch.bmm, torch.matmul, operator.matmul, torch._grouped_mm, torch.einsum, torch.baddbmm)
# nodes the rewrite may erase once unused besides the region's own (which are checked): pure values and the
# unbacked-size assertions Dynamo hangs off the grouping's data-dependent sizes
_ASSERTS = (torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default,
            torch.ops.aten.sym_constrain_range.default, torch._check, torch._check_is_size)


class Skip(Exception):
    """A precise reason the routed experts at hand are not what PipelinedLLEP computes."""


def _name(node) -> str:
    return node.name if isinstance(node, fx.Node) else repr(node)


def _target_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _call_is(node, *targets) -> bool:
    """node is a call of one of ``targets`` (functions, or method names as strings)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return any(node.target is t for t in targets if not isinstance(t, str))
    return node.op == "call_method" and node.target in [t for t in targets if isinstance(t, str)]


def _combine_parts(node: fx.Node):
    """(accumulator, dim, index, source, in_place) of ``acc.index_add_(dim, index, source)`` or ``index_add``."""
    if len(node.args) != 4 or set(node.kwargs) - {"alpha"}:
        raise Skip(f"{node.name}: index_add spelled with keywords: not matched")
    if node.kwargs.get("alpha", 1) != 1:
        raise Skip(f"{node.name}: index_add with alpha: the combine is not a plain weighted sum")
    return (*node.args, node.op == "call_method" and node.target == "index_add_")


def _linear(node, role: str) -> tuple[fx.Node, fx.Node]:
    """(input, weight) of ``F.linear(input, weight)`` without bias; a named refusal otherwise."""
    if _call_is(node, *_BATCHED):
        raise Skip(f"the experts are batched matmuls ({_target_name(node)}), not per-expert linear layers")
    if not _call_is(node, F.linear):
        raise Skip(f"the experts' {role} is {_name(node)} ({_target_name(node) if isinstance(node, fx.Node) else ''}),"
                    f" not a linear layer: not silu(x W1) * (x W3) -> W2")
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if bias is not None:
        raise Skip("the experts have biases (PipelinedLLEP computes bias-free SwiGLU experts)")
    return node.args[0], node.args[1]


def _match_expert(y: fx.Node):
    """(gathered x node, W1, W2, W3, nodes) of y = linear(silu(linear(a, W1)) * linear(a, W3), W2)."""
    p, w2 = _linear(y, "output projection")
    if not _call_is(p, *_MULS, "mul"):
        act = _target_name(p) if isinstance(p, fx.Node) else repr(p)
        raise Skip(f"the experts are not gated (SwiGLU): their down projection takes {act}")
    a, b = p.args[:2]
    silus = [n for n in (a, b) if _call_is(n, F.silu, "silu")]
    if not silus:
        acts = ", ".join(_target_name(n) for n in (a, b) if isinstance(n, fx.Node) and not _call_is(n, F.linear))
        raise Skip(f"the experts' activation is {acts or 'missing'}, not SiLU (PipelinedLLEP computes SwiGLU)")
    act = silus[0]
    up = b if act is a else a
    if act.kwargs.get("inplace") or (len(act.args) > 1 and act.args[1]):
        raise Skip("the experts' silu is in place")
    gate_in, w1 = _linear(act.args[0], "gate projection")
    up_in, w3 = _linear(up, "up projection")
    if gate_in is not up_in:
        raise Skip("the experts' gate and up projections take different inputs")
    selects = set()
    for w in (w1, w2, w3):
        param = w
        if _call_is(w, operator.getitem) and isinstance(w.args[1], int):  # one expert of a [E, out, in] parameter
            param = w.args[0]
            selects.add(w)
        if not isinstance(param, fx.Node) or param.op != "placeholder":
            raise Skip(f"the experts' weight {_name(w)} is computed in the graph, not a parameter")
        arg = param.meta.get("grapharg")
        if arg is not None and not isinstance(arg.example, torch.nn.Parameter):
            raise Skip(f"the experts' weight {_name(param)} is a tensor argument, not a parameter")
    return gate_in, w1, w2, w3, {y, p, act, act.args[0], up} | selects


def size_hint(value):
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is None:
            raise Skip(f"the routing uses a data-dependent size {value} that cannot be probed")
        return int(hint)
    return value


class Probe:
    """Evaluate the grouping's nodes (those computed from the top-k ids) on real probe tensors bound to the ids and
    the scores; anything else they read must be a size (taken at its hint) or a constant made in the graph."""

    def __init__(self, env: dict, computed_from_ids: set):
        self.env, self.inside, self.visited = dict(env), computed_from_ids, set()

    def __call__(self, node):
        if not isinstance(node, fx.Node):
            return node
        if node in self.env:
            return self.env[node]
        if node.op not in ("call_function", "call_method") or (node not in self.inside and node.all_input_nodes):
            val = _val(node)
            if isinstance(val, (int, torch.SymInt)):
                return size_hint(val)
            raise Skip(f"the grouping of tokens by expert reads {node.name} besides the top-k ids and scores")
        args = fx.node.map_arg(node.args, self)
        kwargs = fx.node.map_arg(node.kwargs, self)
        out = getattr(args[0], node.target)(*args[1:], **kwargs) if node.op == "call_method" else \
            node.target(*args, **kwargs)
        self.env[node] = out
        if node in self.inside:
            self.visited.add(node)
        return out


def _probe_ids(shape, experts: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Routings a top-k can draw (k distinct experts per token): consecutive experts (every expert used when
    T k >= E), random ones, and every token on experts 0..k-1 (the others empty)."""
    T, k = shape
    consecutive = torch.arange(T * k).view(T, k) % experts
    rand = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(T)])
    first = torch.arange(k).expand(T, k).clone()
    return [consecutive, rand, first]


def match_routed_experts(graph: fx.Graph, topk: fx.Node, routed_nodes: set):
    """The routed-experts region fed by this top-k, or Skip with the reason. Returns a dict of what the rewrite
    needs: x, ids, scores, per-expert (W1, W2, W3) in expert order, the accumulator, the combines, the region."""
    ids = next((u for u in topk.users if _call_is(u, operator.getitem) and u.args[1] == 1), None)
    if ids is None:
        raise Skip("the top-k's expert ids are not used")
    router = _val(topk.args[0]) if topk.args else None
    ids_val = _val(ids)
    if ids_val is None or ids_val.dim() != 2 or router is None:
        raise Skip("the top-k is not [T, E] router scores -> [T, k] expert ids")
    experts, k = int(router.shape[-1]), int(ids_val.shape[-1])
    after = descendants(ids)
    combines = [n for n in after if isinstance(n, fx.Node) and n.op in ("call_method", "call_function")
                and _target_name(n) in _COMBINES]
    if not combines:
        raise Skip("tokens grouped by expert are not combined back with index_add (no weighted combine found)")
    other = [n for n in combines if _target_name(n) not in ("index_add_", "index_add")]
    if other:
        raise Skip(f"the experts' outputs are combined with {_target_name(other[0])}, not index_add along the "
                    f"token dim")
    order = {n: i for i, n in enumerate(graph.nodes)}
    combines.sort(key=order.__getitem__)
    parts = [_combine_parts(c) for c in combines]
    acc = parts[0][0]
    in_place = parts[0][4]
    for c, (base, dim, _, _, inplace) in zip(combines, parts):
        chained = base is acc if inplace else (base is acc or base in combines)
        if inplace != in_place or not chained:
            raise Skip(f"{c.name}: the combines do not add into one accumulator")
        if dim not in (0, -2):
            raise Skip(f"{c.name}: index_add along dim {dim}, not the token dim")
    if not in_place and any(p[0] is not (acc if i == 0 else combines[i - 1]) for i, p in enumerate(parts)):
        raise Skip("the functional index_adds do not form one chain")
    acc_val = _val(acc)
    if not _call_is(acc, torch.zeros_like, torch.zeros, "new_zeros", "zero_") or acc_val is None:
        raise Skip(f"the combine adds into {_name(acc)}, not a zero-initialised output")

    x = None
    branches = []  # (combine, index node, weight node, W1, W2, W3, nodes)
    region = {acc, *combines}
    for c, (_, _, index, src, _) in zip(combines, parts):
        if not _call_is(src, *_MULS, "mul"):
            if _call_is(src, F.linear):
                fed = _match_expert(src)[0]
                if _call_is(fed, *_MULS, "mul"):
                    raise Skip("the scores are combined another way: they scale the experts' input rows, not their "
                                "outputs")
                raise Skip("the experts' outputs are combined unweighted (the top-k scores are not applied to them)")
            raise Skip(f"the experts' outputs are combined through {_name(src)} ({_target_name(src)}), "
                        f"not multiplied by their route's score")
        lhs, rhs = src.args[:2]
        y, w = (lhs, rhs) if _call_is(lhs, F.linear, *_BATCHED) else (rhs, lhs)
        if not isinstance(w, fx.Node):
            raise Skip("the experts' outputs are scaled by a constant, not by their route's score")
        gathered, w1, w2, w3, nodes = _match_expert(y)
        if _call_is(gathered, operator.getitem) and gathered.args[1] is index:
            source = gathered.args[0]
        elif _call_is(gathered, torch.index_select, "index_select") and gathered.args[1] in (0, -2) \
                and gathered.args[2] is index:
            source = gathered.args[0]
        else:
            raise Skip(f"expert {len(branches)} is fed {_name(gathered)}, not x gathered at the tokens it adds back "
                        f"to (the scores are combined another way, e.g. applied to the input)")
        if x is None:
            x = source
        elif source is not x:
            raise Skip("the experts gather from different inputs")
        branches.append((c, index, w, w1, w2, w3))
        region |= nodes | {src, gathered}

    x_val = _val(x)
    if x_val is None or x_val.dim() != 2 or not statically_known_true(x_val.shape[0] == ids_val.shape[0]):
        raise Skip("the experts gather rows of a tensor that is not [T, H] over the top-k's T tokens")
    if acc_val.shape != x_val.shape or acc_val.dtype != x_val.dtype:
        raise Skip("the combine's output is not shaped like its input x")
    if len(branches) != experts:
        raise Skip(f"{len(branches)} experts combined for a {experts}-way router")

    # the scores: the one floating [T, k] tensor outside the grouping that the route weights are read from
    leaves: dict = {}
    walked = set()

    def walk(node):
        for a in node.all_input_nodes:
            if a in after and a not in region and a not in walked:
                walked.add(a)
                walk(a)
            elif a not in after:
                leaves[a] = None
    for _, index, w, *_ in branches:
        walk(w)
        walk(index)
    floats = [n for n in leaves if n is not ids and isinstance(_val(n), torch.Tensor) and _val(n).is_floating_point()]
    if len(floats) != 1 or _val(floats[0]).shape != ids_val.shape:
        raise Skip("the route weights are not read from one [T, k] scores tensor (the scores are combined "
                    f"another way; read from {[n.name for n in floats]})")
    scores = floats[0]
    if _val(scores).dtype != x_val.dtype:
        raise Skip(f"the route weights are {_val(scores).dtype}, x is {x_val.dtype}: the combine is mixed-dtype")
    hidden, inter = (int(d) for d in (x_val.shape[1], _val(branches[0][3]).shape[0]))
    for _, _, _, w1, w2, w3 in branches:
        shapes = (tuple(_val(w1).shape), tuple(_val(w2).shape), tuple(_val(w3).shape))
        if shapes != ((inter, hidden), (hidden, inter), (inter, hidden)):
            raise Skip(f"the experts' weights are shaped {shapes}, not W1/W3 [I, H], W2 [H, I] alike for every expert")
        if any(_val(w).dtype != x_val.dtype for w in (w1, w2, w3)):
            raise Skip("the experts' weights are not in x's dtype")

    # what each branch computes, on probe routings: the routes of exactly one expert, weighted by S[t, s]
    shape = tuple(size_hint(d) for d in ids_val.shape)
    gen = torch.Generator().manual_seed(0)
    candidates = [set(range(experts)) for _ in branches]  # the experts each branch may be, narrowed per probe
    grouping = set()
    for probe in _probe_ids(shape, experts, gen):
        s = torch.randn(shape, generator=gen, dtype=torch.float64)
        ev = Probe({ids: probe, scores: s}, after)
        for b, (_, index, w, *_rest) in enumerate(branches):
            try:
                token, weight = ev(index), ev(w)
            except Skip:
                raise
            except Exception as err:  # an op that refuses the probe: a grouping we cannot read
                raise Skip(f"the grouping of expert {b}'s tokens could not be evaluated on a probe routing "
                            f"({type(err).__name__}: {err})") from None
            if not isinstance(token, torch.Tensor) or token.dim() != 1 or token.dtype not in (torch.int64, torch.int32):
                raise Skip(f"branch {b}'s combine index is not a 1-D token index")
            got = torch.sort(token.long()).values
            for e in list(candidates[b]):
                tok, slot = torch.where(probe == e)
                weight_ok = isinstance(weight, torch.Tensor) and weight.shape == (token.numel(), 1)
                if weight_ok:
                    slot_of = torch.full((shape[0],), -1, dtype=torch.int64)
                    slot_of[tok] = slot
                    weight_ok = torch.equal(weight.to(s.dtype), s[token.long(), slot_of[token.long()]].unsqueeze(1))
                if got.numel() != tok.numel() or not torch.equal(got, tok) or not weight_ok:
                    candidates[b].discard(e)
            if not candidates[b]:
                raise Skip(f"branch {b} does not compute one expert's routes weighted by their top-k score "
                            f"S[token, slot] (probe routings): the tokens or the scores are combined another way")
        grouping |= ev.visited
    expert_of = [min(c) for c in candidates]
    if any(len(c) != 1 for c in candidates) or sorted(expert_of) != list(range(experts)):
        raise Skip(f"the branches take experts {[sorted(c) for c in candidates]}, not each of the {experts} "
                    f"experts once")
    if region & routed_nodes:
        raise Skip("the region overlaps torchtitan's RoutedExperts")

    # one output: nothing outside reads the experts' values, and the accumulator is read only after the last add
    last = combines[-1]
    outputs = [u for u in (acc.users if in_place else last.users) if u not in region]
    for n in region - {acc, last}:
        stray = [u for u in n.users if u not in region]
        if stray:
            raise Skip(f"the region has more than one output: {stray[0].name} reads {n.name}")
    if in_place and any(order[u] < order[last] for u in outputs):
        raise Skip("the combined output is read before its last expert is added")
    if in_place and any(u not in region for u in last.users):
        raise Skip("the region has more than one output: the last index_add_'s result is used")
    if not outputs:
        raise Skip("the combined output is not used")
    ordered = sorted(zip(expert_of, branches), key=lambda eb: eb[0])
    return dict(x=x, ids=ids, scores=scores, weights=[b[3:6] for _, b in ordered], acc=acc, last=last,
                in_place=in_place, outputs=outputs, region=region, grouping=grouping, hidden=hidden, inter=inter,
                experts=experts, top_k=k)


def rewrite_routed_experts(gm: fx.GraphModule, m: dict, op_args) -> fx.Node:
    """Replace the matched region by one ``pipelined_llep_fwd`` on the stacked weights; returns the op node.

    ``op_args(tokens, ids, scores, w1, w2, w3) -> args`` gives the op's full argument list (the pass owns the
    defaults)."""
    graph = gm.graph
    x, last = m["x"], m["last"]
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_user = min(m["outputs"], key=order.__getitem__)
    add = node_adder(graph, _val(x).fake_mode, module_stack_of=last, trace_of=last)
    hidden, k = m["hidden"], m["top_k"]
    with graph.inserting_before(first_user):
        tokens = add("reshape", x, -1, hidden, kind="call_method")
        flat_ids = add("reshape", m["ids"], -1, k, kind="call_method")
        flat_scores = add("reshape", m["scores"], -1, k, kind="call_method")
        # nn.Linear keeps [out, in]: W1/W3 [I, H], W2 [H, I] stack to GroupedExperts' w1/w3 [E, I, H], w2 [E, H, I];
        # experts that are P[0], ..., P[E-1] of one [E, out, in] parameter are P itself, no copy
        stacked = [_whole(per_expert) or add(torch.stack, per_expert)
                   for per_expert in ([ws[j] for ws in m["weights"]] for j in range(3))]
        fused = add(torch.ops.boundpass.pipelined_llep_fwd.default, *op_args(tokens, flat_ids, flat_scores, *stacked))
        out = add(operator.getitem, fused, 0)
        out = add("view_as", out, x, kind="call_method")  # not the zeros: nothing may keep them alive
    for user in m["outputs"]:
        user.replace_input_with(m["acc"] if m["in_place"] else last, out)
    erase_dead(graph, m["region"], m["grouping"])
    return fused


def _whole(per_expert: list) -> fx.Node | None:
    """P when expert e's weight is P[e] for every e of one parameter P holding exactly those experts."""
    params = {w.args[0] for w in per_expert if _call_is(w, operator.getitem)}
    if len(params) != 1 or any(not _call_is(w, operator.getitem) or w.args[1] != e for e, w in enumerate(per_expert)):
        return None
    (param,) = params
    return param if _val(param).shape[0] == len(per_expert) else None


def erase_dead(graph: fx.Graph, region: set, grouping: set) -> None:
    """Erase the region (checked to have no other reader) and whatever of its grouping nothing else reads: the
    sizes and assertions on the grouping's data-dependent lengths go with it; a value also used elsewhere stays."""
    candidates = set(region) | set(grouping)
    for n in grouping:
        candidates |= descendants(n)
    sweep_dead_nodes(graph, keep=lambda n: n not in candidates or not (n in region or _removable(n)))


def _removable(node: fx.Node) -> bool:
    if node.op == "call_method":
        return not node.target.endswith("_")
    if node.op != "call_function":
        return False
    if node.target in _ASSERTS:
        return True
    name = getattr(node.target, "__name__", "")
    return node.target is not operator.setitem and not name.endswith("_") and not (
        isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable)
