"""`boundpass.Config`: every knob of boundpass, one name each, every default defined here once (docs/config.md).

A knob is ``<section>.<field>`` in Config and in the torchtitan recipe (``--boundpass.<section>.<field>``),
``<section>_<field>`` as a Python keyword (``boundpass.compile``, ``boundpass.plan``, ``composed.Launch``) and
``--<section>-<field>`` in ``python -m boundpass plan``; a top-level field (``budget``) has no section part. A
section's on/off switch is its ``enable`` field (``vocab.enable``, ``dispatch.enable``, ``sco.enable``); the
optimizer section has none (an optimizer given to compile is always budgeted): its ``offload`` field chooses what
runs it. The sympy symbols (C, c, β, S, L_off) are the math notation of the same knobs in formulas and docs.

Importable without torch, sympy or torchtitan: ``python -m boundpass plan`` validates its arguments through it
before importing torch (tests/planning/test_plan.py checks that torch stays unimported).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from boundpass.core.errors import BoundpassInputError
from boundpass.core.units import parse_bytes

__all__ = ["Config", "VocabConfig", "DispatchConfig", "AttentionConfig", "SCOConfig", "OptimizerConfig", "config_from", "knob_paths",
           "INNER_COMPILERS", "MODES", "PLAN_KNOBS", "PLAN_BUDGET", "PLAN_VOCAB_BLOCK", "PLAN_DISPATCH_CAP",
           "OPTIMIZER_STAGING_BYTES", "OPTIMIZER_SLOTS"]

INNER_COMPILERS = ("aot_eager", "inductor")
MODES = ("auto", True, False)  # the three-way switches (sco.enable, optimizer.offload)
# The knobs boundpass.plan, composed.Launch and `python -m boundpass plan` take (by the same names): the budgets and
# the knobs the composed budget has a term for. The on/off switches are plan's `operators` there (ring_dtp =
# vocab.enable, pipelined_llep = dispatch.enable, sco = sco.enable, offload_adamw = optimizer.offload): a plan composes
# a launch with or without each operator, it has no "auto" (docs/config.md).
PLAN_KNOBS = ("budget", "host_budget", "vocab_block", "dispatch_cap", "dispatch_borrowed_slots", "sco_max_layers",
              "optimizer_bucket", "optimizer_slots")

# What a knob left at None ("the planner's choice") is taken as where no planner chooses it: the composed budget
# (composed.Launch) evaluated as given, the MoP recipe layout without a budget, an OffloadStreamAdamW built by hand.
# boundpass.compile's planner, and for a composed launch planner.planned_launch (plan, the MoP recipe with a budget:
# the dispatch cap c and the bucket β), pick min(the widest value the budget allows, the knee of the modelled time)
# instead (docs/knobs.md).
PLAN_BUDGET = "139GiB"         # boundpass.plan's device budget when none is given: one H200 (141 GB less headroom)
PLAN_VOCAB_BLOCK = 4096        # vocab.block (Ring-DTP strip width C)
PLAN_DISPATCH_CAP = 4096       # dispatch.cap (PipelinedLLEP tokens per source rank per chunk, c)
# OffloadStreamAdamW's staging when optimizer.slots / optimizer.bucket are None: S slots whose buckets stage this many
# device bytes during step() (runtime/offload_adamw.py derives β from it: 2^24 elements at S = 2)
OPTIMIZER_STAGING_BYTES = 512 << 20
OPTIMIZER_SLOTS = 2            # optimizer.slots (S): one bucket's copies overlap the next bucket's update


def _names(path: str, what: str = "") -> str:
    """A knob by its one name as every surface spells it: dispatch.cap (chunk cap c; dispatch_cap= / --dispatch-cap);
    the CLI option only for a knob plan takes."""
    keyword = path.replace(".", "_")
    option = f" / --{keyword.replace('_', '-')}" if keyword in PLAN_KNOBS else ""
    return f"{path} ({what}{keyword}={option})"


def _positive(path: str, value, *, least: int = 1, what: str = "") -> None:
    """None, or an int >= least (bool refused); else BoundpassInputError naming the knob."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        need = "a positive int" if least == 1 else f"an int >= {least}"
        raise BoundpassInputError(f"boundpass.Config: {_names(path, what)} must be {need} or None, got {value!r}")


def _mode(path: str, value) -> None:
    if not (value is True or value is False or value == "auto"):
        raise BoundpassInputError(f"boundpass.Config: {_names(path)} must be 'auto', True or False, got {value!r}")


