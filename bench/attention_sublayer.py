"""The attention sublayer in query blocks (boundpass::attention_blocks) on torchtitan's trainer: the whole step's
device peak against the sequence length, with and without the attention pass, beside stock torchtitan.

Each point is one run of bench/e2e.py's reach job: torchtitan's Trainer on the deepseek_v3 debug recipe (V = 32,768,
MLA: 16 heads, qk 192, v 128), 1 rank, batch 1, FullAC, torchtitan's per-block compile (aot_eager); step 2 measured
at torch's allocator (the state live at the step's start + every allocation of the step; boundpass's host buffers
left out by design), step 1 compiles. Variants:
  stock      torchtitan as it ships, its ChunkedLossWrapper at <= 128 tokens per chunk
  boundpass  the per-block path (Ring-DTP head, PipelinedLLEP, SCO auto, OffloadStreamAdamW), attention as it runs
             (torch's fused kernel on value-padded v)
  +blocks    the same with --boundpass.attention.enable --boundpass.attention.no-offload: every block's attention
             sublayer walked in query blocks, k, v made per key tile, kept whole on the device
  +offload   --boundpass.attention.enable (offload on by default): k, v and the backward's q, dO, dq on the host, read
             back a tile at a time, the next prefetched (host bytes reported beside the device peak)
  +rows      + --boundpass.feed_forward.enable: every block's feed-forward (block 0's dense MLP with its norm, the
             MoE blocks' shared experts) walked C_r rows at a time (boundpass::row_blocks)
  +rows+sco  + --boundpass.sco.enable True: every block's checkpoint boundary on the host too (SCO's pool), where
             `auto` keeps them on the device while the budget allows
The peak's growth per token between the two longest lengths, each variant. Writes docs/results/attention_sublayer.json
and .md.

    python bench/attention_sublayer.py [--lengths 2048,4096,8192] [--variants stock,boundpass,blocks]
        [--budget 4GiB] [--reuse runs.json]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import fmt_bytes, markdown_table, publish, run_metadata
from boundpass.testing.distributed import run_on_ranks

VARIANTS = {"stock": ("stock", ()), "boundpass": ("boundpass", ()),
            "blocks": ("boundpass", ("--boundpass.attention.enable", "--boundpass.attention.no-offload")),
            "offload": ("boundpass", ("--boundpass.attention.enable",)),
            "rows": ("boundpass", ("--boundpass.attention.enable", "--boundpass.feed_forward.enable")),
            "rows+sco": ("boundpass", ("--boundpass.attention.enable", "--boundpass.feed_forward.enable",
                                       "--boundpass.sco.enable", "True"))}


def run_point(assets: str, variant: str, seq: int, budget: str, timed_steps: int, profiler: bool = True,
              rope_to_seq_len: bool = False, certify_only: bool = False) -> dict:
    from bench.e2e import reach_job
    kind, extra = VARIANTS[variant]
    extra = (*extra, "--boundpass.rope_to_seq_len") if rope_to_seq_len else extra
    out = run_on_ranks(reach_job, 1, assets, kind, seq, None if kind == "stock" else budget, "aot_eager", 128,
                       "64GiB", timed_steps, extra, profiler=profiler, certify_only=certify_only, timeout_s=7200)[0]
    out["variant"] = variant
    out["rope_to_seq_len"] = rope_to_seq_len
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--variants", default="stock,boundpass,blocks,offload")
    p.add_argument("--budget", default="4GiB", help="boundpass's budget (large: every length runs)")
    p.add_argument("--timed-steps", type=int, default=0)
    p.add_argument("--reuse", default="", help="a runs file (this bench's --runs) whose points are not rerun")
    p.add_argument("--runs", default=str(Path(tempfile.gettempdir()) / "attention_sublayer_runs.json"))
    p.add_argument("--provenance", default="", help="how the reused runs were made (rendered instead of the command)")
    p.add_argument("--reach-budget", default="1GiB,2GiB",
                   help="the budgets (comma-separated) the table says which lengths fit and the reach is given at")
    p.add_argument("--rope-to-seq-len", action="store_true",
                   help="every variant's RoPE table sized to its length (--boundpass.rope_to_seq_len): past 16,384")
    p.add_argument("--certify-only-from", type=int, default=1 << 30,
                   help="from this length on, step 1's forward alone: boundpass's certificate, nothing measured")
    p.add_argument("--counting-from", type=int, default=1 << 30,
                   help="from this length on, step 2's peak is the counting allocator's alone (no profiler events)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    from boundpass.recipes.assets import ensure_assets
    assets = str(Path(tempfile.gettempdir()) / "bp_assets")
    ensure_assets(assets)
    runs = json.loads(Path(args.reuse).read_text()) if args.reuse else []
    for variant in args.variants.split(","):
        for seq in (int(s) for s in args.lengths.split(",")):
            if any(r["variant"] == variant and r["seq"] == seq
                   and r.get("rope_to_seq_len", False) == args.rope_to_seq_len for r in runs):
                continue
            runs.append(run_point(assets, variant, seq, args.budget, args.timed_steps,
                                  profiler=seq < args.counting_from, rope_to_seq_len=args.rope_to_seq_len,
                                  certify_only=seq >= args.certify_only_from and VARIANTS[variant][0] != "stock"))
            r = runs[-1]
            print(variant, seq, r.get("peak"), r.get("certified"), r.get("reason"), flush=True)
            Path(args.runs).write_text(json.dumps(runs, indent=1, default=str))
    data = dict(runs=[{k: v for k, v in r.items() if k not in ("summary", "args")} for r in runs],
                budget=args.budget, meta=run_metadata(), provenance=args.provenance, reach_budget=args.reach_budget,
                command="python bench/attention_sublayer.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    for r in data["runs"]:   # the tile and the feed-forward's rows the planner chose (the knee), from the summary
        summary = next((x.get("summary", "") for x in runs if x is r or (x["variant"], x["seq"], x.get("rope_to_seq_len"))
                        == (r["variant"], r["seq"], r.get("rope_to_seq_len"))), "")
        if not r.get("tiles"):
            r["tiles"] = sorted({int(t) for t in re.findall(r"C_s=(\d+)", summary)})
        if not r.get("rows_per_block"):
            r["rows_per_block"] = sorted({int(t) for t in re.findall(r"C_r=(\d+)", summary)})
    # growth per token over the range every variant ran, and over each variant's two longest lengths
    data["slopes"] = []
    grid = [r for r in runs if not r.get("rope_to_seq_len")]   # the debug model as it ships (RoPE at 16,384)
    ran = [{r["seq"] for r in grid if r["variant"] == v and r.get("peak")} for v in VARIANTS]
    ran = [points for points in ran if points]
    common = sorted(set.intersection(*ran)) if ran else []
    for variant in VARIANTS:
        points = dict((r["seq"], r["peak"]) for r in grid if r["variant"] == variant and r.get("peak"))
        if len(points) < 2:
            continue
        spans = {tuple(sorted(points)[-2:])} | ({tuple(common[-2:])} if len(common) > 1 else set())
        for a, b in sorted(s for s in spans if len(s) == 2):
            data["slopes"].append(dict(variant=variant, between=[a, b],
                                       bytes_per_token=(points[b] - points[a]) / (b - a)))
    summaries = [r.get("summary", "") for v in ("blocks", "offload") for r in runs if r["variant"] == v]
    data["blocks_regions"] = [line.strip() for line in (summaries[-1] if summaries else "").splitlines()
                              if "REWRITTEN attention" in line][:1]
    publish("attention_sublayer", data, render, started)
    return 0


def render(data: dict) -> str:
    meta = data["meta"]
    from boundpass.core.units import parse_bytes
    budgets = [(b, parse_bytes(b)) for b in data["reach_budget"].split(",")]
    made = data.get("provenance") or f"`{data['command']}`"
    lines = ["# The attention sublayer in query blocks, whole step on torchtitan's trainer (issue 36)", "",
             f"{made}; rendered {meta['date_utc']}, torch {meta['torch']}, {meta['nproc']} cores, one thread per run. "
             "torchtitan's deepseek_v3 debug recipe (V = 32,768; MLA: 16 heads, qk 192, v 128), 1 rank, batch 1, "
             "FullAC, per-block compile (aot_eager), bf16 mixed precision; step 2's peak at torch's allocator "
             "(bench/attention_sublayer.py says what each variant runs); step 2 runs under the profiler's memory "
             "events (its time, one run per point, not a median, is comparable between variants, not a training speed). boundpass's budget per run in "
             "the table (large enough that every length runs, but for the reach point at the budget it is about; the "
             "tile C_s is the planner's: the knee where it fits).", ""]
    table = []
    for r in sorted(data["runs"], key=lambda r: (bool(r.get("rope_to_seq_len")), list(VARIANTS).index(r["variant"]),
                                                 r["seq"])):
        cert = r.get("certified")
        certified_only = r.get("measure", "").startswith("certified only")
        fit_text = ((f"{r.get('budget')} (certified only)" if r.get("accepted") else f"refused at {r.get('budget')}")
                    if certified_only or not r.get("peak") else
                    ", ".join(name for name, limit in budgets
                              if r["peak"] <= limit and (cert is None or cert <= limit)) or "no")
        profiled = r.get("measure", "profiler") != "the counting allocator alone"
        host = r.get("host_bytes")
        table.append([r["variant"] + (" (RoPE at L)" if r.get("rope_to_seq_len") else ""), f"{r['seq']:,}",
                      r.get("budget") or "—",
                      (fmt_bytes(r["peak"]) + ("" if profiled else " ‡")) if r.get("peak") else "—",
                      fmt_bytes(r["counted"]) if r.get("counted") else "—",
                      fmt_bytes(cert) if cert else "—",
                      f"{cert / r['peak']:.3f}" if cert and r.get("peak") else "—",
                      fmt_bytes(host) if host else "—",
                      fit_text, ", ".join(map(str, r.get("tiles") or [])) or "—",
                      ", ".join(map(str, r.get("rows_per_block") or [])) or "—",
                      ("—" if certified_only else f"{r.get('measured_step_seconds', 0):.0f} s" + ("" if profiled else " ‡")),
                      f"{statistics.median(r['step_seconds']):.1f} s ({len(r['step_seconds'])})"
                      if r.get("step_seconds") else "—"])
    lines += [markdown_table(["variant", "L", "budget", "measured peak (step 2)", "counting allocator",
                              "certified", "certified / measured", "host (set aside)", "fits",
                              "C_s", "C_r", "step 2 (profiled)", "later steps, median (n)"], table), "",
              "(RoPE at L): `--boundpass.rope_to_seq_len`, every block's RoPE table sized to the run's length (the "
              "debug flavor's stops at 16,384 positions), on both sides; the slopes below are the grid's, without it.",
              "",
              "host (set aside): every host buffer boundpass holds by design (OffloadStreamAdamW's state, SCO's and "
              "the attention op's pools), left out of the device measure. Later steps: no profiler, nothing "
              "measured.", "",
              "fits: the reach budgets its measured peak and its certificate are both under. (certified only): "
              "`--certify-only-from`, the run stopped after step 1's forward (`--boundpass.certify_only`, the block "
              "graphs compiled and checked, computing nothing): boundpass's certificate accepted the run's budget; "
              "nothing was measured (a step that long takes hours on this CPU: attention is quadratic). refused: "
              "the certificate refused the run's budget before anything ran.", "",
              "‡ measured by the counting allocator alone (`bench/e2e.measured_step(profiler=False)`: the profiler's "
              "event tree of a step this long does not fit this machine's memory); its time is not under the "
              "profiler. The counting allocator's column beside the profiler's peak shows the two measures agree "
              "where both ran.", ""]
    for sl in data["slopes"]:
        a, b = sl["between"]
        lines.append(f"- {sl['variant']}: the peak grows {sl['bytes_per_token'] / 1024:.1f} KiB per token between "
                     f"L = {a:,} and {b:,}.")
    stock = [r for r in data["runs"] if r["variant"] == "stock" and r.get("peak")]
    for name, budget in budgets:
        fit = [r["seq"] for r in stock if r["peak"] <= budget]
        miss = [r["seq"] for r in stock if r["peak"] > budget]
        if not fit:
            continue
        longest = max(fit)
        lines += ["", f"Reach at {name} (1 rank), over the lengths this page ran: stock's longest measured L that "
                  f"fits is {longest:,}" + (f" (its first measured miss here: {min(m for m in miss if m > longest):,})"
                                            if any(m > longest for m in miss) else "") + "."]
        for variant in VARIANTS:
            if variant == "stock":
                continue
            runs_v = [r for r in data["runs"] if r["variant"] == variant]
            measured = [r["seq"] for r in runs_v if r.get("peak") and r["peak"] <= budget
                        and r.get("certified", 0) <= budget]
            only = [r for r in runs_v if r.get("measure", "").startswith("certified only") and r.get("budget") == name]
            certified = [r["seq"] for r in only if r.get("accepted")]
            refused = [r["seq"] for r in only if not r.get("accepted") and r["seq"] > max(certified, default=0)]
            if measured or certified:
                lines.append(f"- {variant}: "
                             + (f"longest run that fits {max(measured):,} ({max(measured) / longest:.1f}x)"
                                if measured else "no run that fits")
                             + (f"; longest accepted by the certificate at {name} (certified only, not run) "
                                f"{max(certified):,} ({max(certified) / longest:.1f}x)" if certified else "")
                             + (f", refused from {min(refused):,}" if refused else ""))
    if data.get("blocks_regions"):
        lines += ["", "The attention pass's region (the last run with it), from boundpass's summary:", "", "```",
                  *data["blocks_regions"], "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
