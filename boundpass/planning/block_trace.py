"""The activation peak of one model block, from its own AOTAutograd graphs, in symbolic tokens (issue 13, plan).

``block_peak(module, example_inputs)`` traces the module's forward + backward through AOTAutograd
(``aot_function`` with a partition function that keeps torch's ``default_partition`` graphs) under a
``FakeTensorMode`` whose ``ShapeEnv`` makes the token dimension of the inputs a SymInt (nothing is allocated:
a 671B block at a million tokens costs what a debug block costs), then walks the partitioned graphs with the
same analysis ``boundpass.compile`` certifies (``boundpass.measure.step_peak.analyze_graphs``: storages by torch's
``GraphAliasTracker``, lifetimes in execution order, saved tensors across forward/backward, custom-op workspace).
The result is a ``GraphPeak`` whose bytes are sympy expressions in the token symbol, mapped to
``boundpass.core.symbols.N``.

Parameters and buffers are static inputs: persistent state, never in the walk. ``weight_grads=False`` (the
default) also leaves out the gradients backward returns for them (the composed budget counts every gradient by
phase, boundpass/bound/composed.py). The module's output is returned to the caller and its incoming gradient is a
real tensor (``tangents``, live through backward), as for a block inside a model; with ``loss_fn`` the loss is
the output instead.

``block_phases`` splits the walk into the sub-phases of a recomputed block that the composed budget lays the
ZeRO-3 terms on (forward; backward of the FFN; backward of the attention output projection and kernel; the
input projections' tail), from ``torch.fx.traceback.annotate`` tags that module hooks put on the forward nodes
(AOTAutograd copies them onto the backward nodes it derives from them).

Data-dependent shapes: torchtitan's EP = 1 token dispatch has static shapes (N·k rows, sorted), but under
EP > 1 the rows a rank receives depend on the routing; ``stand_in`` replaces a submodule by a shape-keeping
stand-in (output = input · 0, so its saved bytes are none) for a region whose bytes a hand-written,
routing-independent bound gives instead (boundpass/bound/composed.py: the routed experts).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import sympy
import torch
import torch.fx.traceback as fx_traceback

from boundpass.core import symbols as sym
from boundpass.measure.step_peak import GraphPeak, ProgramPoint, analyze_graphs

PHASES = ("forward", "ffn_backward", "attention_backward", "tail_backward")


@dataclass
class BlockTrace:
    """One block's traced activation peak: the analysis, the token symbol, sub-phase peaks (sympy in N)."""
    peak: GraphPeak
    token: sympy.Symbol
    phases: dict = field(default_factory=dict)   # PHASES -> max live bytes in that sub-phase (sympy in sym.N)
    seconds: float = 0.0

    def peak_expr(self) -> sympy.Expr:
        return self.peak.peak_expr()


def _fake(mode, t: torch.Tensor, *, dynamic_dims: Sequence[int] = (), device: str = "cpu") -> torch.Tensor:
    """A fake copy of ``t`` (meta tensors become fake tensors on ``device``), its ``dynamic_dims`` symbolic."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
    if not dynamic_dims:
        out = mode.from_tensor(t, static_shapes=True)
    else:
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d in dynamic_dims else DimDynamic.STATIC
                                                      for d in range(t.dim())])
        out = mode.from_tensor(t, symbolic_context=ctx)
    if out.device.type == "meta":  # built on meta (nothing allocated): trace it as the device would run it
        out = out.detach().to(device)
    if t.requires_grad:
        out.requires_grad_(True)
    return out


class _StandIn(torch.nn.Module):
    """Keeps a region's output shape and gradient flow (to every floating input) and saves nothing."""

    def __init__(self, output_like: int = 0):
        super().__init__()
        self.output_like = output_like

    def forward(self, *args, **kwargs):
        out = args[self.output_like] * 0
        for a in args[self.output_like + 1:]:
            if isinstance(a, torch.Tensor) and a.is_floating_point() and a.requires_grad:
                out = out + a.sum() * 0
        return out


