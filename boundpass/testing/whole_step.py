"""Measure the whole training step the compiler certified: parameters, buffers, gradients, optimizer state and
every activation, with real tensors (LiveStorageTracker; boundpass's custom ops run under it, so their strips and
chunks count too). Used by the tests, the bench and the demo.

Inductor's kernels allocate outside any dispatch mode (its wrapper calls ``empty_strided_cpu`` directly), so an
Inductor step is measured at torch's allocator instead: ``allocator_step_peak`` reads every CPU allocation and
free c10's allocator reports to ``torch.profiler`` (``profile_memory=True``: its allocation events, in time
order), kernel-internal temporaries included. On an eager step it agrees with the tracker to the byte
(tests/test_step_peak.py). Process RSS
(``boundpass.memtrack.rss_peak_in_subprocess``) adds what no tensor holds: BLAS packing buffers, the C heap,
Python objects.
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
    return max(max(samples) for samples in _measured_steps(step, model, optimizer, batches, warmup))


def allocator_step_peak(step, model, optimizer, batches, *, warmup: int = 1) -> int:
    """Peak allocated bytes of one steady-state step as torch's CPU allocator saw it (any compiled step).

    The state live when the step starts (parameters, buffers, optimizer state, the batch; each storage once)
    plus the highest the allocations and frees of the step (``torch.profiler`` memory events, in time order)
    take the running sum above it. Arguments as ``measured_step_peak``.
    """
    from torch._C._profiler import _ExtraFields_Allocation
    from torch.profiler import ProfilerActivity, profile
    batches = list(batches)
    model.zero_grad(set_to_none=True)
    for batch in batches[:warmup]:
        _train_step(step, model, optimizer, batch)
    best = 0
    for batch in batches[warmup:]:
        state = {}
        for t in [*model.parameters(), *model.buffers(), *optimizer_state_tensors(optimizer),
                  *[b for b in batch if isinstance(b, torch.Tensor)]]:
            storage = t.untyped_storage()
            state[storage.data_ptr()] = storage.nbytes()
        # the allocation events only (no with_stack): torch's MemoryProfile needs Python frames, whose tracer grew
        # without bound on torchtitan's MoE step here in a process that had profiled before
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _train_step(step, model, optimizer, batch)
        events = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if isinstance(node.extra_fields, _ExtraFields_Allocation) and node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.alloc_size))  # < 0: a free
            stack.extend(node.children)
        live = peak = 0
        for _, size in sorted(events, key=lambda e: e[0]):
            live += size
            peak = max(peak, live)
        best = max(best, sum(state.values()) + peak)
    return best


def measured_step_timeline(step, model, optimizer, batches, *, warmup: int = 1) -> list[int]:
    """Live bytes over the last of ``batches``' steady-state steps, as ``measured_step_peak`` measures them.

    One sample (all devices, bytes) when the step starts (parameters, buffers, optimizer state and the batch)
    and one after every op that allocates (``LiveStorageTracker(record=True)``), through step, backward,
    optimizer.step and zero_grad; its maximum is that step's ``measured_step_peak``. The x of sample i is its
    rank among the step's allocations, not time: ``ExplainReport.plot(measured=...)`` spreads it over 0..1.
    """
    return _measured_steps(step, model, optimizer, batches, warmup)[-1]


def _measured_steps(step, model, optimizer, batches, warmup: int) -> list[list[int]]:
    """Live-byte samples of each measured step (after ``warmup`` unmeasured ones), starting with no gradients."""
    batches = list(batches)
    model.zero_grad(set_to_none=True)  # a step starts with no gradients held (no accumulation)
    for batch in batches[:warmup]:
        _train_step(step, model, optimizer, batch)
    out = []
    for batch in batches[warmup:]:
        with LiveStorageTracker(record=True) as tracker:
            tracker.track_existing(list(model.parameters()), list(model.buffers()),
                                   optimizer_state_tensors(optimizer), batch)
            _train_step(step, model, optimizer, batch)
        out.append(tracker.samples + [tracker.peak_bytes()])
    return out


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


# One training step in a fresh interpreter: its process RSS growth beside the certified peak less the state
# resident before it (parameters, optimizer state). Inductor's kernels allocate where no dispatch mode sees.
RSS_MODELS = {
    # plain PyTorch LM: V = 8,192, 4 x 512 tokens, a 4,096-wide MLP
    "dense": """
    from boundpass.testing.dense_lm import DenseLM, ce
    model, loss_fn = DenseLM(vocab=8192, hidden=128, inter=4096), ce
    x = torch.randint(0, 8192, (4, 512)); y = torch.randint(0, 8192, (4, 512)); batch = (x, y)
""",
    # torchtitan deepseek_v3 debug (MoE, every dispatch region rewritten), V = 8,192, 2 x 256 tokens
    "deepseek_v3": """
    from boundpass.recipes.models import build_debug_moe, torchtitan_loss
    from boundpass.testing.dense_lm import lm_batches
    model, loss_fn = build_debug_moe("deepseek_v3", vocab_size=8192, seq_len=256), torchtitan_loss()
    batch = lm_batches(8192, 2, 256, n=1, with_count=True)[0]
""",
}
RSS_STEP_SNIPPET = """
import warnings, torch, boundpass
warnings.filterwarnings("ignore")
def setup():
    torch.manual_seed(0)
{model}
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    step = boundpass.compile(model, budget="16GiB", loss_fn=loss_fn, optimizer=opt, inner="{inner}")
    for _ in range(2):
        measured((step, opt, batch))
    table = boundpass.explain(step).table
    print("CERTIFIED", table.total - table.sum("persistent"), flush=True)
    return step, opt, batch
def measured(state):
    step, opt, batch = state
    out = step(*batch)
    (out[0] if isinstance(out, tuple) else out).backward(); del out
    opt.step(); opt.zero_grad(set_to_none=True)
"""


def certified_and_rss(inner: str, model: str = "dense", timeout: float = 900) -> tuple[int, int]:
    """(certified peak above the resident state, RSS growth of the step) of RSS_STEP_SNIPPET, bytes."""
    import subprocess
    import sys

    from boundpass.memtrack import rss_peak_in_subprocess
    code = RSS_STEP_SNIPPET.replace("{inner}", inner).replace("{model}", RSS_MODELS[model].strip("\n"))
    grown = rss_peak_in_subprocess(code, timeout=timeout)
    probe = subprocess.run([sys.executable, "-c", code + "\nsetup()\n"], capture_output=True, text=True,
                           timeout=timeout)
    line = next((ln for ln in probe.stdout.splitlines() if ln.startswith("CERTIFIED")), None)
    if line is None:
        raise RuntimeError(f"the certified-peak probe printed nothing; stderr:\n{probe.stderr[-2000:]}")
    return int(line.split()[1]), grown