def _switch(path: str, value) -> None:
    if not isinstance(value, bool):
        raise BoundpassInputError(f"boundpass.Config: {_names(path)} must be True or False, got {value!r}")


@dataclass(kw_only=True, slots=True)
class VocabConfig:
    """The vocab projection + cross-entropy (Ring-DTP, runtime/ring_dtp.py; docs/ring_dtp.md)."""

    enable: bool = True
    """Rewrite lm_head -> cross-entropy regions to boundpass::ring_dtp (no [N, V] logits). False: the region runs as the
    model wrote it and the step analysis bounds it as it is."""
    block: int | None = None
    """Ring-DTP's strip width C (vocab rows per strip). None: the planner's choice, min(the widest the budget allows,
    the knee of the modelled time) (docs/knobs.md); boundpass.plan takes PLAN_VOCAB_BLOCK."""
    keep_logits: bool = False
    """A model that returns its [N, V] logits beside the loss it computes (Hugging Face's CausalLMOutput): in training
    (module.training, grad enabled) the logits only the caller would read are not materialised, their place in the
    output holds None (Liger-Kernel's convention) and the region is rewritten. True: they are returned, and the region
    is skipped (the [N, V] tensor must exist). Eval / no_grad calls always return them."""

    def __post_init__(self):
        _switch("vocab.enable", self.enable)
        _switch("vocab.keep_logits", self.keep_logits)
        _positive("vocab.block", self.block, what="strip width C; ")


@dataclass(kw_only=True, slots=True)
class DispatchConfig:
    """Expert dispatch (PipelinedLLEP, runtime/pipelined_llep.py; docs/pipelined_llep.md)."""

    enable: bool = True
    """Rewrite routed-experts regions (torchtitan's RoutedExperts, and SwiGLU experts in plain PyTorch found by what
    they compute) to boundpass::pipelined_llep, whose peak is set by the launch, not by the router."""
    cap: int | None = None
    """PipelinedLLEP's chunk cap c: tokens per source rank per chunk. None: the planner's choice (the knee, narrower
    when the budget needs it; every EP rank gets the narrowest any rank allows); boundpass.plan takes
    PLAN_DISPATCH_CAP."""
    borrowed_slots: int | None = None
    """PipelinedLLEP's borrowed-expert slots s_b per EP rank: LLEP's planner lends a rank at most this many other ranks'
    experts (their weights and gradients are held on it, 2 s_b experts in the bound); 0 never relocates. Fewer slots:
    less memory, LLEP balances hot ranks less. None: e = E / E_p, LLEP's default (no slots on one EP rank; more than
    the (E_p - 1) e other experts there are counts as those)."""

    def __post_init__(self):
        _switch("dispatch.enable", self.enable)
        _positive("dispatch.cap", self.cap, what="chunk cap c; ")
        _positive("dispatch.borrowed_slots", self.borrowed_slots, least=0, what="borrowed-expert slots s_b; ")


@dataclass(kw_only=True, slots=True)
class AttentionConfig:
    """Attention along the sequence (runtime/chunked_attention.py; docs/chunked_attention.md)."""

    enable: bool = False
    """Rewrite scaled_dot_product_attention calls (torchtitan's SDPA attention, plain PyTorch, Hugging Face's sdpa
    interface) to boundpass::chunked_attention: tiles of C_s x C_s scores with an online softmax, never [L, L]. Off by
    default: the reordered sums change the last bits against eager's kernel (the tolerance class of a fused kernel)."""
    chunk: int | None = None
    """The tile C_s (query and key rows per tile). None: the planner's choice, min(the widest the budget allows, the
    knee of the modelled time) (docs/knobs.md)."""
    query_blocks: bool = True
    """Where the call's query path and output projection are position-wise (torchtitan's attention of every family,
    plain PyTorch, Hugging Face's): rewrite the whole sublayer to boundpass::attention_blocks, walked C_s query rows at
    a time, so q, the attention output, their gradients and dq are never whole (runtime/attention_blocks.py). False:
    the call alone, to boundpass::chunked_attention."""
    offload: bool = True
    """Where the sublayer is walked with k and v made per key tile: k and v, and the backward's q and output gradient,
    kept on the host under host_budget and read back one tile at a time, the next prefetched (FPDT's schedule), so the
    device holds two tiles of them instead of the whole sequence (runtime/host_tiles.py). False: whole on the device."""

    def __post_init__(self):
        _switch("attention.enable", self.enable)
        _switch("attention.query_blocks", self.query_blocks)
        _switch("attention.offload", self.offload)
        _positive("attention.chunk", self.chunk, what="tile C_s; ")


