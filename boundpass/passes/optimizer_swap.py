"""Optimizer pass: replace torch AdamW (or the AdamWs in a torchtitan OptimizersContainer) with OffloadStreamAdamW
when the budget needs it or the user asks, migrating existing state, and budget the optimizer's terms: any
optimizer kept on the device is measured by fake steps (boundpass.optimizer_phase), state and step workspace.

This is not a graph rewrite: the optimizer step runs outside every captured graph (torchtitan never compiles
it, and a compiled `opt.step` holds its state as graph constants that cannot move to the host). The decision
is made in `boundpass.compile`, before any LR scheduler is built on the optimizer boundpass returns.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch

from boundpass import symbols as sym
from boundpass.bounds import BoundTerm
from boundpass.errors import BoundpassError, BoundpassInputError
from boundpass.optimizer_phase import OptimizerPhase, optimizer_phase
from boundpass.runtime import offload_adamw as oa
from boundpass.units import format_bytes

OFFLOAD_CHOICES = ("auto", True, False)
DEFAULT_SLOTS = oa.DEFAULT_SLOTS    # two slots suffice to overlap copy-in, update and write-back
MAX_BUCKET = oa.DEFAULT_BUCKET      # elements (2^24); beyond this a bucket only adds staging bytes, not speed
MIN_OVERLAP_BUCKET = 1 << 16  # elements; below this per-bucket launch and copy latency dominates overlap


@dataclass
class OptimizerPlan:
    """What boundpass decided for the optimizer: the one to step, and its budget terms."""
    optimizer: object
    offloaded: bool
    reason: str
    terms: list[BoundTerm] = field(default_factory=list)
    host_bytes: int = 0


def _adamws(optimizer) -> list[torch.optim.Optimizer] | None:
    """The AdamW instances inside `optimizer` (itself, or a torchtitan container's), else None."""
    inner = getattr(optimizer, "optimizers", None)
    candidates = list(inner) if isinstance(inner, (list, tuple)) else [optimizer]
    if all(isinstance(o, torch.optim.AdamW) and not isinstance(o, oa.OffloadStreamAdamW) for o in candidates):
        return candidates
    return None


def _state_elements(optimizers) -> tuple[int, int]:
    """(parameter elements Θ on this rank, bytes per working element b)."""
    params = [oa._local(p) for opt in optimizers for g in opt.param_groups for p in g["params"]]
    return sum(p.numel() for p in params), max((p.element_size() for p in params), default=4)


def _refuse_stale_steps(old: torch.optim.Optimizer) -> None:
    def step(*args, **kwargs):
        raise BoundpassError("boundpass.compile replaced this AdamW with OffloadStreamAdamW (its state moved to the "
                             "host): step compiled.optimizer instead, and build LR schedulers on it")
    old.step = step


def plan_optimizer(optimizer, *, budget: int, persistent: int, offload="auto", bucket: int | None = None,
                   slots: int | None = None, host_budget: int | None = None) -> OptimizerPlan:
    """Decide offload (and β, S), migrate state if offloading, and return the optimizer's budget terms (bytes).

    persistent: bytes already committed on the device (parameters + gradients). slots None: S = 2, or S = 1
    when what the budget leaves cannot hold two slots of useful size (no overlap, but it fits).
    """
    if offload not in OFFLOAD_CHOICES:
        raise BoundpassInputError(f"offload_optimizer must be one of {OFFLOAD_CHOICES}, got {offload!r}")
    if isinstance(optimizer, oa.OffloadStreamAdamW):
        return _offloaded_plan(optimizer, [optimizer], "already OffloadStreamAdamW", host_budget)
    adamws = _adamws(optimizer)
    if adamws is None and offload is True:
        raise BoundpassInputError(f"offload_optimizer=True needs torch.optim.AdamW or a torchtitan "
                                  f"OptimizersContainer of AdamW; got {type(optimizer).__name__}")
    on_device = 0
    if offload is not True:  # what keeping it costs, measured by fake steps: state + step workspace, bytes
        phase = optimizer_phase(optimizer)
        kept = _kept_terms(phase)
        if adamws is None:
            return OptimizerPlan(optimizer, False, f"{phase.name} kept on device (OffloadStreamAdamW takes only "
                                 f"AdamW): state and step workspace measured by a fake step", terms=kept)
        on_device = phase.state_bytes + phase.step_peak_bytes
    theta = _state_elements(adamws)[0]
    if offload is False or (offload == "auto" and persistent + on_device <= budget):
        kept[0].knob = (f"boundpass.compile(..., offload_optimizer=True) moves it to the host "
                        f"(saves {format_bytes(phase.state_bytes)})")
        reason = "kept on device (asked)" if offload is False else "kept on device: it fits the budget"
        return OptimizerPlan(optimizer, False, reason, terms=kept)
    room = max(budget - persistent, 0) // (4 * 4)  # fp32 elements x 4 buffers per slot that fit what is left
    if slots is None:
        slots = DEFAULT_SLOTS if room >= DEFAULT_SLOTS * min(theta, MIN_OVERLAP_BUCKET) else 1
    if bucket is None:  # the largest bucket whose staging fits what parameters and gradients leave
        bucket = max(1, min(theta, MAX_BUCKET, room // slots))
    knobs = dict(bucket_params=bucket, staging_slots=slots)
    if hasattr(optimizer, "optimizers"):
        migrated = oa.offload_optimizers_container(optimizer, **knobs)  # in place: the container object stays
        inner = migrated.optimizers
    else:
        migrated = oa.OffloadStreamAdamW.from_adamw(optimizer, **knobs)
        _refuse_stale_steps(optimizer)
        inner = [migrated]
    reason = "offloaded (asked)" if offload is True else (
        f"offloaded: parameters + gradients + AdamW state and step workspace ({format_bytes(persistent + on_device)}) "
        f"exceed the budget")
    return _offloaded_plan(migrated, inner, reason, host_budget)


def _kept_terms(phase: OptimizerPhase) -> list[BoundTerm]:
    """The device terms of an optimizer kept on the device: its state and its step() workspace (bytes)."""
    knob = "an optimizer with less state, or shard parameters over more ranks (FSDP2 / ZeRO-3)"
    return [BoundTerm(f"optimizer state ({phase.name}: {phase.describe()})", sympy.Integer(phase.state_bytes),
                      phase.state_bytes, kind="persistent", knob=knob),
            BoundTerm(f"optimizer step workspace ({phase.name})", sympy.Integer(phase.step_peak_bytes),
                      phase.step_peak_bytes, kind="step",
                      knob="fused=True (no foreach temporaries) or foreach=False (per-tensor temporaries)")]


def _offloaded_plan(optimizer, inner, reason: str, host_budget: int | None) -> OptimizerPlan:
    terms, host = [], 0
    for opt in inner:
        b = max((oa._local(p).element_size() for p in opt._params), default=4)
        values = oa.bound_values(b=b, Theta=opt.numel, beta=opt.bucket_params, S=opt.staging_slots)
        terms.append(BoundTerm(f"optimizer staging (OffloadStreamAdamW, beta={opt.bucket_params}, "
                               f"S={opt.staging_slots})", oa.offload_adamw_staging_bound(),
                               sym.evaluate(oa.offload_adamw_staging_bound(), values), kind="step",
                               knob="boundpass.compile(..., optimizer_bucket=<smaller beta>)"))
        host += sym.evaluate(oa.offload_adamw_host_bound(), values)
    host_term = BoundTerm("optimizer state on host (fp32 master, exp_avg, exp_avg_sq)",
                          oa.offload_adamw_host_bound(), host, kind="host",
                          knob="more ranks (FSDP2 shards Theta) or a larger host_budget")
    return OptimizerPlan(optimizer, True, reason, terms=terms + [host_term], host_bytes=host)