@contextlib.contextmanager
def _swapped(module: torch.nn.Module, stand_in: dict[str, torch.nn.Module]):
    saved = {}
    try:
        for path, new in stand_in.items():
            parent_path, _, name = path.rpartition(".")
            parent = module.get_submodule(parent_path) if parent_path else module
            saved[path] = (parent, name, getattr(parent, name))
            setattr(parent, name, new)
        yield
    finally:
        for parent, name, old in saved.values():
            setattr(parent, name, old)


@contextlib.contextmanager
def _tagged(module: torch.nn.Module, tags: dict[str, str]):
    """Module hooks that annotate the nodes each tagged submodule's forward traces (innermost tag wins)."""
    handles, stack = [], []

    def pre(tag):
        def hook(_m, _a):
            cm = fx_traceback.annotate({"boundpass_part": tag})
            cm.__enter__()
            stack.append(cm)
        return hook

    def post(_m, _a, _o):
        stack.pop().__exit__(None, None, None)

    try:
        for path, tag in tags.items():
            try:
                sub = module.get_submodule(path)
            except AttributeError:
                continue
            handles.append(sub.register_forward_pre_hook(pre(tag)))
            handles.append(sub.register_forward_hook(post))
        yield
    finally:
        for h in handles:
            h.remove()


def block_peak(module: torch.nn.Module, example_inputs: Sequence, *, symbolic_tokens: bool = True,
               token_dim: int = 1, loss_fn: Callable | None = None, weight_grads: bool = False,
               count_inputs: bool = False, kwargs: dict | None = None,
               tags: dict[str, str] | None = None, stand_in: dict[str, torch.nn.Module] | None = None,
               ctx: dict | None = None) -> tuple[GraphPeak, sympy.Symbol | None]:
    """Trace ``module``'s forward + backward and analyse its partitioned graphs: (GraphPeak, token symbol).

    example_inputs: real or meta tensors (their values are never read); floating ones that require grad get a
    gradient. The token dimension (``token_dim``) of every tensor input with at least ``token_dim + 1`` dims is
    one SymInt (``symbolic_tokens=False``: the concrete size, token symbol None); the GraphPeak's bytes are
    expressed in ``boundpass.core.symbols.N``. count_inputs=False leaves the inputs' own storages out (a block's
    input is its checkpoint boundary, counted by its own term). tags: {submodule path: tag} annotations for
    ``block_phases``. stand_in: {submodule path: module} regions replaced while tracing.
    """
    trace = _trace(module, example_inputs, symbolic_tokens=symbolic_tokens, token_dim=token_dim, loss_fn=loss_fn,
                   weight_grads=weight_grads, count_inputs=count_inputs, kwargs=kwargs or {}, tags=tags or {},
                   stand_in=stand_in or {}, ctx=ctx)
    return trace.peak, (sym.N if symbolic_tokens else None)


def block_phases(module: torch.nn.Module, example_inputs: Sequence, **kw) -> BlockTrace:
    """``block_peak`` plus the peak of each sub-phase of a recomputed block (``PHASES``), from the tags.

    Backward is split where its first node of the attention's output projection or kernel runs (before it:
    the FFN's backward) and after its last kernel node (the input projections' tail). Forward points are one
    sub-phase. Tags default to torchtitan's block layout (``TORCHTITAN_TAGS``).
    """
    kw.setdefault("tags", TORCHTITAN_TAGS)
    return _trace(module, example_inputs, symbolic_tokens=kw.pop("symbolic_tokens", True),
                  token_dim=kw.pop("token_dim", 1), loss_fn=kw.pop("loss_fn", None),
                  weight_grads=kw.pop("weight_grads", False), count_inputs=kw.pop("count_inputs", False),
                  kwargs=kw.pop("kwargs", None) or {}, tags=kw.pop("tags"), stand_in=kw.pop("stand_in", None) or {},
                  ctx=kw.pop("ctx", None), split=True)


# torchtitan's TransformerBlock: attention (its output projection, its kernel) and the FFN / MoE
TORCHTITAN_TAGS = {"attention": "attention", "attention.wo": "wo", "attention.inner_attention": "kernel",
                   "feed_forward": "ffn", "moe": "ffn"}


