"""`BoundpassTrainer`: torchtitan's own Trainer with a `boundpass` config section (off unless a budget is given).

With `--boundpass.budget 2GiB` the trainer, after torchtitan has built and parallelized the model and built its
optimizer, calls `boundpass.compile(model, budget=..., loss_fn=<the trainer's loss>, optimizer=<the trainer's
OptimizersContainer>)` and then runs every forward + loss + backward through what boundpass returned, and steps
the optimizer boundpass chose (the container object stays the same; if boundpass offloaded its AdamWs, the LR
schedulers and the checkpointer are re-pointed at the new inner optimizers). Without a budget, or with
`--boundpass.no-enable`, nothing here runs: the step is torchtitan's `_forward_backward_body` unchanged.

Why the loss changes under boundpass: torchtitan's MoE configs use `ChunkedLossWrapper`, which runs lm_head
+ cross-entropy chunk by chunk with an eager `backward()` inside the loss; no compiler can capture that. With
the vocab rewrite on we give the trainer the wrapper's inner CrossEntropyLoss, so model + loss form one graph
(`linear -> cross_entropy`) that boundpass rewrites to Ring-DTP, whose bound is below the chunked loss's.
The loss value is the same function (sum CE / global valid tokens).

Under FSDP2 (every torchtitan multi-rank run, EP = 2 included) the model cannot be captured fullgraph: FSDP2's
hooks and the expert-parallel dispatcher's host sync (`.tolist()` of the split sizes) break the graph. We
compile with `fullgraph=False`; Dynamo then hands boundpass one graph per region between breaks, and
`summary()` lists what each graph rewrote and skipped (logged after the first step, never silent).

`--boundpass.layout mop` trains under the MoP rank layout of recipes/mop.py instead (docs/recipe.md): the trainer
wraps torchtitan's parallelize function with `prepare_mop` / `finish_mop`, every rank reads the same batches and
keeps its L/W tokens of each sequence (with their positions), and the loss is `mop_loss` (Ring-DTP) when the head
is vocab-sharded. torchtitan's own train_step is unchanged: its valid-token and loss all-reduces over the batch
mesh are right once each token lives on exactly one rank. boundpass.compile stays off; a budget is checked against
the composed per-rank budget on the meta model, before anything is materialised.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

import spmd_types as spmd
import torch
import torch.nn as nn
import torch.nn.functional as F

from boundpass.core.config import Config
from boundpass.core.errors import BoundpassError, BoundpassInputError, InfeasibleBudgetError
from boundpass.core.units import format_bytes

from torchtitan.components.checkpointer import LR_SCHEDULER
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer


@dataclass(kw_only=True, slots=True)
class BoundpassConfig(Config):
    """The `--boundpass.*` section: boundpass.Config (every knob by its one name, `--boundpass.<section>.<field>`:
    `--boundpass.budget 2GiB`, `--boundpass.vocab.block 256`, `--boundpass.optimizer.offload True`; docs/config.md)
    and the recipe's own fields below. boundpass is on iff `budget` is set and `enable` is true."""

    enable: bool = True
    """Master switch; `--boundpass.no-enable` trains as stock torchtitan even with a budget."""
    capture: Literal["auto", "head", "model"] = "auto"
    """What boundpass.compile captures. "model": the whole model + loss (fullgraph; only for a model that is
    not FSDP2-wrapped). "head": lm_head -> loss as one graph while torchtitan runs the trunk as it always does
    (the only way to keep the vocab region in one graph under FSDP2). "auto": "head" when FSDP2-wrapped.
    `--boundpass.vocab.enable False` also replaces ChunkedLossWrapper by nothing: the loss stays torchtitan's."""
    blocks: bool = True
    """Compile every TransformerBlock through boundpass (torchtitan's per-block compile with boundpass as its backend:
    dispatch -> PipelinedLLEP, checkpoint boundaries -> SCO, each block graph checked against the whole step's
    budget; boundpass/backend/block_compile.py). On whenever the head is captured (FSDP2, or --compile.enable); with
    --compile.enable the blocks are lowered as --compile.backend asks, without it as --boundpass.inner asks.
    `--boundpass.no-blocks`: the trunk runs as torchtitan runs it (and the budget leaves its activations out)."""
    measure_peak: bool = False
    """Measure each step's device peak at torch's allocator (profiler memory events; slower) and log it beside the
    certified peak (kept in `trainer.peaks` as (step, bytes))."""
    report: bool = True
    """Log boundpass's report (regions rewritten / skipped, bounds table) after the first step."""
    record_losses: str | None = None
    """Append each logged step's global loss and grad norm at full precision as JSON lines to this file
    (rank 0). Works with boundpass off too: it is how stock and boundpass runs are compared step by step."""
    layout: Literal["default", "mop"] = "default"
    """Rank layout. "default": torchtitan's own (data-parallel FSDP2, EP), with boundpass.compile when a budget is
    given. "mop": the MoP layout of recipes/mop.py (all ranks split one batch along the sequence, sequence-to-head
    attention, FSDP2 dense weights, EP experts); boundpass.compile stays off, a budget is checked against the
    composed per-rank budget before anything is materialised (docs/recipe.md)."""
    mop_pipelined_llep: bool = False
    """MoP layout: expert dispatch through PipelinedLLEP (chunk cap `--boundpass.dispatch.cap`, default
    config.PLAN_DISPATCH_CAP) instead of torchtitan's EP all-to-all dispatcher (refused for experts other than
    torchtitan's bias-free SwiGLU ones, e.g. gpt_oss). The layout's own switch: off by default, where
    `dispatch.enable` (boundpass.compile's rewrite) is on."""
    certify_only: bool = False
    """Stop after step 1's forward: by then every graph (each block graph, the head) has compiled and been checked
    against the budget, so the whole step's certificate exists (FITS, or the fail-fast refusal naming what breaks
    it). Logs the report and returns without a backward or an optimizer step: the certificate at a length whose
    step would take long to run (`BoundpassTrainer.CertifiedOnly` carries the certified peak). The block graphs do not
    compute (``CompiledBlocks.dry``): the certificate reads shapes, never values, so it is a real step's, at the cost
    of compiling. Needs a budget."""
    rope_to_seq_len: bool = False
    """Size every block's RoPE table to `--training.seq_len` (torchtitan's debug flavors stop at 16,384 positions and
    refuse longer sequences). The model's config, not boundpass's: it applies with boundpass off too, so a
    comparison sets it on both sides (bench/attention_sublayer.py's reach beyond 16K)."""
    mop_ring_dtp: bool = False
    """MoP layout: lm_head vocab-sharded over the W ranks (outside FSDP2) and the loss run as Ring-DTP (strip width
    `--boundpass.vocab.block`, default the whole local shard). The layout's own switch, off by default."""

    @property
    def active(self) -> bool:
        """boundpass.compile runs (default layout with a budget)."""
        return self.enable and self.budget is not None and self.layout == "default"

    @property
    def mop(self) -> bool:
        return self.enable and self.layout == "mop"


