"""OffloadStreamAdamW: AdamW whose fp32 master weights and moments live on the host, streamed in bounded buckets.

The device keeps only the working weights (the params, any float dtype) and their grads. ``step()`` walks this
rank's parameters as one flat range of Θ elements cut into buckets of at most β elements (a tensor larger than
β is split by flat element ranges; small tensors share a bucket) and rotates the buckets through S staging slots:

    H2D   copy the bucket's fp32 master, exp_avg, exp_avg_sq from the host into the slot
    update  gather the bucket's grads into the slot (cast to fp32), AdamW on the flat slot tensors,
            refresh the working weights from the updated master (cast to their dtype)
    D2H   write master and moments back to the host

On CUDA the three stages run on three streams ordered by events, so up to S buckets are in flight. On a CPU
device host and device are the same memory: the same buckets and slots are used in program order (identical
bounds and arithmetic, no overlap). The update is the op sequence of ``torch.optim.AdamW(foreach=False,
fused=False)`` applied elementwise to the slot, so fp32 results are bit-identical to it (``torch._fused_adamw_``
is not: it differs by up to 2.4e-7 after 10 steps). See docs/offload_adamw.md.
"""
from __future__ import annotations

import contextlib
import itertools

import sympy
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from boundpass.core import symbols as sym
from boundpass.core.config import OPTIMIZER_SLOTS, OPTIMIZER_STAGING_BYTES
from boundpass.core.errors import BoundpassInputError

__all__ = ["OffloadStreamAdamW", "DEFAULT_STAGING_BYTES", "DEFAULT_SLOTS", "DEFAULT_BUCKET", "default_bucket",
           "offload_adamw_bound", "offload_adamw_staging_bound", "offload_adamw_host_bound",
           "reference_adamw_bound", "bound_values", "offload_optimizers_container"]

_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
# The defaults when β and S are not given (OffloadStreamAdamW(params, lr=...) as for torch.optim.AdamW): the
# staging's device bytes during step(), offload_adamw_staging_bound() = 16·S·β. 512 MiB = S = 2 slots of
# β = 2^24 elements: the widest bucket boundpass.compile chooses (a wider one only adds staging bytes), and a
# transient small beside the 16·Θ bytes torch AdamW keeps resident for a model large enough to need offloading
# (Θ ≥ 2^25). Both are defined once, in boundpass/core/config.py (optimizer.slots / optimizer.bucket left at None); every
# other default of β (plan, the composed budget, the MoP recipe) is derived from them here.
DEFAULT_STAGING_BYTES = OPTIMIZER_STAGING_BYTES
DEFAULT_SLOTS = OPTIMIZER_SLOTS  # S: one bucket's copies overlap the next bucket's update (CUDA streams)
_SLOT_BYTES_PER_ELEMENT = 4 * 4  # master, exp_avg, exp_avg_sq, fp32 grad: offload_adamw_staging_bound() / (S·β)


