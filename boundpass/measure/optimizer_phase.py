"""The optimizer phase of a step, measured from the optimizer itself: its persistent state and the transient
bytes of `step()`, by two fake steps of a fresh copy (FakeTensorMode + LiveStorageTracker), for any torch optimizer.

Nothing real is touched or allocated: the fake copy has its own fake parameters and grads (this rank's local
shapes, dtypes, strides and devices) and its own state; the real optimizer, parameters and state are only read.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from boundpass.core.errors import BoundpassInputError
from boundpass.measure.memtrack import LiveStorageTracker

__all__ = ["OptimizerPhase", "optimizer_phase"]

FAKE_STEPS = 2  # state is created lazily by step 1; step 2 is the steady state; the worst of both is taken


@dataclass(frozen=True)
class OptimizerPhase:
    """One rank's optimizer memory: persistent state and `step()` workspace above params + grads + state (bytes)."""
    name: str                  # optimizer class (a container: its inner classes joined by "+")
    state_bytes: int           # every state tensor after a step (local shards), bytes
    step_peak_bytes: int       # transient bytes step() allocates above params + grads + state
    state_breakdown: dict[str, int] = field(default_factory=dict)  # state key ("exp_avg", "step", ...) -> bytes

    def describe(self) -> str:
        """The state keys, largest first, for a term name (e.g. "exp_avg, exp_avg_sq, step")."""
        keys = sorted(self.state_breakdown, key=lambda k: (-self.state_breakdown[k], k))
        return ", ".join(keys) if keys else "no state"


def optimizer_phase(optimizer) -> OptimizerPhase:
    """Measure `optimizer`'s state and step workspace (bytes) by fake steps; a container (`.optimizers`) sums.

    state_bytes is the fake step's state, per parameter and key, raised to the real state's bytes where the
    real optimizer already holds more (e.g. a checkpoint that loaded fp32 moments for bf16 parameters); real
    state is read (its local shard's numel x element size), never changed. A container steps its optimizers
    one after another, so its workspace is the largest of theirs. Raises BoundpassInputError for an optimizer
    that cannot be faked (constructor needs other arguments, step needs a closure or fails on fake tensors).
    """
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, (list, tuple)):
        phases = [optimizer_phase(o) for o in inner]
        breakdown: dict[str, int] = {}
        for ph in phases:
            for k, v in ph.state_breakdown.items():
                breakdown[k] = breakdown.get(k, 0) + v
        return OptimizerPhase("+".join(dict.fromkeys(ph.name for ph in phases)) or type(optimizer).__name__,
                              sum(ph.state_bytes for ph in phases),
                              max((ph.step_peak_bytes for ph in phases), default=0), breakdown)
    return _one(optimizer)


