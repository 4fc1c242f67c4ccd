"""Measure the whole training step the compiler certified: parameters, buffers, gradients, optimizer state and
every activation, with real tensors (LiveStorageTracker; boundpass's custom ops run under it, so their strips and
chunks count too). Used by the tests, the bench and the demo.

Inductor's kernels allocate outside any dispatch mode (its wrapper calls ``empty_strided_cpu`` directly), so an
Inductor step is measured at torch's allocator instead: ``allocator_step_peak`` reads every CPU allocation and
free c10's allocator reports to ``torch.profiler`` (``profile_memory=True``: its allocation events, in time
order), kernel-internal temporaries included. On an eager step it agrees with the tracker to the byte
(tests/measure/test_step_peak.py). Process RSS
(``boundpass.measure.memtrack.rss_peak_in_subprocess``) adds what no tensor holds: BLAS packing buffers, the C heap,
Python objects.
"""
from __future__ import annotations

import os

import torch

from boundpass.measure.memtrack import LiveStorageTracker


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
    batches = list(batches)
    model.zero_grad(set_to_none=True)
    for batch in batches[:warmup]:
        _train_step(step, model, optimizer, batch)
    best = 0
    for batch in batches[warmup:]:
        state = [*model.parameters(), *model.buffers(), *optimizer_state_tensors(optimizer),
                 *[b for b in batch if isinstance(b, torch.Tensor)]]
        _, peak = allocator_peak_of(lambda: _train_step(step, model, optimizer, batch), state)
        best = max(best, peak)
    return best


def allocator_peak_of(fn, state, *, breakdown: dict | None = None) -> tuple[object, int]:
    """(fn(), the peak bytes torch's CPU allocator held while it ran): the storages of ``state`` (tensors live
    when it starts, each storage once; DTensors by their local shard; the caller must not hold the list, so what
    fn frees is freed) plus every other storage ``fn`` frees that was allocated
    before it (live when it started: e.g. buffers FSDP2 keeps from the previous step), plus the highest the
    allocations and frees of ``fn`` (``torch.profiler`` memory events, in time order) take the running sum above
    them. Storages live throughout that neither ``state`` names nor ``fn`` frees are not seen. A free the profiler
    missed (made on a thread it does not follow) is taken as happening when its address is next allocated.

    ``breakdown`` (a dict, filled when given): ``at_start`` (bytes of ``state``), ``earlier`` (bytes allocated before
    fn, not in ``state``, freed by fn), ``implied_frees`` (bytes freed on threads the profiler missed, seen by
    their addresses being allocated again) and ``held`` ([(what allocated it: the profiler's event and its callers,
    bytes)] of the allocations live at the peak, largest first). ``BOUNDPASS_PEAK_DEBUG=1`` prints the same."""
    from torch._C._profiler import _ExtraFields_Allocation
    from torch.profiler import ProfilerActivity, profile
    live_at_start, t, storage = {}, None, None  # (named here: an empty state is allowed)
    for t in state:
        t = getattr(t, "_local_tensor", t)
        storage = t.untyped_storage()
        if t.device.type == "cpu":
            live_at_start[storage.data_ptr()] = storage.nbytes()
    # drop the references: a tensor freed during fn (last step's gradients at zero_grad) must be freed
    del state, t, storage
    # the allocation events only (no with_stack): torch's MemoryProfile needs Python frames, whose tracer grew
    # without bound on torchtitan's MoE step here in a process that had profiled before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = []
    stack = [(n, "") for n in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, parent = stack.pop()
        if isinstance(node.extra_fields, _ExtraFields_Allocation) and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr, parent))
        stack.extend((c, (node.name + " < " + parent)[:160]) for c in node.children)
    live = peak = 0
    events.sort(key=lambda e: e[0])
    at = 0
    made, earlier = set(), 0
    # A free on a thread the profiler does not follow is missing from the events: gloo's worker threads drop the
    # last reference to a finished collective's buffers (created before profiling, they have no profiler state).
    # The allocator cannot hand out an address that is still in use, so a new allocation at an address we count as
    # live proves the block there was freed: counted as freed at that moment, never earlier. The peak stays an upper
    # bound on what was really held (a free not seen at all keeps its block counted to the end).
    open_blocks, implied_frees = {}, 0
    for i, (_, size, ptr, _) in enumerate(events):  # size < 0: a free
        if size > 0:
            made.add(ptr)
            if ptr in open_blocks:
                live -= open_blocks[ptr]
                implied_frees += open_blocks[ptr]
            open_blocks[ptr] = size
        else:
            if ptr not in made and ptr not in live_at_start:
                earlier -= size  # freed here, allocated before fn and not in ``state``: it was live when fn started
            open_blocks.pop(ptr, None)
        live += size
        if live > peak:
            peak, at = live, i
    if breakdown is not None or os.environ.get("BOUNDPASS_PEAK_DEBUG"):  # what the allocations at the peak were made by
        held = {}
        for _, size, ptr, parent in events[:at + 1]:
            if size > 0:
                held[ptr] = (size, parent)
            else:
                held.pop(ptr, None)
        by_op = {}
        for size, parent in held.values():
            by_op[parent] = by_op.get(parent, 0) + size
        detail = dict(at_start=sum(live_at_start.values()), earlier=earlier, implied_frees=implied_frees,
                      held=sorted(by_op.items(), key=lambda kv: -kv[1])[:25])
        if breakdown is not None:
            breakdown.update(detail)
        if os.environ.get("BOUNDPASS_PEAK_DEBUG"):
            freed_known = -sum(sz for _, sz, ptr, _ in events[:at + 1] if sz < 0 and ptr in live_at_start)
            print("PEAK_DEBUG", detail["at_start"], peak, "earlier", earlier, "freed_known", freed_known,
                  "implied_frees", implied_frees, detail["held"], flush=True)
    return out, sum(live_at_start.values()) + earlier + peak


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
    """(certified peak above the resident state, RSS growth of the step) of RSS_STEP_SNIPPET, bytes: both from
    one fresh interpreter (setup prints the certificate of the step it then measures)."""
    from boundpass.measure.memtrack import rss_run_in_subprocess
    code = RSS_STEP_SNIPPET.replace("{inner}", inner).replace("{model}", RSS_MODELS[model].strip("\n"))
    grown, stdout = rss_run_in_subprocess(code, timeout=timeout)
    line = next((ln for ln in stdout.splitlines() if ln.startswith("CERTIFIED")), None)
    if line is None:
        raise RuntimeError(f"the measured step's setup printed no certificate; stdout:\n{stdout[-2000:]}")
    return int(line.split()[1]), grown


def assert_step_matches(step, model, plain, batch, loss_fn, *, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """One compiled step's loss and every parameter's gradient against the unrewritten model's (``plain``, a copy
    of ``model`` before compiling; ``batch`` = (inputs, labels); ``loss_fn(output, labels)``)."""
    loss = step(*batch)
    loss.backward()
    ref = loss_fn(plain(batch[0]), batch[1])
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=rtol, atol=atol)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)