def default_bucket(staging_slots: int = DEFAULT_SLOTS) -> int:
    """β when it is not given: the bucket whose S slots stage DEFAULT_STAGING_BYTES (2^24 elements at S = 2)."""
    return max(1, DEFAULT_STAGING_BYTES // (_SLOT_BYTES_PER_ELEMENT * staging_slots))


DEFAULT_BUCKET = default_bucket()  # β at the default S
# AdamW group keys that select torch's implementation; they mean nothing here and are not carried over.
_TORCH_IMPL_KEYS = {"foreach", "fused", "capturable", "differentiable", "amsgrad", "maximize",
                    "decoupled_weight_decay"}
_WORKING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The aten op, not Tensor.copy_: the Python binding opens a device guard, which fake "cuda" tensors on a
# CPU-only build cannot; the device kernels guard themselves.
_copy = torch.ops.aten.copy_.default


def _refuse_unimplemented(group: dict, where: str) -> None:
    """AdamW variants this optimizer does not compute: refused wherever they are set (the constructor's arguments,
    a group dict, add_param_group, a group edited later), never silently ignored."""
    on = [key for key in ("amsgrad", "maximize") if group.get(key)]
    if group.get("decoupled_weight_decay") is False and group.get("weight_decay"):
        on.append("decoupled_weight_decay=False (Adam's coupled weight decay)")
    if on:
        raise BoundpassInputError(f"OffloadStreamAdamW computes AdamW without {' / '.join(on)}, which {where} sets; "
                                  f"use torch.optim.AdamW for those")


def _local(t: Tensor) -> Tensor:
    """This rank's shard of an FSDP2/DTensor parameter or grad (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


class _Slot:
    """One staging slot on the device: β fp32 elements each of master, exp_avg, exp_avg_sq and grad."""

    def __init__(self, elements: int, device: torch.device):
        self.master, self.exp_avg, self.exp_avg_sq, self.grad = (
            torch.empty(elements, dtype=torch.float32, device=device) for _ in range(4))


class OffloadStreamAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with host-resident fp32 state, stepped in buckets of ≤ β elements.

    A drop-in for ``torch.optim.AdamW``: AdamW's own arguments (params, lr, betas, eps, weight_decay) are enough.
    ``bucket_params`` (β): elements per bucket; ``staging_slots`` (S): buckets in flight, each slot holds
    16·β bytes on the device during ``step()`` (freed after it). Not given, S = DEFAULT_SLOTS (2) and β =
    default_bucket(S): the bucket whose slots stage DEFAULT_STAGING_BYTES (512 MiB: β = 2^24 at S = 2). Slots
    are never wider than the largest bucket nor more than the buckets: a model smaller than β stages 16·Θ bytes.
    ``pin_memory=None`` pins the host state when the params are on a real CUDA device. Masters are taken from the
    params at the first step after construction or a load without masters; from then on the params are casts of
    the masters.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, *, bucket_params: int | None = None, staging_slots: int | None = None,
                 host_device: str | torch.device = "cpu", pin_memory: bool | None = None,
                 amsgrad: bool = False, maximize: bool = False):
        for name, value in (("bucket_params (β)", bucket_params), ("staging_slots (S)", staging_slots)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise BoundpassInputError(f"OffloadStreamAdamW: {name} must be an int >= 1, got {value!r}")
        staging_slots = DEFAULT_SLOTS if staging_slots is None else staging_slots
        bucket_params = default_bucket(staging_slots) if bucket_params is None else bucket_params
        if amsgrad or maximize:
            raise BoundpassInputError("OffloadStreamAdamW supports amsgrad=False and maximize=False only; use "
                                      "torch.optim.AdamW for amsgrad / maximize")
        if torch.device(host_device).type != "cpu":
            raise BoundpassInputError(f"OffloadStreamAdamW keeps its state in host memory: host_device must be "
                                      f"'cpu', got {host_device!r}")
        _check_hyper(lr, betas, eps, weight_decay)
        self.bucket_params, self.staging_slots, self._pin = bucket_params, staging_slots, pin_memory
        self._host: dict[str, Tensor] | None = None  # flat fp32 host state, allocated at the first step/load
        self._streams = None                         # (h2d, compute, d2h) on a real CUDA device
        self._written_back = None                    # event: host state complete after the last step
        self._masters_pending: set[int] = set()      # params whose master is still to be taken from them
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    # ------------------------------------------------------------------------------------------ layout
    def add_param_group(self, param_group: dict) -> None:
        """Add a group (checked: float dtype, dense, contiguous, one device) before the state exists."""
        if self._host is not None:
            raise BoundpassInputError("OffloadStreamAdamW: add_param_group after the first step/load would "
                                      "resize the host state; build a new optimizer with all groups instead")
        group = {**self.defaults, **param_group}
        _refuse_unimplemented(group, "a param group")
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        items = param_group["params"]
        param_group["params"] = items = [items] if isinstance(items, Tensor) else list(items)
        new = [_local(item[1] if isinstance(item, tuple) else item) for item in items]
        for local in new:
            if local.layout != torch.strided or local.dtype not in _WORKING_DTYPES:
                raise BoundpassInputError(
                    f"OffloadStreamAdamW: params must be dense {', '.join(map(str, _WORKING_DTYPES))} tensors "
                    f"(fp32 masters), got {local.dtype} layout {local.layout} of shape {tuple(local.shape)}")
            if not local.is_contiguous():
                raise BoundpassInputError(f"OffloadStreamAdamW: param of shape {tuple(local.shape)} is not "
                                          "contiguous; buckets address params by flat element ranges")
        devices = {t.device for t in new} | {_local(p).device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise BoundpassInputError(f"OffloadStreamAdamW: all params must be on one device, got {devices}")
        super().add_param_group(param_group)
        self.device = devices.pop()
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [i for i, g in enumerate(self.param_groups) for _ in g["params"]]
        self._numels = [_local(p).numel() for p in self._params]
        self._starts = list(itertools.accumulate(self._numels, initial=0))[:-1]
        self.numel = sum(self._numels)

    def _buckets(self) -> list[tuple[int, int, list[tuple[int, int, int, int]]]]:
        """Buckets as (start, stop, pieces) over the flat range; a piece is (param, lo, hi, slot offset)."""
        beta, out, i = self.bucket_params, [], 0
        for start in range(0, self.numel, beta):
            stop, pieces = min(start + beta, self.numel), []
            while i < len(self._params) and self._starts[i] < stop:
                lo = max(start, self._starts[i]) - self._starts[i]
                hi = min(stop, self._starts[i] + self._numels[i]) - self._starts[i]
                if hi > lo:
                    pieces.append((i, lo, hi, self._starts[i] + lo - start))
                if self._starts[i] + self._numels[i] > stop:
                    break  # this tensor continues in the next bucket
                i += 1
            out.append((start, stop, pieces))
        return out

    # ------------------------------------------------------------------------------------------- state
    def _allocate_host_state(self) -> None:
        """Allocate the 12·Θ-byte flat host state; state[p] holds views of it shaped like the local param."""
        pin = self._pin if self._pin is not None else (
            self.device.type == "cuda" and torch.cuda.is_available() and not _is_fake(_local(self._params[0])))
        self._host = {k: torch.empty(self.numel, dtype=torch.float32, device="cpu", pin_memory=pin)
                      for k in _STATE_KEYS}
        for i, p in enumerate(self._params):
            views = {k: self._host[k].narrow(0, self._starts[i], self._numels[i]).view(_local(p).shape)
                     for k in _STATE_KEYS}
            self.state[p] = {"step": 0.0, **views}

    def _reset_state(self) -> None:
        """Fresh state: zero moments, step 0, masters taken from the params when next needed."""
        for p in self._params:
            state = self.state[p]
            state["step"] = 0.0
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
        # Until a step (or a loaded master) the params are the truth: weights loaded into the model after
        # construction or migration, e.g. by a checkpointer, must not be overwritten by stale masters.
        self._masters_pending = set(range(len(self._params)))

    def _take_pending_masters(self) -> None:
        for i in sorted(self._masters_pending):
            self._copy_bounded(self.state[self._params[i]]["master"], _local(self._params[i]).detach())
        self._masters_pending = set()

    def _copy_bounded(self, host_view: Tensor, src: Tensor) -> None:
        """Copy src into a host view in pieces of ≤ β elements: a casting D2H copy stages ≤ 4·β device bytes."""
        dst, src = host_view.view(-1), src.reshape(-1)
        if dst.numel() != src.numel():
            raise BoundpassInputError(f"OffloadStreamAdamW: state of {src.numel()} elements does not fit a "
                                      f"param of {dst.numel()} elements")
        for lo in range(0, dst.numel(), self.bucket_params):
            hi = min(lo + self.bucket_params, dst.numel())
            _copy(dst.narrow(0, lo, hi - lo), src.narrow(0, lo, hi - lo))

    def _wait_written_back(self) -> None:
        if self._written_back is not None:
            self._written_back.synchronize()

    # -------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every param with a grad (params with grad None are skipped, like torch)."""
        for group in self.param_groups:  # a group's flags may have been set after it was added
            _refuse_unimplemented(group, "param_groups (set after construction)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [self._checked_grad(p) for p in self._params]
        if all(g is None or g.numel() == 0 for g in grads):
            return loss
        if self._host is None:
            self._allocate_host_state()
            self._reset_state()
        self._take_pending_masters()
        for p, g in zip(self._params, grads):
            if g is not None:
                self.state[p]["step"] += 1.0
        work = []
        for start, stop, pieces in self._buckets():
            live = [piece for piece in pieces if grads[piece[0]] is not None]
            if live:  # a bucket without grads keeps its state: nothing to move
                work.append((start, stop, live))
        slots = [_Slot(min(self.bucket_params, max(stop - start for start, stop, _ in work)), self.device)
                 for _ in range(min(self.staging_slots, len(work)))]
        self._run(work, slots, grads)
        return loss

    def _checked_grad(self, p: Tensor) -> Tensor | None:
        """The flat local grad of p, or None; refuses what the flat fp32 slots cannot take, before allocating."""
        if p.grad is None:
            return None
        grad = _local(p.grad)
        if grad.layout != torch.strided or not grad.is_floating_point():
            raise BoundpassInputError(f"OffloadStreamAdamW: grads must be dense real floating tensors, got "
                                      f"{grad.dtype} layout {grad.layout} for a param of shape {tuple(p.shape)}")
        if grad.shape != _local(p).shape or not grad.is_contiguous():
            raise BoundpassInputError(f"OffloadStreamAdamW: grad of shape {tuple(grad.shape)} (contiguous="
                                      f"{grad.is_contiguous()}) must be contiguous like its param "
                                      f"{tuple(_local(p).shape)}")
        return grad.view(-1)

    def _run(self, work, slots: list[_Slot], grads: list[Tensor | None]) -> None:
        """Rotate the buckets through the slots: H2D, update, D2H; on CUDA on three streams, ≤ S in flight."""
        if self.device.type == "cuda" and not _is_fake(slots[0].master):
            if self._streams is None:
                self._streams = tuple(torch.cuda.Stream(self.device) for _ in range(3))
            h2d, compute, d2h = self._streams
            origin = torch.cuda.current_stream(self.device)
            for stream in self._streams:  # grads, slots and params were last touched on the origin stream
                stream.wait_stream(origin)
        else:
            h2d = compute = d2h = origin = None
        freed = [None] * len(slots)  # event: D2H of the slot's previous bucket done, the slot may be refilled
        for k, (start, stop, pieces) in enumerate(work):
            slot, n = slots[k % len(slots)], stop - start
            with _on(h2d):
                _wait(h2d, freed[k % len(slots)])
                for key in _STATE_KEYS:
                    _copy(getattr(slot, key).narrow(0, 0, n), self._host[key].narrow(0, start, n), True)
                loaded = _record(h2d)
            with _on(compute):
                _wait(compute, loaded)
                self._update(slot, pieces, grads)
                updated = _record(compute)
            with _on(d2h):
                _wait(d2h, updated)
                for key in _STATE_KEYS:
                    _copy(self._host[key].narrow(0, start, n), getattr(slot, key).narrow(0, 0, n), True)
                freed[k % len(slots)] = _record(d2h)
        if origin is not None:  # the next forward reads refreshed params; slots are freed on origin after this
            origin.wait_stream(compute)
            origin.wait_stream(d2h)
            self._written_back = freed[(len(work) - 1) % len(slots)]

    def _update(self, slot: _Slot, pieces, grads) -> None:
        """AdamW on the slot, one flat segment per run of pieces sharing (group, step); then refresh params."""
        for i, lo, hi, at in pieces:
            _copy(slot.grad.narrow(0, at, hi - lo), grads[i].narrow(0, lo, hi - lo))  # the reference's fp32 upcast
        segments = []
        for i, lo, hi, at in pieces:
            key = (self._group_of[i], self.state[self._params[i]]["step"])
            if segments and segments[-1][0] == key and segments[-1][2] == at:
                segments[-1][2] = at + hi - lo
            else:
                segments.append([key, at, at + hi - lo])
        for (group_index, step), a, b in segments:
            _adamw_flat(self.param_groups[group_index], step,
                        *(t.narrow(0, a, b - a) for t in (slot.master, slot.exp_avg, slot.exp_avg_sq, slot.grad)))
        for i, lo, hi, at in pieces:
            _copy(_local(self._params[i]).detach().view(-1).narrow(0, lo, hi - lo), slot.master.narrow(0, at, hi - lo))

    # ------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """torch's layout plus a fp32 'master' per param; tensors alias the host state (DTensor for DTensor params)."""
        self._wait_written_back()
        if self._host is not None:
            self._take_pending_masters()
        sd = super().state_dict()
        out = {}
        for index, state in sd["state"].items():
            param = self._params[index]
            entry = {"step": torch.tensor(state["step"], dtype=torch.float32)}
            for key in _STATE_KEYS:
                entry[key] = state[key] if not isinstance(param, DTensor) else DTensor.from_local(
                    state[key], param.device_mesh, param.placements, run_check=False, shape=param.shape,
                    stride=param.stride())
            out[index] = entry
        sd["state"] = out
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load our state_dict or a torch AdamW one (masters then come from the current params)."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise BoundpassInputError(
                f"OffloadStreamAdamW.load_state_dict: saved param groups have sizes "
                f"{[len(g['params']) for g in saved_groups]}, this optimizer "
                f"{[len(g['params']) for g in self.param_groups]}")
        for saved in saved_groups:
            if saved.get("amsgrad") or saved.get("maximize") or (
                    saved.get("decoupled_weight_decay") is False and saved.get("weight_decay")):
                raise BoundpassInputError("OffloadStreamAdamW can only load AdamW state without amsgrad/maximize "
                                          "(Adam's coupled weight decay differs from AdamW's)")
        position = {index: k for k, index in enumerate(i for g in saved_groups for i in g["params"])}
        self._check_saved_state(state_dict.get("state", {}), position)  # before anything is reset or allocated
        self._wait_written_back()
        if self._host is None:
            self._allocate_host_state()
        state_dict = self._unaliased(state_dict)
        self._reset_state()
        for index, saved in state_dict["state"].items():
            state = self.state[self._params[position[index]]]
            state["step"] = float(_local(saved["step"]) if isinstance(saved["step"], Tensor) else saved["step"])
            for key in _STATE_KEYS:
                if key in saved:
                    self._copy_bounded(state[key], _local(saved[key]))
            if "master" in saved:
                self._masters_pending.discard(position[index])
        for saved, own in zip(saved_groups, self.param_groups):
            own.update({k: v for k, v in saved.items() if k not in _TORCH_IMPL_KEYS and k != "params"})

    def _check_saved_state(self, saved_state: dict, position: dict) -> None:
        """Refuse what torch AdamW would fail on at its next step: a param's state without ``step``, ``exp_avg``
        or ``exp_avg_sq``, a moment (or master) not shaped like its param, an index no group holds, a non-float
        tensor. An empty entry (a param never stepped) is allowed and starts fresh."""
        where = "OffloadStreamAdamW.load_state_dict"
        for index, saved in saved_state.items():
            if index not in position:
                raise BoundpassInputError(f"{where}: state for param index {index!r}, which no saved param group "
                                          f"lists (groups list {sorted(position)})")
            if not saved:
                continue
            param = _local(self._params[position[index]])
            missing = [key for key in ("step", "exp_avg", "exp_avg_sq") if key not in saved]
            if missing:
                raise BoundpassInputError(f"{where}: the state of param {index} (shape {tuple(param.shape)}) lacks "
                                          f"{', '.join(missing)}; it has {sorted(saved)} (an AdamW state holds step, "
                                          f"exp_avg and exp_avg_sq)")
            for key in _STATE_KEYS:
                if key not in saved:
                    continue
                value = saved[key]
                if not isinstance(value, Tensor) or not value.is_floating_point():
                    raise BoundpassInputError(f"{where}: state {key!r} of param {index} must be a floating tensor, "
                                              f"got {type(value).__name__}"
                                              + (f" {value.dtype}" if isinstance(value, Tensor) else ""))
                local = _local(value)
                if tuple(local.shape) != tuple(param.shape):
                    raise BoundpassInputError(f"{where}: state {key!r} of param {index} has shape "
                                              f"{tuple(local.shape)}, its param {tuple(param.shape)}")
                if local.device.type == "meta":
                    raise BoundpassInputError(f"{where}: state {key!r} of param {index} is a meta tensor (no data)")
            step = saved["step"]
            if isinstance(step, Tensor) and step.numel() != 1:
                raise BoundpassInputError(f"{where}: 'step' of param {index} must be a scalar, got shape "
                                          f"{tuple(step.shape)}")

    def _unaliased(self, state_dict: dict) -> dict:
        """Clone the saved tensors that share storage with this optimizer's own state (host copies).

        A checkpointer may load in place: torchtitan's DCP writes into the tensors our state_dict() returned, then
        hands that same dict to load_state_dict. Resetting the state first would zero what was just loaded.
        """
        own = {t.untyped_storage().data_ptr() for st in self.state.values() for t in st.values()
               if isinstance(t, Tensor)}

        def unaliased(value):
            if isinstance(value, Tensor) and _local(value).untyped_storage().data_ptr() in own:
                return _local(value).clone()
            return value
        return {**state_dict, "state": {index: {key: unaliased(v) for key, v in saved.items()}
                                        for index, saved in state_dict["state"].items()}}

    @classmethod
    def from_adamw(cls, adamw: torch.optim.Optimizer, **knobs) -> "OffloadStreamAdamW":
        """Migrate a torch AdamW (groups, hyperparameters, names, exp_avg/exp_avg_sq/step; masters from params).

        Drop the AdamW afterwards to free its device state. LR schedulers hold the old optimizer: build new ones.
        """
        groups = []
        for g in adamw.param_groups:
            _refuse_unimplemented(g, f"the {type(adamw).__name__} to migrate")
            params = list(zip(g["param_names"], g["params"])) if "param_names" in g else list(g["params"])
            groups.append({**{k: v for k, v in g.items() if k not in _TORCH_IMPL_KEYS | {"param_names"}},
                           "params": params})
        optimizer = cls(groups, **knobs)
        optimizer.load_state_dict(adamw.state_dict())
        return optimizer

    def planned_bytes(self) -> dict[str, int]:
        """Bytes at this optimizer's params: device (working weights + grads + staging), staging, host."""
        b = max(_local(p).element_size() for p in self._params)
        values = bound_values(b=b, Theta=self.numel, beta=self.bucket_params, S=self.staging_slots)
        return {"device": sym.evaluate(offload_adamw_bound(), values),
                "staging": sym.evaluate(offload_adamw_staging_bound(), values),
                "host": sym.evaluate(offload_adamw_host_bound(), values)}


# ------------------------------------------------------------------------------------------------ math
def _adamw_flat(group: dict, step: float, master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                grad: Tensor) -> None:
    """torch.optim.AdamW's single-tensor update, op for op, on flat fp32 views; grad is reused as denom."""
    lr, (beta1, beta2) = float(group["lr"]), (float(group["betas"][0]), float(group["betas"][1]))
    eps, weight_decay = group["eps"], group["weight_decay"]
    if weight_decay != 0:
        master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = torch.sqrt(exp_avg_sq, out=grad).div_(bias_correction2_sqrt).add_(eps)  # reuses grad: no temporary
    master.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    if not (float(lr) >= 0 and float(eps) >= 0 and float(weight_decay) >= 0
            and all(0 <= float(beta) < 1 for beta in betas)):
        raise BoundpassInputError(f"OffloadStreamAdamW: need lr >= 0, eps >= 0, weight_decay >= 0 and "
                                  f"0 <= betas < 1; got lr={lr}, betas={betas}, eps={eps}, "
                                  f"weight_decay={weight_decay}")


def _is_fake(t: Tensor) -> bool:
    return isinstance(t, torch._subclasses.FakeTensor)


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _record(stream):
    return stream.record_event() if stream is not None else None


def _wait(stream, event) -> None:
    if event is not None:
        stream.wait_event(event)


# ----------------------------------------------------------------------------------------------- bounds
def offload_adamw_staging_bound() -> sympy.Expr:
    """Device bytes of the staging slots during step(): S slots × β elements × 4 fp32 buffers.

    A slot holds master, exp_avg, exp_avg_sq and the grad upcast to fp32 (reused in place as the update's
    denominator, so the update has no other temporary). Taking masters from the params, or loading state of
    another dtype, copies ≤ β elements at a time (≤ 4·β bytes of casting temporary) while no slot exists.
    """
    return sym.S * sym.beta * 4 * sym.b_acc


def offload_adamw_bound(*, count_working_state: bool = True) -> sympy.Expr:
    """Peak device bytes of one rank during step(): working weights Θ·b + grads Θ·b + staging.

    Θ (Theta) is the number of parameter elements this rank holds (Θ/W of the model under FSDP), b the bytes
    of the working dtype. ``count_working_state=False`` leaves weights and grads to a budget that counts them.
    """
    working = 2 * sym.Theta * sym.b if count_working_state else 0
    return working + offload_adamw_staging_bound()


def offload_adamw_host_bound() -> sympy.Expr:
    """Host bytes of one rank: fp32 master + exp_avg + exp_avg_sq = 3·Θ·4 (pinned on CUDA)."""
    return 3 * sym.Theta * sym.b_acc


def reference_adamw_bound(*, mixed_precision: bool) -> sympy.Expr:
    """Persistent device bytes of plain torch AdamW (fused: no update temporaries) on one rank.

    Weights Θ·b + grads Θ·b + exp_avg and exp_avg_sq in fp32, plus a fp32 master copy when the working dtype
    is narrower (mixed precision): 16·Θ in both the bf16+master and the fp32 case.
    """
    return sym.Theta * (2 * sym.b + 2 * sym.b_acc + int(mixed_precision) * sym.b_acc)


def bound_values(*, b: int, Theta: int, beta: int = 1, S: int = 2) -> dict:
    """Concrete symbol values: working-dtype bytes b, this rank's params Θ, bucket β, slots S."""
    return {sym.b: b, sym.b_acc: 4, sym.Theta: Theta, sym.beta: beta, sym.S: S}


# ---------------------------------------------------------------------------------------- torchtitan
def offload_optimizers_container(container, **knobs):
    """Swap each AdamW inside a torchtitan OptimizersContainer for OffloadStreamAdamW (state migrated).

    Call it before building the LR schedulers (they hold the inner optimizers). Returns the container.
    """
    container.optimizers = [OffloadStreamAdamW.from_adamw(opt, **knobs)
                            if isinstance(opt, torch.optim.Adam) else opt for opt in container.optimizers]
    return container