def _one(opt) -> OptimizerPhase:
    """The phase of one torch optimizer (bytes), from two fake steps of a fresh instance of its class."""
    name = type(opt).__name__
    if not isinstance(opt, torch.optim.Optimizer):
        raise BoundpassInputError(f"{name} is not a torch.optim.Optimizer (nor a container with .optimizers): "
                                  "its state cannot be counted")
    from boundpass.runtime.offload_adamw import OffloadStreamAdamW
    if isinstance(opt, OffloadStreamAdamW):
        raise BoundpassInputError("OffloadStreamAdamW is counted by its own staging and host bounds "
                                  "(boundpass.runtime.offload_adamw), not by a fake step")
    real = [p for g in opt.param_groups for p in g["params"]]
    mode = FakeTensorMode()
    with mode:
        groups = [_fake_group(g, mode) for g in opt.param_groups]
    params = [p for g in groups for p in g["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    peak = 0
    with mode, LiveStorageTracker() as tracker, _ScalarsAsOne():
        tracker.track_existing(params, grads)
        base = tracker.live_bytes()
        fake = _construct(opt, groups, mode)  # inside the tracker: optimizers such as Adagrad build state here
        for _ in range(FAKE_STEPS):
            tracker.reset_peak()
            try:
                fake.step()
            except Exception as e:  # noqa: BLE001 -- any failure means this optimizer cannot be faked
                raise BoundpassInputError(f"{name}.step() cannot run on fake tensors, so its state and step "
                                          f"workspace cannot be counted: {type(e).__name__}: {e}") from e
            peak = max(peak, tracker.peak_bytes())
    per_param = [_state_bytes(fake.state.get(p, {})) for p in params]
    for i, p in enumerate(real):  # real state already held counts where it is larger (never mutated)
        for k, v in _state_bytes(opt.state.get(p, {})).items():
            per_param[i][k] = max(per_param[i].get(k, 0), v)
    breakdown: dict[str, int] = {}
    for d in per_param:
        for k, v in d.items():
            breakdown[k] = breakdown.get(k, 0) + v
    state = sum(breakdown.values())
    return OptimizerPhase(name, state, max(0, peak - base - state), breakdown)


def _fake_group(group: dict, mode: FakeTensorMode) -> dict:
    """A copy of a param group over fake parameters with fake grads; foreach resolved as torch would for it."""
    out = {k: _fake_value(v, mode) for k, v in group.items() if k != "params"}
    out["params"] = [_fake_param(p) for p in group["params"]]
    if out.get("foreach", False) is None and not out.get("fused"):
        # torch picks foreach from the parameters' types and devices, and FakeTensor is not among its
        # supported types: decide from the real parameters so the fake step runs the kernels the real one will
        out["foreach"] = _default_foreach(group["params"], bool(group.get("differentiable", False)))
    return out


def _fake_param(p: torch.Tensor) -> torch.Tensor:
    """A fake leaf with this rank's layout of p (a DTensor's local shard), with a fake grad if p is trained."""
    local = getattr(p, "_local_tensor", p)
    fake = torch.empty_strided(local.size(), local.stride(), dtype=local.dtype, device=local.device,
                               requires_grad=p.requires_grad)
    if p.requires_grad:
        g = getattr(p.grad, "_local_tensor", p.grad) if p.grad is not None else local
        fake.grad = torch.empty_strided(g.size(), g.stride(), dtype=g.dtype, device=g.device)
    return fake


def _fake_value(v, mode: FakeTensorMode):
    """A hyperparameter for the fake copy: tensors (a tensor lr, betas) become fake, the rest is kept."""
    if isinstance(v, torch.Tensor):
        return v if isinstance(v, FakeTensor) and v.fake_mode is mode else mode.from_tensor(v)
    if isinstance(v, (tuple, list)):
        return type(v)(_fake_value(x, mode) for x in v)
    return v


def _default_foreach(params, differentiable: bool) -> bool | None:
    """torch.optim's foreach default for these (real) parameters, counting fake ones by their fake device."""
    try:
        from torch.optim.optimizer import _foreach_supported_types, _get_foreach_kernels_supported_devices
    except ImportError:  # a torch without these internals: leave the default to the optimizer
        return None
    if differentiable or torch.jit.is_scripting():
        return False
    devices = _get_foreach_kernels_supported_devices()
    return all((type(p) in _foreach_supported_types or isinstance(p, FakeTensor))
               and p.device.type in devices and torch.is_floating_point(p) for p in params)


def _construct(opt, groups: list[dict], mode: FakeTensorMode) -> torch.optim.Optimizer:
    """type(opt)(groups, **its constructor's defaults): a fresh optimizer of the same class over fake groups."""
    cls = type(opt)
    try:
        sig = inspect.signature(cls.__init__).parameters
        takes_any = any(q.kind is inspect.Parameter.VAR_KEYWORD for q in sig.values())
        kwargs = {k: v for k, v in opt.defaults.items() if takes_any or k in sig}
        return cls(groups, **{k: _fake_value(v, mode) for k, v in kwargs.items()})
    except Exception as e:  # noqa: BLE001
        raise BoundpassInputError(f"{cls.__name__}(param_groups, **defaults) cannot be constructed over fake "
                                  f"parameters, so its state and step workspace cannot be counted: "
                                  f"{type(e).__name__}: {e}") from e


def _state_bytes(state: dict) -> dict[str, int]:
    """Bytes of each tensor in one parameter's state (a DTensor: its local shard)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            t = getattr(v, "_local_tensor", v)
            out[str(k)] = t.numel() * t.element_size()
    return out


class _ScalarsAsOne(TorchDispatchMode):
    """Lets `.item()` of a fake tensor (a step count, a norm) return its value when fake mode knows it, else 1."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            try:
                return func(*args, **(kwargs or {}))
            except Exception:  # noqa: BLE001 -- data-dependent under fake mode: 1 keeps step-count formulas finite
                dtype = args[0].dtype
                return True if dtype == torch.bool else (1.0 if dtype.is_floating_point or dtype.is_complex else 1)
        return func(*args, **(kwargs or {}))
