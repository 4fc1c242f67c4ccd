"""Optimizer step: OffloadStreamAdamW against the schedules a user already has, on the same model state (CPU).

Schedules (fp32 working weights, the same Θ parameters and grads, AdamW lr 1e-4, betas (0.9, 0.95), wd 0.1):
  torch-fused     torch.optim.AdamW(fused=True): weights, grads and both moments on the device, no offload
  offload-stream  boundpass OffloadStreamAdamW (β, S below): fp32 master + moments on the host, bucketed
  serial-offload  ZeRO-Offload's step shape, our implementation: grads D2H into a host fp32 buffer, AdamW on
                  the host (torch's fused CPU kernel), working weights H2D
  deepspeed       the same serial shape with DeepSpeed's DeepSpeedCPUAdam (AVX) as the host optimizer, run in
                  a throwaway venv (/tmp/dsvenv) if it exists there; otherwise reported as not available

On this CPU machine "device" and "host" are the same memory: every copy is a memcpy, nothing overlaps, and the
link the offload schedules are built to saturate does not exist. Bytes come from the bounds and are checked
against a live-storage tracker (transient = peak during one step minus what was live before it).

Knee section (issue 18, docs/knobs.md; one thread): the step's time against the bucket β (medians, round-robin),
boundpass/bound/cost_model.py's model beside it and both knees; then, at a loose and at a tight budget side by side
in one run, OffloadStreamAdamW at the planner's choice (``optimizer_swap.choose_knobs``, the rule
boundpass.compile applies) against torch AdamW (the baseline), the widest β the budget allows, and the old rule
(S = 2, the widest β): device bytes, measured transient, median step time.
Writes docs/results/optimizer.json and optimizer.md (``--knee-only`` reruns the knee section and keeps the
other one from the json).

    python bench/optimizer.py [--quick] [--knee-only | --no-knee]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import (RESULTS_DIR, fmt_bytes, fmt_seconds, interleaved_medians, markdown_table, run_metadata,
                          write_results)
from boundpass.bound import cost_model as cm
from boundpass.core import symbols as sym
from boundpass.measure.memtrack import LiveStorageTracker
from boundpass.runtime.offload_adamw import (OffloadStreamAdamW, bound_values, offload_adamw_bound,
                                             offload_adamw_host_bound, reference_adamw_bound)

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
DS_PYTHON = Path("/tmp/dsvenv/bin/python")
# A small Llama-like dense model: embedding + lm_head [V, H], L layers of attention [H, H] x4 and MLP.
# Two bucket sizes: a slot that fits in the CPU caches (β = 2^16: 1 MiB) and β ≈ 3.6% of Θ (the paper's ratio).
FULL = dict(V=32000, H=1024, I=2816, L=4, betas=(1 << 16, 1 << 22), S=2, repeats=5)
QUICK = dict(V=4000, H=256, I=704, L=2, betas=(1 << 12, 1 << 16), S=2, repeats=5)


def model_shapes(V: int, H: int, I: int, L: int) -> list[tuple[int, ...]]:
    """Parameter shapes of the benchmark model (Θ = sum of their elements)."""
    layer = [(H, H)] * 4 + [(I, H), (I, H), (H, I), (H,), (H,)]
    return [(V, H)] + layer * L + [(H,), (V, H)]


def make_state(shapes, device="cpu", dtype=torch.float32):
    """(params, grads): the same values for every schedule (seeded), grads ~ N(0, 1e-2)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device, dtype)) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-2).to(device, dtype) for s in shapes]
    return params, grads


class SerialCpuAdamOffload:
    """ZeRO-Offload's step shape (our implementation): grads D2H, AdamW on the host, working weights H2D.

    Host: fp32 masters, both moments and a fp32 grad buffer (16·Θ bytes, pinned on CUDA); device: weights + grads.
    ``host_optimizer`` builds the host AdamW from the master params (default: torch's fused CPU kernel).
    """

    def __init__(self, params, host_optimizer=None, **hyper):
        pin = params[0].is_cuda
        self.params = params
        self.masters = []
        for p in params:
            master = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin)
            master.copy_(p.detach())
            master = torch.nn.Parameter(master)
            master.grad = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin)
            self.masters.append(master)
        self.host = (host_optimizer or (lambda ps: torch.optim.AdamW(ps, fused=True, **hyper)))(self.masters)

    @torch.no_grad()
    def step(self) -> None:
        """Grads to the host, one host AdamW step, weights back to the device."""
        for p, m in zip(self.params, self.masters):
            m.grad.copy_(p.grad, non_blocking=True)
        if self.params[0].is_cuda:
            torch.cuda.synchronize()
        self.host.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m, non_blocking=True)


