"""Measure the whole training step the compiler certified: parameters, buffers, gradients, optimizer state and
every activation, with real tensors (LiveStorageTracker; boundpass's custom ops run under it, so their strips and
chunks count too). Used by the tests, the bench and the demo; Inductor kernels allocate outside a dispatch mode,
so an Inductor step is measured by process RSS instead (``boundpass.memtrack.rss_peak_in_subprocess``).
"""
from __future__ import annotations

import torch

from boundpass.memtrack import LiveStorageTracker


def optimizer_state_tensors(optimizer) -> list:
    """Every tensor an optimizer (or a torchtitan container of them) holds as device state.

    OffloadStreamAdamW keeps its state on the host by design: not device bytes, so not counted.
    """
    from boundpass.runtime.offload_adamw import OffloadStreamAdamW
    inner = getattr(optimizer, "optimizers", None)
    opts = list(inner) if isinstance(inner, (list, tuple)) else ([optimizer] if optimizer is not None else [])
    opts = [o for o in opts if not isinstance(o, OffloadStreamAdamW)]
    return [t for o in opts for st in o.state.values() for t in st.values() if isinstance(t, torch.Tensor)]


def measured_step_peak(step, model, optimizer, batches, *, warmup: int = 1) -> int:
    """Peak live bytes of one steady-state step ``step(*batch)`` -> backward -> optimizer.step -> zero_grad.

    ``step`` returns the loss (or a tuple whose first item is the loss). The first ``warmup`` steps (compile,
    lazy optimizer state) run unmeasured; the peak is the largest over the remaining batches.
    """
    def one(batch):
        out = step(*batch)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.backward()
        del out, loss
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)

    batches = list(batches)
    for batch in batches[:warmup]:
        one(batch)
    peak = 0
    for batch in batches[warmup:]:
        with LiveStorageTracker() as tracker:
            tracker.track_existing(list(model.parameters()), list(model.buffers()),
                                   optimizer_state_tensors(optimizer), batch)
            one(batch)
        peak = max(peak, tracker.peak_bytes())
    return peak


def measured_step_timeline(step, model, optimizer, batches, *, warmup: int = 1) -> list[int]:
    """Live bytes over the last of ``batches``' steady-state steps, as ``measured_step_peak`` measures them.

    One sample (all devices, bytes) when the step starts (parameters, buffers, optimizer state and the batch)
    and one after every op that allocates (``LiveStorageTracker(record=True)``), through step, backward,
    optimizer.step and zero_grad; its maximum is that step's ``measured_step_peak``. The x of sample i is its
    rank among the step's allocations, not time: ``ExplainReport.plot(measured=...)`` spreads it over 0..1.
    """
    batches = list(batches)
    for batch in batches[:warmup]:
        _train_step(step, model, optimizer, batch)
    samples: list[int] = []
    for batch in batches[warmup:]:
        with LiveStorageTracker(record=True) as tracker:
            tracker.track_existing(list(model.parameters()), list(model.buffers()),
                                   optimizer_state_tensors(optimizer), batch)
            _train_step(step, model, optimizer, batch)
        samples = tracker.samples
    return samples


def _train_step(step, model, optimizer, batch) -> None:
    """``step(*batch)`` -> backward -> optimizer.step -> zero_grad: ``measured_step_peak``'s step."""
    out = step(*batch)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    loss.backward()
    del out, loss
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
