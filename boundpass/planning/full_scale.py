"""`boundpass.plan`: does a torchtitan MoE model fit per-rank memory at this launch, before launch — and what fits.

Method: read the model's shape off torchtitan's real model (built on ``meta``: parameter counts per block, expert
shapes, heads); compose the per-rank budget (boundpass/bound/composed.py: every term a sympy formula); then trace the
real torchtitan blocks at this rank's token count under FakeTensorMode (nothing allocated) and put what the trace
holds beside the bounds. Tracing covers one dense block (if the model has one), one MoE block and the loss head
(final norm + lm_head + torchtitan's CrossEntropyLoss) on one rank; the model is composed from them by layer
count. The trace runs torchtitan's own schedule on one rank (all experts local, every head, full logits, SDPA's
CPU kernel), so its figures are the *reference* working sets of a layer and of the head, not the rewritten ones.

Models come from a model source (boundpass/core/model_source.py): by default torchtitan's, found from its own model
registries (recipes/families.py); this module imports nothing of boundpass.recipes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field

import torch

from boundpass.bound import composed
from boundpass.core import textwidth
from boundpass.bound.composed import Launch, ModelShape
from boundpass.core.config import PLAN_BUDGET
from boundpass.core.model_source import ModelSource, default_source
from boundpass.core.plan_input import DTYPE_BYTES, OPERATORS, CostModel, PlanInput, locate, make_input  # noqa: F401
from boundpass.core.units import format_bytes
from boundpass.planning import planner

@dataclass
class PlanResult:
    """The composed budget at this launch, the traced figures beside it, the verdict, and --solve's answer."""
    inputs: PlanInput
    shape: ModelShape
    table: composed.ComposedBudget
    traced: dict = field(default_factory=dict)      # term name -> traced bytes
    trace_notes: list = field(default_factory=list)
    solve: dict | None = None
    search: dict | None = None
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return self.table.fits()

    def to_json(self) -> dict:
        t = self.table
        bind = t.binding()
        return {
            "model": self.inputs.model, "flavor": self.inputs.flavor,
            "launch": {k: (sorted(v) if isinstance(v, frozenset) else v)
                       for k, v in dataclasses.asdict(self.inputs).items()},
            "shape": dataclasses.asdict(self.shape),
            "terms": [{"term": x.name, "kind": x.kind, "formula": str(x.formula), "bound_bytes": x.value,
                       "traced_bytes": self.traced.get(x.name), "knob": x.knob, "share": _share(x, t)}
                      for x in t.terms],
            "comparisons": {k: v for k, v in self.traced.items() if k.startswith("[")},
            "device_peak_bytes": t.total, "budget_bytes": t.budget,
            "host_bytes": t.host_total, "host_budget_bytes": t.host_budget,
            "fits": self.fits, "binding_term": bind.name, "binding_knob": bind.knob,
            "trace_notes": self.trace_notes, "solve": self.solve, "search": self.search, "seconds": self.seconds,
        }

    def render(self, *, formulas: bool = False, width: int = textwidth.WIDTH) -> str:
        """The report within ``width`` columns: each term with its bound, traced bytes and share, the verdict, the
        notes. formulas=True adds each term's sympy formula under its row (wrapped); --json has them too."""
        t = self.table
        rows, formula_of = [("term", "bound", "traced", "share")], {}
        for x in t.terms:
            share = "-" if _share(x, t) is None else f"{100 * _share(x, t):.1f}%"
            traced = self.traced.get(x.name)
            formula_of[len(rows)] = x.formula
            rows.append((f"[{x.kind}] {x.name}", format_bytes(x.value), "-" if traced is None else format_bytes(traced),
                         share))
        for name, value in self.traced.items():
            if name.startswith("["):
                rows.append((name, format_bytes(value[0]), format_bytes(value[1]), ""))
        lines = []
        for n, line in enumerate(textwidth.table(rows, width=width)):
            lines.append(line)
            if formulas and n in formula_of:
                lines += textwidth.wrap(str(formula_of[n]), width=width, first="    = ", rest="      ")
        i = self.inputs
        params = self.shape.params
        size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"   # a debug model is 33M, not 0.0B
        head = (f"boundpass plan: {i.model} {i.flavor} ({size} params), W={i.ranks} "
                f"E_p={i.ep} P={i.ring}, N={i.tokens_per_rank:,} tokens/rank"
                + (f" (context {i.context:,} x batch {i.global_batch})" if i.context else "")
                + f", {i.dtype}, operators: {', '.join(sorted(i.operators)) or 'none (baseline)'}"
                + (", layout dp (FSDP2 data parallelism: whole sequences per rank)" if i.layout == "dp" else "")
                + (f", torchtitan's chunked loss ({i.loss_chunks} chunks)" if i.loss_chunks > 1
                   and "ring_dtp" not in i.operators else "")
                + (f", attention in tiles of C_s={i.attention_tiles} (the whole sequence's q, k, v, output and "
                   "gradients on the host)" if i.attention_tiles else ""))
        out = [*textwidth.wrap(head, width=width), "", *lines, "", *textwidth.wrap(composed.describe(t), width=width)]
        for n in self.trace_notes:
            out += textwidth.wrap(n, width=width, first="note: ", rest="      ")
        if self.solve and self.solve.get("ceiling"):
            out.append(f"solve: {self.solve['what']} {self.solve['value']:,} ({self.solve['tokens_per_rank']:,} "
                       f"tokens/rank) fits and so does {self.solve['next']:,}: the search stopped at its ceiling "
                       f"(2^34 tokens/rank), the budget does not bind below it")
        elif self.solve:
            out.append(f"solve: largest {self.solve['what']} that fits: {self.solve['value']:,} "
                       f"({self.solve['tokens_per_rank']:,} tokens/rank); {self.solve['next']:,} does not fit"
                       + (f"; PipelinedLLEP's chunk cap there: c = {self.solve['dispatch_cap']:,}"
                          if self.solve.get("dispatch_cap") else "")
                       + (f"; OffloadStreamAdamW's bucket there: beta = {self.solve['optimizer_bucket']:,}"
                          if self.solve.get("optimizer_bucket") else ""))
        if self.search:
            best = self.search.get("best")
            out.append("search: " + (f"best {best['knobs']} at predicted step {best['step_seconds']:.3g} s "
                                     f"(peak {format_bytes(best['peak_bytes'])})" if best else "nothing fits"))
        return "\n".join(ln for line in out for ln in (textwidth.wrap(line, width=width) if len(line) > width
                                                        else [line]))


