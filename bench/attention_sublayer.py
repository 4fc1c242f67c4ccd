"""The attention sublayer in query blocks (boundpass::attention_blocks) on torchtitan's trainer: the whole step's
device peak against the sequence length, with and without the attention pass, beside stock torchtitan.

Each point is one run of bench/e2e.py's reach job: torchtitan's Trainer on the deepseek_v3 debug recipe (V = 32,768,
MLA: 16 heads, qk 192, v 128), 1 rank, batch 1, FullAC, torchtitan's per-block compile (aot_eager); step 2 measured
at torch's allocator (the state live at the step's start + every allocation of the step; boundpass's host buffers
left out by design), step 1 compiles. Variants:
  stock      torchtitan as it ships, its ChunkedLossWrapper at <= 128 tokens per chunk
  boundpass  the per-block path (Ring-DTP head, PipelinedLLEP, SCO auto, OffloadStreamAdamW), attention as it runs
             (torch's fused kernel on value-padded v)
  +blocks    the same with --boundpass.attention.enable: every block's attention sublayer walked in query blocks
The peak's growth per token between the two longest lengths, each variant. Writes docs/results/attention_sublayer.json
and .md.

    python bench/attention_sublayer.py [--lengths 2048,4096,8192] [--variants stock,boundpass,blocks]
        [--budget 4GiB] [--reuse runs.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import fmt_bytes, markdown_table, publish, run_metadata
from boundpass.testing.distributed import run_on_ranks

VARIANTS = {"stock": ("stock", ()), "boundpass": ("boundpass", ()),
            "blocks": ("boundpass", ("--boundpass.attention.enable",))}


def run_point(assets: str, variant: str, seq: int, budget: str, timed_steps: int) -> dict:
    from bench.e2e import _reach_job
    kind, extra = VARIANTS[variant]
    out = run_on_ranks(_reach_job, 1, assets, kind, seq, None if kind == "stock" else budget, "aot_eager", 128,
                       "64GiB", timed_steps, extra, timeout_s=7200)[0]
    out["variant"] = variant
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--variants", default="stock,boundpass,blocks")
    p.add_argument("--budget", default="4GiB", help="boundpass's budget (large: every length runs)")
    p.add_argument("--timed-steps", type=int, default=0)
    p.add_argument("--reuse", default="", help="a runs file (this bench's --runs) whose points are not rerun")
    p.add_argument("--runs", default=str(Path(tempfile.gettempdir()) / "attention_sublayer_runs.json"))
    args = p.parse_args(argv)
    started = time.perf_counter()
    from boundpass.recipes.assets import ensure_assets
    assets = str(Path(tempfile.gettempdir()) / "bp_assets")
    ensure_assets(assets)
    runs = json.loads(Path(args.reuse).read_text()) if args.reuse else []
    for variant in args.variants.split(","):
        for seq in (int(s) for s in args.lengths.split(",")):
            if any(r["variant"] == variant and r["seq"] == seq for r in runs):
                continue
            runs.append(run_point(assets, variant, seq, args.budget, args.timed_steps))
            r = runs[-1]
            print(variant, seq, r.get("peak"), r.get("certified"), r.get("reason"), flush=True)
            Path(args.runs).write_text(json.dumps(runs, indent=1, default=str))
    data = dict(runs=[{k: v for k, v in r.items() if k not in ("summary", "args")} for r in runs],
                budget=args.budget, meta=run_metadata(),
                command="python bench/attention_sublayer.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    data["slopes"] = {}
    for variant in VARIANTS:
        points = sorted((r["seq"], r["peak"]) for r in runs if r["variant"] == variant and r.get("peak"))
        if len(points) > 1:
            (a, pa), (b, pb) = points[-2:]
            data["slopes"][variant] = dict(between=[a, b], bytes_per_token=(pb - pa) / (b - a))
    summaries = [r.get("summary", "") for r in runs if r["variant"] == "blocks"]
    data["blocks_regions"] = [line.strip() for line in (summaries[-1] if summaries else "").splitlines()
                              if "REWRITTEN attention" in line][:1]
    publish("attention_sublayer", data, render, started)
    return 0


def render(data: dict) -> str:
    meta = data["meta"]
    lines = ["# The attention sublayer in query blocks, whole step on torchtitan's trainer (issue 36)", "",
             f"`{data['command']}`; {meta['date_utc']}, torch {meta['torch']}, {meta['nproc']} cores. torchtitan's "
             "deepseek_v3 debug recipe (V = 32,768; MLA: 16 heads, qk 192, v 128), 1 rank, batch 1, FullAC, per-block "
             "compile (aot_eager), bf16 mixed precision; step 2's peak at torch's allocator (bench/attention_sublayer.py "
             f"says what each variant runs). boundpass's budget {data['budget']} (every length runs).", ""]
    table = []
    for r in sorted(data["runs"], key=lambda r: (list(VARIANTS).index(r["variant"]), r["seq"])):
        cert = r.get("certified")
        table.append([r["variant"], f"{r['seq']:,}", fmt_bytes(r["peak"]) if r.get("peak") else "—",
                      fmt_bytes(cert) if cert else "—",
                      f"{cert / r['peak']:.3f}" if cert and r.get("peak") else "—",
                      f"{r.get('step1_seconds', 0):.0f} s", r.get("reason") or ""])
    lines += [markdown_table(["variant", "L", "measured peak (step 2)", "certified", "certified / measured",
                              "step 1 (compile + run)", "note"], table), ""]
    for variant, sl in data["slopes"].items():
        a, b = sl["between"]
        lines.append(f"- {variant}: the peak grows {sl['bytes_per_token'] / 1024:.1f} KiB per token between "
                     f"L = {a:,} and {b:,}.")
    if data.get("blocks_regions"):
        lines += ["", "The attention pass's region (+blocks), from boundpass's summary:", "", "```",
                  *data["blocks_regions"], "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
