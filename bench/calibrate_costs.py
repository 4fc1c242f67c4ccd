"""Recalibrate boundpass/bound/cost_model.py's constants on this machine's device (issue 18; docs/knobs.md).

Times one Ring-DTP forward + backward (the custom op, P = 1, fp32) at several strip widths C, fits ``launch_s``
and the streaming rates with ``cost_model.calibrate`` (out-of-cache strips: ``bandwidth``; strips that fit
``cache_bytes``: ``cache_bandwidth``), and writes ``{"<device>": {...}}`` to ``$OUT/costs.json`` (else
bench/out/costs.json) with the measured curve, the fitted constants, and the measured, default-model and
fitted-model knees. Point ``BOUNDPASS_COSTS`` at the file to make ``boundpass.compile`` use it.
``bench/gpu_check.sh`` runs it on the GPU; ``--dry-run`` runs a tiny shape on the CPU.

    python bench/calibrate_costs.py [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from boundpass.bound import cost_model
from boundpass.runtime.ring_dtp import ring_dtp_loss

GPU = dict(N=8192, H=2048, V=65536, Cs=(256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536), repeats=5)
DRY = dict(N=512, H=64, V=4096, Cs=(128, 512, 1024, 4096), repeats=2)


def step_seconds(h, w, labels, C: int, repeats: int) -> float:
    """Median seconds of one forward + backward of the Ring-DTP op at strip width C (device synchronised)."""
    V = w.shape[0]
    times = []
    for i in range(repeats + 1):  # the first is the warm-up
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        if h.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = ring_dtp_loss(hh, ww, labels, vocab_size=V, block=C)
        torch.autograd.grad(loss, (hh, ww))
        if h.is_cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU")
    args = parser.parse_args(argv)
    cfg = DRY if args.dry_run or not torch.cuda.is_available() else GPU
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    N, H, V = cfg["N"], cfg["H"], cfg["V"]
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=gen).to(device)
    w = torch.randn(V, H, generator=gen).mul_(H ** -0.5).to(device)
    labels = torch.randint(0, V, (N,), generator=gen).to(device)
    measured = {C: step_seconds(h, w, labels, C, cfg["repeats"]) for C in cfg["Cs"]}
    base = cost_model.costs_for(device)
    shape = dict(N=N, H=H, V=V)
    miss = {C: t for C, t in measured.items() if N * C * 4 > base.cache_bytes}
    fit = {C: t for C, t in measured.items() if N * C * 4 <= base.cache_bytes}
    fitted = base
    if len(miss) >= 2:
        fitted = cost_model.calibrate(miss, base=fitted, **shape)
    if len(fit) >= 2:
        fitted = cost_model.calibrate(fit, base=fitted, **shape)
    lo = min(cfg["Cs"])
    out = {"device": device, "name": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shape": shape,
           "curve": [{"C": C, "seconds": t,
                      "model_default": cost_model.ring_dtp_seconds(C, costs=base, **shape),
                      "model_fitted": cost_model.ring_dtp_seconds(C, costs=fitted, **shape)} for C, t in measured.items()],
           "measured_knee": cost_model.knee(measured),
           "default_knee": cost_model.ring_dtp_knee(lo=lo, hi=V, costs=base, **shape),
           "fitted_knee": cost_model.ring_dtp_knee(lo=lo, hi=V, costs=fitted, **shape),
           device: {k: v for k, v in asdict(fitted).items() if k != "name"}}
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "costs.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    for row in out["curve"]:
        print(f"calibrate_costs: C={row['C']:6d} measured {row['seconds'] * 1e3:9.2f} ms  default model "
              f"{row['model_default'] * 1e3:9.2f} ms  fitted {row['model_fitted'] * 1e3:9.2f} ms")
    print(f"calibrate_costs: knee measured {out['measured_knee']}, default model {out['default_knee']}, fitted "
          f"{out['fitted_knee']}; {cost_model.describe(fitted)}; wrote {path} (BOUNDPASS_COSTS={path})")
    return out


if __name__ == "__main__":
    main()
