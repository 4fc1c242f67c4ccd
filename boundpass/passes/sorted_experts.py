"""Routed experts in the sorted grouped-matmul form, rewritten to PipelinedLLEP at EP = 1.

The form (Hugging Face transformers 5.x's ``grouped_mm`` experts implementation, which its experts interface uses
by default for Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, ... : ``transformers.integrations.moe``):

    ids, S = top-k of the router                               [T, k] each
    ids_g, perm = sort(ids.flatten())                          routes grouped by expert
    xs = x[perm // k]                                          x [T, H]
    offsets = cumsum(histc(ids_g, E))                          each expert's rows
    y = grouped_mm(xs, W_gu, offsets)                          W_gu [E, 2I, H] (or transposed [E, H, 2I])
    y = act(gate) * up  of y's two halves (chunked or interleaved)
    y = grouped_mm(y, W_d, offsets)                            W_d [E, H, I] (or transposed)
    out = (y * S.flatten()[perm]).[inverse perm].view(T, k, H).sum(1)

which is PipelinedLLEP's contract: out[t] = sum_s S[t, s] * expert_{ids[t, s]}(x[t]) with w1 = the gate half of W_gu,
w3 = its up half, w2 = W_d: views of the model's own parameters, no copy. HF's ``batched_mm`` implementation computes
the same function without the sort: each token repeated k times, each route's weights gathered (W_gu[ids], a
[T k, 2I, H] copy) and applied with bmm; its expert matmuls are matched as bmm's of a gathered 3-D parameter.

How it is recognised: the two grouped matmuls and their parameters structurally (the first fed x gathered through
the sort, the second reading the first's descendants), the region as every node between the routing and the
[T, H] result; then what the region computes by evaluating it on probe inputs (random x, scores and weights; a
random routing and one on the first k experts) against sum_s S * SwiGLU for each layout the weights' shapes allow
(halves chunked or interleaved; weights transposed or not). Exactly one layout must agree; a variant the op does not
compute (biases, another activation, a clamp, a post-expert norm, the scores applied to the inputs) agrees with none
and is skipped with that reason.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from boundpass.passes.dispatch_structure import Probe, Skip, erase_dead, size_hint
from boundpass.passes.graph_edit import example_value as _val
from boundpass.passes.graph_edit import descendants, node_adder

FORMS = {"grouped_mm": "top-k -> sort -> grouped_mm SwiGLU experts (gate/up fused) -> weighted sum (HF grouped_mm)",
         "batched_mm": "top-k -> per-route gathered weights -> bmm SwiGLU experts (gate/up fused) -> weighted sum "
                       "(HF batched_mm)"}


def _is_grouped_mm(node) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    target = node.target
    if target is getattr(torch, "_grouped_mm", None) or target is getattr(F, "grouped_mm", None):
        return True
    return "grouped_mm" in str(getattr(target, "__name__", target))  # transformers::grouped_mm_fallback


def _gathered_param(node):
    """The [E, a, b] parameter P when ``node`` is P[expert ids] (through a transpose): batched_mm's per-route weights."""
    node = _through(node, "transpose", "contiguous", "to")
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem \
            and isinstance(node.args[1], fx.Node):
        base = node.args[0]
        if isinstance(base, fx.Node) and base.op == "placeholder" and _val(base) is not None and _val(base).dim() == 3:
            return base
    return None


def _expert_matmul(node):
    """(kind, token operand, weight operand) of one expert matmul: a grouped matmul over the sorted routes, or a
    bmm of each route's gathered weight; None for anything else."""
    if _is_grouped_mm(node):
        return "grouped_mm", node.args[0], node.args[1]
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in (torch.bmm, torch.matmul) \
            or isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("bmm", "matmul"):
        a, b = node.args[:2]
        if _gathered_param(a) is not None:
            return "batched_mm", b, a
        if _gathered_param(b) is not None:
            return "batched_mm", a, b
    return None