def _share(term, table) -> float | None:
    """The term's fraction of its budget (host terms of the host budget); None when that budget is unlimited."""
    limit = table.host_budget if term.kind == "host" else table.budget
    return term.value / limit if limit else None


def launch_of(inp: PlanInput, tokens_per_rank: int | None = None) -> Launch:
    return Launch(ranks=inp.ranks, ep=inp.ep, ring=inp.ring, tokens_per_rank=tokens_per_rank or inp.tokens_per_rank,
                  operators=inp.operators, b=DTYPE_BYTES[inp.dtype], b_acc=4, dispatch_cap=inp.dispatch_cap,
                  dispatch_borrowed_slots=inp.dispatch_borrowed_slots, vocab_block=inp.vocab_block,
                  optimizer_bucket=inp.optimizer_bucket,
                  optimizer_slots=inp.optimizer_slots, sco_max_layers=inp.sco_max_layers, routing=inp.routing,
                  # under data parallelism each rank's trainer holds only its own batch: the count at W = 1
                  held_batch_per_token=composed.trainer_held_batch(inp.ranks if inp.layout == "mop" else 1),
                  layout=inp.layout, loss_chunks=inp.loss_chunks, attention_tiles=inp.attention_tiles,
                  # a context given: torchtitan's trainer sizes the RoPE tables to it (N·W / G positions)
                  sequences_per_step=inp.global_batch if inp.context is not None else None)


# ------------------------------------------------------------------------------------------- the model
def model_config(model: str, flavor: str, *, seq_len: int | None = None, source: ModelSource | None = None):
    """The source's decoder config of (model, flavor) with causal SDPA attention (the CPU-traceable kernel);
    BoundpassInputError when the flavor cannot be planned (no MoE block, a missing kernel package, an attention
    kind the composed budget does not model), with the reason."""
    return (source or default_source()).config(model, flavor, seq_len=seq_len)


def _is_routed(name: str) -> bool:
    """A block parameter of its routed experts: torchtitan's moe.routed_experts, or experts directly under the
    block's moe (HF's experts interface, through recipes/hf.py's view)."""
    return "routed_experts" in name or name.startswith("moe.experts.")


def _ffn_width(ffn: torch.nn.Module) -> int:
    """The hidden width of a SwiGLU FFN: torchtitan's w1, HF's gate_proj."""
    first = getattr(ffn, "w1", None) or getattr(ffn, "gate_proj")
    return first.weight.shape[0]


