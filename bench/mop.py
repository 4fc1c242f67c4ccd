"""MoP layout vs FSDP2-only on 4 gloo ranks: per-rank peak and step time vs sequence length (real, CPU).

Model: torchtitan deepseek_v3 debug MoE (6 layers, 8 experts top-3, MLA with 16 heads), fp32, every block
checkpointed (torchtitan FullAC), AdamW, torchtitan's cross-entropy. One sequence of L tokens per layout step:

  MoP         the sequence is split over the W = 4 ranks (L/4 tokens each, global positions), attention runs
              under the sequence-to-head all-to-all, dense weights FSDP2 over 4 ranks, experts E_p = 2
              (recipes/mop.py). Global batch: 1 sequence of L tokens.
  MoP+ops     the same layout with both bounded operators of the layout on: PipelinedLLEP dispatch over the
              E_p group (chunk cap c = 4096) and the Ring-DTP head over the 4-rank ring (lm_head vocab-sharded,
              never gathered, no [N, V] logits); once under the router's own routing and once with every token
              sent to experts 0..2, all on EP rank 0 (the routing that fills that rank's receive buffers: the
              composed bound, set by the launch whatever the router draws, is checked for tightness there).
  FSDP2-only  torchtitan's FSDP2 over the same 4 ranks, no sequence split, no EP: every rank holds a whole
              sequence (L tokens). Global batch: 4 sequences (one per rank), the only way FSDP2 alone uses 4
              ranks on sequences of length L.

Per-rank peak, two measures of one whole training step (forward, backward, optimizer step), the rank's parameter
shards, buffers and optimizer state counted from the start: torch's CPU allocator (allocator_peak_of: kernel
workspaces and collective buffers included; the composed bound is checked against it, both ways for MoP+ops) and
the live storages of tensors (LiveStorageTracker: no C++-internal buffers; it compares the layouts like for like).
Step time: median of
``repeats`` steps after one warm-up, barrier before each clock read; tokens/s = global tokens / step time.
For MoP the composed per-rank budget (boundpass.bound.composed: standard EP at worst-case routing and full logits,
or PipelinedLLEP + Ring-DTP for MoP+ops; AdamW on the device) is shown next to the measurement.

Writes docs/results/mop.json and mop.md.

    python bench/mop.py [--quick]
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import fmt_bytes, fmt_seconds, markdown_table, publish, run_metadata, targets_section

warnings.filterwarnings("ignore", message=r".*(autocast|Casting complex|initial_load).*")

WORLD, EP, VOCAB = 4, 2, 2048
FULL = dict(seqs=(512, 1024, 2048), repeats=2)
QUICK = dict(seqs=(256, 512), repeats=2)


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _bench_rank(rank, world, layout, seqs, repeats, vocab=VOCAB, skew=False):
    """Per sequence length: (peak bytes, median step s, composed bound or None) of this rank."""
    import statistics
    import warnings as _w
    _w.filterwarnings("ignore")
    import torch.distributed as dist
    from boundpass.measure.memtrack import LiveStorageTracker
    from boundpass.testing.whole_step import allocator_peak_of
    from boundpass.recipes.mop import build_model, mop_config, mop_loss, parallelize_mop, shard_batch
    from boundpass.testing.routing import route_all_to
    from torchtitan.distributed.activation_checkpoint import FullAC

    mop = layout.startswith("MoP")
    ops = layout == "MoP+ops"
    ep = EP if mop else 1
    cfg = mop_config("deepseek_v3", world=world, ep=ep, seq_len=max(seqs), vocab_size=vocab)
    model = build_model(cfg)
    if skew:
        route_all_to(model, (0, 1, 2))
    from boundpass.bound import composed
    from boundpass.planning import full_scale as plan
    shape = plan.shape_of_module(model, name="deepseek_v3 debugmodel", top_k=3,
                                 heads_config=cfg.model_spec.model.layers[0].attention)
    parallelize_mop(model, cfg, world=world, ac_config=FullAC.Config(), sequence_to_head=mop, pipelined_llep=ops,
                    ring_dtp=ops)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = mop_loss(model)
    out = []
    for L in seqs:
        g = torch.Generator().manual_seed(1000 + L + (0 if mop else rank))  # FSDP2-only: a sequence per rank
        tokens, labels = torch.randint(0, vocab, (1, L), generator=g), torch.randint(0, vocab, (1, L), generator=g)
        positions, global_tokens = None, (L if mop else world * L)
        if mop:
            tokens, labels, positions = shard_batch(tokens, labels, rank, world)

        def step():
            loss, _ = loss_fn(model(tokens, positions=positions), labels, torch.tensor(global_tokens))
            loss.backward()
            opt.step()
            opt.zero_grad()

        step()  # warm-up (also creates the optimizer state)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            times.append(time.perf_counter() - start)
        state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
        with LiveStorageTracker() as tracker:
            tracker.track_existing(*map(_local, [*model.parameters(), *model.buffers(), *state]))
            step()
        del state
        # the same step at torch's allocator: what C++ allocates (kernel workspaces, collective buffers) included
        _, allocator = allocator_peak_of(step, [*model.parameters(), *model.buffers(), *(
            t for st in opt.state.values() for t in st.values() if torch.is_tensor(t))])
        bound = None
        if mop:
            launch = composed.Launch(ranks=world, ep=ep, ring=world, tokens_per_rank=L // world,
                                     operators=frozenset({"pipelined_llep", "ring_dtp"} if ops else ()),
                                     b=4, b_acc=4)
            bound = composed.compose(shape, launch, budget=1 << 50).total
        out.append(dict(seq=L, tokens_per_rank=L // world if mop else L, global_tokens=global_tokens,
                        peak=tracker.peak_bytes(), allocator=allocator, step_s=statistics.median(times), bound=bound))
    return out


# MoP+ops with every token sent to experts 0..2 (all on EP rank 0): the routing that fills PipelinedLLEP's receive
# buffers on that rank, where a routing-independent bound can be checked for tightness
SKEWED = "MoP+ops, all to EP rank 0"
LAYOUTS = ("MoP", "MoP+ops", SKEWED, "FSDP2-only")


def run(seqs, repeats, layouts_to_run=LAYOUTS) -> dict:
    from boundpass.testing.distributed import run_on_ranks
    layouts = {}
    for layout in layouts_to_run:
        start = time.perf_counter()
        per_rank = run_on_ranks(_bench_rank, WORLD, "MoP+ops" if layout == SKEWED else layout, tuple(seqs), repeats,
                                VOCAB, layout == SKEWED, timeout_s=1800)
        rows = []
        for i, L in enumerate(seqs):
            ranks = [r[i] for r in per_rank]
            step_s = max(r["step_s"] for r in ranks)  # the slowest rank sets the step
            rows.append(dict(seq=L, tokens_per_rank=ranks[0]["tokens_per_rank"],
                             global_tokens=ranks[0]["global_tokens"],
                             peak_per_rank=[r["peak"] for r in ranks], peak_max=max(r["peak"] for r in ranks),
                             allocator_per_rank=[r["allocator"] for r in ranks],
                             allocator_max=max(r["allocator"] for r in ranks),
                             composed_bound=ranks[0]["bound"], step_s=step_s,
                             tokens_per_s=ranks[0]["global_tokens"] / step_s))
        layouts[layout] = dict(rows=rows, wall_s=time.perf_counter() - start)
    return layouts


OPS_EFFECT = dict(seq=1024, vocab=32768)  # where the head and the dispatch are a visible part of the peak


def run_operators_effect(repeats) -> list[dict]:
    """MoP vs MoP+ops at one length with a 32K vocabulary, balanced and all-tokens-to-EP-rank-0 routing."""
    from boundpass.testing.distributed import run_on_ranks
    rows = []
    for skew in (False, True):
        for layout in ("MoP", "MoP+ops"):
            start = time.perf_counter()
            per_rank = run_on_ranks(_bench_rank, WORLD, layout, (OPS_EFFECT["seq"],), repeats, OPS_EFFECT["vocab"],
                                    skew, timeout_s=1800)
            ranks = [r[0] for r in per_rank]
            rows.append(dict(layout=layout, routing="all to EP rank 0" if skew else "router's own",
                             peak_per_rank=[r["peak"] for r in ranks], peak_max=max(r["peak"] for r in ranks),
                             allocator_per_rank=[r["allocator"] for r in ranks],
                             allocator_max=max(r["allocator"] for r in ranks),
                             composed_bound=ranks[0]["bound"], step_s=max(r["step_s"] for r in ranks),
                             wall_s=time.perf_counter() - start))
    return rows


def render(data: dict) -> str:
    lines = ["# MoP layout vs FSDP2-only (4 gloo ranks, CPU)" + (" — quick run" if data["quick"] else ""), "",
             f"Model: {data['model']}. Run: {data['meta']['date_utc']}, torch {data['meta']['torch']}, "
             f"{data['meta']['nproc']} cores ({data['meta']['processor']}); {data['repeats']} timed steps per "
             f"point (median; the slowest rank's), wall {data['wall_seconds']:.0f} s.", "",
             "Two measures of one whole training step (forward + backward + AdamW) per rank, parameter shards, "
             "buffers and optimizer state counted from the start: **allocator peak**, torch's CPU allocator "
             "(`allocator_peak_of`: the profiler's allocation events, so kernel workspaces and what collectives "
             "allocate in C++ count), which the composed bound must cover; and **live storages** "
             "(LiveStorageTracker: tensors' storages only, blind to C++-internal buffers), which compares the "
             "layouts like for like (the FSDP2-only rows have only this measure when reused). The bound's "
             "targets read the allocator peak, the largest over the 4 ranks. MoP splits one sequence over the "
             "4 ranks; FSDP2-only gives each rank a whole sequence (4 sequences per step).", "",
             "Attention kernels: MoP's sequence-to-head wrapper zero-pads MLA's v head dim (128) to the qk one "
             "(192) so SDPA runs its fused O(N) kernel; FSDP2-only runs torchtitan's stock SDPA call, which for "
             "these unequal head dims is torch's math path ([L, L] scores per head). So at long L part of the "
             "peak gap is that kernel choice, not the layout; the layout's part is L/4 vs L tokens per rank.",
             ""]
    if data.get("baseline_from"):
        lines += [f"FSDP2-only rows reused from the run of {data['baseline_from']} (`--reuse-baseline`: its "
                  "code path did not change since); MoP rows from this run.", ""]
    lines += ["## Per-rank peak and step time vs sequence length", ""]
    names = [n for n in LAYOUTS if n in data["layouts"]]
    base = data["layouts"]["FSDP2-only"]["rows"]
    rows = []
    for name in names:
        for r, f in zip(data["layouts"][name]["rows"], base):
            bound = r["composed_bound"]
            alloc = r.get("allocator_max")
            rows.append([name, str(r["seq"]), fmt_bytes(alloc) if alloc else "-", fmt_bytes(bound) if bound else "-",
                         f"{bound / alloc:.3f}" if bound and alloc else "-", fmt_bytes(r["peak_max"]),
                         f"{r['peak_max'] / f['peak_max']:.2f}",
                         fmt_seconds(r["step_s"]), f"{r['step_s'] / f['step_s']:.2f}", f"{r['tokens_per_s']:.0f}"])
    lines.append(markdown_table(["layout", "L (tokens/seq)", "allocator peak/rank", "composed bound",
                                 "bound / allocator peak", "live storages/rank", "live storages / FSDP2-only's",
                                 "step", "step / FSDP2-only's", "tokens/s"], rows))
    lines += ["", "Activation part of the peak (live storages minus the smallest length's of the same layout): "
              "MoP grows with L/4 tokens per rank, FSDP2-only with L.", ""]
    rows = [[str(r0["seq"])] + [fmt_bytes(data["layouts"][n]["rows"][i]["peak_max"] -
                                          data["layouts"][n]["rows"][0]["peak_max"]) for n in names]
            for i, r0 in enumerate(base)]
    lines.append(markdown_table(["L"] + [f"{n} peak growth" for n in names], rows))
    if data.get("operators_effect"):
        lines += ["", f"## The operators' part: L = {OPS_EFFECT['seq']}, V = {OPS_EFFECT['vocab']:,}, MoP vs MoP+ops",
                  "", "Same layout and model with a 32K vocabulary (the head's [N/W, V] logits become a visible part "
                  "of the peak), under the router's own routing and with every token sent to experts 0..2 (all "
                  "on EP rank 0: torchtitan's dispatcher hands that rank every routed row). Bounds: standard EP "
                  "at worst-case routing + full logits, vs PipelinedLLEP + Ring-DTP.", ""]
        rows = [[r["layout"], r["routing"], fmt_bytes(r["allocator_max"]), fmt_bytes(r["composed_bound"]),
                 f"{r['composed_bound'] / r['allocator_max']:.3f}", fmt_bytes(r["peak_max"]), fmt_seconds(r["step_s"])]
                for r in data["operators_effect"]]
        lines.append(markdown_table(["layout", "routing", "allocator peak/rank (max over ranks)", "composed bound",
                                     "bound / allocator peak", "live storages/rank", "step"], rows))
    lines += [""] + targets_section(data["targets"])
    lines += ["Limits: CPU bytes, not a GPU allocator's reserved memory; gloo collectives; 2 shared "
              "cores run 4 ranks, so step times show overhead trends, not GPU throughput. The 120B-class "
              "sweep (128K / 512K / 1M tokens on 16 ranks) is `bench/mop_sim.py` -> docs/results/mop_sim.md.", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two short lengths, 2 timed steps")
    parser.add_argument("--reuse-baseline", action="store_true",
                        help="rerun the MoP layouts only; take the FSDP2-only rows from docs/results/mop.json (same lengths)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    start = time.perf_counter()
    baseline_from = None
    if args.reuse_baseline:
        import json
        from bench.common import RESULTS_DIR
        old = json.loads((RESULTS_DIR / "mop.json").read_text())
        if [r["seq"] for r in old["layouts"]["FSDP2-only"]["rows"]] != list(cfg["seqs"]):
            raise SystemExit("--reuse-baseline: the saved FSDP2-only rows are for other lengths; run without it")
        layouts = run(cfg["seqs"], cfg["repeats"], ("MoP", "MoP+ops", SKEWED))
        layouts["FSDP2-only"] = old["layouts"]["FSDP2-only"]
        baseline_from = old.get("baseline_from") or old["meta"]["date_utc"]
    else:
        layouts = run(cfg["seqs"], cfg["repeats"])
    effect = [] if args.quick else run_operators_effect(cfg["repeats"])
    base = layouts["FSDP2-only"]["rows"]
    targets = []
    for name in ("MoP", "MoP+ops", SKEWED):
        mop = layouts[name]["rows"]
        targets += [dict(target=f"{name}: allocator peak per rank <= its composed bound at every length",
                         figures=", ".join(f"{r['seq']}: bound / peak {r['composed_bound'] / r['allocator_max']:.3f}"
                                           for r in mop),
                         met=all(r["allocator_max"] <= r["composed_bound"] for r in mop))]
        if name == SKEWED:
            # boundpass's layout: its bound is set by the launch, whatever the router draws, so its tightness is
            # checked under the routing that realises its worst case (the router's own is in the row above)
            targets.append(dict(target=f"{name}: composed bound <= 1.10x the allocator peak at every length",
                                figures=", ".join(f"{r['seq']}: {r['composed_bound'] / r['allocator_max']:.3f}"
                                                  for r in mop),
                                met=all(r["composed_bound"] <= 1.10 * r["allocator_max"] for r in mop)))
        else:
            targets += [dict(target=f"{name}: live storages per rank below FSDP2-only's at the longest length",
                             figures=f"{fmt_bytes(mop[-1]['peak_max'])} vs {fmt_bytes(base[-1]['peak_max'])}",
                             met=mop[-1]["peak_max"] < base[-1]["peak_max"])]
    if effect:
        targets.append(dict(target="operators effect: every allocator peak <= its composed bound",
                            figures=", ".join(f"{r['layout']} / {r['routing']}: bound / peak "
                                              f"{r['composed_bound'] / r['allocator_max']:.3f}" for r in effect),
                            met=all(r["allocator_max"] <= r["composed_bound"] for r in effect)))
    data = dict(model="torchtitan deepseek_v3 debugmodel (6 layers, 8 experts top-3, MLA 16 heads, vocab "
                      f"{VOCAB}), fp32, FullAC, AdamW; MoP W={WORLD}, E_p={EP}", world=WORLD, ep=EP,
                repeats=cfg["repeats"], quick=args.quick, meta=run_metadata(), layouts=layouts, targets=targets,
                operators_effect=effect,
                baseline_from=baseline_from)
    return publish("mop", data, render, start)


if __name__ == "__main__":
    main()