def _through(node, *methods):
    """Follow a chain of ``methods`` (call_method names, or "getitem-free" casts) back to its source."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in methods:
        node = node.args[0]
    return node


def _param(node) -> fx.Node:
    """The [E, a, b] parameter a grouped matmul reads (through a transpose of its last two dims)."""
    base = _through(node, "transpose", "contiguous", "to")
    if not isinstance(base, fx.Node) or base.op != "placeholder":
        raise Skip(f"the grouped matmul's weight {getattr(node, 'name', node)} is computed in the graph, not a "
                    f"parameter")
    arg = base.meta.get("grapharg")
    if arg is not None and not isinstance(arg.example, torch.nn.Parameter):
        raise Skip(f"the grouped matmul's weight {base.name} is a tensor argument, not a parameter")
    if _val(base) is None or _val(base).dim() != 3:
        raise Skip(f"the grouped matmul's weight {base.name} is not [E, out, in]")
    return base


def match_sorted_experts(graph: fx.Graph, topk: fx.Node) -> dict:
    """The sorted grouped-matmul experts fed by this top-k, or Skip with the reason."""
    ids = next((u for u in topk.users if u.target is operator.getitem and u.args[1] == 1), None)
    if ids is None or _val(ids) is None or _val(ids).dim() != 2:
        raise Skip("the top-k's expert ids are not used as [T, k]")
    T, k = _val(ids).shape
    order = {n: i for i, n in enumerate(graph.nodes)}
    after_ids = descendants(ids)
    mms = sorted((n for n in after_ids if _expert_matmul(n) is not None), key=order.__getitem__)
    if len(mms) < 2:
        raise Skip("no grouped matmuls follow the routing")
    up_mm = mms[0]
    down_mm = next((m for m in mms[1:] if m in descendants(up_mm)), None)
    if down_mm is None:
        raise Skip("the grouped matmuls are not chained (up projection -> down projection)")
    kind, up_tokens, up_weight = _expert_matmul(up_mm)
    _, _, down_weight = _expert_matmul(down_mm)
    gathered = _through(up_tokens, "to", "contiguous", "unsqueeze")
    if kind == "grouped_mm" and isinstance(gathered, fx.Node) and gathered.target is operator.getitem \
            and isinstance(gathered.args[1], fx.Node):
        x = gathered.args[0]  # x[perm // k]
    elif kind == "batched_mm" and isinstance(gathered, fx.Node) and gathered.op == "call_method" \
            and gathered.target == "repeat_interleave":
        x = gathered.args[0]  # each token once per route
    else:
        raise Skip("the first expert matmul is not fed the tokens gathered per route")
    x_val = _val(x)
    if x_val is None or x_val.dim() != 2 or not x_val.is_floating_point():
        raise Skip("the experts gather rows of a tensor that is not [T, H]")
    if x_val.dtype not in (torch.float32, torch.float64):
        raise Skip(f"the tokens are {x_val.dtype}: this form sums a token's k routes in one reduction (fp32 "
                    f"accumulation), PipelinedLLEP's combine adds them one by one in {x_val.dtype}, which would change "
                    f"the numerics")
    H = x_val.shape[1]
    if kind == "grouped_mm":
        w_gu, w_d = _param(up_weight), _param(down_weight)
    else:
        w_gu, w_d = _gathered_param(up_weight), _gathered_param(down_weight)
        if w_d is None:
            raise Skip("the down projection's weights are not gathered per route from one parameter")
        _param(w_gu), _param(w_d)  # parameters, not tensor arguments
    # the [T, H] result: the chain after the down projection until a value shaped like x (its cast to x's dtype too)
    out, stack, seen = None, [down_mm], set()
    while stack:
        n = stack.pop(0)
        if n in seen:
            continue
        seen.add(n)
        v = _val(n)
        if n is not down_mm and isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(x_val.shape):
            out = n
            break
        stack.extend(sorted(n.users, key=order.__getitem__))
    if out is None:
        raise Skip("the experts' outputs are not combined back to [T, H]")
    while len(out.users) == 1:  # a cast / contiguous to x's dtype belongs to the region
        (user,) = out.users
        if user.op == "call_method" and user.target in ("to", "contiguous", "type_as") and \
                isinstance(_val(user), torch.Tensor) and tuple(_val(user).shape) == tuple(x_val.shape):
            out = user
        else:
            break
    if _val(out).dtype != x_val.dtype:
        raise Skip(f"the experts' output is {_val(out).dtype}, x is {x_val.dtype}")

    scores = _scores(down_mm, out, (T, k))
    # the region: every node between the routing / x / the scores / the weights and the result (walked back from
    # the result), plus mutations of region values (an inverse permutation filled in place) made before the result
    sources = {ids, x, scores, w_gu, w_d}
    reach = descendants(*sources)
    region, leaves, stack = set(), set(), [out]
    while stack:
        n = stack.pop()
        if n in region:
            continue
        region.add(n)
        for a in n.all_input_nodes:
            if a in sources or a not in reach:
                leaves.add(a)
            else:
                stack.append(a)
    def made_here(a):  # a constant made in the graph from sizes alone (an arange)
        return a.op == "call_function" and not any(isinstance(_val(b), torch.Tensor) for b in a.all_input_nodes)
    for n in list(graph.nodes):
        if n not in region and not n.users and order[n] < order[out] and n.op == "call_function" \
                and any(a in region for a in n.all_input_nodes) \
                and all(a in region or a in leaves or made_here(a) for a in n.all_input_nodes):
            region.add(n)  # e.g. inv_perm[perm] = arange(...)
            region |= {a for a in n.all_input_nodes if a not in leaves and made_here(a)}
    for n in leaves - sources:
        v = _val(n)
        if isinstance(v, torch.Tensor):
            raise Skip(f"the experts read {n.name} besides x, the routing, the scores and their weights")
    stray = [(n, u) for n in region - {out} for u in n.users if u not in region]
    if stray:
        raise Skip(f"the region has more than one output: {stray[0][1].name} reads {stray[0][0].name}")
    layout = _probe_layout(graph, region, order, dict(x=x, ids=ids, scores=scores, w_gu=w_gu, w_d=w_d), H)
    E = int(_val(w_gu).shape[0])
    return dict(x=x, ids=ids, scores=scores, w_gu=w_gu, w_d=w_d, out=out, region=region, layout=layout,
                hidden=int(H), inter=layout["inter"], experts=E, top_k=int(k), kind=kind)


def _scores(down_mm: fx.Node, out: fx.Node, shape) -> fx.Node:
    """The [T, k] route weights that scale the down projection's rows (through the sort's gather, a reshape, an
    unsqueeze, a cast) on the way to the result."""
    inside = descendants(down_mm)
    node = down_mm
    while node is not out:
        users = [u for u in node.users if u in inside or u is out]
        if len(users) != 1:
            break
        node = users[0]
        if node.op == "call_function" and node.target in (operator.mul, torch.mul) or \
                node.op == "call_method" and node.target == "mul":
            other = next((a for a in node.args[:2] if isinstance(a, fx.Node) and a not in inside and a is not down_mm),
                         None)
            while isinstance(other, fx.Node):
                v = _val(other)
                if isinstance(v, torch.Tensor) and v.is_floating_point() and tuple(v.shape) == tuple(shape):
                    return other
                if other.op == "call_method" and other.target in ("unsqueeze", "reshape", "view", "flatten", "to",
                                                                   "float", "type_as", "contiguous"):
                    other = other.args[0]
                elif other.op == "call_function" and other.target in (operator.getitem, torch.reshape, torch.flatten,
                                                                      torch.unsqueeze):
                    other = other.args[0]
                else:
                    break
            raise Skip("the experts' outputs are scaled by something other than the top-k scores gathered by the sort")
    raise Skip("the experts' outputs are not scaled by their route's score (an unweighted combine)")


def _layouts(gu_shape, d_shape, H) -> list[dict]:
    """Every reading of W_gu [E, a, b] and W_d [E, c, d] as gate/up [E, I, H] halves and a down [E, H, I]."""
    out = []
    for transposed in (False, True):
        two_i = gu_shape[1] if not transposed else gu_shape[2]
        hid = gu_shape[2] if not transposed else gu_shape[1]
        down = (d_shape[1], d_shape[2]) if not transposed else (d_shape[2], d_shape[1])
        if hid != H or two_i % 2 or down != (H, two_i // 2):
            continue
        for halves in ("chunked", "interleaved"):
            out.append(dict(transposed=transposed, halves=halves, inter=two_i // 2))
    return out


def _weights(w_gu, w_d, layout):
    """(w1, w2, w3) in GroupedExperts' layout [E, I, H], [E, H, I], [E, I, H] for a layout: views."""
    gu = w_gu.transpose(-2, -1) if layout["transposed"] else w_gu
    w2 = w_d.transpose(-2, -1) if layout["transposed"] else w_d
    inter = layout["inter"]
    if layout["halves"] == "chunked":
        return gu[:, :inter], w2, gu[:, inter:]
    return gu[:, 0::2], w2, gu[:, 1::2]