def _trace(module, example_inputs, *, symbolic_tokens, token_dim, loss_fn, weight_grads, count_inputs, kwargs,
           tags, stand_in, ctx, split: bool = False, eager: bool = True) -> BlockTrace:
    captured = _capture(module, example_inputs, symbolic_tokens=symbolic_tokens, token_dim=token_dim,
                        loss_fn=loss_fn, kwargs=kwargs, tags=tags, stand_in=stand_in)
    return _analyze(captured, weight_grads=weight_grads, count_inputs=count_inputs, ctx=ctx, split=split,
                    eager=eager)


def _capture(module, example_inputs, *, symbolic_tokens, token_dim, loss_fn, kwargs, tags, stand_in) -> dict:
    """The partitioned forward / backward graphs of ``module`` at symbolic tokens (AOTAutograd under fake
    tensors): the expensive half of a trace, which ``_analyze`` reads as many times as it is asked (a block whose
    traces differ only in what is counted is captured once)."""
    import time

    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import default_partition
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    start = time.perf_counter()
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=False)
    captured = {}

    def partition(joint, joint_inputs, **kw):
        fw, bw = default_partition(joint, joint_inputs, **kw)
        captured.update(fw=fw, bw=bw, num_fwd_outputs=kw["num_fwd_outputs"])
        return fw, bw

    with _swapped(module, stand_in):
        state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        names = list(state)
        with mode:
            fake_state = [_fake(mode, t) for t in state.values()]
            inputs = [_fake(mode, t, dynamic_dims=(token_dim,) if symbolic_tokens and t.dim() > token_dim else ())
                      if isinstance(t, torch.Tensor) else t for t in example_inputs]
        n_state, n_in = len(names), len(inputs)

        def step(*flat):
            out = functional_call(module, dict(zip(names, flat[:n_state])), tuple(flat[n_state:]), kwargs)
            if loss_fn is not None:
                out = loss_fn(out)
                out = out[0] if isinstance(out, tuple) else out
            return (out,)

        compiled = aot_function(step, fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm,
                                partition_fn=partition, dynamic=False)
        with _tagged(module, tags), fx_traceback.preserve_node_meta(), mode:
            compiled(*fake_state, *inputs)
    for gm in (captured["fw"], captured["bw"]):  # what eager autograd never runs (e.g. a recomputed op no node
        _drop_unread(gm)                          # reads): gone
    captured.update(n_state=n_state, n_in=n_in, inputs=inputs, symbolic_tokens=symbolic_tokens,
                    token_dim=token_dim, seconds=time.perf_counter() - start)
    return captured


def _analyze(captured: dict, *, weight_grads, count_inputs, ctx, split: bool = False, eager: bool = True) -> BlockTrace:
    """The step analysis of captured graphs: their peak and (split) sub-phase peaks in N, less what the caller
    counts elsewhere (the inputs unless count_inputs; the weights' gradients unless weight_grads)."""
    import time

    start = time.perf_counter()
    fw, bw = captured["fw"], captured["bw"]
    n_state, n_in, inputs = captured["n_state"], captured["n_in"], captured["inputs"]
    symbolic_tokens, token_dim = captured["symbolic_tokens"], captured["token_dim"]
    # plan's block terms are held against the live-storage tracker, which sees tensors, not a kernel's internal
    # blocks: torch kernels' workspace contracts (measure/aten_contracts.py) are left out of the traces
    peak = analyze_graphs(fw, bw, static_inputs=set(range(n_state)), num_user_outputs=captured["num_fwd_outputs"],
                          ctx={**(ctx or {}), "kernel_workspace": False})
    # what the composed budget counts elsewhere: the inputs (a checkpoint boundary) and the weights' gradients
    drop = set()
    if not count_inputs:
        placeholders = fw.graph.find_nodes(op="placeholder")
        drop |= {("input", p.name) for p in placeholders[n_state:n_state + n_in]}
    if not weight_grads:  # the storages of the weights' gradients, by the node that allocates each
        from torch._inductor.fx_passes.memory_estimator import GraphAliasTracker
        nodes = list(bw.graph.nodes)
        alias = GraphAliasTracker(nodes)
        bw_out = bw.graph.find_nodes(op="output")[0].args[0]
        keys = {k for i, o in enumerate(bw_out) if i < n_state and isinstance(o, torch.fx.Node)
                for k in alias.node_to_output_storages.get(o, ())}
        drop |= {(kind, n.name) for n in nodes for k in alias.get_fresh_allocations(n) if k in keys
                 for kind in ("gradient", "activation")}
    token = _token_symbol(inputs, token_dim) if symbolic_tokens else None
    if eager:
        _autograd_node_lifetimes(peak, bw)
    peak = _without(peak, drop, {token: sym.N} if token is not None else {})
    trace = BlockTrace(peak, sym.N if token is not None else None)
    if split:
        trace.phases = _split(peak, bw)
        trace.phases.update(_split_forward(peak, fw))
    trace.seconds = captured["seconds"] + time.perf_counter() - start
    return trace