def model_shape(model: str, flavor: str, *, dtype_bytes: int = 4, trace: bool | None = None,
                progress=None, source: ModelSource | None = None, traces: str = "all",
                attention_tiles: int = 0) -> ModelShape:
    """Read the composed budget's ModelShape off torchtitan's real model, built on meta (< 3 s at 671B), its
    floating weights and buffers at ``dtype_bytes`` (4: fp32, 2: bf16): the width its blocks are traced at.
    progress: called with one line per step (model build, each traced block), e.g. the CLI's stderr printer.

    The result is kept for the rest of the process (ModelShape is frozen; its block traces do not depend on the
    launch): a second plan of the same model, as --solve sweeps and tests make, does not build and trace again.
    traces: which block traces to make (shape_of_module): "all", "one_rank" (W = 1's) or "wide" (W > 1's).
    attention_tiles: the blocks traced with the MoP layout's attention in tiles of that C_s (0: the whole exchange)."""
    source = source or default_source()
    model = source.resolve(model)
    key = (model, flavor, dtype_bytes, trace, id(source), traces, attention_tiles)
    if key in _SHAPES:
        if progress:
            progress(f"{model} {flavor}: shape and block traces already made in this process")
        return _SHAPES[key]
    cfg = model_config(model, flavor, source=source)
    if progress:
        progress(f"building {model} {flavor} on meta ({len(cfg.layers)} blocks)")
    with torch.device("meta"):
        net = cfg.build()
    if dtype_bytes != 4:
        dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
        net = net._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)  # complex RoPE stays complex
    shape = shape_of_module(net, name=f"{model} {flavor}", heads_config=cfg.layers[-1].attention,
                            top_k=max((l.moe.router.top_k for l in cfg.layers if getattr(l, "moe", None)), default=0),
                            trace=trace, progress=progress, loss_fn=source.loss, traces=traces,
                            attention_tiles=attention_tiles)
    _SHAPES[key] = shape
    return shape


_SHAPES: dict = {}   # (model, flavor, dtype_bytes, trace, source, traces, attention_tiles) -> ModelShape


def shape_of_module(net: torch.nn.Module, *, name: str, heads_config, top_k: int,
                    trace: bool | None = None, progress=None, loss_fn=None, traces: str = "all",
                    attention_tiles: int = 0) -> ModelShape:
    """ModelShape of a built torchtitan Decoder (meta or real): parameter counts per block, experts, heads.

    trace (None: for the families in block_trace.TRACED_FAMILIES): also trace one block of each kind forward +
    backward at symbolic N (boundpass/planning/block_trace.py) so that the composed budget takes those blocks'
    activations from their graphs on one rank (composed.uses_trace). loss_fn: a callable returning the head's
    loss (None: the default model source's, torchtitan's CrossEntropyLoss). traces: "all" (default), "one_rank"
    (the blocks and the head as a W = 1 launch reads them: composed.uses_trace) or "wide" (the blocks without their
    routed experts, all a W > 1 launch reads: composed.uses_wide_trace; no head trace). attention_tiles: the blocks'
    attention traced as the MoP layout's sequence-to-head attention in tiles of that C_s (0: the whole exchange)."""
    if traces not in ("all", "one_rank", "wide"):
        raise ValueError(f"traces must be 'all', 'one_rank' or 'wide', got {traces!r}")
    H = net.tok_embeddings.weight.shape[1]
    V = net.lm_head.weight.shape[0]
    blocks = list(net.layers.values())
    moe, experts, expert_hidden, dense_hidden, shared_hidden, block_params, expert_params = 0, 0, 0, 0, 0, 0, 0
    leading_dense, dense_sizes, moe_sizes = 0, [], []
    for blk in blocks:
        params = dict(blk.named_parameters())
        size = sum(p.numel() for p in params.values())
        is_moe = any(_is_routed(n) for n in params)
        (moe_sizes if is_moe else dense_sizes).append(size)
        if not is_moe and not moe_sizes:
            leading_dense += size
        routed = {n: p for n, p in params.items() if _is_routed(n)}
        block_params = max(block_params, sum(p.numel() for n, p in params.items() if not _is_routed(n)))
        if routed:
            moe += 1
            count = sum(p.numel() for p in routed.values())
            expert_params += count
            experts = max(experts, next(iter(routed.values())).shape[0])
            expert_hidden = max(expert_hidden, math.ceil(count / experts / (3 * H)))
            moe_module = getattr(blk, "moe", None)
            shared = getattr(moe_module, "shared_experts", None) or getattr(moe_module, "shared_expert", None)
            if shared is not None:
                shared_hidden = max(shared_hidden, _ffn_width(shared))
        elif getattr(blk, "feed_forward", None) is not None:
            dense_hidden = max(dense_hidden, _ffn_width(blk.feed_forward))
    from boundpass.planning import block_trace
    weight_bytes = next(net.parameters()).element_size()
    if trace is None:  # a parallelized model (DTensor weights) is traced by its one-rank schedule only unsharded
        trace = block_trace.untraced_reason(name.split()[0], weight_bytes) is None and not any(
            hasattr(p, "_local_tensor") for p in net.parameters())
    traced = ()
    if trace:
        traced = block_trace.trace_torchtitan_blocks(net, heads_config, progress=progress, wide=traces != "one_rank",
                                                     one_rank=traces != "wide", attention_tiles=attention_tiles)
        if traces != "wide":
            traced += block_trace.trace_torchtitan_head(net, progress=progress, loss_fn=loss_fn)
    a = heads_config
    rope_positions = getattr(getattr(a, "rope", None), "max_seq_len", 0) or 0
    heads = a.n_heads
    kv_heads = getattr(a, "n_kv_heads", None) or heads
    head_dim = getattr(a, "head_dim", None) or max(a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim)
    return ModelShape(name=name, hidden=H, vocab=V, layers=len(blocks), moe_layers=moe, experts=experts,
                      top_k=top_k, expert_hidden=expert_hidden, dense_hidden=dense_hidden, shared_hidden=shared_hidden,
                      heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      params=sum(p.numel() for p in net.parameters()), expert_params=expert_params,
                      block_params=block_params,
                      tied_embeddings=net.tok_embeddings.weight is net.lm_head.weight,
                      leading_dense_params=leading_dense, min_dense_block_params=min(dense_sizes, default=0),
                      min_moe_block_params=min(moe_sizes, default=0), traced=traced,
                      traced_b=weight_bytes if traced else 0, buffer_bytes=_buffer_bytes(net),
                      rope_bytes_per_position=_rope_bytes_per_position(net, rope_positions),
                      rope_positions=rope_positions,
                      shared_block_input_bytes=getattr(net, "shared_block_input_bytes", 0),
                      param_tensors=len(list(net.parameters())))


