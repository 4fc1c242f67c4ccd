"""What `boundpass.plan` and `python -m boundpass plan` are given, validated with nothing heavy imported.

Every argument error a user can make without the model being built (unknown model or flavor, degrees that do
not divide W, a bad unit, an unknown operator, a bad cost-model input) is raised here, before torch, sympy or
torchtitan are imported: the CLI refuses a typo in well under a second. The model names and flavors come from
the model source (boundpass/core/model_source.py; torchtitan's: recipes/families.py, which finds the packages and reads
their registries' flavors without importing them). What needs the model (it has MoE blocks, an attention kind the
budget models, E_p divides its expert count) is checked once its config is read or it is built on meta.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from boundpass.core.config import PLAN_BUDGET, config_from
from boundpass.core.errors import BoundpassInputError
from boundpass.core.model_source import ModelSource, default_source, source_for

# the bounded operators a launch can switch on (boundpass/bound/composed.py composes their terms)
OPERATORS = ("ring_dtp", "pipelined_llep", "sco", "offload_adamw")
# how the W ranks share a step (composed.Launch.layout): boundpass's MoP layout (one sequence split over the ranks),
# or stock FSDP2's data parallelism (whole sequences per rank)
LAYOUTS = ("mop", "dp")

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}


@dataclass
class PlanInput:
    """Everything `plan` needs, validated before any model is built (units parsed into bytes / tokens). The knobs
    carry boundpass.Config's keyword names and defaults (None: composed.Launch.resolved's value)."""
    model: str
    flavor: str
    ranks: int
    ep: int
    ring: int
    tokens_per_rank: int
    budget: int
    host_budget: int | None
    operators: frozenset
    dtype: str = "bf16"
    context: int | None = None
    global_batch: int | None = None
    dispatch_cap: int | None = None
    dispatch_borrowed_slots: int | None = None
    vocab_block: int | None = None
    optimizer_bucket: int | None = None
    optimizer_slots: int | None = None
    sco_max_layers: int | None = None
    routing: str = "worst"
    layout: str = "mop"      # composed.Launch.layout: "mop" or "dp" (FSDP2's data parallelism, whole sequences)
    loss_chunks: int = 1     # torchtitan's chunked loss (--loss.num_chunks); 1: full logits
    attention_tiles: int = 0  # composed.Launch.attention_tiles: the MoP layout's attention in tiles of this C_s


# ------------------------------------------------------------------------------------------- inputs
def check_model(model: str, flavor: str, source: ModelSource | None = None) -> str:
    """The canonical family name of ``model``; BoundpassInputError for an unknown model, or for a flavor its
    registry does not have (when the source can list them without importing the family)."""
    source = source or default_source()
    family = source.resolve(model)
    known = source.flavors(family)
    if known is not None and flavor not in known:
        raise BoundpassInputError(f"unknown flavor {flavor!r} of {family}; known: {', '.join(known)}")
    return family


def locate(model, flavor: str | None, source: ModelSource | None = None) -> tuple[ModelSource, str, str]:
    """(source, model name there, flavor) of what `plan` was given: a torchtitan family and flavor, or a Hugging
    Face config ("hf:..." or a config object), whose one flavor is taken when none is given."""
    if source is None:
        source, model = source_for(model)
    if flavor is None:
        known = source.flavors(source.resolve(model))
        if not known or len(known) > 1:
            raise BoundpassInputError(f"give the flavor of {model}" + (f"; known: {', '.join(known)}" if known else ""))
        flavor = known[0]
    return source, model, flavor


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BoundpassInputError(f"{name} must be a positive int, got {value!r}")
    return value


def make_input(model: str, flavor: str, *, ranks: int, ep: int = 1, ring: int | None = None,
               tokens_per_rank: int | None = None, context: int | None = None, global_batch: int = 1,
               budget=PLAN_BUDGET, host_budget=None, operators=OPERATORS, dtype: str = "bf16",
               dispatch_cap: int | None = None, dispatch_borrowed_slots: int | None = None,
               vocab_block: int | None = None, optimizer_bucket: int | None = None,
               optimizer_slots: int | None = None, sco_max_layers: int | None = None, routing: str = "worst",
               layout: str = "mop", loss_chunks: int = 1, attention_tiles: int = 0,
               source: ModelSource | None = None) -> PlanInput:
    """Validate and normalise plan inputs (raises BoundpassInputError naming what to change; builds nothing).
    The model is given by its family name in the model source (an alias resolved: PlanInput.model is canonical).
    budget, host_budget and the knobs are boundpass.Config's, validated by it (boundpass/core/config.py)."""
    knobs = config_from(budget=budget, host_budget=host_budget, dispatch_cap=dispatch_cap,
                        dispatch_borrowed_slots=dispatch_borrowed_slots, vocab_block=vocab_block,
                        optimizer_bucket=optimizer_bucket, optimizer_slots=optimizer_slots,
                        sco_max_layers=sco_max_layers)
    if knobs.budget is None:
        raise BoundpassInputError(f"plan needs a device budget per rank (e.g. budget={PLAN_BUDGET!r})")
    model = check_model(model, flavor, source)
    ranks = _positive_int("ranks (W)", ranks)
    ep = _positive_int("ep (E_p)", ep)
    ring = ranks if ring is None else _positive_int("ring (P)", ring)
    for name, degree in (("E_p", ep), ("ring degree P", ring)):
        if ranks % degree:
            raise BoundpassInputError(f"{name} = {degree} does not divide W = {ranks} ranks: pick one of "
                                      f"{[d for d in range(1, ranks + 1) if ranks % d == 0]}")
    if dtype not in DTYPE_BYTES:
        raise BoundpassInputError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if (tokens_per_rank is None) == (context is None):
        raise BoundpassInputError("give exactly one of tokens_per_rank (N) or context (tokens per sequence, "
                                  "with global_batch sequences)")
    if context is not None:
        context = _positive_int("context", context)
        global_batch = _positive_int("global_batch", global_batch)
        if (context * global_batch) % ranks:
            raise BoundpassInputError(f"context x global_batch = {context * global_batch:,} tokens do not split "
                                      f"evenly over W = {ranks} ranks; use a multiple of {ranks}")
        tokens_per_rank = context * global_batch // ranks
    tokens_per_rank = _positive_int("tokens_per_rank (N)", tokens_per_rank)
    if layout not in LAYOUTS:
        raise BoundpassInputError(f"layout must be 'mop' (one sequence split over the ranks) or 'dp' (FSDP2's data "
                                  f"parallelism: whole sequences per rank), got {layout!r}")
    if layout == "dp" and context is not None and global_batch % ranks:
        raise BoundpassInputError(f"layout 'dp' trains whole sequences on every rank: global_batch = {global_batch} "
                                  f"sequences do not split over W = {ranks} ranks; use a multiple of {ranks}")
    loss_chunks = _positive_int("loss_chunks", loss_chunks)
    if isinstance(attention_tiles, bool) or not isinstance(attention_tiles, int) or attention_tiles < 0:
        raise BoundpassInputError(f"attention_tiles must be an int >= 0 (the tile C_s; 0: the whole-tensor exchange), "
                                  f"got {attention_tiles!r}")
    if attention_tiles and layout != "mop":
        raise BoundpassInputError("attention_tiles is the MoP layout's sequence-to-head attention in tiles; layout "
                                  f"{layout!r} has no exchange: set attention_tiles 0")
    ops = frozenset(operators)
    if ops - set(OPERATORS):
        raise BoundpassInputError(f"unknown operators {sorted(ops - set(OPERATORS))}; known: {', '.join(OPERATORS)}")
    return PlanInput(model, flavor, ranks, ep, ring, tokens_per_rank, knobs.budget_bytes, knobs.host_budget_bytes, ops,
                     dtype, context, global_batch if context is not None else None, dispatch_cap=dispatch_cap,
                     dispatch_borrowed_slots=dispatch_borrowed_slots, vocab_block=vocab_block,
                     optimizer_bucket=optimizer_bucket, optimizer_slots=optimizer_slots,
                     sco_max_layers=sco_max_layers, routing=routing, layout=layout, loss_chunks=loss_chunks,
                     attention_tiles=attention_tiles)


