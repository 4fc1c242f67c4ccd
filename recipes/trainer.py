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
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import spmd_types as spmd
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.components.checkpointer import LR_SCHEDULER
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer


@dataclass(kw_only=True, slots=True)
class BoundpassConfig:
    """The `--boundpass.*` section. boundpass is on iff `budget` is set and `enable` is true."""

    enable: bool = True
    """Master switch; `--boundpass.no-enable` trains as stock torchtitan even with a budget."""
    budget: str | None = None
    """Per-rank device budget ("2GiB", "700MiB", bytes). None: boundpass off (stock torchtitan)."""
    host_budget: str | None = None
    """Per-rank host budget for offloaded optimizer state (None: unchecked)."""
    vocab: bool = True
    """Ring-DTP vocab rewrite of lm_head -> cross-entropy (replaces ChunkedLossWrapper by its inner CE loss)."""
    vocab_block: int | None = None
    """Ring-DTP strip width C (None: the widest that fits the budget)."""
    max_tokens_per_rank: int | None = None
    """Largest token count N any rank holds at the vocab projection (None: this rank's)."""
    offload_optimizer: Literal["auto", "true", "false"] = "auto"
    """OffloadStreamAdamW swap: auto (when AdamW moments do not fit), true (always), false (never)."""
    optimizer_bucket: int | None = None
    """OffloadStreamAdamW bucket size in elements (None: the largest that fits)."""
    optimizer_slots: int | None = None
    """OffloadStreamAdamW staging slots (None: 2, or 1 when two do not fit)."""
    inner: Literal["aot_eager", "inductor"] = "aot_eager"
    """Kernels after boundpass's rewrite: eager (aot_eager) or Inductor."""
    capture: Literal["auto", "head", "model"] = "auto"
    """What boundpass.compile captures. "model": the whole model + loss (fullgraph; only for a model that is
    not FSDP2-wrapped). "head": lm_head -> loss as one graph while torchtitan runs the trunk as it always does
    (the only way to keep the vocab region in one graph under FSDP2). "auto": "head" when FSDP2-wrapped."""
    report: bool = True
    """Log boundpass's report (regions rewritten / skipped, bounds table) after the first step."""
    record_losses: str | None = None
    """Append each logged step's global loss and grad norm at full precision as JSON lines to this file
    (rank 0). Works with boundpass off too: it is how stock and boundpass runs are compared step by step."""

    @property
    def active(self) -> bool:
        return self.enable and self.budget is not None


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


class BoundpassTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        boundpass: BoundpassConfig = field(default_factory=BoundpassConfig)

    def __init__(self, config: Config):
        self.bounded = None
        self._reported = False
        bp = config.boundpass
        if bp.active and bp.vocab and isinstance(config.loss, ChunkedLossWrapper.Config):
            config.loss = config.loss.loss_fn  # see the module docstring: a chunked eager backward cannot be captured
        super().__init__(config)
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
        if capture == "head" and not bp.vocab:
            raise ValueError("boundpass recipe: --boundpass.capture head only captures the vocab region; it needs "
                             "--boundpass.vocab")
        self.capture = capture
        if capture == "head":
            model._skip_lm_head = True  # the trunk returns the normed hidden state; VocabHead does lm_head -> loss
            target = VocabHead(model)
        else:
            target = model
        offload = {"auto": "auto", "true": True, "false": False}[bp.offload_optimizer]
        before = list(self.optimizers.optimizers)
        self.bounded = boundpass.compile(
            target, budget=bp.budget, host_budget=bp.host_budget,
            loss_fn=self.loss_fn if bp.vocab else None,
            vocab_block=bp.vocab_block, max_tokens_per_rank=bp.max_tokens_per_rank,
            optimizer=self.optimizers, offload_optimizer=offload, optimizer_bucket=bp.optimizer_bucket,
            optimizer_slots=bp.optimizer_slots, inner=bp.inner, fullgraph=True)
        plan = self.bounded.optimizer_plan
        if plan is not None and list(self.optimizers.optimizers) != before:
            # boundpass swapped the container's AdamWs in place: torchtitan's LambdaLRs still hold the old ones.
            self.lr_schedulers = self.config.lr_scheduler.build(optimizers=self.optimizers,
                                                               training_steps=self.config.training.steps)
            states = getattr(self.checkpointer, "states", None)
            if isinstance(states, dict) and LR_SCHEDULER in states:
                states[LR_SCHEDULER] = self.lr_schedulers
        self.metrics_processor.optimizers = self.optimizers
        logger.info(f"[boundpass] on: budget {bp.budget}, vocab rewrite {'on' if bp.vocab else 'off'}, "
                    f"capture={capture}{' (model is FSDP2-wrapped)' if self.fsdp_wrapped else ''}, optimizer: "
                    f"{plan.reason if plan else 'not given'}")

    # ----------------------------------------------------------------------------------------------- step
    def _forward_backward_body(self, inputs: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor,
                               extra_kwargs: dict[str, Any]) -> torch.Tensor:
        if self.bounded is None:
            return super()._forward_backward_body(inputs, labels, global_valid_tokens, extra_kwargs)
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
            with spmd.no_typecheck():
                loss.backward()
        if not self._reported and self.config.boundpass.report:
            self._reported = True
            logger.info("[boundpass] " + self.summary().replace("\n", "\n[boundpass] "))
        return loss

    # --------------------------------------------------------------------------------------------- report
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
        if self.bounded.loss_fn is not None and not rewritten:
            lines.append("  WARNING: the vocab region was NOT rewritten in any graph: lm_head -> cross-entropy runs "
                         "unbounded (torchtitan's standard schedule); see docs/recipe.md")
        plan = self.bounded.optimizer_plan
        if plan is not None:
            lines.append(f"  OPTIMIZER {type(plan.optimizer).__name__}: {plan.reason}")
        if reports and reports[-1].table is not None:
            lines.append(reports[-1].table.render())
        return "\n".join(lines)


def upgrade_config(config: Trainer.Config) -> BoundpassTrainer.Config:
    """A stock Trainer.Config as a BoundpassTrainer.Config (boundpass section off); others returned as is."""
    if isinstance(config, BoundpassTrainer.Config):
        return config
    if type(config) is not Trainer.Config:
        raise TypeError(f"boundpass recipe: cannot add a boundpass section to {type(config).__qualname__} "
                        "(only torchtitan's Trainer.Config is upgraded)")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return BoundpassTrainer.Config(**values)