def _unique_buffers(net: torch.nn.Module):
    """(name, tensor) of each buffer storage of the model once (a DTensor's local shard; on meta, each tensor)."""
    seen = set()
    for name, b in net.named_buffers():
        b = b._local_tensor if hasattr(b, "_local_tensor") else b
        key = id(b) if b.device.type == "meta" else b.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            yield name, b


def _buffer_bytes(net: torch.nn.Module) -> int:
    """Bytes of the model's buffers as built (torchtitan: each block's RoPE table at its max_seq_len, the
    router's statistics; FSDP2 does not shard buffers), each storage once."""
    return sum(b.numel() * b.element_size() if b.device.type == "meta" else b.untyped_storage().nbytes()
               for _, b in _unique_buffers(net))


def _rope_bytes_per_position(net: torch.nn.Module, positions: int) -> int:
    """Bytes per sequence position of the model's RoPE tables (torchtitan: a ``rope.cache`` buffer per block, one row
    per position up to max_seq_len), each storage once; 0 without such tables."""
    if not positions:
        return 0
    return sum(b.numel() * b.element_size() for name, b in _unique_buffers(net)
               if "rope" in name and b.dim() > 0 and b.shape[0] == positions) // positions


def trace(model: str, flavor: str, tokens: int, *, dtype_bytes: int = 2, progress=None,
          source: ModelSource | None = None) -> tuple[dict, list[str]]:
    """Trace torchtitan's real blocks and head at `tokens` tokens under FakeTensorMode (nothing allocated).

    Returns {"boundary": bytes a checkpointed block keeps (its input), "dense_block" / "moe_block": forward +
    backward peak of one block above its input, "head": forward + backward peak of norm + lm_head + loss}, and
    notes. Parameters and their gradients are left out (budgeted as persistent state): activations only.

    Attention whose qk and v head dims differ (deepseek_v3's MLA: 192 / 128) is traced through
    runtime/seq_to_head's SeqToHeadAttention on one rank (no exchange; the narrower dim zero-padded), which keeps
    SDPA on its fused O(N) kernel, the kernel the bound counts and the MoP layout runs: torch's stock SDPA on CPU
    takes the math path for unequal dims and materialises [N, N] scores per head.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from boundpass.measure.memtrack import LiveStorageTracker

    source = source or default_source()
    torchtitan_loss = source.loss
    cfg = model_config(model, flavor, seq_len=tokens, source=source)
    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    moe_at = next((i for i, l in enumerate(cfg.layers) if getattr(l, "moe", None) is not None), None)
    dense_at = next((i for i, l in enumerate(cfg.layers) if getattr(l, "moe", None) is None), None)
    out, notes, padded = {}, [], False
    previous = torch.get_default_dtype()
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"):
        torch.set_default_dtype(dtype)
        try:
            for key, at in (("dense_block", dense_at), ("moe_block", moe_at)):
                if at is None:
                    continue
                if progress:
                    progress(f"tracing one {key.split('_')[0]} block at N = {tokens:,} (FakeTensorMode)")
                blk = cfg.layers[at].build()
                padded = fuse_unequal_head_dims(blk, cfg.layers[at].attention) or padded
                x = torch.empty(1, tokens, cfg.dim, dtype=dtype, requires_grad=True)
                with LiveStorageTracker() as tracker:
                    y = blk(x, None, None)
                    y.backward(torch.empty_like(y))
                # less the block's weight gradients: they are the persistent gradients term, not activations
                out[key] = tracker.peak_bytes() - sum(p.numel() for p in blk.parameters()) * x.element_size()
                out["boundary"] = x.numel() * x.element_size()
                del blk, x, y
            if progress:
                progress(f"tracing the loss head at N = {tokens:,} (FakeTensorMode)")
            norm, head = cfg.norm.build(), cfg.lm_head.build()
            h = torch.empty(1, tokens, cfg.dim, dtype=dtype, requires_grad=True)
            labels = torch.zeros(1, tokens, dtype=torch.long)
            with LiveStorageTracker() as tracker:
                loss = torchtitan_loss()(head(norm(h)), labels, tokens)
                (loss[0] if isinstance(loss, tuple) else loss).backward()
            out["head"] = tracker.peak_bytes() - sum(p.numel() * p.element_size() for m in (norm, head)
                                                     for p in m.parameters())
        finally:
            torch.set_default_dtype(previous)
    if padded:
        notes.append("trace: the attention's qk and v head dims differ (MLA), so it is traced through "
                     "SeqToHeadAttention on one rank (v zero-padded: SDPA's fused O(N) kernel, as the MoP layout "
                     "runs it; torch's stock CPU SDPA would take the [N, N] math path)")
    return out, notes


def fuse_unequal_head_dims(block: torch.nn.Module, attention_config) -> bool:
    """Wrap the block's inner attention in SeqToHeadAttention (no group) when its qk and v head dims differ."""
    qk = getattr(attention_config, "qk_nope_head_dim", None)
    v = getattr(attention_config, "v_head_dim", None)
    if qk is None or v is None or qk + attention_config.qk_rope_head_dim == v:
        return False
    from boundpass.runtime.seq_to_head import SeqToHeadAttention
    block.attention.inner_attention = SeqToHeadAttention(block.attention.inner_attention, None)
    return True