@dataclass(frozen=True)
class CostModel:
    """Inputs of --search's step-time model (per rank): FLOP/s and link bandwidths in bytes/s, latencies in s."""
    flops: float = 400e12            # sustained bf16 FLOP/s of one rank (H200 dense peak ~989e12 at ~40% MFU)
    link_intra: float = 400e9        # bytes/s per rank inside a node (NVLink)
    link_inter: float = 50e9         # bytes/s per rank across nodes (400 Gb/s NIC)
    host_link: float = 50e9          # bytes/s per rank host <-> device (PCIe 5 x16, one direction)
    gpus_per_node: int = 8
    chunk_latency: float = 30e-6     # fixed cost of one PipelinedLLEP chunk stage (launch + collective setup)
    bucket_latency: float = 50e-6    # fixed cost of one OffloadStreamAdamW bucket

    def __post_init__(self):
        for name in ("flops", "link_intra", "link_inter", "host_link"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise BoundpassInputError(f"cost model: {name.replace('_', '-')} must be a finite number > 0 "
                                          f"(per rank, per second), got {value!r}")
        for name in ("chunk_latency", "bucket_latency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise BoundpassInputError(f"cost model: {name} must be a finite number >= 0 (seconds), got {value!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise BoundpassInputError(f"cost model: gpus-per-node must be an int >= 1, got {self.gpus_per_node!r}")
