"""Expert dispatch: standard EP vs LLEP vs PipelinedLLEP, same inputs (issue 3, benchmark section).

Sections:
  measured (real tensors, CPU)  2 and 4 gloo ranks at scaled shapes, fp32; routings balanced / Zipf / adversarial
                                (every token to experts 0..k-1); per-rank live-storage peak of one forward+backward
                                and barrier-synchronised median time; strided vs consecutive chunk membership.
  simulated (fake tensors)      rank r of E_p = 8 under FakeTensorMode + the fake process group, counts given, at
                                T = 65,536 tokens/rank, H = 7,168, I = 2,048, E = 128, k = 8, c = 6,554, bf16;
                                peak of each schedule beside its sympy bound.
Writes docs/results/dispatch.json and dispatch.md.

    python bench/dispatch.py [--quick]
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from bench.common import (fmt_bytes, fmt_seconds, interleaved_medians, interleaved_samples, markdown_table, publish, run_metadata,
                          targets_section)
from boundpass.core import symbols as sym
from boundpass.measure.memtrack import LiveStorageTracker
from boundpass.runtime.llep_plan import ChunkedRoutes, plan_llep
from boundpass.runtime.pipelined_llep import (bound_values, llep, llep_bound, num_chunks, pipelined_llep,
                                              pipelined_llep_backward, pipelined_llep_bound, pipelined_llep_forward,
                                              standard_ep, standard_ep_bound)

PL = importlib.import_module("boundpass.runtime.pipelined_llep")  # the module (the package re-exports the fn)
ROUTINGS = ("balanced", "zipf", "adversarial")
SCHEDULES = ("standard", "llep", "pipelined", "pipelined_consecutive")
DIAGNOSTIC = "pipelined_k1"  # real tensors only: c = T (K = 1), separates chunking cost from recompute cost
LABELS = {"standard": "standard EP", "llep": "LLEP", "pipelined": "PipelinedLLEP (strided)",
          "pipelined_consecutive": "PipelinedLLEP (consecutive)",
          DIAGNOSTIC: "diagnostic: PipelinedLLEP with c = T (K = 1)"}
ZIPF_S = 1.5

# Real-tensor shapes (fp32). c ~ T/10 so K = 10 as at the paper's shape; min_piece scaled from 1024 at
# 65,536 x 8 routes/rank to this shape's routes/rank (at least 8).
FULL = dict(worlds=(2, 4), T=1024, H=256, I=256, E=16, k=4, cap=103, min_piece=16, repeats=5,
            curve=(13, 26, 52, 103, 205, 410, 1024))
QUICK = dict(worlds=(2, 4), T=512, H=128, I=128, E=8, k=2, cap=52, min_piece=8, repeats=5, curve=(13, 52, 128, 512))
PAPER = dict(P=8, T=65_536, H=7_168, I=2_048, E=128, k=8, cap=6_554, min_piece=1024, dtype=torch.bfloat16)
PLAN = dict(alpha=1.1, imbalance_threshold=1.3)  # LLEP defaults, the same for LLEP and PipelinedLLEP


# -------------------------------------------------------------------------------------------- routing
def routing_ids(kind: str, T: int, E: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[T, k] distinct expert ids per token for a routing family (what torch.topk would give)."""
    if kind == "adversarial":  # every token to experts 0..k-1 (all on rank 0 when E/E_p >= k)
        return torch.arange(k).repeat(T, 1)
    weights = (1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** ZIPF_S if kind == "zipf"
               else torch.ones(E, dtype=torch.float64))
    return torch.multinomial(weights.expand(T, E), k, generator=g)


def global_ids(kind: str, P: int, T: int, E: int, k: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000 * ROUTINGS.index(kind))
    return [routing_ids(kind, T, E, k, g) for _ in range(P)]


def counts_of(ids: list[torch.Tensor], E: int) -> list[list[int]]:
    return [torch.bincount(i.reshape(-1), minlength=E).tolist() for i in ids]