# The DeepSpeed child: the serial schedule above with DeepSpeedCPUAdam, standalone (its venv has no boundpass).
_DS_CHILD = r"""
import json, statistics, sys, time, torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
gen = torch.Generator().manual_seed(0)
params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in cfg["shapes"]]
grads = [torch.randn(s, generator=gen) * 1e-2 for s in cfg["shapes"]]
masters = [torch.nn.Parameter(p.detach().clone()) for p in params]
for m in masters:
    m.grad = torch.empty_like(m)
opt = DeepSpeedCPUAdam(masters, adamw_mode=True, **cfg["hyper"])
def step():
    with torch.no_grad():
        for g, m in zip(grads, masters):
            m.grad.copy_(g)
        opt.step()
        for p, m in zip(params, masters):
            p.copy_(m)
times = []
for i in range(cfg["repeats"] + 1):
    t0 = time.perf_counter(); step(); times.append(time.perf_counter() - t0)
import deepspeed
print("__DS__ " + json.dumps({"median_s": statistics.median(times[1:]), "version": deepspeed.__version__}))
"""


def deepspeed_step_seconds(shapes, repeats: int) -> tuple[float | None, str]:
    """Median DeepSpeedCPUAdam serial step (s) from the throwaway venv, or (None, why not)."""
    if not DS_PYTHON.exists():
        return None, f"DeepSpeed not installed ({DS_PYTHON} missing)"
    cfg = dict(shapes=shapes, repeats=repeats, threads=torch.get_num_threads(),
               hyper={k: v for k, v in HYPER.items()})
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    try:
        proc = subprocess.run([str(DS_PYTHON), "-c", _DS_CHILD, json.dumps(cfg)], capture_output=True, text=True,
                              timeout=900, env=env)
    except subprocess.TimeoutExpired:
        return None, "DeepSpeed CPU Adam run timed out after 900 s"
    for line in proc.stdout.splitlines():
        if line.startswith("__DS__ "):
            rec = json.loads(line[7:])
            return rec["median_s"], f"DeepSpeed {rec['version']} DeepSpeedCPUAdam (adamw_mode), JIT-built here"
    return None, f"DeepSpeed CPU Adam failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"


def transient_bytes(params, grads, step) -> int:
    """Peak live bytes during one ``step()`` minus the bytes live before it (live-storage tracker)."""
    with LiveStorageTracker() as tracker:
        tracker.track_existing(params, grads)
        before = tracker.live_bytes()
        step()
        return tracker.peak_bytes() - before


def main_section(args) -> dict:
    """Run every schedule once on the same state; the data of the first section."""
    cfg = QUICK if args.quick else FULL
    shapes = model_shapes(cfg["V"], cfg["H"], cfg["I"], cfg["L"])
    theta = sum(torch.Size(s).numel() for s in shapes)
    slots, repeats = cfg["S"], cfg["repeats"]
    print(f"Θ = {theta:,} fp32 params, β in {cfg['betas']}, S = {slots}, median of {repeats} steps", flush=True)
    _, grads = make_state(shapes)
    working = 2 * 4 * theta  # fp32 weights + grads
    fused_bytes = sym.evaluate(reference_adamw_bound(mixed_precision=False), bound_values(b=4, Theta=theta))
    builders = {  # name -> (optimizer factory, (device bytes during the step, host bytes) from the bounds)
        "torch-fused": (lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER), (fused_bytes, 0))}
    for beta in cfg["betas"]:
        values = bound_values(b=4, Theta=theta, beta=beta, S=slots)
        builders[f"offload-stream β={beta:,}"] = (
            lambda ps, beta=beta: OffloadStreamAdamW(ps, bucket_params=beta, staging_slots=slots, **HYPER),
            (sym.evaluate(offload_adamw_bound(), values), sym.evaluate(offload_adamw_host_bound(), values)))
    builders["serial-offload"] = (lambda ps: SerialCpuAdamOffload(ps, **HYPER), (working, 16 * theta))
    states, optimizers = {}, {}
    for name, (build, _) in builders.items():  # the same state for each; grads are shared and only read
        states[name], _ = make_state(shapes)
        for p, g in zip(states[name], grads):
            p.grad = g
        optimizers[name] = build(states[name])
    seconds = interleaved_medians({name: opt.step for name, opt in optimizers.items()}, repeats=repeats)
    records = []

    def record(name, step_s, transient, diff, device, host):
        records.append(dict(schedule=name, median_step_s=step_s, device_bytes=device, host_bytes=host,
                            measured_transient_bytes=transient, max_abs_diff_vs_torch_fused=diff))
        print(f"  {name}: {fmt_seconds(step_s)} per step, transient {fmt_bytes(transient)}", flush=True)

    for name, opt in optimizers.items():  # every optimizer has now taken the same number of steps
        transient = transient_bytes(states[name], grads, opt.step)
        diff = max((a - b).abs().max().item() for a, b in zip(states[name], states["torch-fused"]))
        record(name, seconds[name], transient, diff, *builders[name][1])
    del optimizers, states
    ds_seconds, ds_note = deepspeed_step_seconds(shapes, repeats)
    record("deepspeed", ds_seconds, None, None, working, 16 * theta)
    meta = dict(run_metadata(), load_average_1_5_15=os.getloadavg())
    return dict(meta=meta, config=dict(cfg, theta=theta, hyper=HYPER, shapes=shapes), deepspeed=ds_note,
                results=records)