class VocabHead(nn.Module):
    """lm_head's projection as its own module, so `boundpass.compile(VocabHead(model), loss_fn=...)` captures
    `linear -> cross_entropy` in one graph. It reads `model.lm_head.weight` (under FSDP2: the unsharded
    parameter, so FSDP2 reduce-scatters its gradient as usual) and holds `model` so the budget counts all of
    the model's parameters and gradients, not only lm_head's."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.lm_head.weight)


def rope_to_seq_len(config) -> None:
    for layer in getattr(config.model_spec.model, "layers", []):
        rope = getattr(getattr(layer, "attention", None), "rope", None)
        if rope is not None and hasattr(rope, "max_seq_len"):
            layer.attention.rope = dataclasses.replace(rope, max_seq_len=config.training.seq_len)


class CertifiedOnly(Exception):
    """Raised after step 1's forward under --boundpass.certify_only: every graph compiled and checked."""

    def __init__(self, certified: int, host: int):
        super().__init__(f"certified {format_bytes(certified)} (host {format_bytes(host)}); stopped before the "
                         "backward (--boundpass.certify_only)")
        self.certified, self.host = certified, host


class BoundpassTrainer(Trainer):
    CertifiedOnly = CertifiedOnly

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        boundpass: BoundpassConfig = field(default_factory=BoundpassConfig)

    def __init__(self, config: Config):
        self.bounded = None
        self.blocks = None
        self._reported = False
        self.mop_state = None
        self.peaks: list[tuple[int, int]] = []  # (step, measured allocator peak bytes) with --boundpass.measure_peak
        bp = config.boundpass
        if bp.certify_only and not bp.active:
            raise BoundpassInputError("--boundpass.certify_only checks a budget: give --boundpass.budget (default "
                                      "layout)")
        if bp.rope_to_seq_len:
            rope_to_seq_len(config)
        if bp.active and bp.vocab.enable and isinstance(config.loss, ChunkedLossWrapper.Config):
            config.loss = config.loss.loss_fn  # see the module docstring: a chunked eager backward cannot be captured
        self.block_backend = self._prepare_block_compile(config) if bp.active else None
        if bp.mop:
            self._prepare_mop_layout(config)
        super().__init__(config)
        if bp.mop:
            self._finish_mop_layout(config)
        if bp.record_losses:
            self._record_losses_to(bp.record_losses)
        if bp.active:
            self._enable_boundpass(bp)

    def _record_losses_to(self, path: str) -> None:
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        log = self.metrics_processor.log

        def log_and_record(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(global_avg_loss), "max_loss": float(global_max_loss),
                                    "grad_norm": float(grad_norm)}) + "\n")
            return log(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)
        self.metrics_processor.log = log_and_record

    # ---------------------------------------------------------------------------------------------- setup
    def _prepare_block_compile(self, config: Config):
        """Before torchtitan builds the model: make boundpass the backend of torchtitan's per-block compile.

        torchtitan's parallelize function calls ``apply_compile`` (every TransformerBlock, fullgraph) with
        ``--compile.backend``; that backend becomes a boundpass backend which lowers with what was asked. The
        planning state it needs (the optimizer's terms) exists only after torchtitan built the optimizer, so the
        backend is a forwarder filled in by ``_enable_boundpass``: blocks compile lazily, at the first forward.
        """
        bp, compile_config = config.boundpass, config.compile
        if bp.capture == "model":
            if compile_config.enable and "model" in compile_config.components:
                raise BoundpassInputError(
                    "boundpass recipe: --boundpass.capture model compiles the whole model + loss as one graph, which "
                    "cannot hold torchtitan's per-block compile (--compile.enable) inside it; drop --compile.enable, "
                    "or use --boundpass.capture auto (every block compiled through boundpass, the head captured)")
            return None
        if not bp.blocks or not bp.vocab.enable:
            return None
        if not (compile_config.enable or _world_size() > 1):
            return None  # one rank, not compiled: "auto" captures the whole model in one graph
        asked = compile_config.backend if compile_config.enable and "model" in compile_config.components else None
        if asked is not None and asked not in ("inductor", "aot_eager"):
            raise BoundpassInputError(f"boundpass recipe: --compile.backend {asked!r}: boundpass lowers block graphs "
                                      "with 'inductor' or 'aot_eager'")
        self.block_inner = asked or bp.inner
        self.block_compile_note = (f"torchtitan's per-block compile (--compile.enable) with boundpass as its backend, "
                                   f"lowered by {self.block_inner}" if asked else
                                   f"boundpass compiles each block itself (torchtitan's apply_compile; no "
                                   f"--compile.enable given), lowered by {self.block_inner}")
        backend = _BlockBackend()
        compile_config.enable = True
        # the head (lm_head -> loss) is compiled by boundpass.compile: torchtitan must not compile the loss itself
        compile_config.components = ["model"]
        compile_config.backend = backend
        return backend

    def _enable_boundpass(self, bp: BoundpassConfig) -> None:
        import boundpass
        from torch.distributed.fsdp import FSDPModule

        if self.parallel_dims.pp_enabled:
            raise ValueError("boundpass recipe: pipeline parallelism is not supported (model parts are staged); "
                             "set --parallelism.pipeline_parallel_degree 1 or --boundpass.no-enable")
        model = self.model_parts[0]
        self.fsdp_wrapped = any(isinstance(m, FSDPModule) for m in model.modules())
        capture = bp.capture if bp.capture != "auto" else ("head" if self.fsdp_wrapped else "model")
        if capture == "model" and self.fsdp_wrapped:
            raise ValueError("boundpass recipe: --boundpass.capture model needs a model that is not FSDP2-wrapped "
                             "(FSDP2's hooks break the graph between lm_head and the loss, so the vocab region "
                             "would not be rewritten); use --boundpass.capture head (the default here)")
        if capture == "head" and not bp.vocab.enable:
            raise ValueError("boundpass recipe: --boundpass.capture head only captures the vocab region; it needs "
                             "--boundpass.vocab.enable True")
        if self.block_backend is not None and capture != "head":
            raise BoundpassInputError("boundpass recipe: per-block compile needs --boundpass.capture head or auto")
        self.capture = capture
        if capture == "head":
            model._skip_lm_head = True  # the trunk returns the normed hidden state; VocabHead does lm_head -> loss
            target = VocabHead(model)
        else:
            target = model
        before = list(self.optimizers.optimizers)
        # the section is a boundpass.Config: compile reads every knob from it (the recipe's own fields are dropped)
        self.bounded = boundpass.compile(target, bp, loss_fn=self.loss_fn if bp.vocab.enable else None,
                                         optimizer=self.optimizers, fullgraph=True)
        plan = self.bounded.optimizer_plan
        if self.block_backend is not None:
            from boundpass.backend.block_compile import CompiledBlocks
            from boundpass.backend.gloo_release import install_releasing_collectives
            # gloo's worker threads keep finished collectives' buffers alive (timing dependent): the reduce-scatter's
            # clone and the all-gather's output are freed when FSDP2 is done with them instead (boundpass/backend/gloo_release.py),
            # so the step's peak is the one the composition counts
            released = install_releasing_collectives(model) if self.fsdp_wrapped else 0
            self.blocks = CompiledBlocks(
                model, list(model.layers.values()), dataclasses.replace(self.bounded.boundpass_config, inner=self.block_inner),
                state_terms=self.bounded.state_terms, optimizer_plan=plan)
            self.blocks.dry = bp.certify_only  # blocks compile and are checked, and compute nothing
            self.blocks.check_tail()  # the backward's tail needs no graph: checked here, before step 1
            self.block_backend.target = self.blocks
            self.bounded.trunk = self.blocks  # the head runs with every block's saved tensors held
            logger.info(f"[boundpass] blocks: {self.block_compile_note}; {self.blocks.num_blocks} blocks, "
                        f"{len(self.blocks.units)} FSDP2 units"
                        + (f"; {released} FSDP2 group(s) on boundpass.backend.gloo_release's collectives "
                           f"(gloo: no buffer left to its worker threads)" if released else ""))
        if plan is not None and list(self.optimizers.optimizers) != before:
            self._repoint_at_swapped_optimizers()
        self.metrics_processor.optimizers = self.optimizers
        logger.info(f"[boundpass] on: budget {bp.budget}, vocab rewrite {'on' if bp.vocab.enable else 'off'}, "
                    f"capture={capture}{' (model is FSDP2-wrapped)' if self.fsdp_wrapped else ''}, optimizer: "
                    f"{plan.reason if plan else 'not given'}")

    # ------------------------------------------------------------------------------------------ MoP layout
    def _prepare_mop_layout(self, config: Config) -> None:
        """Before torchtitan builds anything: refuse what the layout cannot do, and wrap the model's parallelize
        function (torchtitan calls it itself in Trainer.__init__, on the meta model) with the layout's halves."""
        from boundpass.recipes.mop import MoPOptions, compile_config_under_mop, finish_mop, prepare_mop

        bp = config.boundpass
        world = _world_size()
        check_mop_launch(config, world)
        options = MoPOptions(pipelined_llep=bp.mop_pipelined_llep, dispatch_cap=bp.dispatch.cap,
                             dispatch_borrowed_slots=bp.dispatch.borrowed_slots,
                             ring_dtp=bp.mop_ring_dtp, vocab_block=bp.vocab.block,
                             attention_tiles=mop_attention_tiles(config, world) if bp.attention.enable else 0)
        if options.ring_dtp and isinstance(config.loss, ChunkedLossWrapper.Config):
            # the model's head becomes the identity and mop_loss runs projection + CE as Ring-DTP: the chunked
            # wrapper (which calls lm_head itself) must not be set up by torchtitan
            config.loss = config.loss.loss_fn
        original = config.model_spec.parallelize_fn
        self.mop_budget = self.mop_bucket = None
        self.mop_tiles_unneeded = False  # the attention in tiles allowed, the budget holding the whole exchange
        self.mop_offload = bp.optimizer.offload is True  # without a budget, "auto" keeps AdamW on the device

        def parallelize_under_mop(model, *, parallel_dims, **kwargs):
            layout = options
            if bp.budget is not None:  # model still on meta: nothing of size has been allocated
                layout, (self.mop_budget, self.mop_bucket, self.mop_offload, cap) = choose_mop_attention(
                    model, config, parallel_dims, options)
                self.mop_tiles_unneeded = bool(options.attention_tiles and not layout.attention_tiles)
                if cap is not None:  # the chunk cap the budget was certified at is the one the op runs
                    layout = dataclasses.replace(layout, dispatch_cap=cap)
            state = prepare_mop(model, parallel_dims, layout)
            if "compile_config" in kwargs:  # PipelinedLLEP: torchtitan's per-block compile, boundpass's dispatch pass
                kwargs["compile_config"] = compile_config_under_mop(kwargs["compile_config"], state)
            elif state.dispatch_backend is not None:
                raise BoundpassInputError("boundpass MoP layout: torchtitan's parallelize function was called without "
                                          "compile_config, so PipelinedLLEP's per-block compile cannot be set up")
            model = original(model, parallel_dims=parallel_dims, **kwargs)
            finish_mop(model, parallel_dims, state)
            model._mop = state  # mop_loss reads the options from it
            return model

        config.model_spec = dataclasses.replace(config.model_spec, parallelize_fn=parallelize_under_mop)

    def _finish_mop_layout(self, config: Config) -> None:
        """After torchtitan built, parallelized and initialised the model: the loss, the data and the batch count."""
        from torchtitan.components.checkpointer import DATALOADER

        from boundpass.recipes.mop import mop_loss

        model = self.model_parts[0]
        self.mop_state = model._mop
        if self.mop_state.options.ring_dtp:
            self.loss_fn = mop_loss(model)
        training = config.training
        if training.global_batch_size > 0:
            # torchtitan counted W data replicas; under MoP the W ranks read the same local_batch_size sequences
            if training.global_batch_size % training.local_batch_size:
                raise BoundpassInputError(
                    f"boundpass MoP layout: --training.global_batch_size ({training.global_batch_size}) must be a "
                    f"multiple of --training.local_batch_size ({training.local_batch_size}): the W ranks share each "
                    "batch (no data replicas)")
            self.gradient_accumulation_steps = training.global_batch_size // training.local_batch_size
        # torchtitan's dataloader gives each of the W "data-parallel" ranks its own sequences; under MoP the W ranks
        # are one sequence-sharding group: every rank reads the same batches (dp world 1) and keeps its L/W tokens
        self.dataloader = config.dataloader.build(
            dp_world_size=1, dp_rank=0, tokenizer=self.tokenizer, seq_len=training.seq_len,
            local_batch_size=training.local_batch_size,
            snapshot_every_n_steps=(config.checkpoint.interval * self.gradient_accumulation_steps
                                    if config.checkpoint.enable else None))
        states = getattr(self.checkpointer, "states", None)
        if isinstance(states, dict) and DATALOADER in states:
            states[DATALOADER] = self.dataloader
        if self.mop_offload:
            self._offload_optimizer_under_mop(config.boundpass)
        state = self.mop_state
        world = self.parallel_dims.world_size
        dispatch = (f"PipelinedLLEP c={state.options.cap} from boundpass's dispatch pass in torchtitan's per-block "
                    f"compile, lowered by {state.dispatch_backend.inner}; the rewritten regions are logged after step 1"
                    if state.options.pipelined_llep else "torchtitan EP")
        logger.info(f"[boundpass] MoP layout: W={world} ranks share each batch of {training.local_batch_size} x "
                    f"{training.seq_len} tokens ({training.seq_len // world} per sequence per rank; torchtitan's "
                    f"'global batch size' above counts W replicas; {self.gradient_accumulation_steps} batch(es) per "
                    f"optimizer step), E_p={self.parallel_dims.ep}, "
                    + (f"sequence-to-head attention in tiles of C_s={state.options.attention_tiles} (q, k, v, output and "
                       "gradients of the whole sequence on the host)" if state.options.attention_tiles else
                       "sequence-to-head attention" + (" (whole: the budget holds it, so not in tiles)"
                                                       if self.mop_tiles_unneeded else ""))
                    + ", dispatch="
                    f"{dispatch}, "
                    f"head={'Ring-DTP from the vocab pass (the head step compiles at step 1)' if state.options.ring_dtp else 'FSDP2 lm_head'}"
                    f", optimizer {'OffloadStreamAdamW (host state)' if self.mop_offload else 'on the device'}"
                    + (f", {state.released} FSDP2 group(s) on boundpass.backend.gloo_release's collectives"
                       if state.released else "")
                    + "; boundpass.compile off" + (f"; composed budget {format_bytes(self.mop_budget.total)} of "
                                                   f"{config.boundpass.budget}" if self.mop_budget else ""))

    def _offload_optimizer_under_mop(self, bp: BoundpassConfig) -> None:
        """OffloadStreamAdamW in place of the container's AdamWs (state on the host, stepped in buckets of β on
        the device): what the composed budget's offload_adamw operator counts. Same container object; the LR
        schedulers hold the old optimizers, so they are rebuilt and the checkpointer re-pointed."""
        from boundpass.runtime import offload_adamw as oa
        # the budgeted β when checked, else the knobs (None: OffloadStreamAdamW's defaults, from boundpass/core/config.py)
        oa.offload_optimizers_container(self.optimizers, bucket_params=self.mop_bucket or bp.optimizer.bucket,
                                        staging_slots=bp.optimizer.slots)
        self._repoint_at_swapped_optimizers()
        self.metrics_processor.optimizers = self.optimizers

    def _repoint_at_swapped_optimizers(self) -> None:
        """The container's AdamWs were swapped in place: torchtitan's LambdaLRs still hold the old ones, so they
        are rebuilt on the new inner optimizers and the checkpointer is pointed at the new schedulers."""
        self.lr_schedulers = self.config.lr_scheduler.build(optimizers=self.optimizers,
                                                           training_steps=self.config.training.steps)
        states = getattr(self.checkpointer, "states", None)
        if isinstance(states, dict) and LR_SCHEDULER in states:
            states[LR_SCHEDULER] = self.lr_schedulers

    def batch_generator(self, data_iterable):
        if self.mop_state is None:
            return super().batch_generator(data_iterable)
        # shard before torchtitan's generator counts the tokens: train_step then sums this rank's valid tokens over
        # the batch mesh (the W ranks) into the global count, and the logged loss sums the ranks' shares, as it
        # assumes for data replicas; both are right because every token is held by exactly one rank
        return super().batch_generator(self._mop_sequence_shards(data_iterable))

    def _mop_sequence_shards(self, data_iterable):
        from boundpass.runtime.seq_to_head import shard_positions, shard_sequence

        world = self.parallel_dims.world_size
        # the layout's sequence group is every rank (no PP/TP/CP/replicas: check_mop_launch): its rank is the global one
        rank = torch.distributed.get_rank() if world > 1 else 0
        for input_dict, labels in data_iterable:
            seq_len = labels.shape[1]
            keep = shard_sequence(seq_len, rank, world)
            shard = {}
            for key, value in input_dict.items():
                if not (torch.is_tensor(value) and value.shape == labels.shape):
                    raise BoundpassInputError(
                        f"boundpass MoP layout: the dataloader's {key!r} is not a [batch, seq] tensor like the labels; "
                        "the layout only knows how to split those along the sequence")
                shard[key] = value[:, keep].contiguous()
            if "positions" not in shard:  # the unsharded model's positions are 0..L-1
                shard["positions"] = shard_positions(seq_len, rank, world).expand(labels.shape[0], -1)
            yield shard, labels[:, keep].contiguous()

    # ----------------------------------------------------------------------------------------------- step
    def _forward_backward_body(self, inputs: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor,
                               extra_kwargs: dict[str, Any]) -> torch.Tensor:
        if self.bounded is None:
            if self.mop_state is None or (self.mop_state.dispatch_backend is None
                                          and self.mop_state.head_backend is None):
                return super()._forward_backward_body(inputs, labels, global_valid_tokens, extra_kwargs)
            with _boundpass_errors_plainly():  # a pass refused a region
                loss = super()._forward_backward_body(inputs, labels, global_valid_tokens, extra_kwargs)
            if not self._reported and self.config.boundpass.report:
                self._reported = True
                logger.info("[boundpass] " + self._mop_passes_summary().replace("\n", "\n[boundpass] "))
            return loss
        if self.blocks is not None:
            self.blocks.begin_step()
            with _boundpass_errors_plainly():  # a block graph's budget check
                return self._bounded_forward_backward(inputs, labels, global_valid_tokens, extra_kwargs)
        return self._bounded_forward_backward(inputs, labels, global_valid_tokens, extra_kwargs)

    def _bounded_forward_backward(self, inputs, labels, global_valid_tokens, extra_kwargs) -> torch.Tensor:
        with self.train_context():
            if self.capture == "head":
                model = self.model_parts[0]
                hidden = model(inputs, **extra_kwargs)
                # FSDP2 groups [norm, lm_head] in one unit whose post-forward hook waits for lm_head to run; the
                # head reads lm_head's (unsharded) weight inside the compiled graph, so close the unit with an
                # empty call (0 tokens, no memory) that runs FSDP2's hooks eagerly, as ChunkedLossWrapper's
                # lm_head calls do.
                model.lm_head(hidden[:, :0])
                loss, _ = self.bounded(hidden, labels, global_valid_tokens)
                del hidden
            elif self.bounded.loss_fn is not None:
                loss, _ = self.bounded(inputs, labels, global_valid_tokens, **extra_kwargs)
            else:
                pred = self.bounded(inputs, **extra_kwargs)
                loss_kwargs = {"positions": extra_kwargs["positions"]} if "positions" in extra_kwargs else {}
                loss, _ = self.loss_fn(pred, labels, global_valid_tokens, **loss_kwargs)
                del pred
            if self.config.boundpass.certify_only:
                if self.config.boundpass.report:
                    logger.info("[boundpass] " + self.summary().replace("\n", "\n[boundpass] "))
                raise CertifiedOnly(self.certified_peak(), self.certified_host())
            with spmd.no_typecheck():
                loss.backward()
        if not self._reported and self.config.boundpass.report:
            self._reported = True
            logger.info("[boundpass] " + self.summary().replace("\n", "\n[boundpass] "))
        return loss

    def train(self):
        try:
            return super().train()
        except CertifiedOnly as done:
            logger.info(f"[boundpass] {done}")

    def train_step(self, data_iterator):
        if self.blocks is not None:
            # last step's gradients must be gone before this step's exist (the certified peak counts one set): some
            # are only reachable from reference cycles, and torchtitan turns Python's automatic gc off (its
            # GarbageCollection runs every --training.gc_freq steps). Measured: up to 32 MiB of last step's
            # gradients alive at the end of backward on the debug model without this.
            import gc
            self.optimizers.zero_grad(set_to_none=True)
            gc.collect(1)
        if not self.config.boundpass.measure_peak:
            return super().train_step(data_iterator)
        from boundpass.testing.whole_step import allocator_peak_of
        out, peak = allocator_peak_of(lambda: super(BoundpassTrainer, self).train_step(data_iterator),
                                      self._device_state())
        self.peaks.append((self.step, peak))
        certified = self.certified_peak()
        host = self.certified_host() if self.device.type == "cpu" else 0
        # on a CPU the host state (OffloadStreamAdamW's fp32 masters and moments) lives in the same allocator as
        # everything else: the allocator's peak is then compared with the certified device peak + host total
        what = f"certified {format_bytes(certified)}" + (f" + host {format_bytes(host)} (the same memory on CPU)"
                                                        if host else "")
        logger.info(f"[boundpass] step {self.step}: measured peak {format_bytes(peak)} (torch's allocator), {what}"
                    + (f" ({(certified + host) / max(peak, 1):.3f}x measured)" if certified else ""))
        return out

    def _tables(self) -> list:
        """Every budget table boundpass checked for this step: the head's, each block graph's, the head's
        reduce-scatter and the backward's tail; under the MoP layout, the composed per-rank budget checked before
        launch."""
        tables = [c.table for c in self.bounded.certificates] if self.bounded is not None else []
        if getattr(self, "mop_budget", None) is not None:
            tables.append(self.mop_budget)
        if self.blocks is not None:
            tables += [c.table for c in self.blocks.certificates] + self.blocks.phase_tables()
        return tables

    def certified_host(self) -> int:
        """The host bytes the checked tables hold (the optimizer's host state, SCO's pool use)."""
        return max((t.host_total for t in self._tables()), default=0)

    def _device_state(self) -> list:
        """Every tensor live when a step starts: parameters, buffers, last step's gradients, optimizer state."""
        model = self.model_parts[0]
        state = [*model.parameters(), *model.buffers(), *[p.grad for p in model.parameters() if p.grad is not None]]
        for opt in getattr(self.optimizers, "optimizers", [self.optimizers]):
            state += [t for st in getattr(opt, "state", {}).values() for t in st.values() if torch.is_tensor(t)]
        return state

    def certified_peak(self) -> int:
        """The step's certified device peak (bytes): the largest total of every table boundpass checked."""
        return max((t.total for t in self._tables()), default=0)

    # --------------------------------------------------------------------------------------------- report
    def _block_summary(self) -> list[str]:
        blocks = self.blocks
        lines = [f"blocks: {self.block_compile_note}; {blocks.num_blocks} blocks ran {len(blocks.graph_saved)} "
                 f"block graph(s)"]
        for g, at in enumerate(blocks.graph_cert):
            report = blocks.reports[g]
            users = [i for i, run in enumerate(blocks.runs) if run == g]
            lines.append(f"  block graph {g}: blocks {users or '-'}, saves {format_bytes(blocks.graph_saved[g])} "
                         "for backward" + ("" if at is None else
                                            f", step peak with it {format_bytes(blocks.certificates[at].table.total)}"))
            for r in report.regions:
                lines.append(f"    {r.describe()}")
            if report.sco is not None:
                lines += [f"  {line}" for line in report.sco.lines()]
        phases = blocks.phases()
        for name, table in phases:
            lines.append(f"  phase {name}: {format_bytes(table.total)}")
        lines.append(f"  composed step budget: certified peak {format_bytes(self.certified_peak())} of "
                     f"{self.config.boundpass.budget} (the largest total: each block graph with state, the other "
                     "blocks' saved tensors and FSDP2's units; the head's; the phases outside the graphs)")
        worst = max([c.table for c in blocks.certificates] + [t for _, t in phases], key=lambda t: t.total,
                    default=None)
        if worst is not None:
            lines.append(worst.render())
        return lines

    def _mop_passes_summary(self) -> str:
        """The MoP layout's passes after step 1: every block graph the dispatch pass saw and what it rewrote, and the
        head step's vocab region."""
        backend, head = self.mop_state.dispatch_backend, self.mop_state.head_backend
        lines = []
        if backend is not None:
            lines += [f"MoP layout: {backend.graphs} block graph(s) through boundpass's dispatch pass ({backend!r}); "
                      f"routed-experts modules on PipelinedLLEP: {len(self.mop_state.dispatch)}"]
            lines += [f"  {r.describe()}" for r in backend.regions]
        if head is not None:
            lines += [f"MoP layout: the head step through boundpass's vocab pass ({head!r})"]
            lines += [f"  {r.describe()}" for r in head.regions]
        return "\n".join(lines)

    def summary(self) -> str:
        """What boundpass did, over every graph Dynamo handed it: rewritten and skipped regions, graph count."""
        if self.bounded is None:
            return "boundpass off"
        reports = self.bounded.reports
        rewritten = [r for rep in reports for r in rep.rewritten_of("vocab")]
        skipped = [r for rep in reports for r in rep.skipped_of("vocab")]
        dispatch = [r for rep in reports for r in rep.regions if r.kind == "dispatch"]
        lines = [f"{len(reports)} graph(s) captured ({'one graph' if len(reports) == 1 else 'graph breaks'}); "
                 f"vocab regions rewritten: {len(rewritten)}, skipped: {len(skipped)}"]
        for r in rewritten:
            lines.append(f"  REWRITTEN {r.module_path}: Ring-DTP N={r.tokens} H={r.hidden} V={r.vocab} "
                         f"branch={r.branch} C={r.block}")
        for r in skipped:
            lines.append(f"  SKIPPED   {r.module_path}: {r.reason}")
        lines += [f"  {r.describe()}" for r in dispatch]  # expert dispatch regions (PipelinedLLEP)
        if self.blocks is not None:
            lines += self._block_summary()
        if self.bounded.loss_fn is not None and not rewritten:
            lines.append("  WARNING: the vocab region was NOT rewritten in any graph: lm_head -> cross-entropy runs "
                         "unbounded (torchtitan's standard schedule); see docs/recipe.md")
        plan = self.bounded.optimizer_plan
        if plan is not None:
            lines.append(f"  OPTIMIZER {type(plan.optimizer).__name__}: {plan.reason}")
        if reports and reports[-1].table is not None:
            lines.append(reports[-1].table.render())
        return "\n".join(lines)


