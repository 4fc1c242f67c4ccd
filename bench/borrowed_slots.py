"""PipelinedLLEP's borrowed-expert slots s_b (``dispatch.borrowed_slots``): what fewer slots save and cost.

On 2 gloo ranks (real tensors, fp32, the scaled shape of bench/dispatch.py: T = 1,024 tokens per rank, H = I = 256,
E = 16 experts, e = 8 per rank, k = 4, c = 103), for s_b in 0, 1, 2, 4, 8 (8 = e, LLEP's default) under three
routings that make LLEP relocate (Zipf over all experts; "hot rank": every token's k experts drawn among EP rank 0's;
adversarial: every token to experts 0..k-1), per rank:
  - the live-storage peak of one forward + backward of the op (boundpass.measure.memtrack) beside its sympy bound at that s_b;
  - the experts the plan lent each rank, and the most rows any rank computes (the load LLEP balances);
  - the median step time (round-robin over the s_b values, barrier-synchronised), as a ratio to s_b = e.
Every s_b is checked against standard EP (outputs and gradients) before it is timed.
Writes docs/results/borrowed_slots.json and .md.

    python bench/borrowed_slots.py [--quick]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from bench.common import fmt_bytes, interleaved_medians, markdown_table, publish, run_metadata
from bench.dispatch import PLAN, autograd_step, counts_of, live_peak, rank_tensors, routing_ids
from boundpass.core import symbols as sym
from boundpass.runtime.llep_plan import ChunkedRoutes, plan_llep
from boundpass.runtime.pipelined_llep import bound_values, pipelined_llep_bound

FULL = dict(world=2, T=1024, H=256, I=256, E=16, k=4, cap=103, min_piece=16, repeats=7, slots=(0, 1, 2, 4, 8))
QUICK = dict(FULL, T=512, repeats=3, slots=(0, 2, 8))
ROUTINGS = ("zipf", "hot_rank", "adversarial")


def rank_ids(kind: str, rank: int, cfg: dict) -> torch.Tensor:
    T, E, k, e = cfg["T"], cfg["E"], cfg["k"], cfg["E"] // cfg["world"]
    g = torch.Generator().manual_seed(11 + 100 * ROUTINGS.index(kind) + rank)
    if kind == "hot_rank":  # k distinct experts among EP rank 0's e, uniformly
        return torch.multinomial(torch.ones(e, dtype=torch.float64).expand(T, e), k, generator=g)
    return routing_ids(kind, T, E, k, g)


def rank_inputs(kind: str, rank: int, cfg: dict):
    """This rank's routing and bench/dispatch.py's tensors for it (x, scores, output gradient, its experts)."""
    return (rank_ids(kind, rank, cfg),) + rank_tensors(rank, cfg["world"], cfg)


def on_rank(rank: int, world: int, cfg: dict) -> dict:
    group = dist.group.WORLD
    out = {}
    for kind in ROUTINGS:
        ids, x, s, grad, ws = rank_inputs(kind, rank, cfg)
        ref = autograd_step("standard", x, ids, s, ws, grad, group, cfg)
        err = {}
        for slots in cfg["slots"]:
            got = autograd_step("pipelined", x, ids, s, ws, grad, group, dict(cfg, max_borrowed=slots))
            err[slots] = max(float((a - b).abs().max() / (b.abs().max() + 1e-30)) for a, b in zip(got, ref))
            if err[slots] > 1e-4:
                raise AssertionError(f"rank {rank} {kind} s_b={slots}: relative difference {err[slots]:.3g}")
        del ref, got
        seconds = interleaved_medians(
            {slots: (lambda slots=slots: autograd_step("pipelined", x, ids, s, ws, grad, group,
                                                       dict(cfg, max_borrowed=slots))) for slots in cfg["slots"]},
            repeats=cfg["repeats"], warmup=1, sync=dist.barrier)
        peaks = {slots: live_peak("pipelined", x, ids, s, ws, grad, group, dict(cfg, max_borrowed=slots))
                 for slots in cfg["slots"]}
        out[kind] = {"seconds": seconds, "peak_bytes": peaks, "max_rel_err": err, "ids": ids}
    return out


def main(argv=None) -> dict:
    from boundpass.testing.distributed import run_on_ranks
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    cfg = QUICK if parser.parse_args(argv).quick else FULL
    started = time.perf_counter()
    P, E, k = cfg["world"], cfg["E"], cfg["k"]
    per_rank = run_on_ranks(on_rank, P, cfg, timeout_s=1800)
    rows = {}
    for kind in ROUTINGS:
        counts = counts_of([r[kind].pop("ids") for r in per_rank], E)
        rows[kind] = {}
        for slots in cfg["slots"]:
            plan = plan_llep(counts, min_piece=cfg["min_piece"], max_borrowed=slots, **PLAN)
            one = ChunkedRoutes(counts, plan, 1)
            computed = [sum(n for _, _, n in one.recv_runs(d, 0)) for d in range(P)]
            values = bound_values(torch.float32, N=cfg["T"], H=cfg["H"], I=cfg["I"], E=E, E_p=P, k=k, c=cfg["cap"],
                                  s_b=slots)
            bound = sym.evaluate(pipelined_llep_bound(mixed_precision=False), values)
            rows[kind][str(slots)] = {
                "bound_bytes": int(bound), "borrowed": [len(b) for b in plan.borrowed],
                "rows_computed": computed, "max_over_mean_rows": max(computed) / (sum(computed) / P),
                "peak_bytes": [r[kind]["peak_bytes"][slots] for r in per_rank],
                "seconds": [r[kind]["seconds"][slots] for r in per_rank],
                "max_rel_err": max(r[kind]["max_rel_err"][slots] for r in per_rank)}
    data = {"config": cfg, "meta": run_metadata(), "routings": rows}
    return publish("borrowed_slots", data, render, started)


def render(data: dict) -> str:
    cfg = data["config"]
    e = cfg["E"] // cfg["world"]
    lines = ["# PipelinedLLEP borrowed-expert slots s_b: memory saved, balance and time given up", "",
             f"2 gloo ranks, real tensors, fp32; T = {cfg['T']:,} tokens/rank, H = I = {cfg['H']}, E = {cfg['E']} "
             f"(e = {e}), k = {cfg['k']}, c = {cfg['cap']}, min_piece = {cfg['min_piece']}; medians of "
             f"{cfg['repeats']} interleaved runs (rank 0's clock, barrier-synchronised). Peak: live storages of one "
             "forward + backward of the op beyond its inputs (boundpass.measure.memtrack), the worse rank. Bound: the op's "
             "sympy bound at that s_b. Rows: routes each rank computes after LLEP's plan (max / mean: 1.00 is "
             f"balanced). Time ratio: against s_b = e = {e} (LLEP's default), rank 0.", ""]
    headers = ["routing", "s_b", "borrowed (per rank)", "rows max / mean", "peak", "bound", "bound / peak",
               "time", "time / s_b = e"]
    table = []
    for kind, by in data["routings"].items():
        base = by[str(e)]["seconds"][0] if str(e) in by else None
        for slots, row in by.items():
            peak = max(row["peak_bytes"])
            table.append([kind, slots, " / ".join(map(str, row["borrowed"])), f"{row['max_over_mean_rows']:.2f}",
                          fmt_bytes(peak), fmt_bytes(row["bound_bytes"]), f"{row['bound_bytes'] / peak:.3f}",
                          f"{row['seconds'][0] * 1e3:.1f} ms",
                          f"{row['seconds'][0] / base:.2f}" if base else "—"])
    from boundpass.runtime.llep_plan import lendable_experts
    lent = lendable_experts(cfg["T"] * cfg["k"], e, cfg["world"])
    lines += [markdown_table(headers, table), "",
              f"The op here is given each s_b as is. Through the compiler (the dispatch pass) s_b is at most what LLEP's "
              f"planner can ever lend one helper at T k routes per rank: {lent} here (`llep_plan.lendable_experts`), so "
              f"an s_b above {lent} runs and is bounded as s_b = {lent}, with the same plans: no row above borrows more.",
              "", f"Run {data['meta'].get('date_utc', '')}, wall {data.get('wall_seconds', 0):.0f} s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