# ------------------------------------------------------------------------------------------- plan
def plan(model, flavor: str | None = None, *, ranks: int, ep: int = 1, ring: int | None = None,
         tokens_per_rank: int | None = None, context: int | None = None, global_batch: int = 1, budget=PLAN_BUDGET,
         host_budget=None, operators=OPERATORS, dtype: str = "bf16", dispatch_cap: int | None = None,
         dispatch_borrowed_slots: int | None = None, vocab_block: int | None = None,
         optimizer_bucket: int | None = None, optimizer_slots: int | None = None,
         sco_max_layers: int | None = None, routing: str = "worst", layout: str = "mop", loss_chunks: int = 1,
         attention_tiles: int = 0, do_trace: bool = True, solve: bool = False,
         search: CostModel | bool | None = None,
         progress=None, source: ModelSource | None = None, trace_blocks: bool | None = None) -> PlanResult:
    """Compose the per-rank budget of (model, flavor) at this launch, trace it, and say whether it fits.

    model: a torchtitan family ("deepseek_v3", flavor one of its registry's), or a Hugging Face transformers config:
    "hf:<path to config.json>", "hf:<config class name>" (its defaults) or a config object / class (flavor None).

    budget / host_budget: per-rank bytes ("139GiB"; host None = unlimited). operators: any of ring_dtp,
    pipelined_llep, sco, offload_adamw (empty = the baseline: full logits, standard EP, no offload, ZeRO-3).
    dispatch_cap, dispatch_borrowed_slots, vocab_block, optimizer_bucket, optimizer_slots, sco_max_layers:
    boundpass.Config's knobs by the same
    keywords (docs/config.md); None takes composed.Launch.resolved's value (defined in boundpass/core/config.py).
    solve: also find the largest context (or N) that fits. do_trace: trace torchtitan's blocks (fake tensors).
    search: True or a CostModel: choose (E_p, P, c, β, S, SCO subset) at the least predicted step time.
    progress: None, or called with one line per step (the CLI prints them to stderr).
    source: where (model, flavor) come from (boundpass/core/model_source.py; None: torchtitan's registries). A flavor
    that cannot be planned (no MoE block, a kernel package missing, an attention kind the budget does not model)
    raises BoundpassInputError with the reason. trace_blocks: trace the blocks' graphs at symbolic N for the block
    terms (None: where block_trace supports the family; False: the hand-written block terms, a few seconds faster
    per block kind at full scale).
    """
    start = time.perf_counter()
    source, model, flavor = locate(model, flavor, source)
    inp = make_input(model, flavor, ranks=ranks, ep=ep, ring=ring, tokens_per_rank=tokens_per_rank,
                     context=context, global_batch=global_batch, budget=budget, host_budget=host_budget,
                     operators=operators, dtype=dtype, dispatch_cap=dispatch_cap,
                     dispatch_borrowed_slots=dispatch_borrowed_slots, vocab_block=vocab_block,
                     optimizer_bucket=optimizer_bucket, optimizer_slots=optimizer_slots, sco_max_layers=sco_max_layers,
                     routing=routing, layout=layout, loss_chunks=loss_chunks, attention_tiles=attention_tiles,
                     source=source)
    source = source or default_source()
    model = inp.model  # the canonical family name (an alias resolved)
    # the blocks are traced in the launch's dtype
    # only the block traces this launch's budget reads (one rank: the blocks and the head; W > 1: the blocks
    # without their routed experts); --solve and --search keep W, so they read the same ones
    shape = model_shape(model, flavor, dtype_bytes=DTYPE_BYTES[dtype], trace=trace_blocks, progress=progress,
                        source=source, traces="one_rank" if inp.ranks == 1 else "wide",
                        attention_tiles=inp.attention_tiles)
    # PipelinedLLEP's chunk cap and OffloadStreamAdamW's bucket, when not given, are the planner's (the widest that
    # fits, up to the knee / the default), as the recipe and boundpass.compile choose them; plan describes GPU
    # launches, so the dispatch knee is read off the CUDA constants
    launch = planner.planned_launch(shape, launch_of(inp), budget=inp.budget, host_budget=inp.host_budget,
                                    device="cuda")
    table = composed.compose(shape, launch, budget=inp.budget, host_budget=inp.host_budget)  # checks degrees
    result = PlanResult(inp, shape, table)
    result.trace_notes.append(block_terms_note(shape, launch, model))
    result.trace_notes += source.notes(model, flavor)
    if do_trace:
        traced, notes = trace(model, flavor, inp.tokens_per_rank, dtype_bytes=DTYPE_BYTES[dtype], progress=progress,
                              source=source)
        result.trace_notes += notes
        _attach_trace(result, traced, getattr(source, "name", "torchtitan"))
    if solve:
        if progress:
            progress("solving for the largest size that fits")
        result.solve = solve_context(inp, shape)
    if search:
        if progress:
            progress("searching the knobs")
        result.search = search_knobs(inp, shape, search if isinstance(search, CostModel) else None)
    result.seconds = time.perf_counter() - start
    return result


