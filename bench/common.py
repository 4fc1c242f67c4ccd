"""Shared helpers for the benchmarks: timing, run metadata, byte formatting, markdown tables, result files."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "docs" / "results"
MiB = 2 ** 20
GiB = 2 ** 30


def interleaved_medians(steps: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1,
                        sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median wall seconds of each step over ``repeats`` runs, after ``warmup`` untimed runs of each.

    The steps are timed round-robin, so load that drifts on a shared machine slows them all alike.
    ``sync`` runs before each clock read: a barrier across ranks, or a device synchronisation.
    """
    samples = interleaved_samples(steps, repeats=repeats, warmup=warmup, sync=sync)
    return {name: statistics.median(t) for name, t in samples.items()}


def interleaved_samples(steps: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1,
                        sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Every round's wall seconds of each step (round-robin, as ``interleaved_medians``): round i of two steps ran
    back to back, so their ratio in that round is a paired sample that drifting load mostly cancels out of."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step_seconds(step: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Median wall seconds of an already warmed-up ``step()``, the device synchronised around each call."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_metadata() -> dict:
    """Where and when a benchmark ran: torch/python versions, cores, threads, date (UTC)."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "nproc": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fmt_bytes(n: int | None) -> str:
    """Bytes as GiB (>= 1 GiB) or MiB, 2 decimals; '—' for None."""
    if n is None:
        return "—"
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def fmt_seconds(s: float | None) -> str:
    """Seconds as ms (< 1 s) or s, 3 significant figures; '—' for None."""
    if s is None:
        return "—"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table (cells already formatted as strings)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def targets_section(targets: list[dict]) -> list[str]:
    """Markdown lines of the "Targets" section: target, figures, met (a miss in bold)."""
    rows = [[t["target"], t["figures"], "yes" if t["met"] else "**no**"] for t in targets]
    return ["## Targets", "", markdown_table(["target", "figures", "met"], rows), ""]


def publish(name: str, data: dict, render, started: float) -> dict:
    """Stamp the wall time (s) since ``started``, write docs/results/<name>.json + .md, print the markdown."""
    data["wall_seconds"] = time.perf_counter() - started
    markdown = render(data)
    json_path, md_path = write_results(name, data, markdown)
    print(markdown)
    print(f"wrote {json_path.relative_to(REPO_ROOT)} and {md_path.relative_to(REPO_ROOT)}")
    return data


def write_results(name: str, data: dict, markdown: str, out_dir: Path = RESULTS_DIR) -> tuple[Path, Path]:
    """Write ``<name>.json`` and ``<name>.md`` into ``out_dir``; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path
