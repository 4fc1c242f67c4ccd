"""OffloadStreamAdamW on a GPU: exactness, device peak vs bound, step time vs the link floor and serial CPU Adam.

1. exact: 10 steps on CUDA, fp32 and bf16 working weights, vs torch AdamW(foreach=False) on fp32 masters (bit-exact
   expected; the max abs difference is printed).
2. link: pinned host <-> device bandwidth, each direction alone and both at once (the streamed step moves 12·Θ
   bytes each way concurrently); floor = 12·Θ / (the slower concurrent direction).
3. step: bf16 working weights, Θ parameters on one GPU; OffloadStreamAdamW at a few (β, S), the serial
   CPU-Adam offload (ZeRO-Offload's shape, bench/optimizer.py), DeepSpeed CPU Adam in that shape if importable,
   and torch AdamW fused with everything on the device; torch.cuda.max_memory_allocated vs the bound.
4. knee (issue 18, docs/knobs.md): the step time against β at S = 2 beside boundpass/bound/cost_model.py's model, the
   measured knee and the model's at the default and at the measured link rate; the measured link rate is merged
   into $OUT/costs.json as {"cuda": {"link_bandwidth": ...}} (BOUNDPASS_COSTS=that file: compile's β and S knee
   use it) with the curve under "optimizer".
Targets (docs/design.md §2 / issue 5): ≥ 2× faster than the serial CPU-Adam offload, ≤ 1.2× the link floor.

    python3 bench/gpu_optimizer.py [--params N]     # needs CUDA; exits 0 with a message if there is none
    python3 bench/gpu_optimizer.py --dry-run         # tiny shapes on CPU: checks the script, writes nothing

Writes gpu_optimizer.json into $OUT if set, else bench/out/, after every measurement (a run cut short keeps
what it measured). Needs torch and this repository only (no torchtitan, boundpass need not be installed).
"""
from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


class _SourceLayout(importlib.abc.MetaPathFinder):
    """pyproject's package-dir mapping (runtime/ -> boundpass.runtime, recipes/ -> boundpass.recipes) for a
    source checkout run with PYTHONPATH=. where boundpass is not installed; consulted after the normal finders."""

    def find_spec(self, name, path=None, target=None):
        folder = {"boundpass.runtime": "runtime", "boundpass.recipes": "recipes"}.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, REPO / folder / "__init__.py",
                                                      submodule_search_locations=[str(REPO / folder)])


sys.meta_path.append(_SourceLayout())
from bench import common  # noqa: E402
from bench.optimizer import HYPER, SerialCpuAdamOffload  # noqa: E402
from boundpass.core import symbols as sym  # noqa: E402
from boundpass.runtime.offload_adamw import OffloadStreamAdamW, bound_values, offload_adamw_bound  # noqa: E402

SHAPES_EXACT = [(37, 100), (4097,), (64, 64), (3,), (5, 7)]


def median_step_seconds(step, device, repeats: int = 5) -> float:
    """Median wall seconds of step() after one warm-up, with device synchronisation around each."""
    step()
    return common.median_step_seconds(step, device, repeats)