@dataclass(kw_only=True, slots=True)
class FeedForwardConfig:
    """Position-wise sublayers along the sequence (runtime/row_blocks.py; docs/feed_forward.md)."""

    enable: bool = False
    """Rewrite each feed-forward region (its norm where only it reads the norm, the up projections, the activation,
    the down projection: a block's dense MLP, MoE shared experts; found by structure and proved position-wise) to
    boundpass::row_blocks, walked C_r rows at a time and recomputed per block in the backward, so its intermediates
    are never whole; a norm other parts read (an MoE block's, the final one; a call or hand-written) in row blocks
    alone. Off by default: the weights' gradients are summed over the blocks (reordered sums)."""
    chunk: int | None = None
    """The rows per block C_r. None: the planner's choice, min(the widest the budget allows, the knee of the modelled
    time) (docs/knobs.md)."""

    def __post_init__(self):
        _switch("feed_forward.enable", self.enable)
        _positive("feed_forward.chunk", self.chunk, what="rows per block C_r; ")


@dataclass(kw_only=True, slots=True)
class SCOConfig:
    """Selective checkpoint offload of activation-checkpoint boundaries to host memory (runtime/sco.py; docs/sco.md)."""

    enable: Literal["auto", True, False] = "auto"
    """auto: the shortest forward-order prefix of boundaries the device budget needs (none when it fits); True: the
    longest prefix the host pool holds; False: none. Needs checkpointed blocks (e.g. torchtitan FullAC). The host
    pool is what host_budget leaves after the optimizer's host terms."""
    max_layers: int | None = None
    """Offload at most this many boundaries (L_off <= max_layers; 0 offloads none). None: as many as the host pool
    holds."""

    def __post_init__(self):
        _mode("sco.enable", self.enable)
        _positive("sco.max_layers", self.max_layers, least=0, what="most boundaries offloaded, L_off; ")


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer given to boundpass.compile (OffloadStreamAdamW: runtime/offload_adamw.py, docs/offload_adamw.md)"""

    offload: Literal["auto", True, False] = "auto"
    """Swap AdamW (or a torchtitan OptimizersContainer of AdamWs) for OffloadStreamAdamW, its state moved to the host
    and migrated: "auto" when parameters + gradients + AdamW's measured state and step workspace exceed the budget,
    True always, False never (an over-budget state then fails fast)."""
    bucket: int | None = None
    """OffloadStreamAdamW's bucket β: parameter elements per bucket staged on the device. None: the planner's choice
    (the knee of the modelled step time, narrower when the budget needs it); elsewhere the bucket whose S slots stage
    OPTIMIZER_STAGING_BYTES."""
    slots: int | None = None
    """OffloadStreamAdamW's staging slots S (buckets in flight). None: the planner's choice (the knee: 1 on a CPU, 2 on
    CUDA); elsewhere OPTIMIZER_SLOTS."""

    def __post_init__(self):
        _mode("optimizer.offload", self.offload)
        _positive("optimizer.bucket", self.bucket, what="bucket β in elements; ")
        _positive("optimizer.slots", self.slots, what="staging slots S; ")


_SECTIONS = {"vocab": VocabConfig, "dispatch": DispatchConfig, "attention": AttentionConfig,
             "feed_forward": FeedForwardConfig, "sco": SCOConfig,
             "optimizer": OptimizerConfig}


@dataclass(kw_only=True, slots=True)
class Config:
    """Every knob of boundpass.compile (and, by the same names, of boundpass.plan, composed.Launch and the recipe's
    --boundpass section). Build it directly, or pass the flat keywords to boundpass.compile (``config_from``)."""

    budget: str | int | None = None
    """Per-rank device budget: bytes or a size such as "60GiB". boundpass.compile needs one; None in the recipe means
    boundpass off (stock torchtitan)."""
    host_budget: str | int | None = None
    """Per-rank host budget for offloaded optimizer state and SCO's boundary pool (None: unchecked, unlimited; 0: no
    host memory, so nothing is offloaded)."""
    allow_uncertified: bool = False
    """A step boundpass cannot certify whole (graph breaks under fullgraph=False: code runs between the compiled
    graphs that no certificate sees) is refused on its first call (NotCertifiedError, naming Dynamo's break reasons).
    True: it runs, each compiled graph checked on its own, and explain() says NOT CERTIFIED with the reasons."""
    max_tokens_per_rank: int | None = None
    """The largest token count N any ring / EP rank will hold (Ring-DTP's branch, PipelinedLLEP's cap range). None:
    the group's largest N at each compile (one all-reduce)."""
    inner: Literal["aot_eager", "inductor"] = "aot_eager"
    """Kernels after boundpass's rewrite: eager kernels after AOTAutograd ("aot_eager") or Inductor ("inductor"; the
    certificate is then taken on Inductor's final schedule)."""
    vocab: VocabConfig = field(default_factory=VocabConfig)
    """Ring-DTP: the vocab projection + cross-entropy."""
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    """PipelinedLLEP: expert dispatch."""
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """Chunked attention: scaled dot-product attention in tiles along the sequence."""
    feed_forward: FeedForwardConfig = field(default_factory=FeedForwardConfig)
    """Row blocks: a block's feed-forward walked C_r rows at a time."""
    sco: SCOConfig = field(default_factory=SCOConfig)
    """SCO: checkpoint boundaries offloaded to the host."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """OffloadStreamAdamW: the optimizer's state on the host."""

    def __post_init__(self):
        for name in ("budget", "host_budget"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name), what=name, zero_ok=name == "host_budget")
        _positive("max_tokens_per_rank", self.max_tokens_per_rank, what="N_max; ")
        if self.inner not in INNER_COMPILERS:
            raise BoundpassInputError(f"boundpass.Config: inner must be one of {INNER_COMPILERS}, got {self.inner!r}")
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, dict):  # Config(vocab={"block": 256})
                value = cls(**value)
                setattr(self, name, value)
            if not isinstance(value, cls):
                raise BoundpassInputError(f"boundpass.Config: {name} must be a boundpass.core.config.{cls.__name__} (or a "
                                          f"dict of its fields), got {type(value).__name__}")

    @property
    def budget_bytes(self) -> int | None:
        return None if self.budget is None else parse_bytes(self.budget, what="budget")

    @property
    def host_budget_bytes(self) -> int | None:
        return None if self.host_budget is None else parse_bytes(self.host_budget, what="host_budget", zero_ok=True)

    def flat(self) -> dict:
        """Every knob as ``{keyword: value}`` (``{"budget": ..., "dispatch_cap": ...}``)."""
        return {keyword: _get(self, path) for keyword, path in knob_paths().items()}

    def replace(self, **knobs) -> "Config":
        """A copy with ``knobs`` (flat keywords, as boundpass.compile takes them) set; validated again."""
        return config_from(self, **knobs)


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def knob_paths(cls: type = Config) -> dict[str, str]:
    """Every knob of ``cls`` (Config or a subclass), keyword -> Config path: {"budget": "budget", "vocab_block":
    "vocab.block", ...}: the one naming rule every surface applies."""
    out = {}
    for name in _fields(cls):
        section = _SECTIONS.get(name)
        if section is None:
            out[name] = name
        else:
            out.update({f"{name}_{sub}": f"{name}.{sub}" for sub in _fields(section)})
    return out