def block_terms_note(shape: ModelShape, launch: Launch, family: str) -> str:
    """Which block terms this launch's budget uses: traced (block_trace) or hand-written, and why."""
    if composed.uses_trace(shape, launch):
        return ("block terms: traced (the real blocks' forward + backward graphs at symbolic N through the step "
                "analysis, boundpass/planning/block_trace.py; rows named 'traced ...')")
    if composed.uses_wide_trace(shape, launch):
        return ("block terms: traced on one rank without the routed experts and weight gradients (rows named "
                "'traced ...'), plus hand-written for W > 1: the routed experts' dispatch bound, the "
                "sequence-to-head exchange beyond one rank, ZeRO-3's gathered units and unsharded gradients; "
                "the loss head: hand-written")
    from boundpass.planning import block_trace
    reason = block_trace.untraced_reason(family, launch.b)
    if reason is None and (launch.ranks > 1 or launch.ep > 1):
        reason = ("W > 1 / E_p > 1: the sequence-to-head exchange and the routed rows a rank receives are not in a "
                  "one-rank trace")
    elif reason is None and shape.traced and launch.b != shape.traced_b:
        reason = f"the blocks were traced at {shape.traced_b}-byte weights, the launch runs {launch.b}-byte ones"
    return f"block terms: hand-written ({reason or 'not traced'})"


def _attach_trace(result: PlanResult, traced: dict, library: str = "torchtitan") -> None:
    """Put the traced figures beside the bounds: boundaries per term; a block and the head against the bound of
    the same (reference) schedule on one rank (W = E_p = P = 1, no operator, balanced routing R = N·k).
    library: whose blocks and loss were traced (the model source's name)."""
    t, shape, inp = result.table, result.shape, result.inputs
    values = composed.symbol_values(shape, launch_of(inp), host_budget=t.host_budget)
    for x in t.terms:
        if x.name.startswith("checkpoint boundaries (device)"):
            resident = max(shape.layers - values[composed.sym.L_off], 2 * min(values[composed.sym.L_off], 1))
            result.traced[x.name] = traced["boundary"] * resident
    one_rank = dataclasses.replace(launch_of(inp), ranks=1, ep=1, ring=1, operators=frozenset(), routing="balanced")
    ref = composed.compose(shape, one_rank, budget=t.budget)
    if "moe_block" in traced:
        result.traced[f"[MoE block, one rank] reference bound | {library} block"] = (ref.layer_peak("moe"),
                                                                                    traced["moe_block"])
    if "dense_block" in traced:
        result.traced[f"[dense block, one rank] reference bound | {library} block"] = (ref.layer_peak("dense"),
                                                                                      traced["dense_block"])
    result.traced[f"[head, one rank] full-logits bound | norm + lm_head + {library} loss"] = (ref.sum("head"),
                                                                                               traced["head"])
    result.trace_notes.append("[...] rows: at this N on one rank (W = E_p = P = 1, no operator, R = N k), the "
                              f"bound of the reference schedule beside the {library} block / head traced forward "
                              "+ backward under FakeTensorMode, weights and weight gradients left out")