@contextlib.contextmanager
def _boundpass_errors_plainly():
    """A boundpass error raised inside a Dynamo backend (a pass's refusal, a graph's budget check) re-raised as itself,
    not wrapped in Dynamo's BackendCompilerFailed with its internal traceback."""
    try:
        yield
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        inner = getattr(exc, "inner_exception", None)
        if isinstance(inner, BoundpassError):
            raise inner.with_traceback(None) from None
        raise


class _BlockBackend:
    """The Dynamo backend torchtitan's apply_compile is handed: forwards each block graph to the CompiledBlocks the
    trainer fills in once the optimizer exists (blocks compile at the first forward, after that).

    It holds that CompiledBlocks weakly (the trainer holds it): Dynamo keeps each compiled block function as a
    global of torchtitan's decoder module, where ``torch._dynamo.reset()`` leaves it, and that function reaches this
    backend; a strong reference kept every trainer's model alive for the rest of the process (2 GiB of parameters
    per trainer on the 3-block qwen3 at EP = 2, docs/results/test_times.md, session 11)."""

    _target = None

    @property
    def target(self):
        return self._target() if self._target is not None else None

    @target.setter
    def target(self, blocks) -> None:
        self._target = weakref.ref(blocks)

    def __call__(self, gm, example_inputs):
        target = self.target
        if target is None:
            raise RuntimeError("boundpass recipe: a block was compiled before the trainer set boundpass up (or after "
                               "the trainer was gone)")
        return target.backend(gm, example_inputs)

    def __repr__(self) -> str:  # torchtitan logs the backend
        return "boundpass"


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_mop_launch(config: Trainer.Config, world: int) -> None:
    """Refuse, before anything is built, a launch the MoP layout cannot run (recipes/mop.py's own checks for the
    sequence length and head counts; the degrees and options here)."""
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    from boundpass.recipes.mop import attention_heads
    from boundpass.runtime.seq_to_head import check_head_counts, shard_sequence

    par = config.parallelism
    why = {
        "pipeline parallelism": (par.pipeline_parallel_degree != 1, "--parallelism.pipeline_parallel_degree 1"),
        "tensor parallelism": (par.tensor_parallel_degree != 1, "--parallelism.tensor_parallel_degree 1"),
        "context parallelism (the layout already splits every sequence over all W ranks)":
            (par.context_parallel_degree != 1, "--parallelism.context_parallel_degree 1"),
        "data-parallel replicas of whole sequences": (par.data_parallel_replicate_degree != 1,
                                                     "--parallelism.data_parallel_replicate_degree 1"),
        f"an FSDP degree other than the {world} ranks": (par.data_parallel_shard_degree not in (-1, world),
                                                        "--parallelism.data_parallel_shard_degree -1"),
        f"the {par.spmd_backend} SPMD backend (the layout is built on partial_dtensor)":
            (par.spmd_backend != "partial_dtensor", "--parallelism.spmd_backend partial_dtensor"),
        "validation (the validator feeds whole sequences per data-parallel rank)":
            (config.validator.enable, "--validator.no-enable"),
        "the feed-forward pass yet (the layout's composed budget counts each block's feed-forward whole)":
            (config.boundpass.feed_forward.enable, "--boundpass.feed_forward.no-enable"),
    }
    for what, (refused, fix) in why.items():
        if refused:
            raise BoundpassInputError(f"boundpass MoP layout (--boundpass.layout mop) does not support {what}; "
                                      f"set {fix}, or train with --boundpass.layout default")
    ep = par.expert_parallel_degree
    if world % ep:
        raise BoundpassInputError(f"boundpass MoP layout: the expert-parallel degree E_p = {ep} must divide the "
                                  f"W = {world} ranks; set --parallelism.expert_parallel_degree to one of "
                                  f"{[d for d in range(1, world + 1) if world % d == 0]}")
    shard_sequence(config.training.seq_len, 0, world)  # a ragged last shard is refused with the lengths to use
    check_head_counts(*attention_heads(config), world)
    for i, layer in enumerate(config.model_spec.model.layers):
        inner = getattr(getattr(layer, "attention", None), "inner_attention", None)
        if isinstance(inner, (FlexAttention.Config, VarlenAttention.Config)):
            raise BoundpassInputError(
                f"boundpass MoP layout: layer {i} uses {type(inner).__qualname__.split('.')[0]}, whose document "
                "masks the sequence-to-head exchange does not shard; use the MoP configs (causal SDPA) "
                "of boundpass.recipes (e.g. deepseek_v3_debug_mop)")
    loss = config.loss
    if (not config.boundpass.mop_ring_dtp and isinstance(loss, ChunkedLossWrapper.Config)
            and (config.training.seq_len // world) % loss.num_chunks):
        raise BoundpassInputError(
            f"boundpass MoP layout: each rank holds {config.training.seq_len // world} tokens per sequence, which "
            f"torchtitan's ChunkedLossWrapper cannot split into --loss.num_chunks {loss.num_chunks}; pick a "
            "num_chunks dividing it, or --boundpass.mop_ring_dtp")
    if config.boundpass.budget is not None and not isinstance(config.activation_checkpoint, FullAC.Config):
        raise BoundpassInputError(
            "boundpass MoP layout: --boundpass.budget is checked against the composed per-rank budget, which "
            "assumes every block is activation-checkpointed (torchtitan's FullAC); got "
            f"{type(config.activation_checkpoint).__qualname__}. Add activation-checkpoint:full or drop the budget")


def mop_attention_tiles(config: Trainer.Config, world: int) -> int:
    """C_s of the MoP layout's attention in tiles (``--boundpass.attention.enable``; runtime/seq_to_head_tiles.py):
    ``--boundpass.attention.chunk`` where given, else the knee of the chunked attention's time model at this rank's
    heads (A_q / W) over the whole sequence (docs/knobs.md), never past the rank's own tokens."""
    from boundpass.bound import cost_model
    from boundpass.recipes.mop import attention_heads
    from boundpass.runtime.seq_to_head_tiles import check_tiles_heads

    A_q, A_kv = attention_heads(config)
    check_tiles_heads(A_q, A_kv, world)
    training = config.training
    local = training.seq_len // world
    if config.boundpass.attention.chunk is not None:
        return min(config.boundpass.attention.chunk, local)
    att = config.model_spec.model.layers[0].attention
    if getattr(att, "v_head_dim", None) is not None:      # MLA
        d, d_v = att.qk_nope_head_dim + att.qk_rope_head_dim, att.v_head_dim
    else:
        d = d_v = getattr(att, "head_dim", None) or config.model_spec.model.dim // A_q
    knee = cost_model.chunked_attention_knee(lo=64, hi=max(64, min(1024, local)), B=training.local_batch_size,
                                             L=training.seq_len, A_q=A_q // world, D=d, D_v=d_v,
                                             costs=cost_model.costs_for(_device_type()))
    return min(knee, local)


def choose_mop_attention(model: nn.Module, config: Trainer.Config, dims, options):
    """(the options the layout runs, ``check_mop_budget``'s result for them). With the attention in tiles allowed
    (``options.attention_tiles``, from --boundpass.attention.enable) and its tile left to the planner (no
    --boundpass.attention.chunk): the whole-tensor exchange where the budget holds it (torch's fused kernel on the
    exchanged heads: the faster schedule, measured in docs/results/reach.md), else the tiles; the refusal, where neither
    fits, names what binds with the tiles. A tile given is run as given."""
    if options.attention_tiles and config.boundpass.attention.chunk is None:
        whole = dataclasses.replace(options, attention_tiles=0)
        try:
            return whole, check_mop_budget(model, config, dims, whole)
        except InfeasibleBudgetError:
            pass
    return options, check_mop_budget(model, config, dims, options)


def check_mop_budget(model: nn.Module, config: Trainer.Config, dims, options):
    """(composed per-rank budget of this MoP launch, OffloadStreamAdamW bucket β or None, whether AdamW's state goes
    to the host, PipelinedLLEP's chunk cap c), read off the model built on meta (boundpass.bound.composed;
    `--boundpass.optimizer.offload` auto / True / False decides the offload_adamw operator as boundpass.compile does;
    c and β, where not given, are the one planner's: boundpass.planning.planner.planned_launch);
    InfeasibleBudgetError naming the binding term when it does not fit. Measured against torch's allocator and the
    live-storage tracker: docs/recipe.md."""
    from boundpass.bound import composed
    from boundpass.planning import full_scale as plan
    from boundpass.planning import planner

    bp, training = config.boundpass, config.training
    layers = config.model_spec.model.layers
    top_k = max((l.moe.router.top_k for l in layers if getattr(l, "moe", None) is not None), default=0)
    world = dims.world_size
    # W > 1 reads only the blocks' wide traces (composed.uses_wide_trace): the one-rank MoE block and the head are
    # not traced (3 of the 5 graphs, 4 s of deepseek_v3 debug's 7 s check on 2 ranks here)
    shape = plan.shape_of_module(model, name=config.model_spec.name, heads_config=layers[0].attention, top_k=top_k,
                                 traces="wide" if world > 1 else "all", attention_tiles=options.attention_tiles)
    base = frozenset(name for name, on in (("ring_dtp", options.ring_dtp),
                                           ("pipelined_llep", options.pipelined_llep)) if on)

    budget, host_budget = bp.budget_bytes, bp.host_budget_bytes

    def launch(offload: bool):
        return composed.Launch(
            ranks=world, ep=dims.ep, ring=world, tokens_per_rank=training.local_batch_size * training.seq_len // world,
            operators=base | {"offload_adamw"} if offload else base,
            # b = 4 even under bf16 mixed precision: FSDP2 keeps the sharded parameters and their gradients in fp32
            # (only the gathered copies are bf16), and the composed budget counts both at b (b = 2 would undercount
            # them); activations are then counted at 4 bytes where torchtitan holds 2 (conservative there)
            b=4, b_acc=4, fsdp_param_b=_fsdp_cast_bytes(training),
            # None: the planner's (the widest that fits, up to the dispatch time model's knee on this device)
            dispatch_cap=options.dispatch_cap if options.pipelined_llep else None,
            dispatch_borrowed_slots=options.dispatch_borrowed_slots if options.pipelined_llep else None,
            # Ring-DTP's runtime strip is the whole local vocab shard unless a width is given
            vocab_block=(options.vocab_block or shape.vocab // world) if options.ring_dtp else None,
            optimizer_bucket=bp.optimizer.bucket, optimizer_slots=bp.optimizer.slots,
            held_batch_per_token=composed.trainer_held_batch(world),
            # torchtitan built the RoPE tables at --training.seq_len (update_from_config): N·W / B positions
            sequences_per_step=training.local_batch_size, attention_tiles=options.attention_tiles)

    def checked(offload: bool):
        at = planner.planned_launch(shape, launch(offload), budget=budget, host_budget=host_budget,
                                    device=_device_type())
        table = composed.check(shape, at, budget=budget, host_budget=host_budget)
        cap = at.dispatch_cap if options.pipelined_llep else None
        return table, (at.optimizer_bucket if offload else None), offload, cap

    if bp.optimizer.offload is True:
        return checked(True)
    try:
        return checked(False)
    except InfeasibleBudgetError:
        if bp.optimizer.offload is False:
            raise
        # "auto": AdamW's state on the host when that makes it fit; if it still does not, the error names what
        # binds with the state already offloaded
        return checked(True)


def _device_type() -> str:
    """The device type this trainer runs on (the dispatch time model's constants are read for it)."""
    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else "cpu"


def _fsdp_cast_bytes(training) -> int | None:
    """The bytes of FSDP2's compute dtype when it is narrower than its reduce dtype (bf16 params, fp32 reduce: 2), else
    None (composed.Launch.fsdp_param_b)."""
    param = getattr(torch, training.mixed_precision_param).itemsize
    reduce = getattr(torch, training.mixed_precision_reduce).itemsize
    return param if param < reduce else None


def upgrade_config(config: Trainer.Config) -> BoundpassTrainer.Config:
    """A stock Trainer.Config as a BoundpassTrainer.Config (boundpass section off); others returned as is."""
    if isinstance(config, BoundpassTrainer.Config):
        return config
    if type(config) is not Trainer.Config:
        raise TypeError(f"boundpass recipe: cannot add a boundpass section to {type(config).__qualname__} "
                        "(only torchtitan's Trainer.Config is upgraded)")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return BoundpassTrainer.Config(**values)
