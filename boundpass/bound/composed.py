"""The composed per-rank budget of one training step (docs/design.md §2, MoP layout): every term a sympy formula.
(``Launch.layout="dp"``: stock FSDP2's data parallelism instead, the baseline plan models: no exchange, attention
local, FSDP2's held reduce-scatter input; docs/plan.md.)

Layout: ZeRO-3 shards every parameter, gradient and optimizer state over the W ranks; experts are placed over
E_p expert-parallel ranks (E/E_p per rank, each gathered from its ZeRO shards); attention runs under a
sequence-to-head all-to-all over the W ranks; every block is activation-checkpointed (its input, the checkpoint
boundary, is what a block keeps between forward and backward); the loss head runs over a ring of P ranks.
Once the per-rank token ceiling N is set, every term is fixed by model + launch configuration.

Phases (why the terms are not simply summed): the optimizer steps after backward freed its activations, and the
loss head runs before (forward) or after (backward) any block's recomputation, never during one:

    device peak = persistent + max(optimizer step + all gradients,
                                   all gradients + the embedding's ZeRO-3 backward (gathered weight, unsharded
                                                                                  gradient, reduce-scatter),
                                   a dense block, a MoE block,
                                   boundaries + prefetched unit + head + gradient of the head)
    block       = boundaries + this block gathered (ZeRO-3) + block glue + max over its sub-phases: forward
                  (prefetched unit, attention or attention saved + FFN, no gradients) and, in backward, with the
                  gradients live then and the block's unsharded gradients produced so far: the FFN's backward,
                  the attention kernel's, the input projections' (``_phase_alternatives``)
    FFN         = dense FFN, or shared experts + router + dispatch

Gradients appear as backward produces them (one step, zero_grad(set_to_none=True) before the next, torchtitan's
default; with gradient accumulation they are persistent): while the head runs only its own gradient exists,
while any block runs the embedding's does not yet (its backward is the last), nor the blocks' before it (the dense
blocks that precede every MoE block, while a MoE block runs), nor, under ZeRO-3 (W > 1), the block's own sharded
gradient (its unsharded one is in the gathered-block term until the reduce-scatter after its backward); at the
optimizer step all do.

Within a recomputed block the attention's own forward + backward peak and the FFN's do not coexist: while the FFN
runs forward and backward (its backward comes first) the attention holds only what it saved for its backward;
its backward runs after the FFN's activations are freed.

Each term's formula comes from the runtime module that owns it (imported, not copied): Ring-DTP / the full-logits
reference (runtime/ring_dtp.py), PipelinedLLEP / standard EP / LLEP (runtime/pipelined_llep.py), SCO
(runtime/sco.py), OffloadStreamAdamW / plain AdamW (runtime/offload_adamw.py), sequence-to-head attention
(runtime/seq_to_head.py). The few terms no operator owns (gathered ZeRO-3 layer, dense FFN, router scores,
parameters and gradients) are written here.

``boundpass.compile`` can call ``compose(shape, launch, budget=..., host_budget=...)`` with a ModelShape read off
the live model (``boundpass.plan.shape_of_module``) for its fail-fast check: the result is a BudgetTable.
"""
from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass

import sympy

from boundpass.core import symbols as sym
from boundpass.bound.bounds import BoundTerm, BudgetTable, device_peak, raise_infeasible
from boundpass.core.config import OPTIMIZER_SLOTS, PLAN_DISPATCH_CAP, PLAN_VOCAB_BLOCK
from boundpass.core.errors import BoundpassInputError
from boundpass.core.plan_input import LAYOUTS, OPERATORS  # noqa: F401  (where the CLI reads them without torch)
from boundpass.core.units import format_bytes

# the modules, not the same-named functions boundpass.runtime re-exports
oa = importlib.import_module("boundpass.runtime.offload_adamw")
pl = importlib.import_module("boundpass.runtime.pipelined_llep")
rd = importlib.import_module("boundpass.runtime.ring_dtp")
sco = importlib.import_module("boundpass.runtime.sco")

# Parameter elements of blocks whose gradients are absent while a block runs backward (this module's own symbols,
# beside the shared vocabulary: only the composed budget needs them)
_nonneg = dict(integer=True, nonnegative=True)
G_lead = sympy.Symbol("G_lead", **_nonneg)            # the dense blocks before the first MoE block
G_dense_min = sympy.Symbol("G_dense_min", **_nonneg)  # the smallest dense block
G_moe_min = sympy.Symbol("G_moe_min", **_nonneg)      # the smallest MoE block, routed experts included
L_moe = sympy.Symbol("L_moe", **_nonneg)              # MoE blocks


@dataclass(frozen=True)
class ModelShape:
    """What the composed budget needs to know about a model (element counts, not bytes)."""
    name: str
    hidden: int            # H
    vocab: int             # V
    layers: int            # L (all blocks)
    moe_layers: int        # blocks with routed experts
    experts: int           # E
    top_k: int             # k
    expert_hidden: int     # I (an expert's MLP is ~3·I·H elements)
    dense_hidden: int      # hidden size of the dense blocks' FFN (0: no dense block)
    shared_hidden: int     # hidden size of the shared experts' MLP in a MoE block (0: none)
    heads: int             # A_q
    kv_heads: int          # A_kv
    head_dim: int          # D_h (the larger of the qk and v head dims)
    params: int            # Θ of the whole model
    expert_params: int     # routed-expert elements over all blocks
    block_params: int      # non-routed-expert elements of the largest block (what ZeRO-3 gathers per block)
    tied_embeddings: bool = False  # the embedding and the lm_head share one weight (one gradient)
    leading_dense_params: int = 0  # elements of the dense blocks before the first MoE block (grads absent in MoE bwd)
    min_dense_block_params: int = 0  # elements of the smallest dense block (0: none)
    min_moe_block_params: int = 0    # elements of the smallest MoE block, its routed experts included (0: none)
    # traced block activations (boundpass/planning/block_trace.py): ((block kind "dense"/"moe", sub-phase, sympy bytes in N),
    # ...) of one block of each kind, traced forward + backward on one rank; () = the hand-written block terms
    traced: tuple = ()
    traced_b: int = 0  # bytes per element of the weights / activations the blocks were traced at
    buffer_bytes: int = 0  # the model's buffers as built (RoPE tables, router statistics): persistent, not sharded
    # the part of buffer_bytes that holds one row per sequence position (torchtitan: each block's RoPE table), and how
    # many positions the model was built with (its max_seq_len): torchtitan's trainer rebuilds the tables at the
    # training sequence length (Launch.sequences_per_step)
    rope_bytes_per_position: int = 0
    rope_positions: int = 0
    # bytes per token of what the model computes once per step and hands every block beside its hidden state (HF's
    # rotary cos / sin and position ids; torchtitan's RoPE table is a buffer): live through forward and backward
    shared_block_input_bytes: int = 0
    param_tensors: int = 0  # parameter tensors (torch AdamW keeps one fp32 step counter per tensor on the device)

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers


@dataclass(frozen=True)
class Launch:
    """Launch configuration of one rank: degrees, token ceiling, operators, knobs. The knobs carry boundpass.Config's
    keyword names and defaults (None: the value ``resolved`` takes, defined in boundpass/core/config.py)."""
    ranks: int                      # W
    ep: int                         # E_p
    ring: int                       # P (Ring-DTP ring; the ZeRO-3 shard of the head when Ring-DTP is off)
    tokens_per_rank: int            # N
    operators: frozenset = frozenset(OPERATORS)
    b: int = 2                      # bytes per element of weights / activations (bf16)
    b_acc: int = 4                  # fp32 accumulation / master state
    dispatch_cap: int | None = None     # c (Config's dispatch.cap)
    vocab_block: int | None = None      # C (vocab.block)
    optimizer_bucket: int | None = None  # β (optimizer.bucket)
    optimizer_slots: int | None = None   # S (optimizer.slots)
    sco_max_layers: int | None = None   # SCO host subset: offload at most this many boundaries (None: all that fit)
    dispatch_borrowed_slots: int | None = None  # s_b (dispatch.borrowed_slots: LLEP's slots per rank; None: E / E_p)
    routing: str = "worst"          # standard EP only: "worst" (a hot rank receives E_p·N·k rows) or "balanced"
    grad_accumulation: int = 1      # microbatches per optimizer step (> 1: every gradient lives through all of them)
    # FSDP2 computing in a narrower dtype than it reduces in, counted under the b = 4 convention (the MoP recipe:
    # b = 4 for its fp32 shards, bf16 compute): that dtype's bytes (2). The embedding's backward then holds three
    # V x H copies in it (autograd's dense gradient, the cast autograd makes of it, FSDP2's copy-in before the cast to
    # the reduce dtype) beside the reduce-scatter input (measured: torch's allocator, tests/recipes/test_recipe_mop.py).
    # None: FSDP2 computes in b.
    fsdp_param_b: int | None = None
    # bytes per token of N of the batch the training loop holds on this rank through the whole step, optimizer step
    # included (the caller's, not the model's: torchtitan's trainer under the MoP layout, ``trainer_held_batch``);
    # 0: not counted
    held_batch_per_token: int = 0
    # sequences a step's W·N tokens are cut into, when the caller sizes the model's per-position buffers to one
    # sequence (torchtitan's trainer: RoPE tables at --training.seq_len = N·W / G positions, update_from_config);
    # None: the buffers as the model was built (ModelShape.buffer_bytes)
    sequences_per_step: int | None = None
    # how the W ranks share the work: "mop" (one sequence split over the ranks, attention through the sequence-to-head
    # exchange: boundpass's layout and plan's own baseline) or "dp" (FSDP2's data parallelism as torchtitan's stock
    # trainer runs it: every rank trains whole sequences of its own, attention local with all heads, no exchange)
    layout: str = "mop"
    # torchtitan's chunked loss (ChunkedLossWrapper, --loss.num_chunks): the head's logits in this many sequence
    # chunks, each chunk's backward run at once (1: full logits). Only without Ring-DTP.
    loss_chunks: int = 1
    # the MoP layout's attention in tiles of this C_s, the whole sequence's tensors on the host
    # (runtime/seq_to_head_tiles.py; the blocks traced with it: ModelShape.traced); 0: the whole-tensor exchange
    attention_tiles: int = 0

    def resolved(self, knob: str) -> int:
        """A Config knob's value at this launch: the one given, else what boundpass/core/config.py says a knob left to
        the planner is taken as where no planner chooses it (c, C, S; β: OffloadStreamAdamW's default bucket, derived
        from config.py's staging bytes and slots)."""
        value = getattr(self, knob)
        if value is not None:
            return value
        return {"dispatch_cap": PLAN_DISPATCH_CAP, "vocab_block": PLAN_VOCAB_BLOCK, "optimizer_slots": OPTIMIZER_SLOTS,
                "optimizer_bucket": oa.DEFAULT_BUCKET}[knob]