def solve_context(inp: PlanInput, shape: ModelShape) -> dict:
    """Largest context (with global_batch sequences), or largest N when given N, whose budget fits; with the knobs
    the planner takes there (``optimizer_bucket``, None when not offloaded; ``dispatch_cap``, None without
    PipelinedLLEP)."""
    launch = launch_of(inp)
    if inp.context is not None:
        per = inp.global_batch
        # N = context·G / W must be an integer: context in multiples of W / gcd(W, G)
        step = inp.ranks // math.gcd(inp.ranks, per)
        n_step = step * per // inp.ranks
        n = planner.largest_tokens(shape, launch, budget=inp.budget, host_budget=inp.host_budget, multiple=n_step)
        value = n * inp.ranks // per
        out = {"what": "context (tokens per sequence)", "value": value, "tokens_per_rank": n,
               "next": value + step, "global_batch": per,
               "ceiling": n > 0 and _next_fits(shape, launch, inp, n + n_step)}
    else:
        n = planner.largest_tokens(shape, launch, budget=inp.budget, host_budget=inp.host_budget)
        out = {"what": "tokens per rank N", "value": n, "tokens_per_rank": n, "next": n + 1,
               "ceiling": _next_fits(shape, launch, inp, n + 1)}
    at = planner.planned_launch(shape, dataclasses.replace(launch, tokens_per_rank=max(n, 1)), budget=inp.budget,
                                host_budget=inp.host_budget, device="cuda")
    out["optimizer_bucket"] = at.optimizer_bucket if "offload_adamw" in launch.operators and n else None
    out["dispatch_cap"] = at.dispatch_cap if "pipelined_llep" in launch.operators and n else None
    return out


def _next_fits(shape: ModelShape, launch: Launch, inp: PlanInput, tokens: int) -> bool:
    """True when the size after the answer fits too: the search stopped at its ceiling, not at the budget."""
    trial = dataclasses.replace(planner.narrowest_knobs(launch), tokens_per_rank=tokens)
    return composed.compose(shape, trial, budget=inp.budget, host_budget=inp.host_budget).fits()


