"""SCO (selective checkpoint offload): step-time overhead on real tensors, and device/host boundary bytes at
gpt-oss-20b-like shapes on fake tensors.

Sections:
  real       torchtitan deepseek_v3 debug MoE model on CPU (fp32, batch 1, long sequence), torchtitan FullAC on
             model.layers. Variants: no SCO, and SCO with 0 / half / all boundaries offloaded (host budget =
             k × boundary bytes). Median fwd+bwd step time (interleaved), ratio vs no SCO, gradients
             torch.equal to no SCO, and the SCO ledger (device boundary peak vs sco_device_bound, host bytes).
             On CPU host and device are the SAME memory: this shows correctness and time overhead only, not a
             memory saving.
  compiled   the same model through boundpass.compile (aot_eager): sco_enable=False vs sco_enable=True at 0 / half / all
             boundaries offloaded; median step time, gradients torch.equal, ledger vs sco_compiled_device_bound.
  simulated  24 checkpointed residual blocks (Linear H→H + GELU, bf16) of width H = 2,880 under FakeTensorMode
             (fake cpu tensors: no data, real autograd schedule and storage lifetimes) at per-rank sequences of
             32K and 128K tokens; host budget swept from 0 to all 24 boundaries. Device boundary peak and host
             bytes are MEASURED by the SCO ledger (storage finalizers), and checked against the sympy bound.

Writes docs/results/sco.json and sco.md.

    python bench/sco.py [--quick]
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from bench.common import (fmt_bytes, fmt_seconds, interleaved_medians, markdown_table, publish, run_metadata,
                          targets_section)
from boundpass.core import symbols as sym
from boundpass.runtime import apply_sco
from boundpass.runtime.sco import bound_values, sco_device_bound, sco_host_bound

warnings.filterwarnings("ignore", message=r".*(autocast|Casting complex|initial_load).*")

FULL = dict(seq=1024, vocab=2048, repeats=5)
QUICK = dict(seq=256, vocab=2048, repeats=3)
SIM = dict(L=24, H=2880, Ns=(32_768, 131_072), dtype=torch.bfloat16)
TARGET_RATIO, TARGET_REDUCTION = 1.10, 0.15


# -------------------------------------------------------------------------------------------- real
def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def run_real(seq: int, vocab: int, repeats: int) -> dict:
    from torchtitan.distributed.activation_checkpoint import FullAC

    from boundpass.recipes.models import build_debug_moe
    base = build_debug_moe("deepseek_v3", vocab_size=vocab, seq_len=seq)
    FullAC(FullAC.Config()).apply(base)
    L, H = len(base.layers), base.tok_embeddings.embedding_dim
    boundary = 1 * seq * H * 4  # batch 1, fp32
    tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    counts = {"SCO, 0 offloaded": 0, f"SCO, {L // 2} offloaded": L // 2, f"SCO, {L} offloaded": L}
    models = {"no SCO": base} | {name: copy.deepcopy(base) for name in counts}
    handles = {name: apply_sco(models[name].layers, k * boundary) for name, k in counts.items()}

    def step(name):
        def run():
            model = models[name]
            model.zero_grad(set_to_none=True)
            if name in handles:
                handles[name].events.clear()
            model(tokens).float().pow(2).mean().backward()
        return run

    start = time.perf_counter()
    medians = interleaved_medians({name: step(name) for name in models}, repeats=repeats, warmup=1)
    timing_s = time.perf_counter() - start
    ref = _grads(models["no SCO"])  # every variant's last step ran on the same tokens and weights
    rows = [dict(variant="no SCO", offloaded_layers=None, host_budget=None, median_s=medians["no SCO"], ratio=1.0,
                 grads_equal=True)]
    for name, k in counts.items():
        h = handles[name]
        values = bound_values(N=seq, H=H, b=4, L=L, host_budget=k * boundary)
        equal = all(torch.equal(a, b) for a, b in zip(ref, _grads(models[name])))
        assert equal, f"{name}: gradients differ from no SCO"
        row = dict(variant=name, offloaded_layers=k, host_budget=k * boundary, median_s=medians[name],
                   ratio=medians[name] / medians["no SCO"], grads_equal=equal,
                   planned=[int(o) for o in h.offloaded],
                   device_boundary_peak=h.peak_device_boundary_bytes(),
                   device_bound=int(sym.evaluate(sco_device_bound(), values)),
                   offloaded_bytes=h.offloaded_bytes(), host_pool_bytes=h.host_pool_bytes,
                   host_bound=int(sym.evaluate(sco_host_bound(), values)),
                   restored_live_peak=h.peak_restored_live())
        assert sum(row["planned"]) == k and row["offloaded_bytes"] == row["host_bound"] == k * boundary
        assert row["device_boundary_peak"] <= row["device_bound"]
        rows.append(row)
        h.remove()
    return dict(model="torchtitan deepseek_v3 debug MoE, fp32, FullAC on model.layers", layers=L, hidden=H,
                seq=seq, batch=1, vocab=vocab, boundary_bytes=boundary, repeats=repeats, timing_wall_s=timing_s,
                rows=rows)


# ------------------------------------------------------------------------------------------ compiled
def run_compiled(seq: int, vocab: int, repeats: int) -> dict:
    """The same model through boundpass.compile (aot_eager): sco_enable=False vs sco_enable=True at 0 / half / all
    offloaded."""
    import boundpass
    from torchtitan.distributed.activation_checkpoint import FullAC

    from boundpass.recipes.models import build_debug_moe
    from boundpass.runtime.sco import sco_compiled_device_bound
    base = build_debug_moe("deepseek_v3", vocab_size=vocab, seq_len=seq)
    FullAC(FullAC.Config()).apply(base)
    L, H = len(base.layers), base.tok_embeddings.embedding_dim
    boundary = 1 * seq * H * 4
    tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    counts = {"compiled, no SCO": None, "compiled SCO, 0 offloaded": 0,
              f"compiled SCO, {L // 2} offloaded": L // 2, f"compiled SCO, {L} offloaded": L}
    models, compiled = {}, {}
    for name, k in counts.items():
        models[name] = copy.deepcopy(base)
        compiled[name] = boundpass.compile(models[name], budget="64GiB", loss_fn=lambda out, _: out.float().pow(2).mean(),
                                           sco_enable=k is not None,
                                           host_budget=None if k is None else max(k * boundary, 1))

    def runtime(name):
        plans = compiled[name].sco_plans
        return plans[-1].runtime if plans else None

    def step(name):
        def run():
            models[name].zero_grad(set_to_none=True)
            if runtime(name) is not None:
                runtime(name).events.clear()
            compiled[name](tokens).backward()
        return run

    start = time.perf_counter()
    medians = interleaved_medians({name: step(name) for name in counts}, repeats=repeats, warmup=1)
    timing_s = time.perf_counter() - start
    ref = _grads(models["compiled, no SCO"])
    rows = [dict(variant="compiled, no SCO", offloaded_layers=None, median_s=medians["compiled, no SCO"], ratio=1.0,
                 grads_equal=True)]
    for name, k in counts.items():
        if k is None:
            continue
        h = runtime(name)
        equal = all(torch.equal(a, b) for a, b in zip(ref, _grads(models[name])))
        assert equal, f"{name}: gradients differ from compiled without SCO"
        values = bound_values(N=seq, H=H, b=4, L=L, host_budget=k * boundary)
        row = dict(variant=name, offloaded_layers=k, median_s=medians[name], ratio=medians[name] / medians[
            "compiled, no SCO"], grads_equal=equal)
        if h is not None:
            row.update(device_boundary_peak=h.peak_device_boundary_bytes(),
                       device_bound=int(sym.evaluate(sco_compiled_device_bound(), values)),
                       offloaded_bytes=h.offloaded_bytes(), host_pool_bytes=h.host_pool_bytes,
                       restored_live_peak=h.peak_restored_live())
            assert row["offloaded_bytes"] == k * boundary and row["device_boundary_peak"] <= row["device_bound"]
        rows.append(row)
    return dict(model="torchtitan deepseek_v3 debug MoE, fp32, FullAC, boundpass.compile(inner='aot_eager')",
                layers=L, hidden=H, seq=seq, boundary_bytes=boundary, repeats=repeats, timing_wall_s=timing_s,
                rows=rows)


# --------------------------------------------------------------------------------------- simulated
def _sim_one(L: int, H: int, N: int, dtype: torch.dtype) -> dict:
    b = torch.finfo(dtype).bits // 8
    boundary = N * H * b
    budgets = sorted({0, boundary - 1} | {k * boundary for k in range(1, L + 1)})
    rows = []
    with FakeTensorMode():
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList(
            checkpoint_wrapper(torch.nn.Sequential(torch.nn.Linear(H, H, bias=False, dtype=dtype), torch.nn.GELU()))
            for _ in range(L))
        x = torch.randn(N, H, dtype=dtype, requires_grad=True)
        for budget in budgets:
            handle = apply_sco(blocks, budget)  # under fake tensors the prefetch copy runs inline (no data)
            for _ in range(2):  # the second step reuses the host pool
                handle.events.clear()
                h = x * 1  # a fresh first boundary (x itself is a leaf the bench keeps)
                for block in blocks:
                    h = block(h) + h
                h.float().sum().backward()
                del h
            values = bound_values(N=N, H=H, b=b, L=L, host_budget=budget)
            rows.append(dict(host_budget=budget, offloaded_layers=int(values[sym.L_off]),
                             device_boundary_peak=handle.peak_device_boundary_bytes(),
                             device_bound=int(sym.evaluate(sco_device_bound(), values)),
                             offloaded_bytes=handle.offloaded_bytes(), host_pool_bytes=handle.host_pool_bytes,
                             host_bound=int(sym.evaluate(sco_host_bound(), values)),
                             restored_live_peak=handle.peak_restored_live()))
            handle.remove()
            for p in blocks.parameters():
                p.grad = None
    peaks = [r["device_boundary_peak"] for r in rows]
    monotone = all(a >= b for a, b in zip(peaks, peaks[1:]))
    for r in rows:
        assert r["device_boundary_peak"] <= r["device_bound"] and r["host_pool_bytes"] <= r["host_budget"]
    return dict(N=N, boundary_bytes=boundary, rows=rows, monotone=monotone,
                reduction=1 - peaks[-1] / peaks[0], none_peak=peaks[0], all_peak=peaks[-1])


def run_simulated(L: int, H: int, Ns: tuple, dtype: torch.dtype) -> dict:
    return dict(blocks=f"{L} checkpoint_wrapper'd residual blocks (Linear {H}→{H}, no bias, + GELU), {dtype}",
                mode="FakeTensorMode (fake cpu tensors), prefetch copy run inline; measured by the SCO ledger", L=L, H=H,
                dtype=str(dtype), sweeps=[_sim_one(L, H, N, dtype) for N in Ns])


# ------------------------------------------------------------------------------------------ report
def check_targets(real: dict, sim: dict, compiled: dict | None = None) -> list[dict]:
    worst = max(r["ratio"] for r in real["rows"])
    out = [dict(target=f"CPU step time ≤ {TARGET_RATIO}× no SCO (all variants)",
                figures=", ".join(f"{r['variant']}: {r['ratio']:.3f}×" for r in real["rows"][1:]),
                met=worst <= TARGET_RATIO),
           dict(target="gradients torch.equal to no SCO", figures="all variants",
                met=all(r["grads_equal"] for r in real["rows"]))]
    if compiled is not None:
        out.append(dict(target=f"compiled: CPU step time ≤ {TARGET_RATIO}× compiled without SCO",
                        figures=", ".join(f"{r['variant']}: {r['ratio']:.3f}×" for r in compiled["rows"][1:]),
                        met=max(r["ratio"] for r in compiled["rows"]) <= TARGET_RATIO))
        out.append(dict(target="compiled: gradients torch.equal to compiled without SCO", figures="all variants",
                        met=all(r["grads_equal"] for r in compiled["rows"])))
    for s in sim["sweeps"]:
        out.append(dict(target=f"simulated N={s['N']:,}: device peak monotone in host budget",
                        figures=f"{len(s['rows'])} budgets", met=s["monotone"]))
        out.append(dict(target=f"simulated N={s['N']:,}: ≥ {TARGET_REDUCTION:.0%} device-peak reduction at full "
                               f"offload", figures=f"{fmt_bytes(s['none_peak'])} → {fmt_bytes(s['all_peak'])} "
                                                   f"({s['reduction']:.1%})", met=s["reduction"] >= TARGET_REDUCTION))
    return out


def render(data: dict) -> str:
    real, sim = data["real"], data["simulated"]
    m = data["meta"]
    md = ["# SCO benchmark (`bench/sco.py`)", "",
          f"torch {m['torch']}, {m['processor']}, {m['nproc']} cores, {m['torch_threads']} torch threads, "
          f"{m['date_utc']}. Wall time {data['wall_seconds']:.0f} s. Shared machine: load from other jobs varies.", "",
          "## Real tensors on CPU (measured)", "",
          f"{real['model']}: {real['layers']} layers, H = {real['hidden']}, seq {real['seq']}, batch 1; "
          f"boundary = {fmt_bytes(real['boundary_bytes'])}. Median fwd+bwd step over {real['repeats']} interleaved "
          f"repeats (1 warm-up each). Host budget = k × boundary bytes.", "",
          "**Host and device are the same memory on CPU**: this section shows correctness (bit-exact gradients) and "
          "time overhead only. The 'device boundary' figures are the SCO ledger's bytes of boundary storages that "
          "would be on the device; no real memory is saved here.", ""]
    rows = []
    for r in real["rows"]:
        sco = "device_boundary_peak" in r
        rows.append([r["variant"], fmt_seconds(r["median_s"]), f"{r['ratio']:.3f}×", "yes" if r["grads_equal"] else "NO",
                     fmt_bytes(r["device_boundary_peak"]) if sco else "—",
                     fmt_bytes(r["device_bound"]) if sco else "—",
                     fmt_bytes(r["offloaded_bytes"]) if sco else "—",
                     fmt_bytes(r["host_pool_bytes"]) if sco else "—",
                     str(r["restored_live_peak"]) if sco else "—"])
    md += [markdown_table(["variant", "median step", "vs no SCO", "grads torch.equal", "ledger device boundary peak",
                           "sco_device_bound", "host bytes offloaded", "host pool", "restored live ≤"], rows), ""]
    comp = data.get("compiled")
    if comp is not None:
        md += ["## Compiled: `boundpass.compile(..., sco_enable=True)` on CPU (measured)", "",
               f"{comp['model']}: {comp['layers']} layers, H = {comp['hidden']}, seq {comp['seq']}, batch 1; "
               f"boundary = {fmt_bytes(comp['boundary_bytes'])}. Median fwd+bwd step over {comp['repeats']} "
               f"interleaved repeats (1 warm-up each, which compiles). Ratios are vs the same model compiled "
               f"without SCO; the bound is `sco_compiled_device_bound`. Same CPU caveat as above.", ""]
        rows = []
        for r in comp["rows"]:
            sco = "device_boundary_peak" in r
            rows.append([r["variant"], fmt_seconds(r["median_s"]), f"{r['ratio']:.3f}×",
                         "yes" if r["grads_equal"] else "NO",
                         fmt_bytes(r["device_boundary_peak"]) if sco else "—",
                         fmt_bytes(r["device_bound"]) if sco else "—",
                         fmt_bytes(r["offloaded_bytes"]) if sco else "—",
                         str(r["restored_live_peak"]) if sco else "—"])
        md += [markdown_table(["variant", "median step", "vs compiled, no SCO", "grads torch.equal",
                               "ledger device boundary peak", "bound", "host bytes offloaded", "restored live ≤"],
                              rows), ""]
    md += ["## Simulated at gpt-oss-20b-like shapes (measured on fake tensors)", "",
           f"{sim['blocks']}; {sim['mode']}. Not the real gpt_oss model: only the boundary (block input, N×H) "
           f"matters to SCO. Per-rank sequence N tokens; host budget swept from 0 to all {sim['L']} boundaries. "
           f"Figures are the SCO ledger's, checked ≤ the sympy bound.", ""]
    for s in sim["sweeps"]:
        md += [f"### N = {s['N']:,} tokens (boundary {fmt_bytes(s['boundary_bytes'])})", ""]
        rows = [[fmt_bytes(r["host_budget"]) + (" (boundary − 1 B)" if r["host_budget"] == s["boundary_bytes"] - 1 else ""), str(r["offloaded_layers"]), fmt_bytes(r["device_boundary_peak"]),
                 fmt_bytes(r["device_bound"]), fmt_bytes(r["host_pool_bytes"]), str(r["restored_live_peak"])]
                for r in s["rows"]]
        md += [markdown_table(["host budget", "L_off", "device boundary peak", "sco_device_bound", "host bytes",
                               "restored live ≤"], rows), "",
               f"Monotone: {'yes' if s['monotone'] else 'NO'}. None → all offloaded: {fmt_bytes(s['none_peak'])} → "
               f"{fmt_bytes(s['all_peak'])}, a {s['reduction']:.1%} reduction of device boundary bytes.", ""]
    md += targets_section(data["targets"])
    md += ["Not covered: real CUDA device peak and step time (no GPU here; side-stream overlap untested; "
           "bench/gpu_sco.py measures them on a GPU), Inductor timings. Device boundary bytes are the boundaries "
           "only, not the whole activation peak.", ""]
    return "\n".join(md)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 256, 3 repeats")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    start = time.perf_counter()
    print("simulated (fake tensors)", flush=True)
    sim = run_simulated(**SIM)
    print("real tensors (CPU)", flush=True)
    real = run_real(**cfg)
    print("compiled (CPU)", flush=True)
    compiled = run_compiled(**cfg)
    data = {"meta": run_metadata(), "quick": args.quick, "real": real, "compiled": compiled, "simulated": sim}
    data["targets"] = check_targets(real, sim, compiled)
    return publish("sco", data, render, start)


if __name__ == "__main__":
    main()
