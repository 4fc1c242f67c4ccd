"""MoP layout at 120B scale, simulated: per-rank peak of gpt_oss 120b on 16 ranks at 128K / 512K / 1M tokens.

`python bench/mop_sim.py` -> docs/results/mop_sim.{json,md}. The per-rank figures are the composed sympy budget
of the MoP layout (`boundpass.plan`: ZeRO-3 dense weights, sequence-to-head attention over all W ranks, experts
over E_p = 8), with torchtitan's own MoE block and head traced forward + backward under FakeTensorMode at the
same tokens per rank beside their reference bounds. Nothing is allocated; no GPU figure is claimed. Two variants:
all four boundpass operators on, and the layout with them off (full logits, standard EP at worst-case routing,
optimizer on the device, no boundary offload).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import fmt_bytes, markdown_table, publish, run_metadata, targets_section  # noqa: E402
from boundpass.bound.composed import OPERATORS  # noqa: E402
from boundpass.planning.full_scale import plan  # noqa: E402

MODEL, FLAVOR, RANKS, EP = "gpt_oss", "120b", 16, 8
CONTEXTS = (131_072, 524_288, 1_048_576)
BUDGET, HOST = "139GiB", "256GiB"
VARIANTS = (("MoP + all four operators", OPERATORS), ("MoP, operators off", ()))


def run() -> list[dict]:
    rows = []
    for context in CONTEXTS:
        for name, ops in VARIANTS:
            result = plan(MODEL, FLAVOR, ranks=RANKS, ep=EP, context=context, budget=BUDGET, host_budget=HOST,
                          operators=ops)
            table, binding = result.table, result.table.binding()
            traced = {k: list(v) for k, v in result.traced.items() if isinstance(v, tuple)}
            rows.append(dict(context=context, variant=name, tokens_per_rank=result.inputs.tokens_per_rank,
                             device_peak=table.total, host=table.host_total, fits=result.fits,
                             binding=binding.name, binding_bytes=binding.value, traced=traced,
                             attention=next(t.value for t in table.terms if t.name.startswith("attention")),
                             seconds=result.seconds))
            print(f"  {context:>9,} {name:28s} peak {fmt_bytes(table.total)} host {fmt_bytes(table.host_total)} "
                  f"{'FITS' if result.fits else 'DOES NOT FIT'} ({result.seconds:.1f} s)", flush=True)
    return rows


def render(data: dict) -> str:
    lines = [f"# MoP layout at 120B scale, simulated (`bench/mop_sim.py`)", "",
             f"{data['model']} on {data['ranks']} ranks (sequence-to-head over all of them, E_p = {data['ep']}), "
             f"one sequence per step, bf16, {data['budget']} device and {data['host']} host per rank. "
             f"Run {data['meta']['date_utc']}, torch {data['meta']['torch']}; wall {data['wall_seconds']:.0f} s.", "",
             "Per-rank peak = the composed sympy budget (predicted, `boundpass.plan`). Traced = torchtitan's own "
             "block / head forward + backward under FakeTensorMode at the same tokens per rank, beside the bound "
             "of the same reference schedule (what `plan` prints); nothing is allocated.", ""]
    rows = [[f"{r['context']:,}", r["variant"], f"{r['tokens_per_rank']:,}", fmt_bytes(r["device_peak"]),
             fmt_bytes(r["attention"]), fmt_bytes(r["host"]), "FITS" if r["fits"] else "DOES NOT FIT",
             f"{r['binding']} ({fmt_bytes(r['binding_bytes'])})"] for r in data["rows"]]
    lines.append(markdown_table(["tokens / sequence", "variant", "tokens / rank", "per-rank device peak",
                                 "of which attention", "host / rank", "verdict", "binding term"], rows))
    lines += ["", "Traced beside the reference bounds (one rank, at the same tokens per rank):", ""]
    # a bound of 0: no hand-written term is left for that part (at W > 1 the block's activations are the trace's)
    rows = [[f"{r['context']:,}", name.replace(" | ", " vs "), fmt_bytes(bound) if bound else "- (the trace is the term)",
             fmt_bytes(traced), f"{traced / bound:.2f}" if bound else "-"]
            for r in data["rows"] if r["variant"] == VARIANTS[0][0] for name, (bound, traced) in r["traced"].items()]
    lines.append(markdown_table(["tokens / sequence", "what", "bound", "traced", "traced / bound"], rows))
    lines += [""] + targets_section(data["targets"])
    return "\n".join(lines)


def main() -> dict:
    start = time.perf_counter()
    rows = run()
    on = [r for r in rows if r["variant"] == VARIANTS[0][0]]
    targets = [dict(target="MoP + all four operators fits 139 GiB per rank at 128K, 512K and 1M tokens",
                    figures=", ".join(f"{r['context']:,}: {fmt_bytes(r['device_peak'])}" for r in on),
                    met=all(r["fits"] for r in on))]
    data = dict(model=f"{MODEL} {FLAVOR}", ranks=RANKS, ep=EP, budget=BUDGET, host=HOST, rows=rows,
                meta=run_metadata(), targets=targets)
    return publish("mop_sim", data, render, start)


if __name__ == "__main__":
    main()