# ------------------------------------------------------------------------------------------- --search
def step_seconds(shape: ModelShape, launch: Launch, context: int, cost: CostModel, l_off: int) -> dict:
    """Predicted step time (s) of one rank and its parts, for comparing knob settings (not an absolute forecast).

    compute    8·Θ_active·N + 8·L·T²·A_q·D_h / W FLOPs: forward, recompute (full AC) and a 2x backward of the
               matmuls, plus causal attention over the whole sequence T with A_q/W heads on this rank
    ep         dispatch + combine all-to-alls, 6 per MoE block (fwd, recompute, bwd), N·k·H·b·(E_p-1)/E_p bytes each
               over NVLink if E_p fits a node else the NIC; PipelinedLLEP overlaps all but one of its K = N/c
               chunks with expert compute and pays chunk_latency per chunk stage
    ring       Ring-DTP moves min(N, V/P)·H·b per round, P-1 rounds, forward + backward (x3), not overlapped
    zero3      3·b·(Θ_dense·(W-1)/W + Θ_experts/E_p·(1 - E_p/W)) bytes (gather, re-gather, reduce-scatter of the
               dense weights and of this rank's experts); hidden behind compute when shorter
    sco        L_off·N·H·b each way over the host link; hidden behind the recompute of the offloaded blocks
    optimizer  OffloadStreamAdamW: 12·Θ/W bytes each way over the host link (S >= 2 overlaps the three stages;
               S = 1 runs them in series: x2), plus bucket_latency per bucket of β parameters
    """
    W, E_p, P, N, b = launch.ranks, launch.ep, launch.ring, launch.tokens_per_rank, launch.b
    ops = launch.operators
    active = shape.params - shape.expert_params + shape.moe_layers * shape.top_k * 3 * shape.expert_hidden * shape.hidden
    compute = (8 * active * N + 8 * shape.layers * context * context * shape.heads * shape.head_dim / W) / cost.flops
    ep_link = cost.link_intra if E_p <= cost.gpus_per_node else cost.link_inter
    a2a = 6 * shape.moe_layers * N * shape.top_k * shape.hidden * b * (E_p - 1) / E_p / ep_link
    if "pipelined_llep" in ops:
        chunks = -(-N // min(launch.resolved("dispatch_cap"), N))
        ep = a2a / chunks + 3 * shape.moe_layers * chunks * cost.chunk_latency
    else:
        ep = a2a
    ring_link = cost.link_intra if P <= cost.gpus_per_node else cost.link_inter
    ring = 3 * (P - 1) * min(N, -(-shape.vocab // P)) * shape.hidden * b / ring_link if "ring_dtp" in ops else 0.0
    # dense weights are gathered from all W shards; an EP rank's experts (1/E_p of them) from their W/E_p replicas
    gathered = (shape.params - shape.expert_params) * (W - 1) / W + shape.expert_params / E_p * (1 - E_p / W)
    zero3 = max(0.0, 3 * gathered * b / (cost.link_inter if W > cost.gpus_per_node else cost.link_intra) - compute)
    per_block = compute / max(shape.layers, 1)
    sco_copy = l_off * N * shape.hidden * b / cost.host_link
    sco_time = max(0.0, sco_copy - l_off * per_block / 2)  # overlap with the recompute (about half a block's work)
    optimizer = 0.0
    if "offload_adamw" in ops:
        theta = -(-shape.params // W)
        bucket = max(1, min(launch.resolved("optimizer_bucket"), theta))
        optimizer = 12 * theta / cost.host_link * (1 if launch.resolved("optimizer_slots") >= 2 else 2) + \
            -(-theta // bucket) * cost.bucket_latency
    parts = {"compute": compute, "ep": ep, "ring": ring, "zero3_exposed": zero3, "sco_exposed": sco_time,
             "optimizer": optimizer}
    parts["total"] = sum(parts.values())
    return parts


def search_knobs(inp: PlanInput, shape: ModelShape, cost: CostModel | None = None) -> dict:
    """Choose (E_p, P, c, β, S, SCO host subset) that fit the budgets at the least predicted step time."""
    cost = cost or CostModel()
    W, N = inp.ranks, inp.tokens_per_rank
    context = inp.context or N * W
    base = launch_of(inp)
    eps = [d for d in range(1, W + 1) if W % d == 0 and (not shape.moe_layers or shape.experts % d == 0)]
    rings = [d for d in range(1, W + 1) if W % d == 0]
    caps = sorted({min(c, N) for c in (1024, 2048, 4096, 8192, 16384)})
    buckets = (1 << 20, 1 << 22, 1 << 24, 1 << 26)
    l_all = composed.offloaded_boundaries(shape, dataclasses.replace(base, sco_max_layers=None), inp.host_budget) \
        if "sco" in inp.operators else 0
    subsets = sorted({0, l_all // 4, l_all // 2, 3 * l_all // 4, l_all}) if "sco" in inp.operators else [0]
    tried, best = 0, None
    for ep in eps:
        for ring in rings:
            for cap in (caps if "pipelined_llep" in inp.operators else [caps[-1]]):
                for bucket in (buckets if "offload_adamw" in inp.operators else [buckets[-1]]):
                    for slots in ((1, 2) if "offload_adamw" in inp.operators else (2,)):
                        for l_off in subsets:
                            launch = dataclasses.replace(base, ep=ep, ring=ring, dispatch_cap=cap,
                                                         optimizer_bucket=bucket, optimizer_slots=slots,
                                                         sco_max_layers=l_off)
                            tried += 1
                            table = composed.compose(shape, launch, budget=inp.budget, host_budget=inp.host_budget,
                                                     fast=True)
                            if not table.fits():
                                continue
                            l_used = composed.symbol_values(shape, launch, host_budget=inp.host_budget)[
                                composed.sym.L_off]
                            t = step_seconds(shape, launch, context, cost, l_used)
                            if best is None or t["total"] < best[0]["total"]:
                                best = (t, launch, table.total)
    out = {"cost_model": dataclasses.asdict(cost), "candidates": tried, "best": None}
    if best is not None:
        t, launch, _ = best
        exact = composed.compose(shape, launch, budget=inp.budget, host_budget=inp.host_budget)  # exact re-check
        if exact.fits():
            knobs = ("ep", "ring", "dispatch_cap", "optimizer_bucket", "optimizer_slots", "sco_max_layers")
            out["best"] = {"knobs": {name: getattr(launch, name) for name in knobs},
                           "step_seconds": t["total"], "parts": t, "peak_bytes": exact.total,
                           "host_bytes": exact.host_total}
    return out


def as_json(result: PlanResult) -> str:
    return json.dumps(result.to_json(), indent=2, default=str)