def _drop_unread(gm: torch.fx.GraphModule) -> None:
    """Remove pure ops nobody reads (the partitioner may leave a multi-output op's copy in backward whose
    outputs were all saved from the forward: eager autograd never runs it). Mutating ops stay."""
    changed = False
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is not None and not schema.is_mutable and not node.target.namespace.startswith("_c10d"):
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.recompile()


def _token_symbol(inputs, token_dim):
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() > token_dim and isinstance(t.shape[token_dim], torch.SymInt):
            return t.shape[token_dim].node.expr
    return None


def _autograd_node_lifetimes(peak: GraphPeak, bw: torch.fx.GraphModule) -> None:
    """Eager autograd frees at node granularity: a storage last read inside one autograd node's backward (its
    saved tensors, its incoming gradient, the gradients it computes) lives until that node returns. The
    backward graph's nodes carry the ``seq_nr`` of the forward op whose backward they are; a run of consecutive
    backward points with one seq_nr is one node's apply. (A compiled backward frees at each op's last use:
    that is what ``boundpass.compile`` certifies; a model run eagerly, as ``plan``'s measurements are, holds
    them to the end of the node.)"""
    seq = {n.name: n.meta.get("seq_nr") for n in bw.graph.nodes}
    run_end: dict[int, int] = {}
    points = peak.points
    i = 0
    while i < len(points):
        j = i
        if points[i].phase == "backward" and seq.get(points[i].node) is not None:
            while j + 1 < len(points) and points[j + 1].phase == "backward" and \
                    seq.get(points[j + 1].node) == seq.get(points[i].node):
                j += 1
        for k in range(i, j + 1):
            run_end[k] = j
        i = j + 1
    for s in peak.storages:
        if s.end < len(points) and points[s.end].phase == "backward":
            s.end = run_end.get(s.end, s.end)


def _without(peak: GraphPeak, names: set, subs: dict) -> GraphPeak:
    """The walk's live bytes recomputed from its storages' lifetimes, the (kind, name) storages left out and
    symbols renamed: live(point) = its op's workspace + every kept storage with start <= point <= end."""
    out = GraphPeak(gradient_bytes=sympy.sympify(peak.gradient_bytes).xreplace(subs),
                    saved_bytes=sympy.sympify(peak.saved_bytes).xreplace(subs),
                    caller_bytes=sympy.sympify(peak.caller_bytes).xreplace(subs))
    names_subs = {str(a): str(b) for a, b in subs.items()}
    starts: dict[int, list] = {}
    ends: dict[int, list] = {}
    for s in peak.storages:
        s.nbytes = sympy.sympify(s.nbytes).xreplace(subs)
        for a, b_ in names_subs.items():
            s.shape = s.shape.replace(a, b_)
        if (s.kind, s.name) in names:
            continue
        out.storages.append(s)
        starts.setdefault(s.start, []).append(s)
        ends.setdefault(s.end, []).append(s)
    live = sympy.Integer(0)
    for p in peak.points:
        for s in starts.get(p.index, ()):
            live += s.nbytes
        workspace = sympy.sympify(p.workspace).xreplace(subs)
        out.points.append(ProgramPoint(p.index, p.phase, p.node, p.target, p.module_path,
                                       sympy.expand(live + workspace), workspace))
        for s in ends.get(p.index, ()):
            live -= s.nbytes
    return out