def _reference(x, ids, scores, w1, w2, w3):
    """sum_s S[t, s] * W2_e (silu(W1_e x_t) * (W3_e x_t)), e = ids[t, s], in float64."""
    x, scores = x.double(), scores.double()
    out = torch.zeros_like(x)
    for s in range(ids.shape[1]):
        e = ids[:, s]
        h = F.silu(torch.einsum("tih,th->ti", w1.double()[e], x)) * torch.einsum("tih,th->ti", w3.double()[e], x)
        out += scores[:, s, None] * torch.einsum("thi,ti->th", w2.double()[e], h)
    return out


def _probe_layout(graph, region, order, leaves, H) -> dict:
    """The one weight layout under which the region computes PipelinedLLEP's function on probe inputs."""
    ids_val, gu_val, d_val = _val(leaves["ids"]), _val(leaves["w_gu"]), _val(leaves["w_d"])
    T, k = (size_hint(d) for d in ids_val.shape)
    E = size_hint(gu_val.shape[0])
    candidates = _layouts(tuple(size_hint(d) for d in gu_val.shape), tuple(size_hint(d) for d in d_val.shape), size_hint(H))
    if not candidates:
        raise Skip(f"the grouped matmuls' weights {tuple(gu_val.shape)} / {tuple(d_val.shape)} are not gate+up "
                    f"[E, 2I, H] and down [E, H, I] (transposed or not)")
    gen = torch.Generator().manual_seed(0)
    dtype = _val(leaves["x"]).dtype if _val(leaves["x"]).dtype in (torch.float32, torch.float64) else torch.float32
    routings = [torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]),
                torch.arange(k).expand(T, k).clone()]
    nodes = sorted(region, key=order.__getitem__)
    for ids in routings:
        env = {leaves["ids"]: ids.to(ids_val.dtype),
               leaves["x"]: torch.randn(T, size_hint(H), generator=gen, dtype=dtype),
               leaves["scores"]: torch.rand(T, k, generator=gen, dtype=dtype),
               leaves["w_gu"]: torch.randn(tuple(size_hint(d) for d in gu_val.shape), generator=gen, dtype=dtype)
               / size_hint(H) ** 0.5,
               leaves["w_d"]: torch.randn(tuple(size_hint(d) for d in d_val.shape), generator=gen, dtype=dtype)
               / size_hint(H) ** 0.5}
        probe = Probe(env, set(region))
        try:
            for n in nodes:  # in graph order: an in-place fill happens before its readers
                probe(n)
        except Skip:
            raise
        except Exception as err:
            raise Skip(f"the experts could not be evaluated on a probe routing ({type(err).__name__}: {err})") \
                from None
        got = probe.env[nodes[-1]]  # the result: the region's last node
        args = (env[leaves["x"]], ids, env[leaves["scores"]])
        def agrees(layout) -> bool:  # a wrong layout or function is off by O(1); rounding by ~1e-7 relative
            want = _reference(*args, *_weights(env[leaves["w_gu"]], env[leaves["w_d"]], layout))
            return bool((got.double() - want).norm() <= 1e-5 * want.norm())
        candidates = [c for c in candidates if agrees(c)]
        if not candidates:
            raise Skip("the sorted grouped-matmul experts do not compute sum_s S[t, s] * SwiGLU_e(x[t]) with "
                        "bias-free gate/up/down weights (probe routings): biases, another activation, a clamp, a "
                        "post-expert norm, or the scores applied another way")
    if len(candidates) != 1:
        raise Skip(f"the weights' layout is ambiguous on the probes ({candidates})")
    return candidates[0]


