"""Optimizer pass: replace torch AdamW (or the AdamWs in a torchtitan OptimizersContainer) with OffloadStreamAdamW
when the budget needs it or the user asks, migrating existing state, and budget the optimizer's terms: any
optimizer kept on the device is measured by fake steps (boundpass.measure.optimizer_phase), state and step workspace.

This is not a graph rewrite: the optimizer step runs outside every captured graph (torchtitan never compiles
it, and a compiled `opt.step` holds its state as graph constants that cannot move to the host). The decision
is made in `boundpass.compile`, before any LR scheduler is built on the optimizer boundpass returns.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch

from boundpass.core import symbols as sym
from boundpass.bound.bounds import BoundTerm
from boundpass.core.config import OptimizerConfig
from boundpass.core.errors import BoundpassError, BoundpassInputError
from boundpass.measure.optimizer_phase import OptimizerPhase, optimizer_phase
from boundpass.bound.bounds import Knob
from boundpass.runtime import offload_adamw as oa
from boundpass.core.units import format_bytes

MAX_BUCKET = oa.DEFAULT_BUCKET      # elements (2^24): the widest bucket compile considers (the knee is below it)
MIN_OVERLAP_BUCKET = 1 << 16  # elements; below this per-bucket launch and copy latency dominates overlap


@dataclass
class OptimizerPlan:
    """What boundpass decided for the optimizer: the one to step, and its budget terms."""
    optimizer: object
    offloaded: bool
    reason: str
    terms: list[BoundTerm] = field(default_factory=list)
    host_bytes: int = 0
    knobs: list = field(default_factory=list)   # planner.Knob for β (optimizer_bucket) and S (optimizer_slots)


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


def plan_optimizer(optimizer, *, budget: int, persistent: int, knobs: OptimizerConfig | None = None,
                   host_budget: int | None = None) -> OptimizerPlan:
    """Decide offload (and β, S), migrate state if offloading, and return the optimizer's budget terms (bytes).

    persistent: bytes already committed on the device (parameters + gradients). knobs: Config's optimizer section
    (validated there): offload, and bucket / slots (None: chosen by the knee rule, ``choose_knobs``, docs/knobs.md;
    the plan's ``knobs`` say what and why).
    """
    knobs = knobs if knobs is not None else OptimizerConfig()
    offload, bucket, slots = knobs.offload, knobs.bucket, knobs.slots
    if isinstance(optimizer, oa.OffloadStreamAdamW):
        return _offloaded_plan(optimizer, [optimizer], "already OffloadStreamAdamW", host_budget)
    adamws = _adamws(optimizer)
    if adamws is None and offload is True:
        raise BoundpassInputError(f"optimizer_offload=True needs torch.optim.AdamW or a torchtitan "
                                  f"OptimizersContainer of AdamW; got {type(optimizer).__name__}")
    on_device = 0
    if offload is not True:  # what keeping it costs, measured by fake steps: state + step workspace, bytes
        phase = optimizer_phase(optimizer)
        kept = _kept_terms(phase)
        if adamws is None:
            return OptimizerPlan(optimizer, False, f"{phase.name} kept on device (OffloadStreamAdamW takes only "
                                 f"AdamW): state and step workspace measured by a fake step", terms=kept)
        on_device = phase.state_bytes + phase.step_peak_bytes
    if offload is False or (offload == "auto" and persistent + on_device <= budget):
        kept[0].knob = (f"boundpass.compile(..., optimizer_offload=True) moves it to the host "
                        f"(saves {format_bytes(phase.state_bytes)})")
        reason = "kept on device (asked)" if offload is False else "kept on device: it fits the budget"
        return OptimizerPlan(optimizer, False, reason, terms=kept)
    room = max(budget - persistent, 0) // (4 * 4)  # fp32 elements x 4 buffers per slot that fit what is left
    b = _state_elements(adamws)[1]
    plan_knobs = choose_knobs(adamws, room=room, bucket=bucket, slots=slots, b=b)
    bucket, slots = (k.value for k in plan_knobs)
    chosen = dict(bucket_params=bucket, staging_slots=slots)
    if hasattr(optimizer, "optimizers"):
        migrated = oa.offload_optimizers_container(optimizer, **chosen)  # in place: the container object stays
        inner = migrated.optimizers
    else:
        migrated = oa.OffloadStreamAdamW.from_adamw(optimizer, **chosen)
        _refuse_stale_steps(optimizer)
        inner = [migrated]
    reason = "offloaded (asked)" if offload is True else (
        f"offloaded: parameters + gradients + AdamW state and step workspace ({format_bytes(persistent + on_device)}) "
        f"exceed the budget")
    out = _offloaded_plan(migrated, inner, reason, host_budget)
    out.knobs = plan_knobs
    return out


def choose_knobs(adamws, *, room: int, bucket: int | None, slots: int | None, b: int = 4) -> list[Knob]:
    """β and S by the planner's rule (docs/knobs.md): the user's, else min(what ``room`` allows, the knee).

    room: fp32 elements x 4 (bytes / 16) the budget leaves for staging. The knee is cost_model's
    ``offload_adamw_knee`` at this optimizer's Θ, tensor count, working dtype and device. S first: the knee's
    slots while ``room`` holds that many slots of a useful size (min(Θ, MIN_OVERLAP_BUCKET)), fewer otherwise;
    then β: min(room // S, the knee's bucket at that S).
    """
    from boundpass.bound import cost_model
    params = [oa._local(p) for opt in adamws for g in opt.param_groups for p in g["params"]]
    theta = max(1, sum(p.numel() for p in params))
    device = params[0].device.type if params else "cpu"
    costs = cost_model.costs_for(device)
    hi = max(1, min(theta, MAX_BUCKET))
    lo = min(cost_model.OPT_MIN_BUCKET, hi)
    model = dict(Theta=theta, tensors=len(params), b=b, costs=costs, lo=lo, hi=hi)
    s_knob = Knob("optimizer_slots", sym.S, lo=1, hi=cost_model.OPT_MAX_SLOTS, arg="staging_slots", ops=(),
                  user=slots)
    b_knob = Knob("optimizer_bucket", sym.beta, lo=1, hi=hi, arg="bucket_params", ops=(), user=bucket)
    knee_beta, knee_slots = cost_model.offload_adamw_knee(beta=bucket, S=slots, **model)
    s_knob.knee = knee_slots
    s_knob.settle(max(1, min(s_knob.hi, room // min(theta, MIN_OVERLAP_BUCKET))))
    if s_knob.value != knee_slots and bucket is None:  # the budget took slots: the bucket's knee at the slots left
        knee_beta, _ = cost_model.offload_adamw_knee(S=s_knob.value, **model)
    b_knob.knee = knee_beta
    b_knob.settle(max(1, min(hi, room // s_knob.value)))
    return [b_knob, s_knob]


def narrow_bucket(knob: Knob, widest: int) -> int:
    """The bucket once the step's graph shows what the optimizer phase really leaves (``widest`` elements per
    slot): min(widest, knee) by the same rule, never wider than before; the user's value is kept."""
    return knob.settle(max(1, min(knob.widest_fitting or knob.hi, widest)))


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