def _split(peak: GraphPeak, bw: torch.fx.GraphModule) -> dict:
    """Max live bytes per sub-phase (PHASES), from the tags the backward nodes carry."""
    part = {n.name: (n.meta.get("custom") or {}).get("boundpass_part") for n in bw.graph.nodes}
    bw_points = [p for p in peak.points if p.phase == "backward"]
    first = next((i for i, p in enumerate(bw_points) if part.get(p.node) in ("wo", "kernel")), len(bw_points))
    if first == len(bw_points):  # no attention: the whole backward is the FFN's
        return {"forward": _max(p.live for p in peak.points if p.phase == "forward"),
                "ffn_backward": _max(p.live for p in bw_points), "attention_backward": sympy.Integer(0),
                "tail_backward": sympy.Integer(0)}
    kernel = [i for i, p in enumerate(bw_points) if part.get(p.node) == "kernel"]
    last = kernel[-1] if kernel else len(bw_points) - 1  # no kernel tagged: the attention's backward to the end
    groups = {"forward": [p for p in peak.points if p.phase == "forward"],
              "ffn_backward": bw_points[:first], "attention_backward": bw_points[first:last + 1],
              "tail_backward": bw_points[last + 1:]}
    return {name: _max(p.live for p in pts) for name, pts in groups.items()}


FORWARD_PARTS = ("forward_attention", "forward_ffn")


def _split_forward(peak: GraphPeak, fw: torch.fx.GraphModule) -> dict:
    """Max live bytes of the forward before the FFN's first node (the attention's part) and from it on."""
    part = {n.name: (n.meta.get("custom") or {}).get("boundpass_part") for n in fw.graph.nodes}
    points = [p for p in peak.points if p.phase == "forward"]
    first = next((i for i, p in enumerate(points) if part.get(p.node) == "ffn"), len(points))
    return {"forward_attention": _max(p.live for p in points[:first]),
            "forward_ffn": _max(p.live for p in points[first:])}


def _max(values) -> sympy.Expr:
    """Max of sympy expressions, dominated ones pruned (step_peak.max_of)."""
    from boundpass.measure.step_peak import max_of
    return max_of(values)


# ------------------------------------------------------------------------------------------- torchtitan blocks
# families whose plan takes its block activations from this trace (plan's names and the recipes' qwen3_moe);
# kimi_k2_7's blocks are deepseek_v3's DeepSeekV3TransformerBlock (MLA + MoE), its ModelSpec name kimi_k2_5
TRACED_FAMILIES = ("deepseek_v3", "qwen3", "qwen3_moe", "gpt_oss", "kimi_k2_7", "kimi_k2_5")


def untraced_reason(family: str, weight_bytes: int) -> str | None:
    """Why a family's blocks are not traced at this weight width (None: they are): the trace runs only a
    schedule torchtitan itself runs on one rank."""
    if family not in TRACED_FAMILIES and not family.startswith("hf:"):  # hf: HF's own layers (recipes/hf.py)
        return f"{family} is not a torchtitan family block_trace knows (TRACED_FAMILIES)"
    if family == "gpt_oss" and weight_bytes > 2:
        # torchtitan's gpt_oss experts return bf16 rows that its combine scatter-adds into an output of the
        # weights' dtype: in fp32 the real step raises (scatter(): Expected self.dtype to be equal to src.dtype);
        # a fake trace would not, so it would certify a schedule that cannot run
        return ("gpt_oss runs only in bf16 upstream (its combine's scatter_add fails on fp32 weights), so its "
                "fp32 blocks are not traced")
    return None


def _unwrapped(block: torch.nn.Module) -> torch.nn.Module:
    return getattr(block, "_checkpoint_wrapped_module", block)