def check_exact(device) -> dict:
    """Max abs difference after 10 steps vs torch AdamW(foreach=False) on fp32 masters, fp32 and bf16 weights."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        init = [torch.randn(s, generator=gen) for s in SHAPES_EXACT]
        masters = [torch.nn.Parameter(t.to(dtype).float().to(device)) for t in init]
        params = [torch.nn.Parameter(t.to(device, dtype)) for t in init]
        ref = torch.optim.AdamW(masters, foreach=False, fused=False, **HYPER)
        opt = OffloadStreamAdamW(params, bucket_params=1000, **HYPER)
        for _ in range(10):
            for m, p in zip(masters, params):
                p.grad = torch.randn(p.shape, generator=gen).to(device, dtype)
                m.grad = p.grad.float()
            ref.step(), opt.step()
        common.synchronize(device)
        diff = max((p.float() - m.to(dtype).float()).abs().max().item() for p, m in zip(params, masters))
        out[str(dtype)] = {"max_abs_diff_params": diff,
                           "bit_exact": all(torch.equal(p, m.to(dtype)) for p, m in zip(params, masters))}
    return out


def link_bandwidth(device, nbytes: int) -> dict:
    """Pinned host <-> device bytes/s: H2D alone, D2H alone, and each direction while the other runs."""
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host_back = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_back = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = median_step_seconds(lambda: dev.copy_(host, non_blocking=True), device)
    d2h = median_step_seconds(lambda: host_back.copy_(dev_back, non_blocking=True), device)
    if device.type == "cuda":
        streams = [torch.cuda.Stream(device) for _ in range(2)]

        def both():
            for stream in streams:
                stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(streams[0]):
                dev.copy_(host, non_blocking=True)
            with torch.cuda.stream(streams[1]):
                host_back.copy_(dev_back, non_blocking=True)
            for stream in streams:
                torch.cuda.current_stream(device).wait_stream(stream)
        concurrent = median_step_seconds(both, device)
    else:
        concurrent = h2d + d2h
    return {"h2d_Bps": nbytes / h2d, "d2h_Bps": nbytes / d2h, "each_way_concurrent_Bps": nbytes / concurrent}


def _model(device, theta: int, dtype=torch.bfloat16):
    """Θ bf16 working weights in tensors of up to 16M elements, with grads."""
    chunk, params = 1 << 24, []
    for start in range(0, theta, chunk):
        p = torch.nn.Parameter(torch.randn(min(chunk, theta - start), device=device, dtype=dtype) * 0.02)
        p.grad = torch.randn_like(p) * 1e-2
        params.append(p)
    return params


def step_times(device, theta: int, configs, rows: list, save) -> None:
    """Append median step seconds and device peak bytes of each schedule on the same Θ to rows; save() after each."""

    def run(name, make, bound=None, knobs=None):
        params = _model(device, theta)
        try:
            opt = make(params)
        except ImportError as e:
            rows.append({"schedule": name, "error": f"not available: {e}"})
            return
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = median_step_seconds(opt.step, device)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        rows.append({"schedule": name, "median_step_s": seconds, "device_peak_bytes": peak, "bound_bytes": bound,
                     "peak_within_bound": None if None in (peak, bound) else peak <= bound, **(knobs or {})})
        print(f"  {name}: {seconds * 1e3:.1f} ms per step, device peak {peak}, bound {bound}", flush=True)
        save()

    for beta, slots in configs:
        bound = sym.evaluate(offload_adamw_bound(), bound_values(b=2, Theta=theta, beta=beta, S=slots))
        run(f"offload-stream β={beta} S={slots}",
            lambda ps: OffloadStreamAdamW(ps, bucket_params=beta, staging_slots=slots, **HYPER), bound,
            {"beta": beta, "S": slots})
    run("serial-offload (torch fused CPU AdamW)", lambda ps: SerialCpuAdamOffload(ps, **HYPER))

    def deepspeed_serial(ps):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return SerialCpuAdamOffload(ps, host_optimizer=lambda ms: DeepSpeedCPUAdam(ms, adamw_mode=True, **HYPER))
    run("serial-offload (DeepSpeedCPUAdam)", deepspeed_serial)
    run("torch AdamW fused, all on device (bf16 state)", lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER))


def optimizer_knee(device, theta: int, rows: list, link: dict) -> dict:
    """The measured β curve at S = 2 beside cost_model's, the knees, and the link rate for costs.json."""
    from boundpass.bound import cost_model as cm
    tensors = -(-theta // (1 << 24))        # _model's tensors of up to 2^24 elements
    base = cm.costs_for(device.type)
    fitted = cm.calibrate_optimizer({}, Theta=theta, tensors=tensors, b=2, base=base,
                                    link_bandwidth=link["each_way_concurrent_Bps"])
    measured = {r["beta"]: r["median_step_s"] for r in rows if r.get("S") == 2 and "median_step_s" in r}
    curve = [{"beta": b, "seconds": t,
              "model_default": cm.offload_adamw_seconds(b, 2, Theta=theta, tensors=tensors, b=2, costs=base),
              "model_fitted": cm.offload_adamw_seconds(b, 2, Theta=theta, tensors=tensors, b=2, costs=fitted)}
             for b, t in sorted(measured.items())]
    knee = dict(Theta=theta, tensors=tensors, b=2, S=2, curve=curve,
                measured_knee=cm.knee(measured) if measured else None,
                default_knee=list(cm.offload_adamw_knee(Theta=theta, tensors=tensors, b=2, costs=base, hi=1 << 24)),
                fitted_knee=list(cm.offload_adamw_knee(Theta=theta, tensors=tensors, b=2, costs=fitted, hi=1 << 24)),
                link_bandwidth=fitted.link_bandwidth)
    return knee


def main() -> int:
    """Run the checks; print a summary and write gpu_optimizer.json (not with --dry-run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU; writes nothing")
    parser.add_argument("--params", type=int, default=1 << 28, help="Θ for the timed step (default 256M)")
    args = parser.parse_args()
    if args.dry_run:
        device, theta, configs, probe = torch.device("cpu"), 1 << 16, [(1 << 12, 2)], 1 << 20
    elif not torch.cuda.is_available():
        print("gpu_optimizer: no CUDA device here; skipping (use --dry-run to check the script on CPU)")
        return 0
    else:
        device, theta, probe = torch.device("cuda"), args.params, 1 << 30
        configs = [(1 << 18, 2), (1 << 20, 2), (1 << 22, 2), (1 << 24, 2), (1 << 24, 3), (1 << 26, 2)]
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
              "torch": torch.__version__, "theta": theta, "steps": []}
    out = Path(os.environ.get("OUT") or REPO / "bench" / "out") / "gpu_optimizer.json"

    def save():
        if not args.dry_run:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")

    result["exact"] = exact = check_exact(device)
    save()
    print(f"exactness after 10 steps: {exact}", flush=True)
    result["link"] = link = link_bandwidth(device, probe)
    result["floor_s"] = floor_s = 12 * theta / link["each_way_concurrent_Bps"]
    save()
    rates = {k: f"{v / 1e9:.1f} GB/s" for k, v in link.items()}
    print(f"link: {rates}; 12·Θ floor {floor_s * 1e3:.1f} ms",
          flush=True)
    rows = result["steps"]
    step_times(device, theta, configs, rows, save)
    serial = next(r.get("median_step_s") for r in rows if r["schedule"].startswith("serial-offload (torch"))
    for row in rows:
        if "median_step_s" in row:
            row["x_floor"] = row["median_step_s"] / floor_s
            row["speedup_vs_serial"] = serial / row["median_step_s"]
            print(f"  {row['schedule']}: {row['x_floor']:.2f}× floor, {row['speedup_vs_serial']:.2f}× vs serial")
        else:
            print(f"  {row['schedule']}: {row['error']}")
    result["knee"] = knee = optimizer_knee(device, theta, rows, link)
    save()
    print(f"knee: measured β = {knee['measured_knee']}, model (default constants) {knee['default_knee']}, model at "
          f"the measured link {knee['fitted_knee']}", flush=True)
    if not args.dry_run:
        costs = out.parent / "costs.json"   # bench/calibrate_costs.py's file, when it ran first: merged into
        data = json.loads(costs.read_text()) if costs.exists() else {}
        data.setdefault(device.type, {})["link_bandwidth"] = knee["link_bandwidth"]
        data["optimizer"] = knee
        costs.write_text(json.dumps(data, indent=2) + "\n")
        print(f"gpu_optimizer: link_bandwidth {knee['link_bandwidth'] / 1e9:.1f} GB/s merged into {costs} "
              f"(BOUNDPASS_COSTS={costs})", flush=True)
    print("gpu_optimizer --dry-run: ok" if args.dry_run else f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
