"""Expert dispatch on the GPU: standard EP vs LLEP vs PipelinedLLEP (issue 16's comparison, CUDA variant).

On every visible GPU (one rank each; NCCL when there are two or more, up to 4; one GPU: E_p = 1, where nothing
relocates and the comparison is the chunked schedule's cost against one-shot dispatch), the routings of
bench/dispatch.py (balanced, Zipf, adversarial); per schedule: torch.cuda.max_memory_allocated above what was
allocated before the forward + backward, and the median CUDA-synchronised time of REPEATS steps; then
PipelinedLLEP (strided) against the chunk cap c, the curve boundpass/bound/cost_model.py's dispatch knee is
calibrated from on a GPU (its knee: the smallest c within KNEE_TOLERANCE of the best time): with two or more GPUs,
`cost_model.calibrate_dispatch` fits the all-to-all latency and rate to it and merges them into $OUT/costs.json
as {"cuda": {"collective_s": ..., "alltoall_bandwidth": ...}} (BOUNDPASS_COSTS=that file makes compile's c knee
use them); one GPU has no all-to-all to fit.

    PYTHONPATH=. python3 bench/gpu_dispatch.py            # needs CUDA; exits 2 with a message if there is none
    PYTHONPATH=. python3 bench/gpu_dispatch.py --dry-run  # tiny shapes on the CPU (gloo, 2 ranks): checks the script

Writes gpu_dispatch.json (+ .md) into $OUT if set, else bench/out/ (the dry run writes nothing). Stops starting
new measurements after DEADLINE_S (gpu_check.sh shares its minutes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from bench.common import REPO_ROOT, fmt_bytes, fmt_seconds, markdown_table, run_metadata
from bench.dispatch import PLAN, ROUTINGS, autograd_step, global_ids

GPU = dict(T=16_384, H=2_048, I=1_024, E=16, k=4, cap=1_639, min_piece=256, dtype=torch.bfloat16,
           curve=(256, 512, 1_024, 2_048, 4_096, 8_192, 16_384))
DRY = dict(T=256, H=32, I=32, E=8, k=2, cap=26, min_piece=8, dtype=torch.float32, curve=(16, 64, 256))
SCHEDULES = ("standard", "llep", "pipelined", "pipelined_consecutive")
REPEATS = 5
DEADLINE_S = 60


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step, device, group, repeats=REPEATS) -> float:
    step()  # warm-up (first CUDA kernels, allocator)
    times = []
    for _ in range(repeats):
        _sync(device)
        if group is not None:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak(step, device) -> int | None:
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def rank_main(rank: int, world: int, cfg: dict, dry: bool) -> dict:
    device = torch.device("cpu") if dry else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = dist.group.WORLD if world > 1 else None
    T, H, I, E, k, dt = cfg["T"], cfg["H"], cfg["I"], cfg["E"], cfg["k"], cfg["dtype"]
    e = E // world
    start, out = time.perf_counter(), {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                                       else "cpu (dry run)", "routings": {}}
    for kind in ROUTINGS:
        if time.perf_counter() - start > DEADLINE_S:
            out["stopped_early"] = f"deadline {DEADLINE_S} s before {kind}"
            break
        ids = global_ids(kind, world, T, E, k)[rank].to(device)
        g = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(T, H, generator=g).to(device, dt)
        s = torch.rand(T, k, generator=g).to(device, dt)
        grad = torch.randn(T, H, generator=g).to(device, dt)
        gw = torch.Generator().manual_seed(99)
        ws = [(torch.randn(E, *shape, generator=gw) * shape[1] ** -0.5)[rank * e:(rank + 1) * e].to(device, dt)
              for shape in ((I, H), (H, I), (I, H))]
        row = {"seconds": {}, "peak_bytes": {}, "curve_seconds": {}}
        ref = autograd_step("standard", x, ids, s, ws, grad, group, cfg)
        row["max_rel_err"] = {}
        for sch in SCHEDULES:
            step = (lambda sch=sch: autograd_step(sch, x, ids, s, ws, grad, group, cfg))
            got = step()
            row["max_rel_err"][sch] = max(float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-30))
                                          for a, b in zip(got, ref))
            del got
            row["peak_bytes"][sch] = _peak(step, device)
            row["seconds"][sch] = _timed(step, device, group)
        del ref
        for c in cfg["curve"]:
            if time.perf_counter() - start > DEADLINE_S:
                break
            row["curve_seconds"][str(c)] = _timed(
                lambda c=c: autograd_step("pipelined", x, ids, s, ws, grad, group, dict(cfg, cap=c)), device, group)
        out["routings"][kind] = row
    return out


def render(res: dict, world: int, cfg: dict) -> str:
    from boundpass.bound import cost_model

    md = [f"# Expert dispatch on {res['device']}: {world} rank(s), T={cfg['T']}/rank, H={cfg['H']}, I={cfg['I']}, "
          f"E={cfg['E']}, k={cfg['k']}, c={cfg['cap']}, {str(cfg['dtype']).replace('torch.', '')}", ""]
    rows = []
    for kind, row in res["routings"].items():
        for sch in SCHEDULES:
            t, p = row["seconds"][sch], row["peak_bytes"][sch]
            rows.append([kind, sch, fmt_bytes(p) if p is not None else "-", fmt_seconds(t),
                         f"{t / row['seconds']['llep']:.2f}",
                         f"{p / row['peak_bytes']['llep']:.2f}" if p is not None else "-",
                         f"{row['max_rel_err'][sch]:.1e}"])
    md += [markdown_table(["routing", "schedule", "peak (allocated)", "median fwd+bwd", "time / LLEP",
                           "peak / LLEP", "max rel. diff vs standard"], rows), ""]
    rows = []
    for kind, row in res["routings"].items():
        curve = {int(c): t for c, t in row["curve_seconds"].items()}
        if curve:
            rows.append([kind] + [fmt_seconds(curve[c]) if c in curve else "-" for c in cfg["curve"]]
                        + [str(cost_model.knee(curve))])
    md += ["PipelinedLLEP (strided) against the chunk cap c:", "",
           markdown_table(["routing"] + [f"c = {c}" for c in cfg["curve"]] + ["measured knee"], rows), ""]
    return "\n".join(md)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, 2 gloo ranks; writes nothing")
    args = parser.parse_args(argv)
    from boundpass.testing.distributed import run_on_ranks

    if args.dry_run:
        cfg, world, backend = DRY, 2, "gloo"
    else:
        if not torch.cuda.is_available():
            print("gpu_dispatch: no CUDA device visible to torch; nothing measured", file=sys.stderr)
            return 2
        cfg, world, backend = GPU, min(torch.cuda.device_count(), 4), "nccl"
    t0 = time.perf_counter()
    if world == 1:
        results = [rank_main(0, 1, cfg, args.dry_run)]
    else:
        results = run_on_ranks(rank_main, world, cfg, args.dry_run, backend=backend, timeout_s=DEADLINE_S + 120)
    text = render(results[0], world, cfg)
    print(text)
    if args.dry_run:  # the fit runs on the dry run's curves too (checks it; nothing is written)
        print(f"gpu_dispatch: fitted (dry run, not written): {fit_dispatch_costs(results[0], world, cfg)}")
    print(f"gpu_dispatch: {time.perf_counter() - t0:.0f} s")
    if not args.dry_run:
        out = Path(os.environ.get("OUT") or REPO_ROOT / "bench" / "out")
        out.mkdir(parents=True, exist_ok=True)
        data = {"meta": run_metadata(), "world": world, "config": dict(cfg, dtype=str(cfg["dtype"])),
                "rank0": results[0], "plan_args": PLAN}
        fitted = fit_dispatch_costs(results[0], world, cfg)
        if fitted:  # merged into $OUT/costs.json beside the other benches' figures (BOUNDPASS_COSTS reads it)
            data["fitted_costs"] = fitted
            costs = out / "costs.json"
            merged = json.loads(costs.read_text()) if costs.exists() else {}
            merged.setdefault("cuda", {}).update(fitted)
            costs.write_text(json.dumps(merged, indent=2) + "\n")
        (out / "gpu_dispatch.json").write_text(json.dumps(data, indent=1, default=str))
        (out / "gpu_dispatch.md").write_text(text + "\n")
    return 0


def fit_dispatch_costs(res: dict, world: int, cfg: dict) -> dict:
    """The all-to-all latency and rate fitted to the measured c curves ({} on one GPU: no all-to-all to fit)."""
    from boundpass.bound import cost_model

    curves = [(world, {int(c): t for c, t in row["curve_seconds"].items()}) for row in res["routings"].values()
              if len(row["curve_seconds"]) >= 3]
    if world < 2 or not curves:
        return {}
    fitted = cost_model.calibrate_dispatch(curves, N=cfg["T"], H=cfg["H"], I=cfg["I"], E=cfg["E"], k=cfg["k"],
                                           b=torch.empty((), dtype=cfg["dtype"]).element_size(),
                                           base=cost_model.costs_for("cuda"))
    return {"collective_s": fitted.collective_s, "alltoall_bandwidth": fitted.alltoall_bandwidth}


if __name__ == "__main__":
    sys.exit(main())