def _one_rank_attention(block: torch.nn.Module, attention_config, tiles: int = 0) -> dict:
    """Stand-ins that make the block's attention the one-rank schedule the composed budget counts: the fused
    O(N) kernel (SeqToHeadAttention without a group: v zero-padded where the qk and v head dims differ), or with
    ``tiles`` (or a wrapper that has them) the tiles op on one rank (runtime/seq_to_head_tiles.py)."""
    from boundpass.runtime.seq_to_head import SeqToHeadAttention
    inner = getattr(block.attention, "inner_attention", None)
    if inner is None:  # the attention kernel is not a module (HF's attention interface): traced as it runs
        return {}
    if isinstance(inner, SeqToHeadAttention):
        # a fresh one for each trace: the op caches the shapes it checked (symbols of another trace's ShapeEnv)
        return {"attention.inner_attention": SeqToHeadAttention(inner.inner, None, tiles=tiles or inner.tiles)}
    if tiles:
        return {"attention.inner_attention": SeqToHeadAttention(inner, None, tiles=tiles)}
    qk = getattr(attention_config, "qk_nope_head_dim", None)
    v = getattr(attention_config, "v_head_dim", None)
    if qk is None or v is None or qk + attention_config.qk_rope_head_dim == v:
        return {}
    return {"attention.inner_attention": SeqToHeadAttention(inner, None)}


def trace_torchtitan_blocks(net: torch.nn.Module, heads_config, *, wide: bool = True, one_rank: bool = True,
                            progress=None, attention_tiles: int = 0) -> tuple:
    """((kind, sub-phase, sympy bytes in N), ...) for the first dense and the first MoE block of a torchtitan
    Decoder (meta or real weights: nothing is read or allocated), traced on one rank at symbolic N with the
    weights' dtype; the block's input left out (the boundary term); its weights' gradients in, as backward
    produces them (the composed budget's gradient term then leaves that block's own out).

    wide: also kinds "dense_wide" / "moe_wide", the terms for W > 1 (the MoP layout): the same blocks traced
    with their weights' gradients as backward writes them (under ZeRO-3 these are FSDP2's unsharded gradients),
    the block's output not held through backward (it is the next block's boundary) and, in a MoE block, with the
    routed experts stood in (``stand_in``: the rows
    a rank receives under EP depend on the routing; their routing-independent bound stays hand-written).
    one_rank: the kinds "dense" / "moe" (W = 1); False with wide: only the wide kinds (a launch at W > 1 reads
    nothing else: composed.uses_wide_trace), one MoE graph fewer to capture.
    progress: None, or called with a line before each block is traced.
    attention_tiles: C_s of the MoP layout's attention in tiles (runtime/seq_to_head_tiles.py; 0: the whole exchange).

    With ``FORK_CAPTURES`` on (the plan CLI), a model with both kinds has its MoE block captured and analysed in a
    forked second process while this one does the dense block (the two are independent; ~2 s each at full
    scale): the same functions on the same module, the child's sympy results sent back pickled. If the child
    fails or cannot start, this process traces that block itself."""
    x = lambda block: torch.empty(1, 8, net.tok_embeddings.weight.shape[1],  # noqa: E731  (a block's input)
                                  dtype=next(block.parameters()).dtype, device="meta", requires_grad=True)
    blocks = _first_blocks(net)
    side = None
    if len(blocks) > 1 and can_fork():
        kind, block = blocks[-1]
        if progress:
            for _, message in _captures(kind, wide, one_rank):
                progress(f"{message} (in a second process)")
        side = forked(lambda: _block_terms(kind, block, x(block), heads_config, wide=wide, one_rank=one_rank,
                                           tiles=attention_tiles))
    results = [_block_terms(kind, block, x(block), heads_config, wide=wide, one_rank=one_rank, progress=progress,
                            tiles=attention_tiles)
               for kind, block in (blocks[:-1] if side else blocks)]
    if side:
        kind, block = blocks[-1]
        results.append(side() or _block_terms(kind, block, x(block), heads_config, wide=wide, one_rank=one_rank,
                                              progress=progress, tiles=attention_tiles))
    return tuple(t for out, _ in results for t in out) + tuple(t for _, wide_out in results for t in wide_out)


