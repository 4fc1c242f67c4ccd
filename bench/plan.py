"""Longest context that fits, baseline vs boundpass, for every torchtitan MoE family's largest flavor.

Families: every torchtitan.models package with a model registry that has MoE flavors and plans
(recipes/families.py: deepseek_v3, gpt_oss, kimi_k2_7, qwen3 with torchtitan 0.3.0; the others are listed
with the reason they are refused). First, for each family's largest flavor, one plan at a fixed launch
(W = 64, E_p = 8, 128K context, all four operators) timed from a cold process state (meta build, block traces,
compose, trace at N; target < 10 s each). Then for gpt_oss 120b, qwen3 235B-A22B, deepseek_v3 671B and
kimi_k2_7 Kimi-K2.5 (torchtitan's real configs) on W = 16, 32 and 64 ranks,
139 GiB of device memory per rank and a 2 TiB host per 8 ranks (256 GiB per rank), global batch 1 sequence
split over all W ranks (N = context / W), E_p = 8 (one node), bf16 weights/activations, fp32 optimizer state:

  baseline           full-logits loss, standard EP, AdamW state on device, ZeRO-3, every block checkpointed with
                     its boundary on device; standard EP's hot rank counted two ways: worst-case routing (a rank
                     receives E_p N k rows: the only launch-time guarantee) and balanced routing (N k rows: the
                     most optimistic case)
  baseline + host optimizer   the same with AdamW state on the host (ZeRO-Offload-style), shown because the
                     baseline's on-device AdamW state alone exceeds 139 GiB where Θ/W is large
  baseline, data parallel + host optimizer   stock torchtitan's FSDP2 data parallelism instead of the sequence
                     split: W sequences per step, a whole one per rank (N = context), attention local, torchtitan's
                     chunked loss (8 chunks), AdamW state on the host, balanced routing (`plan --layout dp`)
  boundpass          Ring-DTP + PipelinedLLEP + SCO + OffloadStreamAdamW (c = 4,096, C = 4,096, β = 2^24, S = 2)
  --search           at a 1M-token sequence on the paper's pairings: the knobs boundpass plan --search picks

The longest context is `boundpass.plan`'s --solve: the largest context (a multiple of W) whose composed sympy
budget fits device and host, checked exactly at the answer and one step above. These are PREDICTIONS from the
bounds (no GPU here); at the boundpass reach the real torchtitan blocks and head are also traced under
FakeTensorMode and the plan's wall time on this machine is recorded.

First of all, the 671B plan as a user runs it (CLI_ARGS: `python -m boundpass plan deepseek_v3 671B --ranks 64
--ep 8 --context 1048576 --global-batch 64`) in a fresh process, CLI_RUNS times: wall and CPU time (user + sys of
the process and of the child it forks), and how busy the machine was meanwhile (what the other processes used of
its cores, from /proc/stat; the load average). Target: median wall < 10 s (issue 17).

Writes docs/results/plan.json and plan.md.

    python bench/plan.py [--quick] [--cli-only] [--cli-runs 5]

--cli-only: time the CLI again and keep the rest of docs/results/plan.json as it is.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (fmt_bytes, fmt_seconds, markdown_table, publish, run_metadata, targets_section,
                          write_results)
from boundpass.bound.composed import OPERATORS
from boundpass.planning.full_scale import plan
from boundpass.recipes import families

TIMED_LAUNCH = dict(ranks=64, ep=8, context=1 << 17, budget="139GiB", host_budget="256GiB")
PLAN_SECONDS_TARGET = 10.0
# the 671B plan of issue 17, as a user launches it (tests/backend/test_dropin.py runs the same model at W = 64, E_p = 8 with
# a 64K context: the same block graphs are traced, the time does not depend on N)
CLI_ARGS = ["plan", "deepseek_v3", "671B", "--ranks", "64", "--ep", "8", "--context", "1048576", "--global-batch", "64"]
CLI_RUNS = 5
# progress lines of the CLI (boundpass/__main__.py), in order: where each stage of a run starts
CLI_STAGES = (("imports (torch, torchtitan's package)", "importing torch"), ("meta build", "building "),
              ("block graphs at symbolic N + compose", "tracing the first"),
              ("trace at N + report", "tracing one "))
MODELS: list = []  # (class label, family, largest flavor), from the families found (run())
RANKS = (16, 32, 64)
PAPER_PAIRS = {("120B-class", 16), ("240B-class", 32), ("670B-class", 64)}  # the paper's model / rank pairings
BUDGET, HOST_PER_RANK, EP = "139GiB", "256GiB", 8
SEARCH_CONTEXT = 1 << 20  # --search at a 1M-token sequence, the paper's pairings
VARIANTS = {
    "baseline (worst-case routing)": dict(operators=(), routing="worst"),
    "baseline (balanced routing)": dict(operators=(), routing="balanced"),
    "baseline + host optimizer (balanced)": dict(operators=("offload_adamw",), routing="balanced"),
    # stock torchtitan's FSDP2 data parallelism: every rank a whole sequence (W sequences per step), attention local,
    # torchtitan's chunked loss; with the host optimizer, so that it fits where the variant above does
    "baseline, data parallel + host optimizer (balanced)": dict(operators=("offload_adamw",), routing="balanced",
                                                                layout="dp", loss_chunks=8),
    "boundpass (all four)": dict(operators=OPERATORS),
}


def _sequences(ranks: int, variant: dict) -> int:
    """Sequences per step: one split over the W ranks, or W under data parallelism (a whole one per rank)."""
    return ranks if variant.get("layout") == "dp" else 1


def _busy_core_seconds() -> float | None:
    """Core-seconds the whole machine has been busy since boot (/proc/stat: all but idle and iowait), or None."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]   # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _cli_run() -> dict:
    """One fresh `python -m boundpass plan` of CLI_ARGS: wall, CPU (its process tree), the stages' start times from its
    progress lines, and what the rest of the machine used meanwhile."""
    before, busy, load = resource.getrusage(resource.RUSAGE_CHILDREN), _busy_core_seconds(), os.getloadavg()[0]
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "boundpass", *CLI_ARGS], capture_output=True, text=True)
    wall = time.perf_counter() - start
    after, busy_after = resource.getrusage(resource.RUSAGE_CHILDREN), _busy_core_seconds()
    if run.returncode not in (0, 1):  # 1: does not fit (a verdict)
        raise RuntimeError(f"the plan CLI failed ({run.returncode}):\n{run.stderr[-3000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    stamps = [(float(m.group(1)), m.group(2)) for m in re.finditer(r"^\[\s*([\d.]+)s\] (.*)$", run.stderr, re.M)]
    stages = {}
    for name, prefix in CLI_STAGES:
        stages[name] = next((t for t, line in stamps if line.startswith(prefix)), None)
    stages["done"] = stamps[-1][0] if stamps else None
    others = None if busy is None or busy_after is None else max(busy_after - busy - cpu, 0.0) / wall
    return {"wall_s": wall, "cpu_s": cpu, "stage_starts_s": stages, "others_cores_busy": others,
            "loadavg_1min_before": load, "loadavg_1min_after": os.getloadavg()[0],
            "forked": "(in a second process)" in run.stderr}


def _cli(runs: int) -> dict:
    """CLI_RUNS fresh CLI runs, one after another, and their medians."""
    samples = []
    for i in range(runs):
        samples.append(_cli_run())
        s = samples[-1]
        print(f"CLI run {i + 1}/{runs}: wall {s['wall_s']:.1f} s, CPU {s['cpu_s']:.1f} s, other processes "
              f"{s['others_cores_busy'] if s['others_cores_busy'] is None else round(s['others_cores_busy'], 2)} "
              f"cores busy, load {s['loadavg_1min_before']:.1f}", flush=True)
    med = lambda key: statistics.median(s[key] for s in samples)  # noqa: E731
    stage_names = [name for name, _ in CLI_STAGES] + ["done"]
    stage_med = {n: statistics.median(s["stage_starts_s"][n] for s in samples) if all(
        s["stage_starts_s"][n] is not None for s in samples) else None for n in stage_names}
    others = [s["others_cores_busy"] for s in samples if s["others_cores_busy"] is not None]
    return {"args": CLI_ARGS, "date_utc": run_metadata()["date_utc"], "runs": samples,
            "median_wall_s": med("wall_s"), "median_cpu_s": med("cpu_s"),
            "median_stage_starts_s": stage_med, "median_others_cores_busy": statistics.median(others) if others else None,
            "median_loadavg_1min": med("loadavg_1min_before"), "cores": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def _cli_targets(cli: dict) -> list:
    return [{"target": f"`python -m boundpass plan` of deepseek_v3 671B in a fresh process < {PLAN_SECONDS_TARGET:.0f} s "
                       f"(median wall of {len(cli['runs'])} runs)",
             "figures": f"{cli['median_wall_s']:.1f} s wall, {cli['median_cpu_s']:.1f} s CPU; other processes used "
                        + ("?" if cli["median_others_cores_busy"] is None else f"{cli['median_others_cores_busy']:.2f}")
                        + f" of {cli['cores']} cores meanwhile",
             "met": cli["median_wall_s"] < PLAN_SECONDS_TARGET}]


def _stage_seconds(starts: dict) -> list:
    """Seconds of each CLI stage from the times its progress lines were printed (None where one is missing)."""
    marks = [starts.get(name) for name, _ in CLI_STAGES] + [starts.get("done")]
    return [None if a is None or b is None else b - a for a, b in zip(marks, marks[1:])]


def _render_cli(cli: dict) -> list:
    md = ["## The 671B plan from the command line, in a fresh process", "",
          f"`python -m boundpass {' '.join(cli['args'])}`, {len(cli['runs'])} runs one after another "
          f"({cli.get('date_utc', '')}), each a fresh process, imports included. CPU = user + sys of the process and "
          f"of the child it forks (the MoE block's graphs are captured in a second process while the first captures "
          f"the dense block's; with a free core the wall time is below the CPU time). `others` = the cores the other "
          f"processes on this {cli['cores']}-core machine kept busy meanwhile (/proc/stat less this run's CPU); the "
          f"load average counts this bench's own runs too. The stages are timed by the CLI's progress lines "
          f"(start-up before the first line and the exit after the last are in the wall time only).", ""]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    rows = []
    for i, s in enumerate(cli["runs"]):
        rows.append([str(i + 1), f"{s['wall_s']:.1f} s", f"{s['cpu_s']:.1f} s", fmt(s["others_cores_busy"]),
                     f"{s['loadavg_1min_before']:.1f}", *map(fmt, _stage_seconds(s["stage_starts_s"]))])
    rows.append(["median", f"{cli['median_wall_s']:.1f} s", f"{cli['median_cpu_s']:.1f} s",
                 fmt(cli["median_others_cores_busy"]), f"{cli['median_loadavg_1min']:.1f}",
                 *map(fmt, _stage_seconds(cli["median_stage_starts_s"]))])
    md += [markdown_table(["run", "wall", "CPU", "others (cores)", "load avg (1 min)",
                           *(f"{name} (s)" for name, _ in CLI_STAGES)], rows), "",
           "(The median row's stages are differences of the median progress-line times.)", ""]
    return md


def _reach(model: str, flavor: str, ranks: int, variant: dict) -> dict:
    start = time.perf_counter()
    r = plan(model, flavor, ranks=ranks, ep=EP, context=ranks, budget=BUDGET, host_budget=HOST_PER_RANK,
             global_batch=_sequences(ranks, variant), do_trace=False, solve=True, **variant)
    return {"context": r.solve["value"], "next_does_not_fit": r.solve["next"], "tokens_per_rank": r.solve["tokens_per_rank"],
            "solve_seconds": time.perf_counter() - start}


def _at(model: str, flavor: str, ranks: int, context: int, variant: dict, trace: bool) -> dict:
    r = plan(model, flavor, ranks=ranks, ep=EP, context=context, budget=BUDGET, host_budget=HOST_PER_RANK,
             global_batch=_sequences(ranks, variant), do_trace=trace, **variant)
    bind = r.table.binding()
    data = r.to_json()
    return {"fits": r.fits, "device_peak_bytes": r.table.total, "host_bytes": r.table.host_total,
            "binding_term": bind.name, "binding_bytes": bind.value, "binding_knob": bind.knob,
            "plan_seconds": r.seconds, "terms": data["terms"], "comparisons": data["comparisons"],
            "trace_notes": r.trace_notes}


def _class(params: int) -> str:
    return f"{params / 1e12:.0f}T-class" if params >= 1e12 else f"{round(params / 1e9, -1):.0f}B-class"


def _families() -> dict:
    """Every family (recipes/families.py): its largest MoE flavor planned once at TIMED_LAUNCH, timed cold."""
    out = {"launch": TIMED_LAUNCH, "planned": [], "refused": []}
    start = time.perf_counter()
    survey = families.survey()
    out["survey_seconds"] = time.perf_counter() - start
    for family, s in survey.items():
        if s["refused"]:
            out["refused"].append({"family": family, "moe_flavors": list(s["moe_flavors"]), "reason": s["refused"]})
            continue
        flavor = families.largest_moe_flavor(family)
        start = time.perf_counter()
        r = plan(family, flavor, **TIMED_LAUNCH, do_trace=True)   # cold: nothing of this model cached yet
        cold = time.perf_counter() - start
        start = time.perf_counter()
        plan(family, flavor, **TIMED_LAUNCH, do_trace=True)      # warm: shape and block traces kept
        warm = time.perf_counter() - start
        bind = r.table.binding()
        out["planned"].append({"family": family, "flavor": flavor, "moe_flavors": list(s["moe_flavors"]),
                               "params": r.shape.params, "layers": r.shape.layers, "experts": r.shape.experts,
                               "fits": r.fits, "device_peak_bytes": r.table.total, "binding_term": bind.name,
                               "block_terms": r.trace_notes[0], "plan_seconds": cold, "plan_seconds_warm": warm})
        print(f"family {family} {flavor}: {'fits' if r.fits else 'does not fit'}, plan {cold:.1f} s cold, "
              f"{warm:.1f} s warm", flush=True)
    return out


def _models(fams: dict) -> list:
    rows = sorted(fams["planned"], key=lambda f: f["params"])
    return [(_class(f["params"]), f["family"], f["flavor"]) for f in rows]


def run(quick: bool) -> dict:
    fams = _families()
    MODELS[:] = _models(fams)
    rows = []
    for label, model, flavor in MODELS:
        for ranks in (RANKS[:1] if quick else RANKS):
            row = {"class": label, "model": model, "flavor": flavor, "ranks": ranks,
                   "paper_pair": (label, ranks) in PAPER_PAIRS, "variants": {}}
            for name, variant in VARIANTS.items():
                reach = _reach(model, flavor, ranks, variant)
                if reach["context"]:
                    reach["at_reach"] = _at(model, flavor, ranks, reach["context"], variant,
                                            trace=name.startswith("boundpass"))
                reach["above_reach"] = {k: v for k, v in _at(model, flavor, ranks, reach["next_does_not_fit"],
                                                             variant, trace=False).items()
                                        if k in ("fits", "device_peak_bytes", "host_bytes", "binding_term",
                                                 "binding_bytes", "binding_knob")}
                row["variants"][name] = reach
                print(f"{label} W={ranks} {name}: {reach['context']:,}", flush=True)
            base = row["variants"]["baseline (balanced routing)"]["context"]
            ours = row["variants"]["boundpass (all four)"]["context"]
            row["ratio_vs_balanced_baseline"] = ours / base if base else None
            rows.append(row)
    searches = []
    for label, model, flavor in MODELS:
        for ranks in (RANKS[:1] if quick else RANKS):
            if (label, ranks) not in PAPER_PAIRS and not quick:
                continue
            start = time.perf_counter()
            r = plan(model, flavor, ranks=ranks, ep=EP, context=SEARCH_CONTEXT, budget=BUDGET,
                     host_budget=HOST_PER_RANK, do_trace=False, search=True)
            searches.append({"class": label, "model": model, "flavor": flavor, "ranks": ranks,
                             "context": SEARCH_CONTEXT, "search": r.search, "seconds": time.perf_counter() - start})
            print(f"search {label} W={ranks}: {r.search['best'] and r.search['best']['knobs']}", flush=True)
    return {"families": fams, "rows": rows, "searches": searches}


def _targets(rows: list[dict]) -> list[dict]:
    """Targets at the paper's model / rank pairings (the other pairings are reported in the tables above)."""
    rows = [r for r in rows if r["paper_pair"]] or rows
    ratios = [(r["class"], r["ranks"], r["ratio_vs_balanced_baseline"]) for r in rows]
    reach = [(r["class"], r["ranks"], r["variants"]["boundpass (all four)"]["context"]) for r in rows]
    fig = lambda items, f: "; ".join(f"{c} W={w}: {f(v)}" for c, w, v in items)  # noqa: E731
    return [
        *_family_targets(),
        {"target": ">= 8x the baseline's reach at the paper's pairings (balanced-routing baseline; inf where the "
                   "baseline fits nothing)",
         "figures": fig(ratios, lambda v: "inf" if v is None else f"{v:.1f}x"),
         "met": all(v is None or v >= 8 for _, _, v in ratios)},
        {"target": ">= 1M tokens per sequence with boundpass at the paper's pairings", "figures": fig(reach, lambda v: f"{v:,}"),
         "met": all(v >= 2**20 for _, _, v in reach)},
    ]


_FAMILIES: dict = {}


def _family_targets() -> list:
    planned = _FAMILIES.get("planned", [])
    return [{"target": f"every MoE family's largest flavor plans in < {PLAN_SECONDS_TARGET:.0f} s (cold, in process)",
             "figures": "; ".join(f"{f['family']} {f['flavor']}: {f['plan_seconds']:.1f} s" for f in planned),
             "met": bool(planned) and all(f["plan_seconds"] < PLAN_SECONDS_TARGET for f in planned)}]


def _render_families(fams: dict) -> list:
    md = ["## Every torchtitan MoE family (found from torchtitan's registries: recipes/families.py)", "",
          f"Each planned family's largest MoE flavor, planned once at W = {fams['launch']['ranks']}, E_p = "
          f"{fams['launch']['ep']}, context {fams['launch']['context']:,}, {fams['launch']['budget']} device, "
          f"{fams['launch']['host_budget']} host per rank, all four operators, traced (`do_trace=True`). `cold`: the "
          f"first plan of that model in the process (meta build, its blocks' graphs traced at symbolic N, "
          f"compose, the trace at N), torch already imported; `warm`: the same plan again (shape and block traces "
          f"kept). A fresh `python -m boundpass plan` also pays the imports (torch + torchtitan's model package: "
          f"the CLI section above).", ""]
    rows = [[f["family"], f["flavor"], f"{f['params'] / 1e9:,.1f}B", str(f["layers"]), str(f["experts"]),
             "FITS" if f["fits"] else "DOES NOT FIT", fmt_bytes(f["device_peak_bytes"]), f["binding_term"],
             f"{f['plan_seconds']:.1f} s", f"{f['plan_seconds_warm']:.1f} s"] for f in fams["planned"]]
    md += [markdown_table(["family", "largest flavor", "params", "blocks", "experts", "verdict", "device peak",
                           "binding term", "plan (cold)", "plan (warm)"], rows), ""]
    md += ["MoE flavors planned: " + "; ".join(f"{f['family']}: {', '.join(f['moe_flavors'])}" for f in fams["planned"]),
           "", "Refused (`boundpass plan` says why):", ""]
    md += [markdown_table(["family", "MoE flavors", "reason"],
                          [[r["family"], ", ".join(r["moe_flavors"]) or "-", r["reason"]] for r in fams["refused"]]), ""]
    return md


def render(data: dict) -> str:
    m = data["meta"]
    md = ["# Longest context that fits: baseline vs boundpass (`bench/plan.py`)", "",
          f"Predicted by `boundpass.plan --solve` from the composed sympy budget (no GPU: nothing here is a GPU "
          f"measurement). {BUDGET} device and {HOST_PER_RANK} host per rank (2 TiB per 8 ranks), E_p = {EP}, "
          f"global batch 1 sequence split over all W ranks, bf16. torch {m['torch']}, {m['processor']}, "
          f"{m['date_utc']}; wall {data['wall_seconds']:.0f} s.", "",
          *(_render_cli(data["cli"]) if "cli" in data else []),
          *_render_families(data["families"]),
          "## Longest context (tokens per sequence)", ""]
    names = list(VARIANTS)
    table = []
    for r in data["rows"]:
        cells = [f"{r['class']} ({r['model']} {r['flavor']})" + (" *" if r["paper_pair"] else ""), str(r["ranks"])]
        for n in names:
            v = r["variants"][n]["context"]
            cells.append(f"{v:,}" if v else "none fits")
        ratio = r["ratio_vs_balanced_baseline"]
        cells.append("inf (baseline fits nothing)" if ratio is None else f"{ratio:.1f}x")
        table.append(cells)
    md += [markdown_table(["model", "W"] + names + ["boundpass / balanced baseline"], table), "",
           "`*` = the paper's model / rank pairing. `none fits`: even the smallest context (W tokens) is over "
           "budget — for the baseline that is AdamW's on-device state (16 bytes per parameter over W ranks).", "",
           "## What binds", "",
           "At each variant's reach, the term that binds one context step above it (what stops it) and its knob:", ""]
    bind_rows = []
    for r in data["rows"]:
        for n in names:
            above = r["variants"][n]["above_reach"]
            bind_rows.append([f"{r['class']} W={r['ranks']}", n, above["binding_term"], fmt_bytes(above["binding_bytes"]),
                              fmt_bytes(above["device_peak_bytes"]), fmt_bytes(above["host_bytes"])])
    md += [markdown_table(["config", "variant", "binding term above reach", "its bytes", "device peak",
                           "host"], bind_rows), "",
           "## Traced beside the bounds (boundpass reach, torchtitan blocks under FakeTensorMode)", "",
           "Each row: the bound of the *reference* schedule on one rank at this rank's N (W = E_p = P = 1, standard "
           "EP with balanced routing, full logits) beside the traced peak of torchtitan's own block / head at the "
           "same N, weights and their gradients left out. `plan s` is the wall time of one `boundpass.plan` call "
           "(meta build + compose + trace) on this 2-core machine.", ""]
    tr_rows = []
    for r in data["rows"]:
        at = r["variants"]["boundpass (all four)"].get("at_reach")
        if not at:
            continue
        for name, (bound, traced) in at["comparisons"].items():
            tr_rows.append([f"{r['class']} W={r['ranks']}", f"{r['variants']['boundpass (all four)']['tokens_per_rank']:,}",
                            name.split("]")[0] + "]", fmt_bytes(bound), fmt_bytes(traced),
                            f"{traced / bound:.2f}" if bound else "-", fmt_seconds(at["plan_seconds"])])
    md += [markdown_table(["config", "N / rank", "piece", "bound", "traced", "traced / bound", "plan s"], tr_rows), ""]
    notes = sorted({n for r in data["rows"] for v in r["variants"].values() for n in v.get("at_reach", {}).get(
        "trace_notes", [])})
    md += [f"- {n}" for n in notes] + [""]
    md += ["## --search at a 1M-token sequence (paper pairings)", "",
           "The knobs `boundpass plan --search` picks with its default cost model (400 TFLOP/s per rank, 400 GB/s "
           "NVLink, 50 GB/s NIC and host link, 8 ranks per node; see docs/plan.md): the fitting candidate with the "
           "least predicted step time. Predicted times compare candidates; they are not a forecast.", ""]
    srows = []
    for sr in data.get("searches", []):
        best = sr["search"]["best"]
        srows.append([f"{sr['class']} W={sr['ranks']}", f"{sr['search']['candidates']:,}",
                      "nothing fits" if not best else ", ".join(f"{k}={v}" for k, v in best["knobs"].items()),
                      "-" if not best else fmt_bytes(best["peak_bytes"]),
                      "-" if not best else f"{best['step_seconds']:.1f} s (compute {best['parts']['compute']:.1f} s)",
                      fmt_seconds(sr["seconds"])])
    md += [markdown_table(["config", "candidates", "chosen knobs", "device peak", "predicted step", "search time"],
                          srows), ""]
    md += targets_section(data["targets"])
    md += ["Limits: predictions from bounds, not GPU runs; attention is counted for a flash-style kernel "
           "(O(N) per head); the trace runs torchtitan's reference schedule on one rank, not the rewritten "
           "operators; no pipeline parallelism, no tensor parallelism. The context figures are memory only: that a "
           "1M-token sequence fits says nothing of how long its step takes (the search's step-time model ranks "
           "knob settings; it is not a forecast).", ""]
    return "\n".join(md)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="W = 16 only")
    parser.add_argument("--cli-only", action="store_true",
                        help="time the 671B CLI plan again; keep the rest of docs/results/plan.json")
    parser.add_argument("--cli-runs", type=int, default=CLI_RUNS, help="fresh CLI runs (median of them)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    if args.cli_only:
        data = json.loads((Path(__file__).resolve().parents[1] / "docs/results/plan.json").read_text())
        data["cli"] = _cli(args.cli_runs)
        data["targets"] = _cli_targets(data["cli"]) + [t for t in data["targets"] if "fresh process" not in t["target"]]
        markdown = render(data)   # the rest (and its wall time) as the last full run wrote it
        write_results("plan", data, markdown)
        print(markdown)
        return data
    data = {"meta": run_metadata(), "budget": BUDGET, "host_budget_per_rank": HOST_PER_RANK, "ep": EP}
    data["cli"] = _cli(args.cli_runs)   # first: nothing of this process's own plans competes with it
    data.update(run(args.quick))
    _FAMILIES.update(data["families"])
    data["targets"] = _cli_targets(data["cli"]) + _targets(data["rows"])
    return publish("plan", data, render, start)


if __name__ == "__main__":
    main()
