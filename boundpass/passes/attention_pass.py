"""scaled_dot_product_attention => boundpass::chunked_attention (runtime/chunked_attention.py): the attention of a
block in tiles of C_s query x C_s key rows, never [L, L] scores.

Found by what the graph calls: ``F.scaled_dot_product_attention`` (``torch._C._nn.scaled_dot_product_attention`` in a
Dynamo graph), which is what torchtitan's SDPA attention, plain PyTorch models and Hugging Face's "sdpa" attention
interface call. A call is rewritten when the op computes it exactly: [B, heads, L, D] self-attention (query and key
lengths equal), no attention mask but the causal one, no dropout, GQA only through ``enable_gqa``. Anything else
is skipped with the reason and bounded as it runs. The tile C_s is the knob (``attention_chunk``): the planner takes
min(the widest that fits, the knee of ``cost_model.chunked_attention_seconds``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from boundpass.bound.bounds import Knob
from boundpass.measure.step_peak import module_path
from boundpass.passes import attention_region as ar
from boundpass.passes.graph_edit import ancestors, graph_modules, node_adder, sequence_range
from boundpass.passes.graph_edit import example_value as _val
from boundpass.passes.protocol import Diagnosis
from boundpass.runtime import attention_blocks as ab
from boundpass.runtime import chunked_attention as ca

_SDPA = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
MIN_CHUNK = 64   # narrower tiles only add per-tile launches; below this, the sequence itself must shrink


@dataclass
class AttentionRegion:
    """One scaled_dot_product_attention call: where it is, and what happened to it."""
    module_path: str
    rewritten: bool
    reason: str = ""
    kind: str = "attention"
    tokens: object = None          # B L rows of every head (int or SymInt)
    batch: int = 0
    length: object = None          # L (int or SymInt)
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    causal: bool = True
    dtype: torch.dtype | None = None
    chunk: int = 0                 # C_s chosen by the budget
    blocks: bool = False           # the whole sublayer in query blocks (boundpass::attention_blocks)
    blocks_reason: str = ""        # why not, when query blocks were asked for
    kv_blocks: bool = False        # k and v made per key tile too (never whole, nor their gradients)
    kv_reason: str = ""            # why k and v are the op's inputs instead
    host: bool = False             # k, v and the backward's q, dO, dq on the host, read back tile by tile (prefetched)
    norm: bool = False             # the norm both paths read joined them (per block; the row input is its input)
    op_node: fx.Node | None = field(default=None, repr=False)

    def describe(self) -> str:
        if not self.rewritten:
            return f"SKIPPED   attention {self.module_path}: {self.reason}"
        shape = (f"(B={self.batch}, L={self.length}, A_q={self.heads}, A_kv={self.kv_heads}, D={self.head_dim}, "
                 f"D_v={self.v_head_dim}, {'causal' if self.causal else 'full'}, {self.dtype}, C_s={self.chunk})")
        if self.blocks:
            kv = ("k / v path + " if self.kv_blocks else "")
            norm = "norm + " if self.norm else ""
            tail = (("; k, v, q, dO and dq on the host, a tile prefetched" if self.host else "") if self.kv_blocks
                    else f"; k and v whole: {self.kv_reason}")
            return (f"REWRITTEN attention {self.module_path}: {norm}query path + {kv}scaled_dot_product_attention + "
                    f"output projection => boundpass::attention_blocks, C_s query rows / key rows at a time "
                    f"{shape}{tail}")
        tail = f"; not in query blocks: {self.blocks_reason}" if self.blocks_reason else ""
        return (f"REWRITTEN attention {self.module_path}: scaled_dot_product_attention => boundpass::chunked_attention "
                f"{shape}{tail}")


def _bound_args(node: fx.Node) -> dict:
    out = dict(_DEFAULTS)
    out.update(zip(_ARGS, node.args))
    out.update(node.kwargs)
    return out


_MASK_CHECK_LIMIT = 1 << 26   # mask elements the pass evaluates at compile time to prove it causal (64 MiB of bool)


def _causal_mask(mask: fx.Node, length: int) -> str:
    """"" when ``mask`` is the causal mask of ``length`` positions (position j visible from i iff j <= i), else why
    not. Proved by evaluating it: a mask computed from no input of the graph (Hugging Face's sdpa path builds it from
    aranges under torch.compile) is a constant of the traced length, so its value at that length is the proof."""
    nodes = ancestors(mask) | {mask}
    if any(n.op in ("placeholder", "get_attr") for n in nodes):
        return "an attention mask computed from the graph's inputs (the op computes causal or full attention only)"
    val = _val(mask)
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or tuple(val.shape[-2:]) != (length, length):
        return "an attention mask that is not a boolean [L, L] one (the op computes causal or full attention only)"
    if val.numel() > _MASK_CHECK_LIMIT:
        return (f"an attention mask of {val.numel():,} elements, more than boundpass evaluates at compile time to "
                "prove it causal")
    graph, env = fx.Graph(), {}
    for n in (n for n in mask.graph.nodes if n in nodes):
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[mask])
    with torch.no_grad(), torch._subclasses.fake_tensor.unset_fake_temporarily():
        value = fx.GraphModule(torch.nn.Module(), graph)()
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        same = bool((value == causal).all())
    return "" if same else "an attention mask other than the causal one (the op computes causal or full attention only)"


def _why_not(a: dict) -> str:
    """Why the op cannot compute this call exactly ("" when it can)."""
    q, k, v = (_val(a[name]) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "query, key and value are not all [B, heads, L, D] tensors"
    if a["attn_mask"] is not None:
        if not isinstance(a["attn_mask"], fx.Node):
            return "an attention mask other than the causal one (the op computes causal or full attention only)"
        if a["is_causal"] is not False:
            return "an attention mask beside is_causal"
        why = _causal_mask(a["attn_mask"], q.shape[2]) if isinstance(q.shape[2], int) else \
            "an attention mask at a symbolic length"
        if why:
            return why
    if isinstance(a["dropout_p"], fx.Node) or float(a["dropout_p"]) != 0.0:
        return "attention dropout (the op draws no dropout mask)"
    if isinstance(a["is_causal"], fx.Node) or isinstance(a["scale"], fx.Node):
        return "is_causal / scale computed in the graph"
    if q.shape[2] != k.shape[2]:
        return f"query length {q.shape[2]} != key length {k.shape[2]} (the op computes self-attention)"
    if q.shape[1] != k.shape[1] and not a["enable_gqa"]:
        return "query and key/value head counts differ without enable_gqa"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads"
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}"
    if q.device.type == "meta":
        return "meta tensors"
    return ""


@dataclass
class _KVSide:
    """The key / value path as a program: its nodes (the dropped padding's links after them), its inputs and the
    nodes the rewrite erases with it (the padding's own chain is erased with the call, ``Padded.chain``)."""
    path: list
    inputs: list
    dims: dict
    walker: object
    value: fx.Node           # what the program returns as v (the padding's last link, or the value itself)
    alias: dict
    dead: list


def _kv_side(node: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node, unpadded, length: int, qdims: dict,
             norm: set = frozenset()) -> _KVSide:
    """The key / value path made per key tile, or NotPositionwise: every node key and value are computed from that
    the query is not, position-wise from the same row inputs (those the query path shares keep their dims); ``norm``:
    the norm both paths read, joined to this one too (each program computes it for its own rows)."""
    source, links = (unpadded.source, unpadded.links) if unpadded is not None else (v, [])
    pad_chain = unpadded.chain if unpadded is not None else []
    path = ar.kv_path(node, q, k, source, also_using=set(pad_chain))
    if norm:
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        path = sorted(set(path) | norm, key=order.__getitem__)
    inputs = ar.inputs_of(path) if path else [k, source]
    shared = {i: qdims[i] for i in inputs if i in qdims}
    alias = {unpadded.pad: source} if links else {}
    value = links[-1] if links else source
    dims, walker = ar.follow_inputs(path + links, [i for i in inputs if i not in shared], length,
                                    [(k, 2), (value, 2)], fixed=shared, alias=alias)
    return _KVSide(path=path + links, inputs=inputs, dims=dims, walker=walker, value=value, alias=alias,
                   dead=path)


def _region(q, k, v, node, result, qpath, q_inputs, dims, qwalk, opath, o_inputs, odims, owalk, side, host):
    """(the op's row inputs, its weights [query's | kv's | output's], the runtime region of their programs)."""
    rows = [i for i in q_inputs if dims[i] is not None]
    q_weights = [i for i in q_inputs if dims[i] is None]
    kv_weights = []
    if side is not None:
        rows += [i for i in side.inputs if side.dims[i] is not None and i not in rows]
        kv_weights = [i for i in side.inputs if side.dims[i] is None]
    params = q_weights + kv_weights + o_inputs

    def grad(i):
        return bool(getattr(_val(i), "requires_grad", False))
    region = ab.Region(query=ar.program(qpath, rows + q_weights, q, qwalk),
                       kv=ar.program(side.path, rows + kv_weights, (k, side.value), side.walker, side.alias)
                       if side is not None else None,
                       out=ar.program(opath, [node, *o_inputs], result, owalk),
                       row_dims=tuple(dims[i] if i in dims else side.dims[i] for i in rows),
                       query_params=len(q_weights), kv_params=len(kv_weights), host=host and side is not None,
                       y_shape=tuple(_val(result).shape), y_dim=odims[result], y_dtype=_val(result).dtype,
                       needs=tuple(grad(i) for i in (*rows, *params))
                       + ((False, False) if side is not None else (grad(k), grad(v))))
    return rows, params, region


def _query_blocks(sub: fx.GraphModule, node: fx.Node, a: dict, chunk: int, offload: bool):
    """The sublayer around the call rewritten to boundpass::attention_blocks: (its op node, "", why k and v are op
    inputs or "") or (None, why not, "")."""
    q, k, v = a["query"], a["key"], a["value"]
    length = _val(q).shape[2]
    if not isinstance(length, int):
        return None, "the sequence length is symbolic in this graph", ""
    try:
        qpath = ar.query_path(node, q, k, v)
        opath = ar.output_path(node)
        o_inputs = ar.inputs_of(opath, node)
        result = opath[-1] if opath else node
        odims = {node: 2, **{i: None for i in o_inputs}}   # the projection's weight and bias
        owalk = ar.follow(opath, length, odims)
        if odims[result] is None:
            raise ar.NotPositionwise("the output projection's result does not carry the sequence")
    except ar.NotPositionwise as why:
        return None, str(why), ""
    unpadded = ar.padded_value(v, opath)   # (the value before the padding for torch's fused kernel, reshapes)
    width = _val(unpadded.source).shape[-1] if unpadded is not None else _val(v).shape[3]
    o_example = _val(node).new_empty((*_val(node).shape[:3], width))
    # the norm the query and key / value paths read joins both where only they read it; without it, if it will not
    try:
        source, chain = (unpadded.source, set(unpadded.chain)) if unpadded is not None else (v, set())
        kv_nodes = set(ar.kv_path(node, q, k, source, also_using=chain)) | chain
    except ar.NotPositionwise:
        kv_nodes = None
    norm = ar.norm_joining(set(qpath) | kv_nodes | {node, *opath}) if qpath and kv_nodes is not None else set()
    why = kv_why = ""
    for joined in ([norm] if norm else []) + [set()]:
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        path = sorted(set(qpath) | joined, key=order.__getitem__)
        q_inputs = ar.inputs_of(path) if path else [q]
        try:
            dims, qwalk = ar.follow_inputs(path, q_inputs, length, [(q, 2)])
        except ar.NotPositionwise as e:
            why = why or str(e)
            continue
        try:
            side, kv_why = _kv_side(node, q, k, v, unpadded, length, {i: dims[i] for i in q_inputs}, joined), ""
        except ar.NotPositionwise as e:
            if joined:   # the norm joins only where both paths are walked in blocks
                continue
            side, kv_why = None, str(e)
        rows, params, region = _region(q, k, v, node, result, path, q_inputs, dims, qwalk, opath, o_inputs, odims,
                                       owalk, side, offload)
        try:
            key = ab.register_region(region, [_val(i) for i in rows], [_val(i) for i in params], o_example)
        except Exception as e:  # a program that still makes a sequence-long dim at a block's rows
            why = why or f"the query path does not run on a block of rows ({type(e).__name__}: {e})"
            continue
        break
    else:
        return None, why, ""
    qpath = path
    add = node_adder(sub.graph, _val(q).fake_mode, module_stack_of=node, trace_of=node)
    k_arg = v_arg = None
    if side is None:
        k_arg, v_arg = k, v
        if unpadded is not None:
            v_arg = unpadded.source
            with sub.graph.inserting_before(node):
                for link in unpadded.links:
                    v_arg = add(link.target, v_arg, *link.args[1:], kind="call_method")
    with sub.graph.inserting_before(result):
        op = add(torch.ops.boundpass.attention_blocks_fwd.default, rows, params, k_arg, v_arg, key,
                 bool(a["is_causal"]), float(a["scale"] or 0.0), int(chunk))
    op.meta["attention_value_dim"] = width
    op.meta["attention_norm_joined"] = bool(joined)
    result.replace_all_uses_with(op)
    order = {n: i for i, n in enumerate(sub.graph.nodes)}
    dead = {*qpath, node, *opath, *(side.dead if side is not None else []),
            *(unpadded.chain if unpadded is not None else [])}
    for n in sorted(dead, key=order.__getitem__, reverse=True):
        sub.graph.erase_node(n)
    return op, "", kv_why


def rewrite_attention_regions(gm: fx.GraphModule, chunk: int = 0, *,
                              query_blocks: bool = False, offload: bool = False) -> list[AttentionRegion]:
    """Rewrite every eligible call in place (tile ``chunk``; 0: left for the planner); return all calls found.
    ``query_blocks``: the whole sublayer where it is position-wise, the call alone elsewhere (the region says why).
    ``offload``: where k and v are made per key tile, they (and the backward's q, dO) are kept on the host."""
    regions, touched = [], []
    calls = [(sub, node) for sub in list(graph_modules(gm)) for node in sub.graph.nodes
             if node.op == "call_function" and any(node.target is f for f in _SDPA)]
    for sub, node in calls:  # checkpointed blocks keep theirs in the HOP's body
        a = _bound_args(node)
        path = module_path(node) or "<top level>"
        reason = _why_not(a)
        if reason:
            regions.append(AttentionRegion(module_path=path, rewritten=False, reason=reason))
            continue
        mask = a["attn_mask"]
        if mask is not None:   # proved the causal one (_causal_mask): the call is causal attention without it
            a.update(attn_mask=None, is_causal=True)
        q, k, v = a["query"], a["key"], a["value"]
        qv, kv, vv = _val(q), _val(k), _val(v)
        op, why_not_blocks, why_kv_whole = (_query_blocks(sub, node, a, chunk, offload) if query_blocks
                                            else (None, "", ""))
        v_head_dim = int(vv.shape[3])
        if op is not None:
            v_head_dim = op.meta["attention_value_dim"]   # the value the op reads (unpadded where the model padded it)
        else:
            add = node_adder(sub.graph, qv.fake_mode, module_stack_of=node, trace_of=node)
            with sub.graph.inserting_before(node):
                op = add(torch.ops.boundpass.chunked_attention_fwd.default, q, k, v, bool(a["is_causal"]),
                         float(a["scale"] or 0.0), int(chunk))
                out = add(operator.getitem, op, 0)
            node.replace_all_uses_with(out)
            sub.graph.erase_node(node)
        if mask is not None:   # the mask's nodes, read by nothing else now, go with the call
            order = {n: i for i, n in enumerate(sub.graph.nodes)}
            for n in sorted(ancestors(mask) | {mask}, key=order.__getitem__, reverse=True):
                if not n.users and n.op not in ("placeholder", "get_attr"):
                    sub.graph.erase_node(n)
        touched.append(sub)
        regions.append(AttentionRegion(module_path=path, rewritten=True, tokens=qv.shape[0] * qv.shape[2],
                                       batch=int(qv.shape[0]), length=qv.shape[2], heads=int(qv.shape[1]),
                                       kv_heads=int(kv.shape[1]), head_dim=int(qv.shape[3]),
                                       v_head_dim=v_head_dim, causal=bool(a["is_causal"]), dtype=qv.dtype,
                                       chunk=int(chunk), blocks=query_blocks and not why_not_blocks,
                                       blocks_reason=why_not_blocks, kv_blocks=query_blocks and not why_not_blocks
                                       and not why_kv_whole, kv_reason=why_kv_whole,
                                       host=offload and query_blocks and not why_not_blocks and not why_kv_whole,
                                       norm=bool(op.meta.get("attention_norm_joined")), op_node=op))
    for sub in {id(s): s for s in touched}.values():
        sub.recompile()
    return regions


class AttentionPass:
    """scaled_dot_product_attention => chunked attention (boundpass.passes.pipeline's protocol); its knob: C_s."""
    name = "attention"

    def enabled(self, config) -> bool:
        return config.attention.enable

    def rewrite(self, gm: fx.GraphModule, ctx) -> list[AttentionRegion]:
        return rewrite_attention_regions(gm, ctx.fixed.get("attention_chunk", 0),
                                         query_blocks=ctx.config.attention.query_blocks,
                                         offload=ctx.config.attention.offload)

    def knobs(self, regions: list, ctx) -> list[Knob]:
        from boundpass.bound import cost_model
        rewritten, lengths, lo, hi = sequence_range(regions, MIN_CHUNK)
        if not rewritten:
            return []

        def knee_of(region, length) -> int:
            b_acc = torch.promote_types(region.dtype or torch.float32, torch.float32).itemsize
            device = getattr(_val(region.op_node.args[2]), "device", None)
            return cost_model.chunked_attention_knee(
                lo=lo, hi=hi, B=region.batch, L=length, A_q=region.heads, D=region.head_dim, D_v=region.v_head_dim,
                causal=region.causal, b_acc=b_acc, costs=cost_model.costs_for(getattr(device, "type", "cpu")),
                blocks=region.kv_blocks)
        return [Knob("attention_chunk", ca.C_s_sym, lo=lo, hi=hi, arg="chunk",
                     ops=(torch.ops.boundpass.chunked_attention_fwd.default,
                          torch.ops.boundpass.chunked_attention_bwd.default,
                          torch.ops.boundpass.attention_blocks_fwd.default,
                          torch.ops.boundpass.attention_blocks_bwd.default),
                     user=ctx.config.attention.chunk, regions=rewritten,
                     knee=max(knee_of(r, n) for r, n in zip(rewritten, lengths)), owner=self.name)]

    def diagnose(self, knob: Knob, where: str) -> Diagnosis:
        region = knob.regions[0] if knob.regions else None
        length = region.length if region is not None else "?"
        return Diagnosis(fix=f"reduce the sequence length L (now {length}) or the micro-batch, or raise the budget: "
                             f"even the narrowest tile C_s={knob.lo} does not fit beside q, k, v and the output",
                         detail=f"at C_s={knob.value}", name=f"attention (chunked, C_s={knob.value}){where}")