def _captures(kind: str, wide: bool, one_rank: bool) -> list:
    """[(routed experts stood in, progress line)] of the graphs one block kind is captured as: the block itself
    (one rank; a dense block's wide form is the same graph) and, for a MoE block's wide form, the block with its
    routed experts stood in (another graph)."""
    out = []
    if one_rank or (wide and kind == "dense"):
        out.append((False, f"tracing the first {kind} block at symbolic N"))
    if wide and kind == "moe":
        out.append((True, "tracing the first moe block at symbolic N" + (" again" if one_rank else "")
                    + ", its routed experts stood in (W > 1)"))
    return out


def _block_terms(kind: str, block, x, heads_config, *, wide: bool, one_rank: bool, progress=None,
                 tiles: int = 0) -> tuple:
    """(one-rank terms, wide terms) of one block kind (trace_torchtitan_blocks)."""
    out, wide_out = [], []
    for stand_in, message in _captures(kind, wide, one_rank):
        if progress:
            progress(message)
        captured = _capture_block(block, x, heads_config, routed_stand_in=stand_in, tiles=tiles)
        if one_rank and not stand_in:
            out += _phases_of(kind, _analyze(captured, weight_grads=True, count_inputs=False, ctx=None, split=True),
                              PHASES)
        if wide and (stand_in or kind == "dense"):
            # the wide form (W > 1, one block of a per-block compile under ZeRO-3): the block's weights' gradients
            # as backward writes them are FSDP2's unsharded gradients (held to the block's end, then reduced);
            # its output is the next block's checkpoint boundary, which the boundary term counts (per_block: not
            # held through backward here). A dense block's wide form is the same graph: analysed again.
            wide_out += _phases_of(kind + "_wide", _analyze(captured, weight_grads=True, count_inputs=False,
                                                            ctx={"per_block": True}, split=True),
                                   PHASES + FORWARD_PARTS)
    return out, wide_out


# trace_torchtitan_blocks: capture the last block kind in a forked second process (set by the plan CLI, a fresh
# single-threaded process; off by default: a process with other threads, as a test run may be, is not forked)
FORK_CAPTURES = False
FORK_TIMEOUT_S = 300.0


def can_fork() -> bool:
    import os
    import sys
    import threading
    return (FORK_CAPTURES and sys.platform.startswith("linux") and (os.cpu_count() or 1) > 1
            and threading.active_count() == 1 and not torch.cuda.is_initialized())