def check_launch(shape: ModelShape, launch: Launch) -> None:
    """Raise BoundpassInputError naming what to change when degrees do not divide or a knob is out of range."""
    W, E_p, P = launch.ranks, launch.ep, launch.ring
    for name, value in (("ranks W", W), ("expert-parallel degree E_p", E_p), ("ring degree P", P),
                        ("tokens per rank N", launch.tokens_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BoundpassInputError(f"{name} must be a positive int, got {value!r}")
    if W % E_p:
        raise BoundpassInputError(f"E_p = {E_p} does not divide W = {W} ranks: pick E_p among {_divisors(W)}")
    if shape.moe_layers and shape.experts % E_p:
        raise BoundpassInputError(f"E_p = {E_p} does not divide {shape.name}'s E = {shape.experts} experts: "
                                  f"pick E_p among {[d for d in _divisors(W) if shape.experts % d == 0]}")
    if W % P:
        raise BoundpassInputError(f"ring degree P = {P} does not divide W = {W} ranks: pick P among {_divisors(W)}")
    if launch.layout not in LAYOUTS:
        raise BoundpassInputError(f"layout must be one of {', '.join(LAYOUTS)}, got {launch.layout!r}")
    if launch.layout == "mop" and shape.heads % W:
        raise BoundpassInputError(f"sequence-to-head attention splits {shape.name}'s {shape.heads} query heads over "
                                  f"W = {W} ranks: W must divide {shape.heads}")
    unknown = set(launch.operators) - set(OPERATORS)
    if unknown:
        raise BoundpassInputError(f"unknown operators {sorted(unknown)}; known: {', '.join(OPERATORS)}")
    if launch.routing not in ("worst", "balanced"):
        raise BoundpassInputError(f"routing must be 'worst' or 'balanced', got {launch.routing!r}")
    if launch.attention_tiles and launch.layout != "mop":
        raise BoundpassInputError("attention_tiles is the MoP layout's sequence-to-head attention in tiles; the "
                                  f"{launch.layout!r} layout has no exchange (set attention_tiles=0)")
    for name in ("dispatch_cap", "vocab_block", "optimizer_bucket", "optimizer_slots", "dispatch_borrowed_slots",
                 "sco_max_layers", "grad_accumulation", "sequences_per_step", "loss_chunks"):
        value = getattr(launch, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < (
                0 if name in ("dispatch_borrowed_slots", "sco_max_layers") else 1)):
            raise BoundpassInputError(f"{name} must be a positive int (or None for the default), got {value!r}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class ComposedBudget(BudgetTable):
    """A BudgetTable whose device peak follows the phases of a training step (see the module docstring).

    Term kinds: persistent, transient (live through forward + backward), layer (every block, both phases of it),
    attention (its forward + backward peak), attention_saved (what it holds while the FFN runs), dense (dense
    blocks' FFN), moe (MoE blocks' FFN), head (loss head), step (optimizer step), host; gradients: grad (of the
    blocks and head: live from the blocks' backward on), grad_embedding (live from the end of backward),
    grad_head (the head's, a part of grad: the only one live while the head runs), grad_dense / grad_moe (the
    part of grad live while a dense / MoE block runs); embedding_backward (the embedding's ZeRO-3 backward, last
    in backward: every other gradient exists).
    """

    def layer_peak(self, ffn: str) -> int:
        """Activation peak of one recomputed block: glue + max(attention, attention saved + FFN); ffn: "dense" or
        "moe" (a block kind the model does not have: 0). Gathered weights and gradients not included."""
        s = self.sum
        if any(t.kind == f"traced_{ffn}_forward" for t in self.terms):
            return max(s(f"traced_{ffn}_{phase}") for phase in _SUBPHASES)
        if not any(t.kind == ffn and t.counted for t in self.terms):
            return 0
        return s("layer") + max(s("attention"), s("attention_saved") + s(ffn))

    def phases(self) -> dict:
        """Device bytes above the persistent state of each phase: optimizer step, embedding backward, dense block,
        MoE block, head (each the largest of its sub-phases, ``_phase_alternatives``)."""
        kinds = {t.kind for t in self.terms}
        return {phase: max(value for value, _ in alts)
                for phase, alts in _phase_alternatives(self.sum, kinds).items()}

    @property
    def total(self) -> int:
        return device_peak(self.sum("persistent"), *self.phases().values())

    def binding(self) -> BoundTerm:
        """The term to name when the budget is missed: the largest host term if the host is over, else the
        largest device term in the sub-phase that sets the peak."""
        if not self.host_fits():
            return max((t for t in self.terms if t.kind == "host" and t.counted), key=lambda t: t.value)
        kinds = {t.kind for t in self.terms}
        alts = [alt for phase_alts in _phase_alternatives(self.sum, kinds).values() for alt in phase_alts]
        _, phase = max(alts, key=lambda alt: alt[0])
        return max((t for t in self.terms if t.counted and t.kind in phase | {"persistent"}), key=lambda t: t.value)


def _phase_alternatives(s, kinds: set) -> dict:
    """Each phase of a step as its sub-phases: [(bytes above the persistent state, the kinds it sums)].

    ``s(kind)`` sums the terms of a kind (ints, or sympy expressions for total_formula).
    A block phase is its forward (this block and the prefetched one gathered, the block's activations, no
    gradients) or one of three backward sub-phases (the FFN's backward, the attention kernel's, the input
    projections' after it), each with the gradients backward has produced by then (see _term_list).
    """
    def alt(*ks):
        ks = [k for k in ks if k in kinds]
        total = 0
        for k in ks:
            total = total + s(k)
        return total, set(ks)

    out = {"step": [alt("step", "grad", "grad_embedding")], "head": [alt("transient", "gather_prefetch", "head",
                                                                        "grad_head")]}
    if "embedding_backward" in kinds:
        # (stock FSDP2: block 0's reduce-scatter input is still held while the embedding's backward runs)
        out["embedding"] = [alt("grad", "grad_embedding", "embedding_backward", "reduce_held")]
    for ffn in ("dense", "moe"):
        grads = f"grad_{ffn}" if f"grad_{ffn}" in kinds else "grad"
        prefetch_bwd = "gather_prefetch_first" if ffn == "dense" and "gather_prefetch_first" in kinds \
            else "gather_prefetch"
        if f"traced_{ffn}_forward" in kinds:
            # the block's activations per sub-phase from its trace; the forward also as FullAC's recompute, which
            # runs in backward with the gradients produced by then
            # (W > 1: + the exchange's extra over one rank, and the routed experts' own bound while the FFN runs)
            t = lambda phase: f"traced_{ffn}_{phase}"  # noqa: E731
            base = ("transient", "gather_current")
            g = (grads, t("own_grads"), "reduce_held", f"freed_{ffn}")
            ex, ex_saved, disp = "attention_exchange", "attention_exchange_saved", "dispatch" if ffn == "moe" else ""
            # the dispatch's forward alone where it is given apart (PipelinedLLEP), else its whole bound
            disp_f = "dispatch_forward" if ffn == "moe" and "dispatch_forward" in kinds else disp
            if t("forward_ffn") in kinds:  # W > 1: the forward's attention part and its FFN part apart
                forward = [(t("forward_attention"), ex), (t("forward_ffn"), ex_saved, disp_f)]
            else:
                forward = [(t("forward"), ex, disp_f)]
            out[ffn] = [
                *(alt(*base, "gather_prefetch", *f) for f in forward),
                *(alt(*base, prefetch_bwd, *g, *f) for f in forward),
                alt(*base, prefetch_bwd, *g, t("ffn_backward"), f"grads_ffn_{ffn}", ex_saved, disp),
                alt(*base, prefetch_bwd, *g, t("attention_backward"), f"grads_attention_{ffn}",
                    "attention_exchange_backward" if "attention_exchange_backward" in kinds else ex),
                alt(*base, prefetch_bwd, *g, t("tail_backward"), f"grads_tail_{ffn}"),
            ]
            if f"grads_reduce_{ffn}" in kinds:  # the wide trace: the reduce-scatter after the block's backward
                out[ffn].append(alt(*base, prefetch_bwd, *g, f"grads_reduce_{ffn}"))
            continue
        if ffn not in kinds:
            continue
        base = ("transient", "gather_current", "layer")
        g = (grads, "reduce_held", f"freed_{ffn}")
        out[ffn] = [
            alt(*base, "gather_prefetch", "attention"),                                    # forward
            alt(*base, "gather_prefetch", "attention_saved", ffn),                         # forward
            alt(*base, prefetch_bwd, *g, "attention_saved", ffn, f"grads_ffn_{ffn}"),      # FFN backward
            alt(*base, prefetch_bwd, *g, "attention", f"grads_attention_{ffn}"),           # attention kernel bwd
            alt(*base, prefetch_bwd, *g, f"grads_tail_{ffn}"),                             # input projections bwd
        ]
    return out


def symbol_values(shape: ModelShape, launch: Launch, *, host_budget: int | None = None) -> dict:
    """Every shared symbol at this launch: the values each term's formula is evaluated at."""
    W, E_p, P, N = launch.ranks, launch.ep, launch.ring, launch.tokens_per_rank
    theta = -(-shape.params // W)
    v_shard = -(-shape.vocab // P)
    values = {
        sym.N: N, sym.N_max: N, sym.H: shape.hidden, sym.V: shape.vocab, sym.P: P, sym.W: W, sym.L: shape.layers,
        sym.E: max(shape.experts, 1), sym.E_p: E_p, sym.k: max(shape.top_k, 1), sym.I: max(shape.expert_hidden, 1),
        sym.I_f: max(shape.dense_hidden, 1), sym.I_s: max(shape.shared_hidden, 1),
        sym.A_q: shape.heads, sym.A_kv: shape.kv_heads, sym.D_h: shape.head_dim,
        sym.b: launch.b, sym.b_acc: launch.b_acc, sym.b_idx: 8,
        sym.Theta: theta, sym.Theta_blk: shape.block_params,
        sym.c: min(launch.resolved("dispatch_cap"), N),
        sym.C: min(launch.resolved("vocab_block"), v_shard),
        sym.beta: max(1, min(launch.resolved("optimizer_bucket"), theta)), sym.S: launch.resolved("optimizer_slots"),
        # as the dispatch pass gives the op: None is e = E / E_p, never more than the other ranks' experts nor than
        # LLEP's planner lends one helper for N k routes per rank
        sym.s_b: pl.borrowed_slot_count(launch.dispatch_borrowed_slots, shape.experts // E_p, E_p,
                                        N * max(shape.top_k, 1)),
        sym.R: (E_p if launch.routing == "worst" else 1) * N * max(shape.top_k, 1),
    }
    values.update({G_lead: shape.leading_dense_params, G_dense_min: shape.min_dense_block_params,
                   G_moe_min: shape.min_moe_block_params, L_moe: shape.moe_layers})
    values[sym.L_off] = offloaded_boundaries(shape, launch, host_budget) if "sco" in launch.operators else 0
    return values


def optimizer_host_bytes(shape: ModelShape, launch: Launch) -> int:
    """Host bytes of OffloadStreamAdamW's state on one rank (0 when it is off)."""
    if "offload_adamw" not in launch.operators:
        return 0
    return sym.evaluate(oa.offload_adamw_host_bound(), {sym.Theta: -(-shape.params // launch.ranks),
                                                        sym.b_acc: launch.b_acc})


def offloaded_boundaries(shape: ModelShape, launch: Launch, host_budget: int | None) -> int:
    """L_off: boundaries SCO's greedy walk offloads with what the host budget leaves after the optimizer state."""
    if host_budget is None:
        return shape.layers
    left = max(host_budget - optimizer_host_bytes(shape, launch), 0)
    boundary = launch.tokens_per_rank * shape.hidden * launch.b
    fitting = sco.planned_offloaded_layers([boundary] * shape.layers, left)
    return fitting if launch.sco_max_layers is None else min(fitting, launch.sco_max_layers)


def attention_bound(part: str = "peak") -> sympy.Expr:
    """Peak bytes of one sequence-to-head attention forward + backward, or (part="saved") what it holds from its
    forward to its backward (runtime/seq_to_head.py). Kept per process: the peak's sympy Max of three sums takes
    ~0.15 s to build, and a plan reads it three times (its terms, the exchange terms, the reference budget)."""
    return _attention_bound(part)


@functools.lru_cache(maxsize=None)
def _attention_bound(part: str) -> sympy.Expr:
    # torchtitan's attention modules hold q/k/v only through the op and pass the output gradient on (measured)
    return importlib.import_module("boundpass.runtime.seq_to_head").seq_to_head_bound(part=part,
                                                                                      caller_keeps_inputs=False)


def _terms(shape: ModelShape, launch: Launch) -> tuple:
    """(name, formula, kind, knob, float function) of every term at this launch; formulas in the shared symbols."""
    branch = rd.choose_branch(launch.tokens_per_rank, shape.vocab, launch.ring) if "ring_dtp" in launch.operators \
        else ""
    terms = term_formulas(shape.dense_layers > 0, shape.moe_layers > 0, shape.shared_hidden > 0,
                           frozenset(launch.operators), launch.routing, launch.b < launch.b_acc, branch,
                           shape.tied_embeddings, launch.grad_accumulation > 1, _first_dense_only(shape),
                           launch.fsdp_param_b or 0, launch.loss_chunks if "ring_dtp" not in launch.operators else 1,
                           launch.layout == "dp")
    if launch.layout == "dp":
        terms = _local_attention(terms)
    if uses_wide_trace(shape, launch):
        terms = _wide_traced(terms, shape, exchange=launch.layout == "mop", tiles=launch.attention_tiles,
                             batch=launch.sequences_per_step or 1)
    else:
        # the dispatch's forward and backward apart are for the wide trace's sub-phases only
        terms = tuple(t for t in terms if t[2] not in ("dispatch_forward", "dispatch_backward"))
        if uses_trace(shape, launch):
            blocks = tuple(t for t in shape.traced if t[0] in ("dense", "moe"))
            head = traced_head(shape, launch) if launch.loss_chunks == 1 else ()
            # the traced head holds its own weight gradients as its backward writes them: grad_head (only ever in
            # the head's phase) would count them from the head's start
            drop = _TRACED_KINDS | ({"head", "grad_head"} if head else set())
            terms = tuple(t for t in terms if t[2] not in drop) + _traced_terms(blocks) + head
    if shape.buffer_bytes:
        positioned = shape.rope_bytes_per_position if launch.sequences_per_step else 0
        terms += _buffer_term(shape.buffer_bytes - positioned * shape.rope_positions, positioned,
                              launch.ranks, launch.sequences_per_step or 1)
    if shape.shared_block_input_bytes:
        terms += _shared_inputs_term(shape.shared_block_input_bytes)
    if shape.param_tensors and "offload_adamw" not in launch.operators:
        terms += _step_counter_term(shape.param_tensors)
    if launch.held_batch_per_token:
        terms += _held_batch_term(launch.held_batch_per_token)
    if launch.attention_tiles:
        terms += _tiles_host_term()
    return terms


def trainer_held_batch(ranks: int) -> int:
    """Bytes per token of N of the batch torchtitan's trainer holds on every rank under the MoP layout through a
    whole step, optimizer step included (measured at torch's allocator on 4 gloo ranks by a counting allocator,
    boundpass.measure.counting_allocator, at N = 256 and 853): six int64 storages of the whole batch of W·N tokens
    (the data generator's input ids and labels, the trainer's input dict, the global positions and their copies) and
    three of this rank's N (its token ids, positions and labels): 8·(6·W + 3). The recipe's check and ``plan`` count
    it, with ``TRAINER_STEP_SCALARS`` beside it."""
    return 8 * (6 * ranks + 3)


# the scalars the training loop holds at the optimizer step beside the batch (the loss and its detached copy, the
# local and global valid-token counts, the gradient norm): 64 B measured with ``trainer_held_batch``
TRAINER_STEP_SCALARS = 64


@functools.lru_cache(maxsize=None)
def _held_batch_term(per_token: int) -> tuple:
    value = per_token * sym.N + TRAINER_STEP_SCALARS
    return (("the batch and scalars the training loop holds through the step (token ids, labels, positions, loss)",
             value, "persistent", "a shorter context or a smaller batch", _lambdify(value)),)


@functools.lru_cache(maxsize=None)
def _step_counter_term(tensors: int) -> tuple:
    # torch.optim.AdamW's state['step'] is a float32 scalar tensor per parameter, on the parameter's device when
    # fused or capturable: one 4-byte row per parameter tensor, which the traced head checks against torch's allocator
    value = sympy.Integer(4 * tensors)
    return (("optimizer step counters on device (torch AdamW: one fp32 scalar per parameter tensor)", value,
             "persistent", "enable offload_adamw", _lambdify(value)),)


@functools.lru_cache(maxsize=None)
@functools.lru_cache(maxsize=None)
def _shared_inputs_term(per_token: int) -> tuple:
    # every checkpointed block holds them as inputs for its recompute, so they live from the first block's forward to
    # the last block's backward, the head's peak included
    value = per_token * sym.N
    return (("per-token inputs every block takes (position embeddings computed once per step, position ids)",
             value, "transient", "a shorter context", _lambdify(value)),)


@functools.lru_cache(maxsize=None)
def _buffer_term(fixed: int, per_position: int, ranks: int, sequences: int) -> tuple:
    """The model's buffers: ``fixed`` bytes, plus ``per_position`` bytes for each position of one sequence of the
    step (N·W / G) when the caller sizes the RoPE tables to the sequence (torchtitan's trainer)."""
    if not per_position:
        value = sympy.Integer(fixed)
        return (("buffers as the model builds them (RoPE tables at max_seq_len, router statistics; not sharded)",
                 value, "persistent", "a shorter max_seq_len (torchtitan keeps a RoPE table per block)",
                 _lambdify(value)),)
    value = fixed + per_position * sympy.ceiling(sym.N * ranks / sequences)
    return (("buffers: RoPE tables at the sequence length (N·W/G positions, as torchtitan's trainer sizes them), "
             "router statistics; not sharded", value, "persistent", "a shorter context", _lambdify(value)),)


# the hand-written terms of a block's activations the trace replaces (docs/plan.md: which terms are traced)
_TRACED_KINDS = frozenset({"layer", "attention", "attention_saved", "dense", "moe"})
_SUBPHASES = ("forward", "ffn_backward", "attention_backward", "tail_backward")


def uses_trace(shape: ModelShape, launch: Launch) -> bool:
    """The traced block activations stand for the hand-written ones on one rank (W = E_p = 1): there the trace is
    the schedule that runs (torchtitan's EP = 1 dispatch has routing-independent shapes, the attention has no
    exchange). Under W > 1 the sequence-to-head exchange and the routing-set standard-EP / PipelinedLLEP rows
    are not in a one-rank trace: the hand-written terms stay (docs/plan.md). A launch in another dtype than the
    blocks were traced at (``traced_b``) uses the hand-written terms too."""
    return bool(shape.traced) and launch.ranks == 1 and launch.ep == 1 and launch.b == shape.traced_b


def uses_wide_trace(shape: ModelShape, launch: Launch) -> bool:
    """Under W > 1 the traced blocks without their routed experts and weight gradients (kinds "*_wide") stand
    for the hand-written glue, attention, dense FFN, shared experts and router terms; the routed experts (EP's
    routing-set rows, or PipelinedLLEP's bound), the sequence-to-head exchange, ZeRO-3's units and unsharded
    gradients stay hand-written (docs/plan.md)."""
    return launch.ranks > 1 and launch.b == shape.traced_b and any(t[0].endswith("_wide") for t in shape.traced)


@functools.lru_cache(maxsize=None)
def _local_attention(terms: tuple) -> tuple:
    """Data parallelism: each rank's attention is the one-rank schedule (all heads of its own sequences, no
    exchange): the hand-written attention terms at W = 1 (the ZeRO-3 terms keep W)."""
    out = []
    for name, formula, kind, knob, fn in terms:
        if kind in ("attention", "attention_saved"):
            formula = sympy.sympify(formula).subs(sym.W, 1)
            fn = _lambdify(formula)
        out.append((name, formula, kind, knob, fn))
    return tuple(out)


def _wide_traced(terms: tuple, shape: ModelShape, *, exchange: bool = True, tiles: int = 0, batch: int = 1) -> tuple:
    blocks = tuple((t[0][:-len("_wide")], t[1], t[2]) for t in shape.traced if t[0].endswith("_wide"))
    split = any(t[2] == "dispatch_backward" for t in terms)  # PipelinedLLEP: its forward and backward apart
    kept = []
    own_grads = {f"grads_{part}_{ffn}" for part in ("ffn", "attention", "tail") for ffn in ("dense", "moe")}
    for t in terms:
        if t[2] in own_grads:  # the wide trace holds them as the block's backward writes them
            continue
        if t[2] == "moe" and t[0].startswith("expert dispatch"):
            if not split:  # the routed experts: their own bound, by hand (standard EP: one, forward + backward)
                kept.append((t[0], t[1], "dispatch", t[3], t[4]))
        elif t[2] == "dispatch_backward":
            kept.append((t[0], t[1], "dispatch", t[3], t[4]))
        elif t[2] not in _TRACED_KINDS:
            kept.append(t)
    kinds = {t[0] for t in blocks}
    exchange_part = (tiles_exchange_terms(tiles, batch) if tiles else exchange_terms()) if exchange else ()
    return tuple(kept) + _traced_terms(blocks, own_grads=False) + exchange_part + _beside_wide_trace(
        "dense" in kinds, "moe" in kinds)


@functools.lru_cache(maxsize=None)
def _beside_wide_trace(dense: bool, moe: bool) -> tuple:
    """What a block's backward holds beside its wide trace, which holds the block's own unsharded gradients as its
    backward writes them and the tail's activations (so the hand-written ``grads_ffn/attention/tail`` terms are
    left out: ``_wide_traced``): a MoE block's routed experts, stood in there, gathered with their unsharded
    gradients from its attention's backward on; and, as a sub-phase of its own, the reduce-scatter after the block
    (FSDP2 reshards it and copies its unsharded gradients into the reduce-scatter input: the gradients twice,
    beside the gradient of the block's input and the incoming one)."""
    m = sympy.Min(1, sym.W - 1)
    out = []
    for ffn, on in (("dense", dense), ("moe", moe)):
        if not on:
            continue
        own = 2 * _routed_experts(ffn == "moe")
        if ffn == "moe":
            for part in ("attention", "tail"):
                out.append((f"a moe block's routed experts gathered with their unsharded gradients (its {part}'s "
                            "backward)", m * own, f"grads_{part}_moe", "fewer parameters per block; not a launch "
                            "knob", _lambdify(m * own)))
        reduce = m * (sym.Theta_blk * sym.b + own) + 2 * sym.N * sym.H * sym.b
        out.append((f"a {ffn} block's gradients reduced (unsharded gradients + reduce-scatter input, its input's "
                    "gradient)", reduce, f"grads_reduce_{ffn}", "fewer parameters per block; not a launch knob",
                    _lambdify(reduce)))
    return tuple(out)


def _routed_experts(has_moe: bool) -> sympy.Expr:
    """Bytes of this rank's E/E_p routed experts (one copy: weights, or their gradients)."""
    return (sym.E / sym.E_p) * 3 * sym.I * sym.H * sym.b * int(has_moe)


@functools.lru_cache(maxsize=None)
def exchange_terms() -> tuple:
    """What sequence-to-head attention holds on W > 1 ranks beyond its one-rank schedule (the traced one): its
    bound at W less its bound at W = 1 (exchange buffers, gathered copies, k/v replication), for its own peak
    and for what it keeps while the FFN runs; and for the attention's backward sub-phase, its backward's bound at W
    less its backward's at W = 1 (``attention_exchange_backward``).

    Why the backward's own difference holds there: the trace's attention-backward value is at least what one rank
    holds at the kernel's backward, bwd(1) + the rest of the block; at W > 1 the kernel's backward holds bwd_kernel(W)
    + the same rest, and the exchanges after it hold bwd_exchange(W) + no more than that rest (nothing else is made
    between them, the kernel's saved tensors are freed); so W > 1 holds at most max(bwd(W) - bwd(1), 0) over the
    trace in that sub-phase. Where the caller drops its output and output gradient (A_kv = A_q) that is 0: the
    gathered copies take the place of the one-rank tensors one for one (measured: docs/plan.md)."""
    out = []
    for part, kind, what in (("peak", "attention_exchange", "fwd + bwd"),
                             ("saved", "attention_exchange_saved", "held while the FFN runs")):
        full = attention_bound(part)
        parts = [0, full - full.subs(sym.W, 1)]
        if part == "peak":
            saved = attention_bound("saved")
            parts.append(saved - saved.subs(sym.W, 1))
        # none of the parts dominates another: built unevaluated (sym.max_kept; test_plan.py checks it)
        extra = sym.max_kept(*parts)
        out.append((f"attention exchange beyond one rank (sequence-to-head at W > 1, {what}): bound(W) - bound(1)",
                    extra, kind, "a shorter context or more ranks W", _lambdify(extra)))
    backward = attention_bound("backward")
    extra = sym.max_kept(0, backward - backward.subs(sym.W, 1))
    out.append(("attention exchange beyond one rank (sequence-to-head at W > 1, its backward): bwd(W) - bwd(1)",
                extra, "attention_exchange_backward", "a shorter context or more ranks W", _lambdify(extra)))
    return tuple(out)


def _tiles_bound(part: str, tiles: int, batch: int) -> sympy.Expr:
    """The tiles op's device bound (runtime/seq_to_head_tiles.py) in the composed symbols: D_v at D_h (an upper bound:
    D_v <= D_h), C_s at the launch's tile, one sequence of W N / batch positions."""
    st = importlib.import_module("boundpass.runtime.seq_to_head_tiles")
    ca = importlib.import_module("boundpass.runtime.chunked_attention")
    bound = st.seq_to_head_tiles_bound(part, mixed_precision=False, gqa=True, fused=True, padded=True, rows=tiles)
    return bound.xreplace({ca.D_v_sym: sym.D_h, ca.C_s_sym: sympy.Integer(tiles),
                           ca.L_seq_sym: sym.N * sym.W / batch})


@functools.lru_cache(maxsize=None)
def tiles_exchange_terms(tiles: int, batch: int) -> tuple:
    """``exchange_terms`` for the attention in tiles: what the op holds at W ranks beyond its one-rank form (the
    traced one), forward and backward; the pieces the all-to-alls receive into (the one-rank form writes its pieces
    without one), less the smaller tiles of A / W heads. What it keeps from its forward to its backward (its output,
    log-sum-exp and ticket) is the same at every W."""
    out = []
    fwd, bwd = (_tiles_bound(part, tiles, batch) for part in ("forward", "backward"))
    one = {sym.W: 1}
    extra_bwd = sym.max_kept(0, bwd - bwd.xreplace(one))
    extra = sym.max_kept(0, fwd - fwd.xreplace(one), bwd - bwd.xreplace(one))
    for value, kind, what in ((extra, "attention_exchange", "fwd + bwd"),
                              (sympy.Integer(0), "attention_exchange_saved", "held while the FFN runs"),
                              (extra_bwd, "attention_exchange_backward", "its backward")):
        out.append((f"attention exchange beyond one rank (sequence-to-head in tiles of {tiles}, {what}): "
                    "bound(W) - bound(1)", value, kind, "a shorter context or more ranks W", _lambdify(value)))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _tiles_host_term() -> tuple:
    st = importlib.import_module("boundpass.runtime.seq_to_head_tiles")
    ca = importlib.import_module("boundpass.runtime.chunked_attention")
    value = st.seq_to_head_tiles_host_bound("backward").xreplace({ca.D_v_sym: sym.D_h})
    return (("attention q, k, v, output and the backward's dO, dq, dk, dv of the whole sequence on host "
             "(sequence-to-head tiles; one attention at a time)", value, "host",
             "a larger host budget, or the whole-tensor exchange (attention off)", _lambdify(value)),)


def traced_head(shape: ModelShape, launch: Launch) -> tuple:
    """The traced loss head of this launch's schedule (Ring-DTP when it is on, else full logits): one term of
    kind "head" (the head's phase stays; the head's own gradients are in it), or () when that head was not traced."""
    which = "ring_dtp" if "ring_dtp" in launch.operators else "full_logits"
    expr = next((t[2] for t in shape.traced if t[0] == "head" and t[1] == which), None)
    return () if expr is None else _traced_head_term(which, expr)


@functools.lru_cache(maxsize=None)
def _traced_head_term(which: str, expr) -> tuple:
    what = "Ring-DTP op, its declared workspace" if which == "ring_dtp" else "full logits, torchtitan's loss"
    knob = "a smaller strip C (--vocab-block)" if which == "ring_dtp" else "enable ring_dtp (never materializes [N, V])"
    return ((f"traced head: final norm + vocab projection + loss ({what}), fwd + bwd (block_trace, one rank)",
             expr, "head", knob, _lambdify(expr)),)


@functools.lru_cache(maxsize=None)
def _traced_terms(traced: tuple, own_grads: bool = True) -> tuple:
    out = []
    for block, phase, expr in traced:
        name = (f"traced {block} block, {phase.replace('_', ' ')}: activations + its own gradients as backward "
                "produces them (block_trace, one rank)") if own_grads else (
                f"traced {block} block, {phase.replace('_', ' ')}: activations + its unsharded gradients, routed "
                "experts apart (block_trace, one rank; W > 1 adds the hand-written dispatch and exchange)")
        out.append((name, expr, f"traced_{block}_{phase}", "a shorter context", _lambdify(expr)))
    for block in sorted({t[0] for t in traced}) if own_grads else ():
        # the gradient terms count every block's gradient; the running block's own are in its trace (as backward
        # writes them), so one block's (the smallest of its kind) leaves the gradient term there
        own = -(G_dense_min if block == "dense" else G_moe_min) * sym.b
        out.append((f"the running {block} block's own gradients (in its trace, not in the gradient term)", own,
                    f"traced_{block}_own_grads", "", _lambdify(own)))
    return tuple(out)


def _first_dense_only(shape: ModelShape) -> bool:
    """The model's only dense block is its first (deepseek's debug model): nothing but the embedding precedes it."""
    return shape.dense_layers == 1 and shape.leading_dense_params > 0


@functools.lru_cache(maxsize=None)
def term_formulas(has_dense: bool, has_moe: bool, has_shared: bool, ops: frozenset, routing: str, mixed: bool,
                   branch: str, tied: bool = False, accumulate: bool = False, first_dense_only: bool = False,
                   fsdp_param_b: int = 0, loss_chunks: int = 1, reduce_held: bool = False) -> tuple:
    out = _term_list(has_dense, has_moe, has_shared, ops, routing, mixed, branch, tied, accumulate, first_dense_only,
                     fsdp_param_b, loss_chunks, reduce_held)
    return tuple((name, formula, kind, knob, _lambdify(formula)) for name, formula, kind, knob in out)


def _term_list(has_dense, has_moe, has_shared, ops, routing, mixed, branch, tied=False, accumulate=False,
               first_dense_only=False, fsdp_param_b=0, loss_chunks=1, reduce_held=False) -> list:
    N, H, E, E_p, I, I_f = sym.N, sym.H, sym.E, sym.E_p, sym.I, sym.I_f
    b, b_acc, W, Theta = sym.b, sym.b_acc, sym.W, sym.Theta
    out = [("parameters (ZeRO-3 shard, Θ/W)", Theta * b, "persistent", "more ranks W (ZeRO-3 shards Θ/W)")]
    # Gradients by when backward produces them (ZeRO-3 shards; Θ/W rounds up, the embedding's share down, so the
    # split never undercounts): the embedding's last (absent while any block runs), the head's first (the only
    # one while the head runs). Tied embeddings: one weight, its gradient starts in the head. Accumulating
    # microbatches: every gradient lives through the whole step (persistent).
    emb = 0 if tied else sympy.floor(sym.V / W) * H * b
    head_grad = (sympy.ceiling(sym.V / W) * H + sympy.ceiling(H / W)) * b
    if accumulate:
        out.append(("gradients (ZeRO-3 shard, accumulated over microbatches)", Theta * b, "persistent",
                    "more ranks W (ZeRO-3 shards Θ/W)"))
    else:
        out.append(("gradients of the blocks and head (ZeRO-3 shard)", Theta * b - emb, "grad",
                    "more ranks W (ZeRO-3 shards Θ/W)"))
        out.append(("gradient of the embedding (ZeRO-3 shard; produced last in backward)", emb, "grad_embedding",
                    "more ranks W (ZeRO-3 shards Θ/W)"))
        # The embedding's backward, the last of backward, under ZeRO-3 (W > 1): FSDP2 gathers its unit again
        # (V·H·b), autograd writes its whole unsharded gradient (an embedding's gradient is dense: V·H·b), and
        # after resharding the weight FSDP2 copies that gradient into the reduce-scatter input, in the reduce dtype
        # (fp32 under mixed precision); the reduce-scatter output is the gradient shard above. Measured under the
        # recipe's MoP layout at V = 32,768: the step's peak is here (tests/recipes/test_recipe_mop.py). Tied embeddings
        # share the head's unit: not modelled apart (the head terms count its gathered weight).
        if not tied:
            reduce_b = b_acc if mixed else b
            copies = b + reduce_b
            if fsdp_param_b:  # FSDP2 casts (see Launch.fsdp_param_b): three copies in its dtype + the reduce input
                copies = 3 * fsdp_param_b + b
            out.append(("embedding backward under ZeRO-3 (gathered weight, unsharded gradient, reduce-scatter input)",
                        sympy.Min(1, W - 1) * sym.V * H * copies + N * H * b, "embedding_backward",
                        "not a launch knob (an embedding gradient is dense V×H under FSDP2); a smaller vocabulary"))
        out.append(("gradient of the head (lm_head + final norm shard; while the head runs)", head_grad,
                    "grad_head", "more ranks W (ZeRO-3 shards Θ/W)"))
        # while block i runs backward, the blocks before it have no gradient yet, nor (W > 1) block i's own shard
        own = sympy.Min(1, W - 1) * b
        if has_dense:
            out.append(("gradients live while a dense block runs (less its own shard)",
                        Theta * b - emb - own * sympy.floor(G_dense_min / W), "grad_dense",
                        "more ranks W (ZeRO-3 shards Θ/W)"))
        if has_moe:
            out.append(("gradients live while a MoE block runs (less the leading dense blocks' and its own shard)",
                        Theta * b - emb - b * sympy.floor(G_lead / W) - own * sympy.floor(G_moe_min / W),
                        "grad_moe", "more ranks W (ZeRO-3 shards Θ/W)"))
        out += _boundaries_freed(has_dense, has_moe, first_dense_only)
    adamw = oa.reference_adamw_bound(mixed_precision=mixed) - 2 * Theta * b  # its master + moments, not weights/grads
    if "offload_adamw" in ops:
        out.append(("optimizer staging (OffloadStreamAdamW, S·β)", oa.offload_adamw_staging_bound(), "step",
                    "a smaller bucket β (--optimizer-bucket) or S = 1 (--optimizer-slots)"))
        out.append(("optimizer state on host (fp32 master, exp_avg, exp_avg_sq)", oa.offload_adamw_host_bound(),
                    "host", "more ranks W or a larger host budget"))
    else:
        out.append(("optimizer state on device (AdamW master + moments)", adamw, "persistent",
                    "enable offload_adamw (moves it to the host)"))
    # ZeRO-3 (W > 1) under FSDP2, per block: the block's own gathered parameters; the unit FSDP2 prefetches (the
    # block after it in forward, the block before it in backward with that block's experts, or, before the first
    # block in backward, the embedding); and the block's unsharded gradients, which backward produces in order:
    # the FFN's first (while the FFN runs backward only they exist), then the attention output projection's (at
    # the attention kernel's backward: FFN's + wo's + the norm's), then the rest (the attention's input
    # projections, after its kernel freed what it saved). Forward holds no gradients. The block's routed experts
    # (gathered weights and unsharded gradients) are in the dispatch term while the FFN runs and added to the
    # attention's sub-phases of a MoE block, which run while FSDP2 still holds them.
    m = sympy.Min(1, W - 1)
    experts = _routed_experts(has_moe)
    out.append(("ZeRO-3 gathered block (this block)", m * sym.Theta_blk * b, "gather_current",
                "fewer parameters per block; not a launch knob"))
    out.append(("ZeRO-3 prefetched unit (the next / previous block with its experts, or the embedding)",
                m * sympy.Max(sym.Theta_blk * b + experts, sym.V * H * b), "gather_prefetch",
                "fewer parameters per block; not a launch knob"))
    if reduce_held:
        # stock FSDP2 keeps a unit's reduce-scatter input (its unsharded gradients, flattened) until the next unit's
        # reduce-scatter is issued, so through the whole backward of the block after it in backward (measured at
        # FSDP2's post_backward_reduce in bench/reach.py's stock runs); boundpass's gloo release frees it in the call
        # (the MoP recipe: boundpass/backend/gloo_release.py), hence the data-parallel (stock) layout only
        out.append(("FSDP2's reduce-scatter input of the unit before in backward (held through this block's backward)",
                    m * sympy.Max(sym.Theta_blk * b + experts, sym.V * H * b), "reduce_held",
                    "fewer parameters per block; not a launch knob"))
    if first_dense_only:
        # the only dense block is block 0: in backward FSDP2 prefetches only the embedding before it
        out.append(("ZeRO-3 prefetched unit in block 0's backward (the embedding)", m * sym.V * H * b,
                    "gather_prefetch_first", "not a launch knob"))
    wo = sym.A_q * sym.D_h * H + H  # output projection (+ bias), an upper bound: D_v <= D_h
    q_io = N * sym.A_q * sym.D_h * b + 2 * N * sym.A_kv * sym.D_h * b  # q, k, v (or their gradients) on the rank
    for ffn, present, ffn_params, own in (("dense", has_dense, 3 * I_f * H + H, 0),
                                         ("moe", has_moe, 3 * sym.I_s * H * int(has_shared) + E * H + H,
                                          2 * experts)):
        if not present:
            continue
        out.append((f"unsharded gradients of a {ffn} block's FFN (while its FFN runs backward)",
                    m * ffn_params * b, f"grads_ffn_{ffn}", "fewer parameters per block; not a launch knob"))
        out.append((f"unsharded gradients of a {ffn} block at its attention kernel's backward (FFN + wo + norm)"
                    + (", its experts gathered with their gradients" if own else ""),
                    m * ((ffn_params + wo + H) * b + own), f"grads_attention_{ffn}",
                    "fewer parameters per block; not a launch knob"))
        # after the attention's backward: the q/k/v gradients it returned (and their copies before RoPE), the
        # input projections' inputs and gradients, MLA's low-rank intermediates (measured at W = 2: the tail's
        # activations are below one q_io; docs/plan.md)
        out.append((f"a {ffn} block's last backward (all its unsharded gradients, q/k/v gradients, the "
                    "projections' inputs)", m * (sym.Theta_blk * b + own + 2 * q_io + 3 * N * H * b),
                    f"grads_tail_{ffn}", "fewer parameters per block; not a launch knob"))
    out.append(("checkpoint boundaries (device) + SCO prefetch window", sco.sco_device_bound(), "transient",
                "enable sco / a larger host budget (offloads more boundaries), or a shorter context"))
    if "sco" in ops:
        out.append(("checkpoint boundaries offloaded (SCO host pool)", sco.sco_host_bound(), "host",
                    "a larger host budget, or a shorter context"))
    out.append(("attention (sequence-to-head all-to-all), fwd + bwd", attention_bound(), "attention",
                "a shorter context or more ranks W"))
    out.append(("attention saved for backward (live while the FFN runs)", attention_bound("saved"),
                "attention_saved", "a shorter context or more ranks W"))
    # W = 1: the output projection saves its own contiguous copy of the kernel's output (torchtitan reshapes the
    # [B, N, heads, D] output; the kernel keeps its own for backward); at W > 1 that copy is the exchange's result,
    # already the attention bound's output (traced at full scale: docs/plan.md)
    out.append(("attention output as the output projection saves it (W = 1: a copy)",
                (1 - sympy.Min(1, W - 1)) * N * sym.A_q * sym.D_h * b, "attention_saved",
                "a shorter context or more ranks W"))
    # bf16/fp16: each of the block's two RMSNorms saves its input upcast to fp32 (traced at full scale)
    upcast = 2 * N * H * b_acc if mixed else 0
    out.append(("block glue (norm outputs, residual sum, their grads; rstd; fp32 norm inputs if mixed)",
                6 * N * H * b + 2 * N * b_acc + upcast, "layer", "a shorter context"))
    if has_dense:
        out.append(("dense FFN activations (recompute, fwd + bwd)", 2 * N * (H + 3 * I_f) * b, "dense",
                    "a shorter context"))
    if has_moe:
        if has_shared:
            out.append(("shared experts activations (fwd + bwd)", 2 * N * (H + 3 * sym.I_s) * b, "moe",
                        "a shorter context"))
        out.append(("router scores (fp32, fwd + bwd)", 2 * N * E * b_acc, "moe", "a shorter context"))
        # The runtime bounds count this rank's E/E_p experts and their gradients. Under ZeRO-3 (W > 1) those are
        # the gathered, unsharded copies (transient); on one rank they are the parameters and gradients
        # themselves, already persistent: subtract them there, or they would be counted twice.
        own_experts = (1 - sympy.Min(1, W - 1)) * 2 * (E / E_p) * 3 * I * H * b
        if "pipelined_llep" in ops:
            knob = "a smaller chunk cap c (--dispatch-cap) or fewer borrowed slots s_b (--dispatch-borrowed-slots)"
            out.append(("expert dispatch (PipelinedLLEP, routing-independent)",
                        pl.pipelined_llep_bound(mixed_precision=mixed) - own_experts, "moe", knob))
            # its forward and backward apart, for the traced phases (W > 1, _wide_traced): a forward sub-phase
            # (FullAC's recompute included) holds the forward op, not the gradients its backward makes
            for part in ("forward", "backward"):
                out.append((f"expert dispatch (PipelinedLLEP, routing-independent), its {part}",
                            pl.pipelined_llep_bound(mixed_precision=mixed, part=part) - own_experts,
                            f"dispatch_{part}", knob))
        else:
            # torchtitan's GroupedExperts runs the expert MLP in bf16 whatever the parameters' dtype (it casts the
            # routed rows and the expert weights with .bfloat16()): standard_ep_bound counts the received rows and
            # MLP activations (R·(2H + 4I), and their gradients) at b; here they are at b_e = Min(b, 2), and the
            # bf16 weight copies the grouped matmuls save (and their gradients) are added when the parameters are
            # wider than bf16 (measured: docs/plan.md)
            b_e = sympy.Min(b, 2)
            rows_at_bf16 = 2 * sym.R * (2 * H + 4 * I) * (b - b_e)
            weight_copies = 2 * (E / E_p) * 3 * I * H * b_e * sympy.Min(1, b - b_e)  # none when b is bf16 already
            knob = "enable pipelined_llep (a bound that does not depend on routing)"
            out.append((f"expert dispatch (standard EP as torchtitan runs it: bf16 experts, {routing}-case routing R)",
                        pl.standard_ep_bound() - own_experts - rows_at_bf16 + weight_copies, "moe", knob))
            # its forward alone, for the traced forward sub-phases (W > 1, _wide_traced): what it saves, once
            out.append((f"expert dispatch (standard EP as torchtitan runs it, {routing}-case routing R), its forward",
                        pl.standard_ep_bound("forward") - (own_experts + rows_at_bf16 - weight_copies) / 2,
                        "dispatch_forward", knob))
    out.append(("final norm (fp32 upcast + output, fwd + bwd)", N * H * (b + b_acc), "head", "a shorter context"))
    if "ring_dtp" in ops:
        out.append((f"vocab projection + loss (Ring-DTP, move {branch})",
                    rd.ring_dtp_bound(branch, mixed_precision=mixed, count_weight_shard=False), "head",
                    "a smaller strip C (--vocab-block) or a larger ring P"))
    else:
        # reference_bound counts the head's weight shard (a parameter, persistent here) and, with no gather
        # (P = 1), the whole weight's gradient (the gradient-of-the-head term): subtract both so neither counts
        # twice
        shard = sympy.ceiling(sym.V / sym.P) * H * b
        full = rd.reference_bound(mixed_precision=mixed) - shard * (2 - sympy.Min(1, sym.P - 1))
        if loss_chunks == 1:
            out.append(("vocab projection + loss (full logits)", full, "head",
                        "enable ring_dtp (never materializes [N, V])"))
        else:
            out.append((f"vocab projection + loss (torchtitan's chunked loss, {loss_chunks} chunks)",
                        chunked_loss_bound(full, loss_chunks), "head",
                        "more loss chunks (--loss.num_chunks), or enable ring_dtp"))
    return out


def _boundaries_freed(has_dense: bool, has_moe: bool, first_dense_only: bool) -> list:
    """What the boundary term and the gradient term never hold at once in backward (no boundary offloaded).

    The boundary term counts every block's checkpoint boundary (L·N·H·b) and the gradient term every block's
    gradient shard but the running one's. In backward a block's boundary is freed when its backward ends, and only
    then is its gradient shard written: below k finished MoE blocks, k boundaries are gone and the other
    L_moe - 1 - k MoE blocks have no gradient yet, so both terms together overstate the step by at least
    k·N·H·b + (L_moe - 1 - k)·g >= (L_moe - 1)·Min(N·H·b, g), g the smallest MoE block's shard (measured under the
    MoP layout on 4 ranks: one boundary fewer per finished block, its gradient shard more; docs/plan.md). A dense
    block that is the model's only one and its first runs last in backward: every other boundary is gone then.
    With boundaries offloaded (SCO: L_off > 0) the device holds another set: nothing is taken."""
    N, H, b = sym.N, sym.H, sym.b
    resident = 1 - sympy.Min(1, sym.L_off)
    out = []
    if has_moe:
        shard = b * sympy.floor(G_moe_min / sym.W)
        out.append(("boundaries of the finished MoE blocks above, against the gradients not yet written below",
                    -resident * (L_moe - 1) * sympy.Min(N * H * b, shard), "freed_moe", ""))
    if has_dense and first_dense_only:
        out.append(("boundaries of every block above the first (dense) block, freed before its backward",
                    -resident * (sym.L - 1) * N * H * b, "freed_dense", ""))
    return out


def chunked_loss_bound(full: sympy.Expr, chunks: int) -> sympy.Expr:
    """torchtitan's ChunkedLossWrapper at N tokens: the full-logits head's bound at one chunk's tokens
    (ceil(N / chunks): its logits, log-softmax and their gradients, the head's weight and its gradient), plus what
    spans the chunks: the hidden states, their chunks (copies when a batch holds several sequences: the split along
    the sequence is then not contiguous), the fp32 gradient accumulator the chunks' gradients are written into, and
    the labels and their chunks; and the chunk's logits, which the wrapper's loop holds through the chunk's
    backward (the full-logits head's caller drops them before its backward)."""
    N, n = sym.N, sympy.ceiling(sym.N / chunks)
    return full.subs(N, n) + n * sym.V * sym.b + N * sym.H * (2 * sym.b + sym.b_acc) + 2 * N * sym.b_idx


def compose(shape: ModelShape, launch: Launch, *, budget: int, host_budget: int | None = None,
            fast: bool = False) -> ComposedBudget:
    """The per-rank budget of one training step: every term's formula evaluated at this launch (bytes).

    fast: evaluate through a cached float lambdification of each formula (for searches; ~1e-12 relative error)
    instead of exact sympy substitution.
    """
    check_launch(shape, launch)
    values = symbol_values(shape, launch, host_budget=host_budget)
    table = ComposedBudget(budget=budget, host_budget=host_budget)
    args = tuple(values.get(s, 1) for s in _ORDER) if fast else None
    for name, formula, kind, knob, fn in _terms(shape, launch):
        value = int(math.ceil(fn(*args))) if fast else _exact_value(formula, values)
        table.terms.append(BoundTerm(name, formula, value, knob=knob, kind=kind))
    return table


_ORDER = tuple(sym.ALL.values()) + (G_lead, G_dense_min, G_moe_min, L_moe)


def _exact_value(formula, values: dict) -> int:
    """Exact integer bytes of a formula (what symbols.evaluate computes, by xreplace: several times faster)."""
    out = sympy.sympify(formula).xreplace({s: sympy.Integer(v) for s, v in values.items()})
    if out.free_symbols:
        raise ValueError(f"bound {formula} still has free symbols {sorted(map(str, out.free_symbols))}")
    return int(sympy.ceiling(out))


def _lambdify(formula):
    """The formula's float function over _ORDER (compose(fast=True)), lambdified at its first call: an exact
    compose never calls it (a plan without --solve / --search builds ~70 terms it would otherwise lambdify)."""
    return _Lambdified(formula)


class _Lambdified:
    __slots__ = ("formula", "fn")

    def __init__(self, formula):
        self.formula, self.fn = formula, None

    def __call__(self, *args):
        if self.fn is None:
            self.fn = sympy.lambdify(_ORDER, self.formula, modules=[
                {"Max": max, "Min": min, "ceiling": math.ceil, "floor": math.floor}, "math"])
        return self.fn(*args)


def check(shape: ModelShape, launch: Launch, *, budget: int, host_budget: int | None = None) -> ComposedBudget:
    """The composed budget, or InfeasibleBudgetError naming the binding term, its formula, bytes and knob.

    This is the call ``boundpass.compile``'s fail-fast check can make before any real compute.
    """
    table = compose(shape, launch, budget=budget, host_budget=host_budget)
    if not table.fits():
        raise_infeasible(table, table.binding(), detail="(composed per-rank budget, boundpass/bound/composed.py)")
    return table


def total_formula(shape: ModelShape, launch: Launch, *, host_budget: int | None = None) -> sympy.Expr:
    """The device peak as one sympy expression in N (every other symbol at its launch value)."""
    values = symbol_values(shape, launch, host_budget=host_budget)
    values.pop(sym.N)
    values.pop(sym.N_max)
    parts: dict[str, sympy.Expr] = {}
    for _, formula, kind, _, _ in _terms(shape, launch):
        expr = sympy.sympify(formula).subs(sym.N_max, sym.N).subs(values)
        parts[kind] = parts.get(kind, sympy.Integer(0)) + expr
    p = lambda kind: parts.get(kind, sympy.Integer(0))  # noqa: E731
    phases = [value for alts in _phase_alternatives(p, set(parts)).values() for value, _ in alts]
    return device_peak(p("persistent"), *phases)


def describe(table: ComposedBudget) -> str:
    """One line: FITS / DOES NOT FIT, the peak against the budget, the binding term and its knob."""
    verdict = "FITS" if table.fits() else "DOES NOT FIT"
    bind = table.binding()
    return (f"{verdict}: device peak {format_bytes(table.total)} of {format_bytes(table.budget)}"
            + (f", host {format_bytes(table.host_total)} of {format_bytes(table.host_budget)}"
               if table.host_budget is not None else "")
            + f"; binding term: {bind.name} ({format_bytes(bind.value)}) — knob: {bind.knob}")