def rewrite_sorted_experts(gm: fx.GraphModule, m: dict, op_args) -> fx.Node:
    """Replace the region by one ``pipelined_llep_fwd`` on views of the experts' own parameters."""
    graph = gm.graph
    x, out = m["x"], m["out"]
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_user = min(out.users, key=order.__getitem__)
    add = node_adder(graph, _val(x).fake_mode, module_stack_of=out, trace_of=out)
    layout, inter, k = m["layout"], m["inter"], m["top_k"]
    with graph.inserting_before(first_user):
        tokens = add("reshape", x, -1, m["hidden"], kind="call_method")
        ids = add("reshape", m["ids"], -1, k, kind="call_method")
        scores = add("reshape", m["scores"], -1, k, kind="call_method")
        gu = add("transpose", m["w_gu"], -2, -1, kind="call_method") if layout["transposed"] else m["w_gu"]
        w2 = add("transpose", m["w_d"], -2, -1, kind="call_method") if layout["transposed"] else m["w_d"]
        if layout["halves"] == "chunked":
            w1 = add(operator.getitem, gu, (slice(None), slice(None, inter)))
            w3 = add(operator.getitem, gu, (slice(None), slice(inter, None)))
        else:
            w1 = add(operator.getitem, gu, (slice(None), slice(None, None, 2)))
            w3 = add(operator.getitem, gu, (slice(None), slice(1, None, 2)))
        fused = add(torch.ops.boundpass.pipelined_llep_fwd.default, *op_args(tokens, ids, scores, w1, w2, w3))
        result = add(operator.getitem, fused, 0)
        result = add("view_as", result, x, kind="call_method")
    out.replace_all_uses_with(result, delete_user_cb=lambda user: user not in m["region"])
    erase_dead(graph, m["region"], set())
    return fused