def render_main(data: dict) -> str:
    """The first section's markdown, from its data (also when only the knee section was rerun)."""
    meta, cfg, ds_note = data["meta"], data["config"], data["deepspeed"]
    theta, slots, repeats = cfg["theta"], cfg["S"], cfg["repeats"]
    rows = [[r["schedule"], fmt_seconds(r["median_step_s"]), fmt_bytes(r["device_bytes"]), fmt_bytes(r["host_bytes"]),
             fmt_bytes(r["measured_transient_bytes"]),
             "—" if r["max_abs_diff_vs_torch_fused"] is None else f"{r['max_abs_diff_vs_torch_fused']:.1e}"]
            for r in data["results"]]
    table = markdown_table(["schedule", "step (median)", "device bytes (bound)", "host bytes", "measured transient",
                            "max abs diff vs torch-fused"], rows)
    md = f"""# Optimizer step: OffloadStreamAdamW vs no offload vs serial CPU-Adam offload (CPU)

Θ = {theta:,} fp32 parameters (a {cfg['L']}-layer Llama-like model, V = {cfg['V']}, H = {cfg['H']}), S = {slots};
median of {repeats} steps after one warm-up, timed round-robin (deepspeed: in its own process, after);
{meta['nproc']} cores, torch {meta['torch']}, {meta['torch_threads']} threads, {meta['date_utc']}; load average
at the end {', '.join(f'{x:.1f}' for x in meta['load_average_1_5_15'])} (this machine is shared: times are noisy).

{table}

- Device bytes are the bounds during the step: torch-fused `reference_adamw_bound` (16·Θ), offload-stream
  `offload_adamw_bound` (weights + grads 8·Θ + staging S·β·16), the serial schedules weights + grads (8·Θ).
  Host bytes: 12·Θ for offload-stream, 16·Θ for the serial schedules (master, moments, fp32 grad buffer).
- Measured transient: live-storage tracker, peak during one step minus what was live before it. For
  offload-stream it is exactly the staging term S·β·16.
- deepspeed: {ds_note}. Its step is the serial shape with DeepSpeedCPUAdam as the host optimizer.
- OffloadStreamAdamW is bit-identical to torch AdamW's for-loop path (tests); torch's fused kernel rounds
  differently, hence the small max abs diff.
- On this CPU machine host and device are one memory: the offload schedules only add memcpys, and
  OffloadStreamAdamW runs the for-loop update (eight elementwise passes, for exactness) where the fused kernel
  makes one; a cache-sized slot keeps those passes in cache. The step-time target (≥ 2× faster than serial
  CPU Adam at ≤ 1.2× the 12·Θ/W link floor) is a GPU target: `bench/gpu_optimizer.py` measures it.
"""
    return md


# ------------------------------------------------------------------------------- knee section (issue 18)
# a 4-layer Llama-like model of Θ = 45.6M fp32 parameters (39 tensors): a whole-model slot (730 MiB) is far
# outside every cache, a 2^16-element one (1 MiB) inside L2; β from 2^12 to 2^24 (the widest compile considers)
KNEE = dict(V=32000, H=512, I=1408, L=4, repeats=5,
            betas=(1 << 12, 1 << 14, 1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22, 1 << 24),
            # staging room (bytes) the two budgets leave beside weights + grads: loose holds the widest bucket
            # at four slots, tight holds 4 MiB (2^18 elements of one slot)
            rooms=(("loose", 16 * 4 * (1 << 24)), ("tight", 4 << 20)))