def _get(config: Config, path: str):
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def config_from(config: Config | None = None, /, **knobs) -> Config:
    """The Config boundpass.compile runs with: ``config`` (None: the defaults) with the flat keyword ``knobs`` set over
    it (a keyword given beside a Config wins over the Config's value), validated. An unknown keyword raises
    BoundpassInputError listing every known one. A subclass of Config (the recipe's section) gives its Config
    fields only."""
    if config is not None and not isinstance(config, Config):
        raise BoundpassInputError(f"config must be a boundpass.Config, got {type(config).__name__}")
    paths = knob_paths(Config)
    unknown = sorted(set(knobs) - set(paths))
    if unknown:
        raise BoundpassInputError(f"unknown boundpass knob(s) {', '.join(unknown)}; known: {', '.join(paths)}")
    base = config if config is not None else Config()
    if type(base) is not Config:  # a subclass (the recipe's --boundpass section): its boundpass knobs only
        base = Config(**{name: getattr(base, name) for name in _fields(Config)})
    top, sections = {}, {}
    for keyword, value in knobs.items():
        section, _, sub = paths[keyword].partition(".")
        if sub:
            sections.setdefault(section, {})[sub] = value
        else:
            top[keyword] = value
    for section, values in sections.items():
        top[section] = dataclasses.replace(getattr(base, section), **values)
    return dataclasses.replace(base, **top) if top else base