def forked(fn: Callable):
    """Start fn() in a forked child; returns a function that waits for its (pickled) result: the result, or None
    when the child failed, died or ran past FORK_TIMEOUT_S (the caller then computes it itself)."""
    import gc
    import os
    import pickle
    import select
    import signal
    import time
    parent = os.getpid()
    read, write = os.pipe()
    gc.freeze()  # the objects both processes hold: the child's collections then leave them (and their pages) alone
    try:
        pid = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        return lambda: None
    finally:
        if os.getpid() == parent:
            gc.unfreeze()
    if pid == 0:  # the child: compute, send, leave without running the parent's exit handlers
        code = 1
        try:
            os.close(read)
            data = pickle.dumps(fn())
            with os.fdopen(write, "wb") as f:
                f.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(write)

    def result():
        chunks, deadline = [], time.monotonic() + FORK_TIMEOUT_S
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([read], [], [], left)[0]:
                    os.kill(pid, signal.SIGKILL)
                    break
                chunk = os.read(read, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(read)
            _, status = os.waitpid(pid, 0)
        if status != 0 or not chunks:
            return None
        return pickle.loads(b"".join(chunks))
    return result


def _first_blocks(net) -> list:
    """(kind, block) of the first dense and the first MoE block, in layer order."""
    out, seen = [], set()
    for block in net.layers.values():
        block = _unwrapped(block)
        kind = "moe" if getattr(block, "moe", None) is not None else "dense"
        if kind not in seen:
            seen.add(kind)
            out.append((kind, block))
    return out


def _capture_block(block, x, heads_config, *, routed_stand_in: bool, tiles: int = 0) -> dict:
    """A block's graphs. A block that names its parts otherwise than torchtitan's (a model source's view of
    another library's layer, e.g. recipes/hf.py) says where its routed experts are (``boundpass_routed_path``)
    and which submodules carry the sub-phase tags (``boundpass_tags``)."""
    stand_in = _one_rank_attention(block, heads_config, tiles)
    if routed_stand_in:
        stand_in[getattr(block, "boundpass_routed_path", "moe.routed_experts")] = _StandIn()
    return _capture(block, (x, None, None), symbolic_tokens=True, token_dim=1, loss_fn=None, kwargs={},
                    tags=getattr(block, "boundpass_tags", TORCHTITAN_TAGS), stand_in=stand_in)


def _phases_of(kind: str, trace: BlockTrace, phases: tuple) -> list:
    return [(kind, phase, sympy.nsimplify(trace.phases[phase])) for phase in phases]


class _Head(torch.nn.Module):
    """torchtitan's loss head as one module: final norm, then the vocab projection + torchtitan's
    CrossEntropyLoss (full logits), or the Ring-DTP op boundpass's vocab pass rewrites that region into (one
    rank: no ring; the strip width stays the symbol C in its declared workspace)."""

    def __init__(self, norm: torch.nn.Module, lm_head: torch.nn.Module, ring_dtp: bool, loss_fn=None):
        super().__init__()
        self.norm, self.lm_head, self.ring_dtp = norm, lm_head, ring_dtp
        if loss_fn is None:  # the default model source's loss (torchtitan's CrossEntropyLoss)
            from boundpass.core.model_source import default_source
            loss_fn = default_source().loss
        self.loss_fn = loss_fn

    def forward(self, h):
        # the labels made here (one token symbol with h; the batch's labels, counted as the head holds them)
        labels = torch.zeros(h.shape[:-1], dtype=torch.long, device=h.device)
        x = self.norm(h)
        tokens = labels.numel()
        if self.ring_dtp:
            from boundpass.runtime.ring_dtp import ring_dtp_loss
            weight = self.lm_head.weight
            return ring_dtp_loss(x.reshape(-1, x.shape[-1]), weight, labels.reshape(-1),
                                 vocab_size=weight.shape[0]) / tokens
        loss = self.loss_fn()(self.lm_head(x), labels, tokens)
        return loss[0] if isinstance(loss, tuple) else loss


HEADS = ("full_logits", "ring_dtp")


def trace_torchtitan_head(net: torch.nn.Module, *, progress=None, loss_fn=None) -> tuple:
    """(("head", "full_logits" / "ring_dtp", sympy bytes in N), ...): the loss head of a torchtitan Decoder
    (final norm + lm_head + CrossEntropyLoss, and the same region as the Ring-DTP op on one rank) traced forward +
    backward at symbolic N through the step analysis. Its input (the last block's output, which the norm saves)
    and the labels are counted, and the head's weight gradients as its backward writes them (the composed budget
    then leaves its grad_head term out: composed.traced_head). loss_fn: makes the loss (None: the default
    model source's, boundpass/core/model_source.py)."""
    weight = net.lm_head.weight
    h = torch.empty(1, 8, weight.shape[1], dtype=weight.dtype, device="meta", requires_grad=True)
    out = []
    for head in HEADS:
        if progress:
            progress(f"tracing the loss head ({head.replace('_', ' ')}) at symbolic N")
        trace = _trace(_Head(net.norm, net.lm_head, head == "ring_dtp", loss_fn), (h,), symbolic_tokens=True,
                       token_dim=1, loss_fn=None, weight_grads=True, count_inputs=True, kwargs={}, tags={},
                       stand_in={}, ctx={})
        out.append(("head", head, sympy.nsimplify(trace.peak_expr())))
    return tuple(out)