KNEE_QUICK = dict(V=4000, H=256, I=704, L=2, repeats=3, betas=(1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18),
                  rooms=(("loose", 16 * 4 * (1 << 18)), ("tight", 64 << 10)))


def _knee_curve(shapes, grads, cfg) -> dict:
    """Median step seconds of one OffloadStreamAdamW (S = 1) at each β, round-robin over the βs."""
    params, _ = make_state(shapes)
    for p, g in zip(params, grads):
        p.grad = g
    opt = OffloadStreamAdamW(params, staging_slots=1, **HYPER)
    times = {beta: [] for beta in cfg["betas"]}
    for round_ in range(cfg["repeats"] + 1):      # round 0 is the warm-up (host state allocated, caches warm)
        for beta in cfg["betas"]:
            opt.bucket_params = beta               # read at every step: one optimizer serves every β
            start = time.perf_counter()
            opt.step()
            if round_:
                times[beta].append(time.perf_counter() - start)
    del opt, params
    return {beta: statistics.median(t) for beta, t in times.items()}


def knee_section(args) -> dict:
    """The β curve (measured and modelled) and the two budgets side by side; the knee section's data."""
    from boundpass.passes.optimizer_swap import MAX_BUCKET, MIN_OVERLAP_BUCKET, choose_knobs
    torch.set_num_threads(1)
    started = time.perf_counter()
    cfg = KNEE_QUICK if args.quick else KNEE
    shapes = model_shapes(cfg["V"], cfg["H"], cfg["I"], cfg["L"])
    theta, tensors = sum(torch.Size(s).numel() for s in shapes), len(shapes)
    costs = cm.costs_for("cpu")
    _, grads = make_state(shapes)
    print(f"knee: Θ = {theta:,} fp32 params in {tensors} tensors, 1 thread, median of {cfg['repeats']}", flush=True)
    measured = _knee_curve(shapes, grads, cfg)
    model = {beta: cm.offload_adamw_seconds(beta, 1, Theta=theta, tensors=tensors, costs=costs) for beta in measured}
    hi = min(theta, MAX_BUCKET)
    model_knee = cm.offload_adamw_knee(Theta=theta, tensors=tensors, costs=costs, hi=hi)
    in_cache = {b: t for b, t in measured.items() if 16 * b <= costs.cache_bytes}
    fitted = cm.calibrate_optimizer(in_cache, Theta=theta, tensors=tensors, base=costs)
    fitted_knee = cm.offload_adamw_knee(Theta=theta, tensors=tensors, costs=fitted, hi=hi)
    curve = [dict(beta=b, slot_bytes=16 * b, measured_s=measured[b], model_s=model[b],
                  fitted_model_s=cm.offload_adamw_seconds(b, 1, Theta=theta, tensors=tensors, costs=fitted))
             for b in measured]
    for row in curve:
        print(f"  β={row['beta']:>9,}: measured {fmt_seconds(row['measured_s'])}, model {fmt_seconds(row['model_s'])}",
              flush=True)
    # the budgets: the planner's choice (choose_knobs, what boundpass.compile does before the graph is seen)
    adamw = torch.optim.AdamW(make_state(shapes)[0], **HYPER)   # only read for Θ, tensors and device
    budgets, schedules = [], {}
    for label, room_bytes in cfg["rooms"]:
        room = room_bytes // 16
        beta_k, slots_k = choose_knobs([adamw], room=room, bucket=None, slots=None)
        old_slots = 2 if room >= 2 * min(theta, MIN_OVERLAP_BUCKET) else 1     # the rule before issue 18
        old_beta = max(1, min(theta, MAX_BUCKET, room // old_slots))
        budget = dict(label=label, budget_bytes=8 * theta + room_bytes, staging_room_bytes=room_bytes,
                      planner=dict(beta=beta_k.value, S=slots_k.value, why_beta=beta_k.why, why_S=slots_k.why,
                                   knee_beta=beta_k.knee, knee_S=slots_k.knee,
                                   widest_beta=beta_k.widest_fitting, widest_S=slots_k.widest_fitting),
                      rows=[])
        budgets.append(budget)
        for name, beta, slots in ((f"{label}: planner (β {beta_k.why}, S {slots_k.why})", beta_k.value, slots_k.value),
                                  (f"{label}: widest β at the planner's S", beta_k.widest_fitting, slots_k.value),
                                  (f"{label}: old rule (S = 2 when it fits, widest β)", old_beta, old_slots)):
            key = (beta, slots)
            schedules.setdefault(key, []).append(name)
            budget["rows"].append(dict(schedule=name, beta=beta, S=slots, key=list(key)))
    builders = {f"offload β={b} S={s}": (lambda ps, b=b, s=s: OffloadStreamAdamW(ps, bucket_params=b, staging_slots=s,
                                                                                  **HYPER), (b, s))
                for b, s in schedules}
    builders["torch AdamW (for-loop, the bit-exact reference)"] = (
        lambda ps: torch.optim.AdamW(ps, foreach=False, **HYPER), None)
    builders["torch AdamW fused"] = (lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER), None)
    states, optimizers = {}, {}
    for name, (build, _) in builders.items():
        states[name], _ = make_state(shapes)
        for p, g in zip(states[name], grads):
            p.grad = g
        optimizers[name] = build(states[name])
    seconds = interleaved_medians({n: o.step for n, o in optimizers.items()}, repeats=cfg["repeats"] + 2)
    transient = {n: transient_bytes(states[n], grads, o.step) for n, o in optimizers.items()}
    del optimizers, states
    fused_device = sym.evaluate(reference_adamw_bound(mixed_precision=False), bound_values(b=4, Theta=theta))
    baselines = [dict(schedule=n, median_step_s=seconds[n], device_bytes=fused_device,
                      measured_transient_bytes=transient[n]) for n in builders if builders[n][1] is None]
    for budget in budgets:
        for row in budget["rows"]:
            name = f"offload β={row['beta']} S={row['S']}"
            values = bound_values(b=4, Theta=theta, beta=row["beta"], S=row["S"])
            row.update(median_step_s=seconds[name], device_bytes=sym.evaluate(offload_adamw_bound(), values),
                       measured_transient_bytes=transient[name])
        budget["fits_torch_adamw"] = fused_device <= budget["budget_bytes"]
    meta = dict(run_metadata(), load_average_1_5_15=os.getloadavg())
    return dict(meta=meta, config=dict(cfg, theta=theta, tensors=tensors, hyper=HYPER), costs=cm.describe(costs),
                curve=curve, measured_knee=cm.knee(measured), model_knee=list(model_knee),
                fitted=dict(launch_s=fitted.launch_s, cache_bandwidth=fitted.cache_bandwidth),
                fitted_knee=list(fitted_knee), budgets=budgets, baselines=baselines,
                wall_seconds=time.perf_counter() - started)


def render_knee(k: dict) -> str:
    """The knee section's markdown."""
    cfg, meta = k["config"], k["meta"]
    best_m = min(r["measured_s"] for r in k["curve"])
    best_t = min(r["model_s"] for r in k["curve"])
    curve = markdown_table(
        ["β", "slot (16·β)", "measured", "measured / best", "model", "model / best", "fitted model"],
        [[f"{r['beta']:,}", fmt_bytes(r["slot_bytes"]), fmt_seconds(r["measured_s"]), f"{r['measured_s'] / best_m:.2f}",
          fmt_seconds(r["model_s"]), f"{r['model_s'] / best_t:.2f}", fmt_seconds(r["fitted_model_s"])]
         for r in k["curve"]])
    (ref,) = [b for b in k["baselines"] if "for-loop" in b["schedule"]]
    rows = []
    for budget in k["budgets"]:
        widest = next(r for r in budget["rows"] if "widest" in r["schedule"])
        for r in budget["rows"]:
            rows.append([r["schedule"], f"{r['beta']:,}", str(r["S"]), fmt_bytes(r["device_bytes"]),
                         fmt_bytes(r["measured_transient_bytes"]), fmt_seconds(r["median_step_s"]),
                         f"{r['median_step_s'] / widest['median_step_s']:.2f}",
                         f"{r['median_step_s'] / ref['median_step_s']:.2f}",
                         fmt_bytes(widest["device_bytes"] - r["device_bytes"])])
    for b in k["baselines"]:
        rows.append([b["schedule"] + " (fits neither budget)" if not any(x["fits_torch_adamw"] for x in k["budgets"])
                     else b["schedule"], "—", "—", fmt_bytes(b["device_bytes"]), fmt_bytes(b["measured_transient_bytes"]),
                     fmt_seconds(b["median_step_s"]), "—", f"{b['median_step_s'] / ref['median_step_s']:.2f}", "—"])
    side = markdown_table(["schedule", "β", "S", "device bytes in the step (bound)", "measured transient",
                           "step (median)", "× widest β", "× torch AdamW (for-loop)", "saved vs widest β"], rows)
    budgets = "; ".join(f"{b['label']}: weights + grads + {fmt_bytes(b['staging_room_bytes'])} of staging room "
                        f"({fmt_bytes(b['budget_bytes'])})" for b in k["budgets"])
    loose = k["budgets"][0]
    lp = next(r for r in loose["rows"] if "planner" in r["schedule"])
    lw = next(r for r in loose["rows"] if "widest" in r["schedule"])
    fitting = [b["label"] for b in k["budgets"] if b["fits_torch_adamw"]]
    fits = f"fits the {' and '.join(fitting)} budget" if fitting else "fits neither budget"
    return f"""## The bucket β at the knee (issue 18, docs/knobs.md)

Θ = {cfg['theta']:,} fp32 parameters in {cfg['tensors']} tensors (a {cfg['L']}-layer Llama-like model, V = {cfg['V']},
H = {cfg['H']}); one thread; each time the median of {cfg['repeats']} steps after a warm-up, timed round-robin over
the βs (the side-by-side table: over its schedules, median of {cfg['repeats'] + 2}); {meta['nproc']} cores,
torch {meta['torch']}, {meta['date_utc']}; load average at the end
{', '.join(f'{x:.1f}' for x in meta['load_average_1_5_15'])} (the machine is shared with other work: medians,
ratios within a run are what to read). Section wall time {k['wall_seconds']:.0f} s.

### Step time against β (S = 1; on the CPU the slots run in program order, so S changes bytes, not time)

{curve}

Knee (the smallest β within {cm.KNEE_TOLERANCE:.0%} of the best): **measured {k['measured_knee']:,}**, model
{k['model_knee'][0]:,} (S = {k['model_knee'][1]}; `boundpass/bound/cost_model.py`, {k['costs']}). Fitted to the
in-cache points (`cost_model.calibrate_optimizer`; not written into the defaults): {k['fitted']['launch_s'] * 1e6:.1f} µs
per op, slot rate {k['fitted']['cache_bandwidth'] / 1e9:.0f} GB/s, knee {k['fitted_knee'][0]:,}. Narrow buckets
pay per bucket (16 ops each); slots that outgrow the cache pay memory rate on the update's eight passes.

### Two budgets, side by side in one run

{budgets}. The planner's choice is `optimizer_swap.choose_knobs` (what `boundpass.compile` applies before it
sees the graph; the graph can only narrow β further). "Widest β" is what the budget alone allows at the
planner's S; "old rule" is the choice before issue 18 (S = 2 whenever two useful slots fit, the widest β).
Device bytes in the step are `offload_adamw_bound` (weights + grads 8·Θ + staging 16·S·β) and, for torch
AdamW, `reference_adamw_bound` (16·Θ, all state on the device); measured transient is the live-storage
tracker's peak during one step minus what was live before it.

{side}

At the loose budget the planner's β = {lp['beta']:,} is {lp['median_step_s'] / lw['median_step_s']:.2f}× the widest
β's time ({lw['beta']:,}) and saves {fmt_bytes(lw['device_bytes'] - lp['device_bytes'])} of staging; at the tight
budget the budget binds (β = what fits) and the planner's choice is the widest setting. torch AdamW keeps 16·Θ on
the device ({fits}); its for-loop step makes the same eight passes as OffloadStreamAdamW's update (the like-for-like
time baseline), its one-pass fused kernel is several times faster on this CPU, where host and device are one
memory and there is no link to hide (see the section above).
"""


def main() -> None:
    """The schedules section and the knee section (or one of them); docs/results/optimizer.{json,md}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, for a smoke run")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--knee-only", action="store_true", help="only the knee section; the other kept from the json")
    which.add_argument("--no-knee", action="store_true", help="only the schedules section")
    args = parser.parse_args()
    previous = RESULTS_DIR / "optimizer.json"
    data = json.loads(previous.read_text()) if previous.exists() else {}
    if not args.knee_only:
        data.update(main_section(args))
    if not args.no_knee:
        data["knee"] = knee_section(args)
    if "results" not in data:
        raise SystemExit("bench/optimizer.py --knee-only: no earlier schedules section in docs/results/optimizer.json")
    md = render_main(data) + ("\n" + render_knee(data["knee"]) if "knee" in data else "")
    if args.quick:
        print(md)
        print("(--quick: nothing written)")
        return
    json_path, md_path = write_results("optimizer", data, md)
    print(md)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
