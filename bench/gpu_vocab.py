"""Ring-DTP at P = 1 on one GPU: peak device bytes and step time against the standard schedule, the
token-chunked fused linear-CE (Liger-style, our implementation) and Inductor with and without its
auto-chunker. Peaks are torch.cuda.max_memory_allocated; times are CUDA-event medians.

    PYTHONPATH=. python3 bench/gpu_vocab.py [--dry-run]

--dry-run runs tiny shapes on the CPU (wall-clock times, no device peaks) to check the script without a
GPU. Writes gpu_vocab.json into $OUT if set, else bench/out/; rewritten after every measurement, so a
run cut short still leaves what it measured. Needs torch and this repository only (no torchtitan).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import REPO_ROOT, fmt_bytes, fmt_seconds, markdown_table, median_step_seconds, run_metadata
from bench.vocab import LABELS, assert_same, make_inputs, make_step
from boundpass.core import symbols as sym
from boundpass.runtime.ring_dtp import bound_values, choose_branch, reference_bound, ring_dtp_bound

# (N, H, V, dtype, Ring-DTP strip C, with Inductor). C = V/8: a strip holds as many logits as one of the
# auto-chunker's 8 token chunks. The auto-chunker only acts when the logits outgrow the matmul inputs more
# than 8-fold, N*V / (H*(N + V)) > 8, hence H = 1024 in the case that compiles (once: compiling is slow).
GPU_CASES = [(16_384, 1024, 128_000, torch.float32, 16_000, True),
             (16_384, 4096, 128_000, torch.bfloat16, 16_000, False),
             (16_384, 7168, 200_000, torch.float32, 25_000, False)]  # the paper's per-rank shape, one device
DRY_RUN_CASES = [(512, 32, 4096, torch.float32, 512, True), (512, 32, 4096, torch.bfloat16, 512, False)]
SCHEDULES = ("standard", "token_chunked", "ring_dtp", "inductor", "inductor_chunker")
REPEATS = 5
DEADLINE_S = 260  # stop starting new measurements after this: gpu_check.sh's 8 minutes are shared


def peak_device_bytes(step, device: torch.device) -> int | None:
    """max_memory_allocated over one step (bytes, inputs included); None off the GPU."""
    if device.type != "cuda":
        step()
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def bound(schedule: str, *, N: int, H: int, V: int, C: int, dtype, device=None) -> int | None:
    """The runtime's sympy bound (bytes, inputs included) for Ring-DTP and the standard schedule, plus the cuBLAS /
    cuBLASLt workspaces torch keeps once a matmul ran (in max_memory_allocated, not the op's: 64 MiB on an H200)."""
    from boundpass.bound.bounds import blas_workspace_bytes
    mixed = dtype != torch.float32
    values = bound_values(dtype, N=N, H=H, V=V, P=1, C=C)
    workspace = blas_workspace_bytes(device) if device is not None else 0
    if schedule == "ring_dtp":
        return sym.evaluate(ring_dtp_bound(choose_branch(N, V, 1), mixed_precision=mixed), values) + workspace
    if schedule == "standard":
        return sym.evaluate(reference_bound(mixed_precision=mixed), values) + workspace
    return None


def measure_schedule(schedule: str, h, w, labels, *, V: int, C: int, device, ref):
    """One schedule: (row with peak bytes, median time, bound, chunked graphs; the standard's outputs on the CPU)."""
    from torch._inductor import config as inductor_config, metrics

    step = make_step(schedule, h, w, labels, vocab_size=V, block=C)
    before = getattr(metrics, "num_auto_chunking", 0)
    with inductor_config.patch({"auto_chunker.enable": schedule == "inductor_chunker"}
                               if hasattr(inductor_config, "auto_chunker") else {}):
        outputs = step()  # compiles the Inductor variants
    chunked = getattr(metrics, "num_auto_chunking", 0) - before
    outputs = tuple(t.cpu() for t in outputs)  # off the device: the reference must not raise later peaks
    ref = ref or outputs
    if h.dtype == torch.float32:
        assert_same(schedule, outputs, ref)
    elif abs(outputs[0].item() - ref[0].item()) > 1e-3 * abs(ref[0].item()):
        raise AssertionError(f"{schedule}: loss {outputs[0].item()} vs standard {ref[0].item()}")
    loss = outputs[0].item()
    del outputs
    N, H = h.shape
    return {"peak_bytes": peak_device_bytes(step, device),
            "bound_bytes": bound(schedule, N=N, H=H, V=V, C=C, dtype=h.dtype, device=device),
            "seconds": median_step_seconds(step, device, REPEATS), "loss": loss,
            "auto_chunked_graphs": chunked if schedule.startswith("inductor") else None}, ref


def measure_case(N, H, V, dtype, C, with_inductor, device, deadline) -> dict:
    """Every schedule on one shape: peak bytes, median time, bound, loss agreement with the standard."""
    from torch._inductor import config as inductor_config

    h, w, labels = make_inputs(N, H, V, dtype=dtype, device=device)
    inputs_bytes = sum(t.nbytes for t in (h, w, labels))
    rows, ref = {}, None
    for schedule in SCHEDULES:
        if schedule.startswith("inductor") and not with_inductor:
            continue
        if time.monotonic() > deadline:
            rows[schedule] = {"skipped": "time budget of gpu_check.sh spent"}
            continue
        if schedule == "inductor_chunker" and not hasattr(inductor_config, "auto_chunker"):
            rows[schedule] = {"skipped": f"torch {torch.__version__} has no Inductor auto-chunker"}
            continue
        try:
            rows[schedule], ref = measure_schedule(schedule, h, w, labels, V=V, C=C, device=device, ref=ref)
            peak = rows[schedule]["peak_bytes"]
            rows[schedule]["peak_over_inputs_bytes"] = None if peak is None else peak - inputs_bytes
        except Exception as e:  # noqa: BLE001 -- record it (OOM, a compile error of this torch) and go on
            rows[schedule] = {"failed": f"{type(e).__name__}: {e}"[:400]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"  {schedule:17s} " + (rows[schedule].get("failed") or
              f"peak {fmt_bytes(rows[schedule]['peak_bytes']):>10s}  {fmt_seconds(rows[schedule]['seconds'])}"),
              flush=True)
    return {"N": N, "H": H, "V": V, "dtype": str(dtype).replace("torch.", ""), "C": C,
            "inputs_bytes": inputs_bytes, "schedules": rows}


def render(cases: list[dict], device: torch.device) -> str:
    """One markdown table per shape."""
    parts = []
    for case in cases:
        std = case["schedules"].get("standard", {})
        parts.append(f"N={case['N']}, H={case['H']}, V={case['V']}, {case['dtype']}, Ring-DTP strip C={case['C']} "
                     f"({device.type})")
        rows = []
        for schedule, r in case["schedules"].items():
            if "skipped" in r or "failed" in r:
                why = r.get("skipped") or "FAILED: " + r["failed"]
                rows.append([LABELS[schedule], "—", "—", "—", "—", why])
                continue
            ratio = f"{r['peak_bytes'] / std['peak_bytes']:.3f}" if r["peak_bytes"] and std.get("peak_bytes") else "—"
            vs_std = f" ({r['seconds'] / std['seconds']:.2f}x)" if "seconds" in std else ""
            notes = []
            if r["peak_bytes"] is not None and r["bound_bytes"] is not None:
                over = r["peak_bytes"] - r["bound_bytes"]
                notes.append("within bound" if over <= 0 else f"over bound by {over} B")
            if r["auto_chunked_graphs"] is not None:
                notes.append(f"auto-chunked graphs: {r['auto_chunked_graphs']}")
            note = "; ".join(notes)
            rows.append([LABELS[schedule], fmt_bytes(r["peak_bytes"]), fmt_bytes(r["bound_bytes"]), ratio,
                         fmt_seconds(r["seconds"]) + vs_std, note])
        parts += [markdown_table(["schedule", "peak allocated", "sympy bound", "peak / standard",
                                  "median time (vs standard)", "note"], rows), ""]
    return "\n".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, to check the script")
    parser.add_argument("--case", type=int, action="append", help="only these GPU_CASES (by index; repeatable)")
    parser.add_argument("--no-inductor", action="store_true", help="skip the Inductor variants (a short recheck)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_vocab: no CUDA device visible to torch; nothing measured (use --dry-run to check on a CPU)",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO_ROOT / "bench" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / "gpu_vocab.json"
    meta = run_metadata()
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
        meta["cuda"] = torch.version.cuda
    deadline = time.monotonic() + DEADLINE_S
    data = {"meta": meta, "dry_run": args.dry_run, "repeats": REPEATS, "cases": []}
    # a fresh Inductor cache: on a cache hit nothing compiles and the auto-chunker's counter stays 0
    with tempfile.TemporaryDirectory(prefix="gpu_vocab_inductor_") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        cases = DRY_RUN_CASES if args.dry_run else [c for i, c in enumerate(GPU_CASES) if not args.case or i in args.case]
        for N, H, V, dtype, C, with_inductor in cases:
            with_inductor = with_inductor and not args.no_inductor
            print(f"N={N} H={H} V={V} {dtype}", flush=True)
            data["cases"].append(measure_case(N, H, V, dtype, C, with_inductor, device, deadline))
            out_path.write_text(json.dumps(data, indent=2) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    markdown = render(data["cases"], device)
    (out_dir / "gpu_vocab.md").write_text(markdown + "\n")
    print(markdown)
    print(f"wrote {out_path}")
    failed = [f"{c['N']}/{c['dtype']} {s}" for c in data["cases"] for s, r in c["schedules"].items() if "failed" in r]
    if failed:
        print("gpu_vocab: FAILED: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
