"""Chunked attention against the attention torch runs, one training step, peak and time against the sequence length.

Model: boundpass.testing.attention_lm.LM (2 attention-only blocks, H = 64, 4 query heads, 2 key/value heads, head
dim 16), fp32, one sequence of L tokens, two value head dims:
  - "math path": D_v = 24 (MLA-style, unequal to D): torch's SDPA on this CPU runs its math path ([A_q, L, L] scores);
  - "fused":     D_v = 16: torch's fused CPU kernel (flash attention, O(L) memory).
Each at L = 1K-8K (16K for the chunked schedule only), through boundpass.compile with the attention pass off
(torch's kernel) and on (boundpass::chunked_attention, C_s at the planner's knee). Peak: the whole step at torch's
CPU allocator (allocator_step_peak: parameters, gradients, every activation and kernel temporary), measured;
certified beside it. Slope: bytes per token between the two longest lengths both schedules ran. Time: median of
the steps, round-robin. Writes docs/results/attention.json and attention.md.

    python bench/attention.py [--quick]
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
import torch.nn.functional as F

import boundpass
from bench.common import fmt_bytes, fmt_seconds, interleaved_medians, markdown_table, publish, run_metadata
from boundpass.testing.attention_lm import LM, V
from boundpass.testing.whole_step import allocator_step_peak

warnings.filterwarnings("ignore")
FULL = dict(lengths=(1_024, 2_048, 4_096, 8_192), chunked_only=(16_384,), repeats=3)
QUICK = dict(lengths=(512, 1_024), chunked_only=(), repeats=2)
KINDS = {"math path": 24, "fused": 16}
BUDGET = "16GiB"


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def measure(dv: int, length: int, chunked_only: bool, repeats: int) -> dict:
    g = torch.Generator().manual_seed(length)
    batches = [(torch.randint(0, V, (1, length), generator=g), torch.randint(0, V, (1, length), generator=g))
               for _ in range(2)]
    plain = LM(dv=dv)
    rows, steps = {}, {}
    torch._dynamo.reset()
    for name, on in (("torch's kernel", False), ("chunked", True)):
        if on is False and chunked_only:
            continue
        model = copy.deepcopy(plain)
        # the kernels against torch's: the call alone (the whole sublayer in query blocks is bench/attention_sublayer.py)
        step = boundpass.compile(model, loss_fn=_loss, budget=BUDGET, attention_enable=on,
                                 attention_query_blocks=False)
        peak = allocator_step_peak(step, model, None, batches)
        cert = step.certificates[-1]
        row = {"peak_bytes": peak, "certified_bytes": cert.table.total}
        knob = next((k for k in cert.planner.knobs if k.name == "attention_chunk"), None)
        if knob is not None:
            row["chunk"] = knob.value
        rows[name] = row

        def timed(step=step, model=model, batch=batches[0]):
            step(*batch).backward()
            model.zero_grad(set_to_none=True)
        steps[name] = timed
        print(f"D_v={dv} L={length:,} {name}: peak {fmt_bytes(peak)}, certified {fmt_bytes(cert.table.total)}",
              flush=True)
    for name, seconds in interleaved_medians(steps, repeats=repeats, warmup=0).items():
        rows[name]["step_s"] = seconds
    return rows


def _slope(rows: dict, name: str) -> float | None:
    both = [int(n) for n, r in rows.items() if "torch's kernel" in r and name in r]
    if len(both) < 2:
        return None
    a, b = sorted(both)[-2:]
    return (rows[str(b)][name]["peak_bytes"] - rows[str(a)][name]["peak_bytes"]) / (b - a)


def render(data: dict) -> str:
    lines = ["# Chunked attention: one training step against the sequence length", "",
             "boundpass.testing.attention_lm.LM (2 attention-only blocks, H = 64, A_q = 4, A_kv = 2, D = 16), fp32, "
             "one sequence, through boundpass.compile with the attention pass off (torch's kernel) and on (chunked, "
             "C_s at the knee). Peak: the whole step at torch's CPU allocator, measured; certified beside it. Time: "
             f"median of {data['repeats']} steps, round-robin. Run {data['meta']['date_utc']}, "
             f"{data['meta']['nproc']} cores.", ""]
    headers = ["attention", "L", "schedule", "peak (measured)", "certified", "cert / meas", "C_s", "step",
               "vs torch's"]
    table = []
    for kind, by_length in data["kinds"].items():
        for n, rows in by_length.items():
            base = rows.get("torch's kernel")
            for name, r in rows.items():
                table.append([kind, f"{int(n):,}", name, fmt_bytes(r["peak_bytes"]), fmt_bytes(r["certified_bytes"]),
                              f"{r['certified_bytes'] / r['peak_bytes']:.3f}", str(r.get("chunk", "-")),
                              fmt_seconds(r["step_s"]),
                              f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"])
    lines += [markdown_table(headers, table), ""]
    lines += ["Slope of the measured peak between the two longest lengths both schedules ran (bytes per token):", ""]
    for kind, by_length in data["kinds"].items():
        kernel, chunked = _slope(by_length, "torch's kernel"), _slope(by_length, "chunked")
        if kernel is not None:
            lines.append(f"- {kind}: torch's kernel {kernel:,.0f} B/token, chunked {chunked:,.0f} B/token "
                         f"({chunked / kernel:.2f}x)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small L, 2 repeats (a smoke run)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    started = time.perf_counter()
    data = {"meta": run_metadata(), "budget": BUDGET, "repeats": sizes["repeats"], "kinds": {
        kind: {str(n): measure(dv, n, n in sizes["chunked_only"], sizes["repeats"])
               for n in (*sizes["lengths"], *sizes["chunked_only"])} for kind, dv in KINDS.items()}}
    publish("attention_quick" if args.quick else "attention", data, render, started)


if __name__ == "__main__":
    main()