def plan_stats(counts, k: int, cap: int, min_piece: int, max_borrowed: int) -> dict:
    """Realized receive rows per rank (standard EP, LLEP) and per-chunk destination loads (strided, consecutive)."""
    P, E = len(counts), len(counts[0])
    e = E // P
    std_rows = [sum(counts[s][d * e + j] for s in range(P) for j in range(e)) for d in range(P)]
    plan = plan_llep(counts, min_piece=min_piece, max_borrowed=max_borrowed, **PLAN)
    one = ChunkedRoutes(counts, plan, 1)
    llep_rows = [sum(n for _, _, n in one.recv_runs(d, 0)) for d in range(P)]
    K = num_chunks(max(sum(r) for r in counts) // k, cap)
    loads = {}
    for strided in (True, False):
        routes = ChunkedRoutes(counts, plan, K, strided)
        per = [[sum(n for _, _, n in routes.recv_runs(d, j)) for d in range(P)] for j in range(K)]
        mean = sum(map(sum, per)) / (K * P)
        loads["strided" if strided else "consecutive"] = {
            "max_rows": max(map(max, per)), "mean_rows": mean, "max_over_mean": max(map(max, per)) / mean,
            "cap_rows": P * cap * k}
    return {"standard_recv_rows": std_rows, "llep_recv_rows": llep_rows, "relocated": plan.relocated,
            "borrowed": [len(b) for b in plan.borrowed], "K": K, "chunk_loads": loads}


# ---------------------------------------------------------------------------------- one schedule, one rank
def _leaves(x, s, ws):
    return x.detach().requires_grad_(), s.detach().requires_grad_(), [w.detach().requires_grad_() for w in ws]


def autograd_step(schedule, x, ids, s, ws, grad, group, cfg):
    """One forward+backward through autograd (the custom op for PipelinedLLEP): (out, dx, ds, dw1, dw2, dw3)."""
    x, s, ws = _leaves(x, s, ws)
    e = cfg.get("max_borrowed", ws[0].shape[0])  # borrowed-expert slots s_b (default e; bench/borrowed_slots.py)
    if schedule == "standard":
        out = standard_ep(x, ids, s, *ws, group)
    elif schedule == "llep":
        out = llep(x, ids, s, *ws, group, min_piece=cfg["min_piece"], max_borrowed=e, **PLAN)
    else:
        out = pipelined_llep(x, ids, s, *ws, group, cap=_cap(schedule, x, cfg), min_piece=cfg["min_piece"],
                             max_borrowed=e, strided=schedule != "pipelined_consecutive", **PLAN)
    grads = torch.autograd.grad(out, [x, s, *ws], grad, allow_unused=True)
    return (out.detach(),) + tuple(torch.zeros_like(w) if g is None else g for g, w in zip(grads, [x, s, *ws]))


def _cap(schedule, x, cfg) -> int:
    return max(1, x.shape[0]) if schedule == DIAGNOSTIC else cfg["cap"]


def live_peak(schedule, x, ids, s, ws, grad, group, cfg, counts=()) -> int:
    """Live-storage peak of one forward+backward on this rank; x, ids, scores, this rank's experts and the output
    gradient are counted as resident; the gradients are kept to the end. Standard EP and LLEP: their autograd
    graph; PipelinedLLEP: its eager forward/backward (the tracker cannot see inside the custom op)."""
    tracker = LiveStorageTracker().track_existing(x, ids, s, *ws, grad)
    if schedule.startswith("pipelined"):
        e = cfg.get("max_borrowed", ws[0].shape[0])
        args = (group.group_name if group is not None else "", _cap(schedule, x, cfg), PLAN["alpha"],
                cfg["min_piece"], PLAN["imbalance_threshold"], e, schedule != "pipelined_consecutive")
        with tracker, torch.no_grad():
            out, cnt, perm = pipelined_llep_forward(x, ids, s, *ws, *args, tuple(counts))
            if counts:  # simulated ranks: the backward takes the counts as ints (a fake tensor has no data)
                cnt = tuple(counts)
            grads = pipelined_llep_backward(grad, x, ids, s, *ws, cnt, perm, *args)
            del out, cnt, perm, grads
    else:
        with tracker:
            res = autograd_step(schedule, x, ids, s, ws, grad, group, cfg)
            del res
    return tracker.peak_bytes()


# --------------------------------------------------------------------------------- measured (real tensors)
def rank_inputs(kind: str, rank: int, world: int, cfg: dict):
    """This rank's (ids, x, scores, output gradient, its experts' w1, w2, w3) for a routing family."""
    return (global_ids(kind, world, cfg["T"], cfg["E"], cfg["k"])[rank],) + rank_tensors(rank, world, cfg)


def rank_tensors(rank: int, world: int, cfg: dict):
    """This rank's (x, scores, output gradient, its experts' w1, w2, w3), the same for every routing."""
    T, H, I, E, k = cfg["T"], cfg["H"], cfg["I"], cfg["E"], cfg["k"]
    e = E // world
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(T, H, generator=g)
    s = torch.rand(T, k, generator=g)
    grad = torch.randn(T, H, generator=g)
    gw = torch.Generator().manual_seed(99)  # all experts, a copy of this rank's slice (own storage)
    ws = [(torch.randn(E, *shape, generator=gw) * shape[1] ** -0.5)[rank * e:(rank + 1) * e].clone()
          for shape in ((I, H), (H, I), (I, H))]
    return x, s, grad, ws


def real_rank(rank: int, world: int, cfg: dict) -> dict:
    """(On each gloo rank) per routing: exactness vs standard EP, peaks, median times."""
    group = dist.group.WORLD
    out = {}
    for kind in ROUTINGS:
        ids, x, s, grad, ws = rank_inputs(kind, rank, world, cfg)
        ref = autograd_step("standard", x, ids, s, ws, grad, group, cfg)
        err = {}
        for sch in SCHEDULES[1:] + (DIAGNOSTIC,):  # also the warm-up
            got = autograd_step(sch, x, ids, s, ws, grad, group, cfg)
            err[sch] = max(float((a - b).abs().max() / (b.abs().max() + 1e-30)) for a, b in zip(got, ref))
            if err[sch] > 1e-4:
                raise AssertionError(f"rank {rank} {kind} {sch}: relative difference {err[sch]:.3g} vs standard EP")
        del ref, got
        steps = {sch: (lambda sch=sch: autograd_step(sch, x, ids, s, ws, grad, group, cfg))
                 for sch in SCHEDULES + (DIAGNOSTIC,)}
        seconds = interleaved_medians(steps, repeats=cfg["repeats"], warmup=0, sync=dist.barrier)
        peaks = {sch: live_peak(sch, x, ids, s, ws, grad, group, cfg) for sch in SCHEDULES + (DIAGNOSTIC,)}
        # time against the chunk cap c (strided, through the custom op): the curve the knee is read from
        curve = interleaved_medians({c: (lambda c=c: autograd_step("pipelined", x, ids, s, ws, grad, group,
                                                                   dict(cfg, cap=c))) for c in cfg["curve"]},
                                    repeats=cfg["repeats"], warmup=1, sync=dist.barrier)
        out[kind] = {"seconds": seconds, "peak_bytes": peaks, "max_rel_err": err, "curve_seconds": curve,
                     "overlap": overlap_timeline(x, ids, s, ws, grad, group, cfg)}
    return out


def overlap_timeline(x, ids, s, ws, grad, group, cfg) -> dict:
    """Communication hidden behind compute, from the pipeline's own timestamps (PL.TIMELINE).

    One eager forward + backward of PipelinedLLEP (strided) with overlap on and off, repeated; per run: the wall
    time, the time spent blocked in wait() (exposed communication, including waiting for a slower peer), and with
    overlap the time collectives were in flight while this rank computed (launch -> completion, less the blocked
    part). Hidden = exposed without overlap - exposed with overlap (medians)."""
    import statistics

    e = ws[0].shape[0]
    args = (group.group_name, cfg["cap"], PLAN["alpha"], cfg["min_piece"], PLAN["imbalance_threshold"], e, True)
    runs = {True: [], False: []}
    for _ in range(cfg["repeats"]):
        for overlap in (True, False):
            PL.TIMELINE = []
            dist.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                out, cnt, perm = pipelined_llep_forward(x, ids, s, *ws, *args, (), None, overlap)
                grads = pipelined_llep_backward(grad, x, ids, s, *ws, cnt, perm, *args, None, overlap)
            wall = time.perf_counter() - t0
            events, PL.TIMELINE = PL.TIMELINE, None
            del out, cnt, perm, grads
            blocked = sum(t2 - t1 for *_, t1, t2 in events)
            in_flight = sum(max(0.0, t1 - t0_) for *_, t0_, t1, _ in events)  # launched, not yet waited for
            runs[overlap].append((wall, blocked, in_flight, len(events)))
    med = {ov: [statistics.median(r[i] for r in rs) for i in range(4)] for ov, rs in runs.items()}
    return {"wall_on": med[True][0], "wall_off": med[False][0], "blocked_on": med[True][1],
            "blocked_off": med[False][1], "in_flight_on": med[True][2], "collectives": int(med[True][3]),
            "hidden": med[False][1] - med[True][1]}


def run_real(cfg: dict) -> list[dict]:
    from boundpass.testing.distributed import run_on_ranks

    sections = []
    for world in cfg["worlds"]:
        t0 = time.perf_counter()
        per_rank = run_on_ranks(real_rank, world, cfg, timeout_s=1500)
        rows = {}
        for kind in ROUTINGS:
            counts = counts_of(global_ids(kind, world, cfg["T"], cfg["E"], cfg["k"]), cfg["E"])
            stats = plan_stats(counts, cfg["k"], cfg["cap"], cfg["min_piece"], cfg["E"] // world)
            bcfg = dict(cfg, P=world, dtype=torch.float32)
            bounds = [bounds_for(r, stats, bcfg) for r in range(world)]
            rows[kind] = {"per_rank_peak_bytes": {s: [r[kind]["peak_bytes"][s] for r in per_rank]
                                                  for s in SCHEDULES + (DIAGNOSTIC,)},
                          "per_rank_bound_bytes": {s: [b[s] for b in bounds] for s in SCHEDULES},
                          "seconds_rank0": per_rank[0][kind]["seconds"],
                          "max_rel_err": {s: max(r[kind]["max_rel_err"][s] for r in per_rank)
                                          for s in SCHEDULES[1:] + (DIAGNOSTIC,)},
                          "curve_seconds_rank0": {str(c): t for c, t in per_rank[0][kind]["curve_seconds"].items()},
                          "overlap_per_rank": [r[kind]["overlap"] for r in per_rank],
                          "plan": stats}
            print(f"  P={world} {kind:11s} " + ", ".join(
                f"{s} {fmt_bytes(max(rows[kind]['per_rank_peak_bytes'][s]))} "
                f"{fmt_seconds(rows[kind]['seconds_rank0'][s])}" for s in SCHEDULES), flush=True)
        sections.append({"world": world, "wall_seconds": time.perf_counter() - t0, "routings": rows})
    return sections


# ------------------------------------------------------------------------------ simulated (fake tensors)
def simulate_rank(rank: int, counts: list[list[int]], cfg: dict) -> dict:
    """Peaks of rank ``rank`` under FakeTensorMode + fake PG: standard EP (as LLEP's fallback plan, see render),
    LLEP, PipelinedLLEP strided and consecutive."""
    from boundpass.measure.simulate import simulated_rank

    P, T, H, I, E, k, dt = cfg["P"], cfg["T"], cfg["H"], cfg["I"], cfg["E"], cfg["k"], cfg["dtype"]
    e = E // P
    flat = tuple(n for row in counts for n in row)
    peaks = {}
    for sch in SCHEDULES:
        run_cfg = dict(cfg)
        with ExitStack() as stack:
            sim = stack.enter_context(simulated_rank(rank, P, device="cpu"))
            # the count exchange is data-dependent: counts come from the given routing instead
            stack.enter_context(mock.patch.object(PL, "_route_counts",
                                                  lambda ids, n: torch.zeros(n, dtype=torch.int64)))
            stack.enter_context(mock.patch.object(PL._Group, "gather_counts", lambda self, local: counts))
            x = torch.empty(T, H, dtype=dt)
            ids = torch.zeros(T, k, dtype=torch.int64)
            s = torch.empty(T, k, dtype=dt)
            grad = torch.empty(T, H, dtype=dt)
            ws = [torch.empty(e, *shape, dtype=dt) for shape in ((I, H), (H, I), (I, H))]
            if sch == "standard":  # standard_ep reads its counts with .tolist(): LLEP with the fallback plan
                stack.enter_context(mock.patch.dict(PLAN, imbalance_threshold=float("inf")))
                peaks[sch] = live_peak("llep", x, ids, s, ws, grad, sim.group, run_cfg)
            else:
                peaks[sch] = live_peak(sch, x, ids, s, ws, grad, sim.group, run_cfg, counts=flat)
            del x, ids, s, grad, ws
    return peaks


def bounds_for(rank: int, stats: dict, cfg: dict) -> dict:
    P, T, H, I, E, k, dt = cfg["P"], cfg["T"], cfg["H"], cfg["I"], cfg["E"], cfg["k"], cfg["dtype"]
    mixed = torch.empty((), dtype=dt).element_size() < 4
    common = dict(N=T, H=H, I=I, E=E, E_p=P, k=k)
    std = sym.evaluate(standard_ep_bound(), bound_values(dt, **common, R=stats["standard_recv_rows"][rank]))
    ll = sym.evaluate(llep_bound(), bound_values(dt, **common, R=stats["llep_recv_rows"][rank],
                                                 s_b=stats["borrowed"][rank]))
    pipe = sym.evaluate(pipelined_llep_bound(mixed_precision=mixed), bound_values(dt, **common, c=cfg["cap"],
                                                                                  s_b=E // P))
    return {"standard": std, "llep": ll, "pipelined": pipe, "pipelined_consecutive": pipe}


def run_simulated(cfg: dict, ranks: tuple) -> dict:
    out = {}
    for kind in ROUTINGS:
        t0 = time.perf_counter()
        counts = counts_of(global_ids(kind, cfg["P"], cfg["T"], cfg["E"], cfg["k"]), cfg["E"])
        stats = plan_stats(counts, cfg["k"], cfg["cap"], cfg["min_piece"], cfg["E"] // cfg["P"])
        per_rank = {}
        for r in ranks:
            per_rank[r] = {"peak_bytes": simulate_rank(r, counts, cfg), "bound_bytes": bounds_for(r, stats, cfg)}
            print(f"  sim {kind:11s} rank {r}: " + ", ".join(
                f"{s} {fmt_bytes(per_rank[r]['peak_bytes'][s])} (bound {fmt_bytes(per_rank[r]['bound_bytes'][s])})"
                for s in SCHEDULES), flush=True)
        out[kind] = {"plan": stats, "ranks": per_rank, "seconds": time.perf_counter() - t0}
    return out


# ---------------------------------------------------------------------------------------------- report
def check_targets(real: list[dict], sim: dict, cfg: dict | None = None) -> list[dict]:
    targets = []
    ratios = {}
    for kind in ("zipf", "adversarial"):
        for r, row in sim[kind]["ranks"].items():
            ratios[f"{kind} rank {r}"] = row["peak_bytes"]["pipelined"] / row["peak_bytes"]["llep"]
    skew = {n: x for n, x in ratios.items() if n.startswith("zipf")}
    targets.append({"target": "simulated: PipelinedLLEP (strided) peak <= 0.45 x LLEP's under skew (Zipf)",
                    "figures": ", ".join(f"{n}: {x:.3f}" for n, x in skew.items())
                    + "; adversarial: " + ", ".join(f"{n.split()[-1]}: {x:.3f}" for n, x in ratios.items()
                                                    if n.startswith("adv")),
                    "met": all(x <= 0.45 for x in skew.values())})
    over, n = [], 0
    for kind, sec in sim.items():
        for r, row in sec["ranks"].items():
            for s in ("pipelined", "pipelined_consecutive"):
                n += 1
                if row["peak_bytes"][s] > row["bound_bytes"][s]:
                    over.append(f"{kind} rank {r} {s}: {row['peak_bytes'][s]} > {row['bound_bytes'][s]}")
    bounds = sorted({row["bound_bytes"]["pipelined"] for sec in sim.values() for row in sec["ranks"].values()})
    targets.append({"target": "simulated: PipelinedLLEP peak never above its bound, any routing",
                    "figures": f"{n - len(over)}/{n} hold; bound {', '.join(fmt_bytes(b) for b in bounds)} "
                               f"for every routing" + ("; " + "; ".join(over) if over else ""),
                    "met": not over})
    slow = []
    for sec in real:
        for kind, row in sec["routings"].items():
            t = row["seconds_rank0"]
            slow.append((f"P={sec['world']} {kind}", t["pipelined"] / t["llep"]))
    targets.append({"target": "real tensors: PipelinedLLEP (strided) time within 1.1 x LLEP",
                    "figures": ", ".join(f"{n}: {x:.2f}x" for n, x in slow), "met": all(x <= 1.1 for _, x in slow)})
    order = []
    for sec in real:
        for kind, row in sec["routings"].items():
            t = row["seconds_rank0"]
            order.append((f"P={sec['world']} {kind}", t["pipelined"] / t["pipelined_consecutive"]))
    targets.append({"target": "real tensors: strided time <= consecutive time",
                    "figures": ", ".join(f"{n}: {x:.2f}x" for n, x in order), "met": all(x <= 1.0 for _, x in order)})
    if cfg is not None:
        knee = [(f"P={sec['world']} {kind}", t_k / t_w, b_w - b_k) for sec in real
                for kind, (t_k, t_w, b_k, b_w) in knee_rows(sec, cfg).items()]
        targets.append({"target": "real tensors: no slower at the knee than at the widest c (within 5% noise), "
                                  "memory saved",
                        "figures": ", ".join(f"{n}: {x:.2f}x ({fmt_bytes(m)} less bound)" for n, x, m in knee),
                        "met": all(x <= 1.05 for _, x, _ in knee)})
    return targets


def render(data: dict) -> str:
    meta, cfg, pc = data["meta"], data["real_config"], data["sim_config"]
    md = ["# Expert dispatch: standard EP vs LLEP vs PipelinedLLEP", "",
          f"`python bench/dispatch.py{' --quick' if data['quick'] else ''}` on torch {meta['torch']}, "
          f"{meta['nproc']} cores ({meta['processor']}), {meta['date_utc']}; wall time {data['wall_seconds']:.0f} s.",
          "", f"Plan (LLEP and PipelinedLLEP alike): alpha = {PLAN['alpha']}, fallback threshold lambda = "
          f"{PLAN['imbalance_threshold']}, borrowed slots s_b = E/E_p for both (LLEP given `max_borrowed=E/E_p` so "
          f"both run the same plan). Routings: balanced (uniform top-k), Zipf (weights 1/i^{ZIPF_S}, top-k without "
          f"replacement), adversarial (every token to experts 0..k-1, all owned by rank 0).", ""]
    md += ["**Peak accounting (same for all three):** `LiveStorageTracker` (dispatch-mode live storages) over one "
           "forward + backward, with x, ids, scores, this rank's experts and the output gradient counted as resident "
           "and all gradients held to the end. Standard EP and LLEP: their autograd graph "
           "(`torch.autograd.grad`). PipelinedLLEP: its eager `pipelined_llep_forward` / `pipelined_llep_backward` "
           "(the custom op hides its allocations from a dispatch tracker). Times: one forward+backward through "
           "autograd (PipelinedLLEP through its custom op), interleaved medians, barrier-synchronised, 1 thread "
           "per rank, rank 0's figure. Reading the times: PipelinedLLEP overlaps its collectives with its experts "
           "(chunk j+1's dispatch and chunk j-1's combine in flight while chunk j runs, async all-to-alls), runs "
           "one block per expert per chunk across sources, and its backward recomputes only the expert forward "
           "(x, grad and score rows travel again as one packed all-to-all per chunk, results return as one: "
           "keeping the received rows would be the routing-sized buffer it bounds); the diagnostic row with "
           "c = T (K = 1) keeps the recompute and drops the chunking, so (strided - K=1) is the cost of chunking. "
           "Standard EP and LLEP are this repository's autograd schedules; they split their received rows and unbind "
           "their experts (a slice's backward zero-filled a whole-buffer gradient per expert block: 44% of LLEP's "
           "profiled time before that fix, 2026-12-01). The machine is shared with other work: absolute times vary "
           "several-fold between runs" + (f" (1-minute load average at start / end of this run: "
                                          f"{data['load_average'][0]:.1f} / {data['load_average'][1]:.1f} on "
                                          f"{meta['nproc']} cores)" if data.get("load_average") else "") + ".",
           ""]
    for sec in data["real"]:
        P = sec["world"]
        md += [f"## measured (real tensors, CPU): {P} gloo ranks, T={cfg['T']}/rank, H={cfg['H']}, I={cfg['I']}, "
               f"E={cfg['E']}, k={cfg['k']}, c={cfg['cap']}, min_piece={cfg['min_piece']}, fp32, "
               f"{cfg['repeats']} reps", ""]
        rows = []
        for kind, row in sec["routings"].items():
            t, pk, bd = row["seconds_rank0"], row["per_rank_peak_bytes"], row["per_rank_bound_bytes"]
            for s in SCHEDULES + (DIAGNOSTIC,):
                rows.append([kind, LABELS[s], " / ".join(fmt_bytes(b) for b in pk[s]),
                             " / ".join(fmt_bytes(b) for b in bd[s]) if s in bd else "—",
                             f"{max(pk[s]) / max(pk['llep']):.2f}", fmt_seconds(t[s]), f"{t[s] / t['llep']:.2f}",
                             f"{row['max_rel_err'][s]:.1e}" if s in row["max_rel_err"] else "ref"])
        md += [markdown_table(["routing", "schedule", "peak per rank (0 / 1 / ...)", "sympy bound per rank",
                               "max peak / LLEP", "median fwd+bwd", "time / LLEP", "max rel. diff vs standard"],
                              rows), ""]
        rows = []
        for kind, row in sec["routings"].items():
            p = row["plan"]
            for mode in ("strided", "consecutive"):
                L = p["chunk_loads"][mode]
                s = "pipelined" if mode == "strided" else "pipelined_consecutive"
                rows.append([kind, mode, str(p["K"]), str(L["max_rows"]), f"{L['mean_rows']:.0f}",
                             f"{L['max_over_mean']:.2f}", str(L["cap_rows"]),
                             fmt_bytes(max(row["per_rank_peak_bytes"][s])), fmt_seconds(row["seconds_rank0"][s])])
            rows.append([kind, "(plan)", "", f"relocated={p['relocated']}",
                         f"recv rows std {p['standard_recv_rows']}", f"LLEP {p['llep_recv_rows']}", "", "", ""])
        md += [f"Chunk membership ({P} ranks): rows received by one destination in one chunk (max over chunks and "
               "destinations; mean over them; E_p c k is the guaranteed cap).", "",
               markdown_table(["routing", "membership", "K", "max rows", "mean rows", "max / mean", "cap E_p c k",
                               "max peak", "median time"], rows), ""]
        md += curve_section(sec, cfg) + overlap_section(sec)
    md += [f"## simulated (fake tensors): rank r of E_p = {pc['P']}, T={pc['T']}/rank, H={pc['H']}, I={pc['I']}, "
           f"E={pc['E']}, k={pc['k']}, c={pc['cap']}, min_piece={pc['min_piece']}, {pc['dtype']}", "",
           "FakeTensorMode (fake cpu tensors) + the fake process group; nothing is allocated and collectives move no "
           "data, so splits come from the given counts. Bounds: PipelinedLLEP's `pipelined_llep_bound` (launch "
           "configuration only, s_b = E/E_p, mixed_precision for bf16); standard EP's and LLEP's bounds at the "
           "rank's realized receive rows R from the plan (LLEP: s_b = experts it actually borrowed).", "",
           "PipelinedLLEP runs unpatched (its forward takes `counts=`, its backward the same counts as ints). Harness "
           "shims for the two schedules it is compared with (bench-side only): (1) for LLEP, "
           "`_route_counts`/`_Group.gather_counts` return the given counts; (2) **standard EP is simulated as LLEP "
           "with the fallback plan forced (lambda = inf)**: `standard_ep` reads its counts with `.tolist()` and has "
           "no `counts=`; the fallback plan receives exactly standard EP's rows with one all-to-all. On real "
           "tensors this proxy's peak vs `standard_ep`'s is in the table below.", ""]
    rows = []
    for kind, sec in data["simulated"].items():
        for r, row in sec["ranks"].items():
            pk, bd = row["peak_bytes"], row["bound_bytes"]
            for s in SCHEDULES:
                rows.append([kind, str(r), LABELS[s], fmt_bytes(pk[s]), fmt_bytes(bd[s]), f"{pk[s] / bd[s]:.3f}",
                             f"{pk[s] / pk['llep']:.3f}"])
    md += [markdown_table(["routing", "rank", "schedule", "live-storage peak", "sympy bound", "peak / bound",
                           "peak / LLEP"], rows), ""]
    rows = []
    for kind, sec in data["simulated"].items():
        p = sec["plan"]
        rows.append([kind, str(p["relocated"]), str(max(p["standard_recv_rows"])), str(max(p["llep_recv_rows"])),
                     str(p["K"]), f"{p['chunk_loads']['strided']['max_over_mean']:.2f}",
                     f"{p['chunk_loads']['consecutive']['max_over_mean']:.2f}", f"{sec['seconds']:.0f} s"])
    md += ["Plan at the simulated shape (all 8 ranks):", "",
           markdown_table(["routing", "LLEP relocated", "max recv rows, standard", "max recv rows, LLEP", "K",
                           "chunk max/mean, strided", "chunk max/mean, consecutive", "sim time"], rows), ""]
    if data.get("proxy_check"):
        md += ["Standard-EP proxy check (real tensors, 2 gloo ranks, the measured shape, fp32 and bf16): peak of "
               "`standard_ep` vs LLEP with lambda = inf, per routing, rank 0 / rank 1: " + "; ".join(
                   f"{k}: " + " / ".join(f"{fmt_bytes(a)} vs {fmt_bytes(b)}" + (" (same bytes)" if a == b else f" ({b - a:+d} B)")
                                for a, b in v)
                   for k, v in data["proxy_check"].items()) + ".", ""]
    over = [f"{sec_name} {kind} rank {r} {LABELS[s]}: peak {fmt_bytes(p)} > bound {fmt_bytes(b)}"
            for sec_name, kind, r, s, p, b in _all_peaks(data) if p > b]
    md += ["Peaks above their sympy bound (any schedule, any section): "
           + ("; ".join(over) if over else "none") + ".", ""]
    md += targets_section(data["targets"])
    return "\n".join(md)


def curve_section(sec: dict, cfg: dict) -> list[str]:
    """Time against c (strided), per routing, with the measured knee (boundpass.bound.cost_model.knee on the curve)."""
    from boundpass.bound import cost_model

    caps = [str(c) for c in cfg["curve"]]
    rows = []
    for kind, row in sec["routings"].items():
        curve, llep_t = row["curve_seconds_rank0"], row["seconds_rank0"]["llep"]
        knee = cost_model.knee({int(c): t for c, t in curve.items()})
        rows.append([kind] + [f"{fmt_seconds(curve[c])} ({curve[c] / llep_t:.2f})" for c in caps] + [str(knee)])
    model = cost_model.pipelined_llep_knee(lo=1, hi=cfg["T"], N=cfg["T"], H=cfg["H"], I=cfg["I"], E=cfg["E"],
                                           E_p=sec["world"], k=cfg["k"])
    K = [str(num_chunks(cfg["T"], int(c))) for c in caps]
    at, widest = knee_point(sec, cfg)
    saved = [[kind, f"{fmt_seconds(t_knee)} / {fmt_seconds(t_wide)} = {t_knee / t_wide:.2f}",
              f"{fmt_bytes(b_knee)} vs {fmt_bytes(b_wide)}: {fmt_bytes(b_wide - b_knee)} less"]
             for kind, (t_knee, t_wide, b_knee, b_wide) in knee_rows(sec, cfg).items()]
    return [f"Time against the chunk cap c ({sec['world']} ranks, PipelinedLLEP strided, median fwd+bwd through the "
            f"custom op, rank 0; in brackets: / LLEP's median from the table above; K = {', '.join(K)}). Knee: the "
            f"smallest c within {cost_model.KNEE_TOLERANCE:.0%} of the best measured time; the time model's knee "
            f"(`cost_model.pipelined_llep_knee`, what `boundpass.compile` stops c at, over powers of two): {model}.",
            "",
            markdown_table(["routing"] + [f"c = {c}" for c in caps] + ["measured knee"], rows), "",
            f"At the knee against the widest c ({sec['world']} ranks): the curve's c nearest the model's knee "
            f"(c = {at}) against c = {widest} (one chunk: what the budget alone allows when it is loose); the sympy bound "
            "per rank (`pipelined_llep_bound`) at each.", "",
            markdown_table(["routing", "time at the knee / at the widest c", "bound at the knee vs the widest c"],
                           saved), ""]


def knee_point(sec: dict, cfg: dict) -> tuple[int, int]:
    """(the curve's c nearest the time model's knee, the widest c on the curve)."""
    from boundpass.bound import cost_model
    model = cost_model.pipelined_llep_knee(lo=1, hi=cfg["T"], N=cfg["T"], H=cfg["H"], I=cfg["I"], E=cfg["E"],
                                           E_p=sec["world"], k=cfg["k"])
    caps = sorted(int(c) for c in cfg["curve"])
    return min(caps, key=lambda c: (abs(c - model), c)), caps[-1]


def bound_at(c: int, world: int, cfg: dict) -> int:
    """PipelinedLLEP's sympy bound per rank (`pipelined_llep_bound`) at cap c, the bench's shape and dtype."""
    dt = cfg.get("dtype", torch.float32)  # the real-tensor runs are fp32
    mixed = torch.empty((), dtype=dt).element_size() < 4
    return sym.evaluate(pipelined_llep_bound(mixed_precision=mixed),
                        bound_values(dt, N=cfg["T"], H=cfg["H"], I=cfg["I"], E=cfg["E"], E_p=world, k=cfg["k"], c=c,
                                     s_b=cfg["E"] // world))


def knee_rows(sec: dict, cfg: dict) -> dict:
    """Per routing: (time at the knee, time at the widest c, bound at the knee, bound at the widest c)."""
    at, widest = knee_point(sec, cfg)
    out = {}
    for kind, row in sec["routings"].items():
        curve = {int(c): t for c, t in row["curve_seconds_rank0"].items()}
        out[kind] = (curve[at], curve[widest], bound_at(at, sec["world"], cfg), bound_at(widest, sec["world"], cfg))
    return out


def overlap_section(sec: dict) -> list[str]:
    """Communication hidden behind compute, from the pipeline's timestamps, per routing and rank."""
    rows = []
    for kind, row in sec["routings"].items():
        for r, o in enumerate(row["overlap_per_rank"]):
            rows.append([kind, str(r), str(o["collectives"]), fmt_seconds(o["wall_off"]), fmt_seconds(o["wall_on"]),
                         fmt_seconds(o["blocked_off"]), fmt_seconds(o["blocked_on"]), fmt_seconds(o["hidden"]),
                         f"{o['hidden'] / o['blocked_off']:.0%}" if o["blocked_off"] > 0 else "-",
                         fmt_seconds(o["in_flight_on"])])
    return [f"Overlap ({sec['world']} ranks; eager forward + backward of PipelinedLLEP strided at c = the table's, "
            "medians; timestamps from `runtime/pipelined_llep.py` TIMELINE): blocked = time inside wait() on the "
            "all-to-alls (exposed communication, including waiting for a slower peer); hidden = blocked without "
            "overlap - blocked with it; in flight = time between launching a collective and waiting for it, "
            "during which this rank ran experts.", "",
            markdown_table(["routing", "rank", "collectives", "wall, overlap off", "wall, overlap on",
                            "blocked, off", "blocked, on", "hidden", "hidden / blocked off", "in flight, on"], rows),
            ""]


def _all_peaks(data):
    """(section, routing, rank, schedule, peak, bound) for every peak that has a bound."""
    for sec in data["real"]:
        for kind, row in sec["routings"].items():
            for s, bounds in row["per_rank_bound_bytes"].items():
                for r, (p, b) in enumerate(zip(row["per_rank_peak_bytes"][s], bounds)):
                    yield f"measured P={sec['world']}", kind, r, s, p, b
    for kind, sec in data["simulated"].items():
        for r, row in sec["ranks"].items():
            for s in SCHEDULES:
                yield "simulated", kind, r, s, row["peak_bytes"][s], row["bound_bytes"][s]


def proxy_rank(rank: int, world: int, cfg: dict) -> dict:
    """(Gloo rank) peak of standard_ep vs LLEP forced to its fallback plan, per routing."""
    T, H, I, E, k = cfg["T"], cfg["H"], cfg["I"], cfg["E"], cfg["k"]
    e = E // world
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        for kind in ROUTINGS:
            ids = global_ids(kind, world, T, E, k)[rank]
            x, s, grad = torch.randn(T, H, dtype=dt), torch.rand(T, k, dtype=dt), torch.randn(T, H, dtype=dt)
            ws = [torch.randn(e, *shape, dtype=dt) for shape in ((I, H), (H, I), (I, H))]
            a = live_peak("standard", x, ids, s, ws, grad, dist.group.WORLD, cfg)
            with mock.patch.dict(PLAN, imbalance_threshold=float("inf")):
                b = live_peak("llep", x, ids, s, ws, grad, dist.group.WORLD, cfg)
            out[f"{kind} {str(dt).replace('torch.', '')}"] = (a, b)
    return out

# ------------------------------------------------------------------- the dispatch cap at its knee (issue 18)
# Powers of two, so the model's knee (a power of two, cost_model.candidates) is a point of the curve; more rounds
# than the main table, and the knee against the widest c timed again as paired rounds (their ratio per round).
# One rank (E_p = 1: local dispatch, nothing to exchange, what boundpass.compile runs on one device) as well.
KNEE = dict(worlds=(1, 2, 4), T=1024, H=256, I=256, E=16, k=4, min_piece=16, cap=128, repeats=7, pair_repeats=15,
            curve=(16, 32, 64, 128, 256, 512, 1024))
KNEE_QUICK = dict(KNEE, T=256, H=64, I=64, E=8, k=2, min_piece=8, repeats=3, pair_repeats=3, curve=(32, 64, 256))


def knee_rank(rank: int, world: int, cfg: dict) -> dict:
    """(On each gloo rank) per routing: the c curve (interleaved medians) and the model's knee against c = T as
    paired rounds; the knee is cost_model's with the constants compile would use (costs_for('cpu'))."""
    from boundpass.bound import cost_model

    T = cfg["T"]
    knee_c = cost_model.pipelined_llep_knee(lo=1, hi=T, N=T, H=cfg["H"], I=cfg["I"], E=cfg["E"], E_p=world,
                                            k=cfg["k"], costs=cost_model.costs_for("cpu"))
    out = {}
    for kind in ROUTINGS:
        ids, x, s, grad, ws = rank_inputs(kind, rank, world, cfg)

        def at(c):
            return lambda: autograd_step("pipelined", x, ids, s, ws, grad, dist.group.WORLD, dict(cfg, cap=c))
        curve = interleaved_medians({c: at(c) for c in cfg["curve"]}, repeats=cfg["repeats"], warmup=1,
                                    sync=dist.barrier)
        pair = interleaved_samples({"knee": at(knee_c), "widest": at(T)}, repeats=cfg["pair_repeats"], warmup=1,
                                   sync=dist.barrier)
        out[kind] = {"curve_seconds": {str(c): t for c, t in curve.items()}, "pair_seconds": pair}
    return {"model_knee": knee_c, "routings": out}


def knee_main(quick: bool) -> dict:
    """The c curve on 2 and 4 ranks, the time model fitted to it, and the model's knee against the widest c."""
    import statistics

    from boundpass.bound import cost_model
    from boundpass.testing.distributed import run_on_ranks

    cfg = KNEE_QUICK if quick else KNEE
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    sections = []
    for world in cfg["worlds"]:
        print(f"knee: {world} gloo ranks", flush=True)
        rank0 = run_on_ranks(knee_rank, world, cfg, timeout_s=1500)[0]  # barrier-synchronised: rank 0 times all
        for kind, row in rank0["routings"].items():
            ratios = sorted(a / b for a, b in zip(row["pair_seconds"]["knee"], row["pair_seconds"]["widest"]))
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            row["pair_ratio"] = {"median": statistics.median(ratios), "q1": q[0], "q3": q[2]}
        c = rank0["model_knee"]
        sections.append(dict(rank0, world=world, bound_knee=bound_at(c, world, cfg), bound_widest=bound_at(cfg["T"], world, cfg)))
    shape = dict(N=cfg["T"], H=cfg["H"], I=cfg["I"], E=cfg["E"], k=cfg["k"])
    curves = [(sec["world"], {int(c): t for c, t in row["curve_seconds"].items()})
              for sec in sections for row in sec["routings"].values()]
    used = cost_model.costs_for("cpu")
    fitted = cost_model.calibrate_dispatch(curves, **shape, base=used)
    for sec in sections:
        sec["fitted_knee"] = cost_model.pipelined_llep_knee(lo=1, hi=cfg["T"], E_p=sec["world"], costs=fitted, **shape)
        sec["model_curve"] = {str(c): cost_model.pipelined_llep_seconds(c, E_p=sec["world"], costs=used, **shape)
                              for c in cfg["curve"]}
    ratios = [(f"P={sec['world']} {kind}", row["pair_ratio"]["median"]) for sec in sections
              for kind, row in sec["routings"].items()]
    data = {"meta": run_metadata(), "quick": quick, "config": dict(cfg), "sections": sections,
            "costs_used": {"collective_s": used.collective_s, "alltoall_bandwidth": used.alltoall_bandwidth},
            "costs_fitted": {"collective_s": fitted.collective_s, "alltoall_bandwidth": fitted.alltoall_bandwidth},
            "load_average": [load0, os.getloadavg()[0]]}
    data["targets"] = [{"target": "no slower at the model's knee than at the widest c (median of paired rounds "
                                  f"within {cost_model.KNEE_TOLERANCE:.0%}), memory saved",
                        "figures": ", ".join(f"{n}: {x:.2f}x" for n, x in ratios),
                        "met": all(x <= 1 + cost_model.KNEE_TOLERANCE for _, x in ratios)}]
    return publish("dispatch_knee", data, render_knee, start)


def render_knee(data: dict) -> str:
    from boundpass.bound import cost_model

    meta, cfg = data["meta"], data["config"]
    used, fit = data["costs_used"], data["costs_fitted"]
    md = ["# The dispatch cap c at its knee (issue 18)", "",
          f"`python bench/dispatch.py --knee-only{' --quick' if data['quick'] else ''}` on torch {meta['torch']}, "
          f"{meta['nproc']} cores ({meta['processor']}), {meta['date_utc']}; wall time {data['wall_seconds']:.0f} s; "
          f"1-minute load average {data['load_average'][0]:.1f} at start, {data['load_average'][1]:.1f} at end.", "",
          f"PipelinedLLEP (strided), one forward + backward through the custom op, T = {cfg['T']} tokens/rank, "
          f"H = {cfg['H']}, I = {cfg['I']}, E = {cfg['E']}, k = {cfg['k']}, fp32, gloo, 1 thread per rank, "
          f"barrier-synchronised, rank 0's clock. The curve: interleaved medians of {cfg['repeats']} rounds. The "
          f"model's knee (`cost_model.pipelined_llep_knee` with the constants `boundpass.compile` uses: all-to-all "
          f"latency {used['collective_s'] * 1e6:.0f} us, rate {used['alltoall_bandwidth'] / 1e9:.2f} GB/s) against "
          f"c = T (one chunk, what a loose budget alone allows): {cfg['pair_repeats']} paired rounds, the two run "
          f"back to back in each; the ratio is taken per round (load drift cancels) and its median and quartiles "
          f"reported.", ""]
    for sec in data["sections"]:
        rows = []
        for kind, row in sec["routings"].items():
            curve = {int(c): t for c, t in row["curve_seconds"].items()}
            best = min(curve.values())
            rows.append([kind] + [f"{fmt_seconds(t)} ({t / best:.2f})" for t in curve.values()]
                        + [str(cost_model.knee(curve))])
        model = {int(c): t for c, t in sec["model_curve"].items()}
        mbest = min(model.values())
        rows.append(["model (shape only)"] + [f"{t / mbest:.2f}" for t in model.values()] + [str(sec["model_knee"])])
        md += [f"## {sec['world']} ranks: time against c (in brackets: / the routing's best)", "",
               markdown_table(["routing"] + [f"c = {c}" for c in cfg["curve"]] + ["knee"], rows), ""]
        c = sec["model_knee"]
        pair_rows = [[kind, f"{c} (K = {num_chunks(cfg['T'], c)})",
                      fmt_seconds(sorted(row["pair_seconds"]["knee"])[len(row["pair_seconds"]["knee"]) // 2]),
                      fmt_seconds(sorted(row["pair_seconds"]["widest"])[len(row["pair_seconds"]["widest"]) // 2]),
                      f"**{row['pair_ratio']['median']:.2f}** [{row['pair_ratio']['q1']:.2f}, "
                      f"{row['pair_ratio']['q3']:.2f}]",
                      f"{fmt_bytes(sec['bound_knee'])} vs {fmt_bytes(sec['bound_widest'])}: "
                      f"{fmt_bytes(sec['bound_widest'] - sec['bound_knee'])} less"]
                     for kind, row in sec["routings"].items()]
        md += [f"{sec['world']} ranks, the model's knee against c = T = {cfg['T']}:", "",
               markdown_table(["routing", "c at the knee", "time at the knee (median)", "time at c = T (median)",
                               "paired ratio: median [quartiles]", "bound per rank: knee vs c = T"], pair_rows), ""]
    md += [f"Refit on this run's curves (`cost_model.calibrate_dispatch`, both rank counts, every routing): latency "
           f"{fit['collective_s'] * 1e6:.0f} us, rate {fit['alltoall_bandwidth'] / 1e9:.2f} GB/s; knee with them: "
           + ", ".join(f"{s['fitted_knee']} at {s['world']} ranks" for s in data["sections"]) + ".", ""]
    md += targets_section(data["targets"])
    return "\n".join(md)



def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller real-tensor shapes")
    parser.add_argument("--sim-ranks", default="0,1", help="comma-separated simulated ranks (default 0,1)")
    parser.add_argument("--knee-only", action="store_true",
                        help="only the dispatch cap's knee: the c curve, the fit, the knee vs the widest c "
                             "(docs/results/dispatch_knee.*)")
    args = parser.parse_args(argv)
    if args.knee_only:
        return knee_main(args.quick)
    cfg = QUICK if args.quick else FULL
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    print("measured (real tensors)", flush=True)
    real = run_real(cfg)
    from boundpass.testing.distributed import run_on_ranks
    proxy = run_on_ranks(proxy_rank, 2, cfg, timeout_s=600)
    proxy_check = {k: [p[k] for p in proxy] for k in proxy[0]}
    print("simulated (fake tensors)", flush=True)
    sim = run_simulated(PAPER, tuple(int(r) for r in args.sim_ranks.split(",")))
    data = {"meta": run_metadata(), "quick": args.quick, "real_config": {k: v for k, v in cfg.items()},
            "sim_config": dict(PAPER, dtype=str(PAPER["dtype"]).replace("torch.", "")), "plan_args": PLAN,
            "real": real, "simulated": sim, "proxy_check": proxy_check, "load_average": [load0, os.getloadavg()[0]]}
    data["targets"] = check_targets(real, sim, cfg)
    return publish("dispatch", data, render, start)


if __name__ == "__main__":
    main()
