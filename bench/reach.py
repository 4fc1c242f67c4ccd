"""Reach at equal per-rank budget on 4 gloo ranks: FSDP2-best (stock torchtitan) against boundpass's MoP layout.

For a torchtitan MoE debug model (deepseek_v3 or qwen3, V = --vocab, fp32) and each per-rank budget B: the longest
sequence L that each side trains for 2 steps with no rank's step peaking above B at torch's allocator.

  FSDP2-best  stock torchtitan's trainer (boundpass off): FSDP2 over the 4 ranks, every rank a whole sequence (local
              batch 1: 4 sequences per step), the best (longest L) over its memory settings that run on CPU: expert
              parallel degree EP in --fsdp-ep, FullAC (SelectiveAC keeps more activations: measured once, beside),
              its ChunkedLossWrapper with chunks of at most --chunk-tokens tokens. Context parallelism: tried once
              (--try-cp; the report says what happened).
  boundpass   the MoP layout through the same trainer (--config <model>_debug_mop, recipes/mop.py): one sequence
              split over the 4 ranks, sequence-to-head attention, EP = 2 with PipelinedLLEP, the Ring-DTP head,
              FullAC, AdamW's state on the host when the budget needs it; the budget is checked before launch.

Attention is the same on both sides: causal SDPA on torch's fused CPU kernel, MLA's v zero-padded to the qk head
dim (what the MoP layout does; without it the stock side would run the math path with [L, L] scores).

Measured: each run builds the trainer on 4 ranks, runs step 1, measures step 2 at torch's allocator on every rank
and times --timed-steps more steps (the slowest rank's). The peak is the counting allocator's
(boundpass/measure/counting_allocator.py: every CPU block live, whatever thread frees it; boundpass's host buffers,
the offloaded optimizer state, left out by design); the profiler's measure (bench/e2e.py measured_step: the state
live at the step's start + every allocation of the step) is kept beside it: it misses the frees gloo's threads do,
so it is an upper bound of the peak, by up to tens of MiB at 4 ranks.
A point fits B when every rank's peak is <= B (and, for boundpass, B was accepted).

FSDP2-best: its peak does not depend on B, so one ladder per setting (L doubling from --start) serves every budget,
then --bisect midpoints per budget between the last fit and the first miss.
boundpass: the certificate's longest L per budget (the trainer's own check, run here on the meta model, bisected in
steps of --granule tokens) is "certified"; measured points check it both ways (measured <= certified, certified /
measured) at every length up to --bp-max-measured, and at the certified longest L when that is not longer.
plan: `boundpass.plan` on the same model and budgets (its --solve), beside both: boundpass's layout with its
operators, and the FSDP2 baseline as plan models it (`--layout dp --operators none --loss-chunks 8`, worst-case and
balanced routing), its predicted peak beside every measured FSDP2 point. --check-plan-baseline also measures FSDP2
at plan's predicted FSDP2-best length and at 1.1x it (they join the FSDP2 runs: a finer measurement of FSDP2-best).

Writes docs/results/reach.json and reach.md.

    python bench/reach.py --model deepseek_v3 --budgets 384MiB,512MiB,1GiB
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import fmt_bytes, fmt_seconds, markdown_table, publish, run_metadata, targets_section
from bench.e2e import fits_budget, measured_step, refused, trainer_rank_setup
from boundpass.core.units import parse_bytes
from boundpass.testing.distributed import run_on_ranks

WORLD = 4
MOP_EP = 2
TARGET_REACH = 8.0
CONFIGS = {"deepseek_v3": ("deepseek_v3_debug", "deepseek_v3_debug_mop", "deepseek_v3", "debugmodel"),
           "qwen3": ("qwen3_moe_debug", "qwen3_moe_debug_mop", "qwen3", "debugmodel_moe")}


# ------------------------------------------------------------------------------------------ one run
def pad_v_attention() -> None:
    """torchtitan's SDPA module with MLA's narrower v zero-padded to the qk head dim, as the MoP layout runs it
    (runtime/seq_to_head.py _attend): zero v columns give zero output columns, sliced off; the scale stays
    1/sqrt(D_qk). Same function; torch's fused CPU kernel instead of the math path."""
    import torch.nn.functional as F
    from torchtitan.models.common.attention import ScaledDotProductAttention
    forward = ScaledDotProductAttention.forward
    if getattr(forward, "_reach_padded", False):
        return

    # the argument names are torchtitan's own: its local_map sharding spec is keyed by them
    def padded(self, q_BLNH, k_BLNH, v_BLNH, *, scale=None, **kwargs):
        d_qk, d_v = q_BLNH.shape[-1], v_BLNH.shape[-1]
        if d_v >= d_qk:
            return forward(self, q_BLNH, k_BLNH, v_BLNH, scale=scale, **kwargs)
        out = forward(self, q_BLNH, k_BLNH, F.pad(v_BLNH, (0, d_qk - d_v)),
                      scale=d_qk ** -0.5 if scale is None else scale, **kwargs)
        return out[..., :d_v]
    padded._reach_padded = True
    ScaledDotProductAttention.forward = padded


# --bp-attention-tiles: the MoP side's attention in tiles, the whole sequence's tensors on the host
# (runtime/seq_to_head_tiles.py; the trainer's --boundpass.attention.enable under the layout)
MOP_ATTENTION_TILES = [False]


def trainer_args(side: str, model: str, seq: int, *, ep: int, ac: str, chunk_tokens: int, budget: str | None = None,
          host_budget: str, steps: int, cp: int = 1, batch: int = 1) -> list[str]:
    fsdp_config, mop_config, _, _ = CONFIGS[model]
    # batch: sequences per rank (FSDP2) or per step, split over the ranks (the MoP layout)
    args = ["--module", "boundpass.recipes", "--training.seq_len", str(seq), "--training.local_batch_size", str(batch),
            "--training.steps", str(steps), "--lr_scheduler.decay_ratio", "0",
            # fp32 on both sides: the composed budget counts activations at 4 bytes (torchtitan's bf16 default would
            # hold 2, and the certificate would be loose by that, not wrong)
            "--training.mixed_precision_param", "float32"]
    if side == "fsdp2":
        args += ["--config", fsdp_config, "--parallelism.expert_parallel_degree", str(ep),
                 "--loss.num_chunks", str(_loss_chunks(seq, chunk_tokens))]
        if cp > 1:
            args += ["--parallelism.context_parallel_degree", str(cp)]
    else:
        args += ["--config", mop_config, "--boundpass.budget", budget, "--boundpass.host_budget", host_budget,
                 "--boundpass.no-report"]
        if MOP_ATTENTION_TILES[0]:  # past the debug flavor's 16,384 RoPE positions (the tables follow seq_len anyway)
            args += ["--boundpass.attention.enable", "--boundpass.rope_to_seq_len"]
    return args + [f"activation-checkpoint:{ac}"]  # tyro: a subcommand's arguments follow it, so it goes last


def configure(args: list[str], vocab: int):
    """The trainer config of `args` with the bench's attention (causal SDPA everywhere, v padded) and vocabulary."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from boundpass.recipes.config_registry import set_vocab
    from boundpass.recipes.train import config_manager_class
    config = config_manager_class()().parse_args(args)
    for layer in config.model_spec.model.layers:  # stock debug configs use flex attention with document masks
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_vocab(config, vocab)
    config.validator.enable = False
    return config


# above this many tokens per sequence a run's step 2 is measured by the counting allocator alone (the peak every run
# reports), without the profiler's events beside it: their Python event tree grows ~2 KB per op and allocation, and
# the attention in tiles issues millions of tile ops per step at these lengths (a 4-rank run at 15,460 tokens was
# killed for memory with it)
PROFILER_MAX_SEQ = 8192


def _run_job(rank, world, assets, args, vocab, timed_steps):
    """One trainer on this rank: step 1, step 2 measured at torch's allocator, `timed_steps` steps timed."""
    trainer_rank_setup(assets)
    import torch.distributed as dist

    from boundpass.core.errors import InfeasibleBudgetError
    pad_v_attention()
    dump = tempfile.TemporaryDirectory(prefix="bp_reach_")
    out = dict(rank=rank, accepted=None, peak=None, reason="", certified=None)
    config = configure([*args[:-1], "--dump_folder", dump.name, args[-1]], vocab)
    try:
        trainer = config.build()
    except Exception as exc:  # noqa: BLE001 (a refusal is a result; anything else is raised again by refused)
        return refused(out, exc, InfeasibleBudgetError)
    try:
        data = trainer.batch_generator(trainer.dataloader)
        trainer.step = 1
        start = time.perf_counter()
        from torch.profiler import ProfilerActivity, profile
        profiler = config.training.seq_len <= PROFILER_MAX_SEQ
        if profiler:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True):  # see bench/e2e.py reach_job
                trainer.train_step(data)
        else:
            trainer.train_step(data)
        out["step1_seconds"] = time.perf_counter() - start
        if config.boundpass.enable and config.boundpass.budget is not None:
            out["accepted"] = True
            out["certified"] = trainer.certified_peak()
            out["certified_host"] = trainer.certified_host()
            table = max(trainer._tables(), key=lambda t: t.total)
            bind = table.binding()
            out["binding"] = f"{bind.name} ({fmt_bytes(bind.value)})"
            out["optimizer_offloaded"] = bool(getattr(trainer, "mop_offload", False))
        trainer.step = 2
        peak, at_start, host, holders, _, counted = measured_step(trainer, data, profiler=profiler)
        out.update(peak=peak, state_bytes=at_start, host_bytes=host, holders=holders[:4], counted=counted)
        times = []
        for step in range(3, 3 + timed_steps):
            trainer.step = step
            dist.barrier()
            t0 = time.perf_counter()
            trainer.train_step(data)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        out["step_seconds"] = times
        return out
    finally:
        trainer.close()
        dump.cleanup()


def run_point(side: str, model: str, seq: int, *, assets: str, vocab: int, timed_steps: int, log=print,
              **kwargs) -> dict:
    """One 4-rank run; the per-rank results folded: the largest peak, the slowest step."""
    args = trainer_args(side, model, seq, steps=2 + timed_steps, **kwargs)
    start = time.perf_counter()
    try:
        ranks = run_on_ranks(_run_job, WORLD, assets, args, vocab, timed_steps, timeout_s=3600)
    except Exception as exc:  # noqa: BLE001 (a setting torchtitan cannot run here is a result: reported)
        last = [ln for ln in str(exc).splitlines() if ln.strip() and not ln.startswith(" ")][-1]
        log(f"  {side} L={seq} {kwargs}: failed: {last[:300]}")
        return dict(side=side, seq=seq, accepted=None, peak=None, failed=last[:1000], traceback=str(exc)[-6000:],
                    wall_s=time.perf_counter() - start, **{k: v for k, v in kwargs.items() if k != "host_budget"})
    # the peak is the counting allocator's (every free seen, whatever thread frees it); the profiler's, an upper
    # bound where gloo's threads free a collective's buffers (boundpass/measure/counting_allocator.py), kept beside it
    profiled = [r["peak"] for r in ranks]
    counted = [r.get("counted") for r in ranks]
    peaks = counted if None not in counted else profiled
    out = dict(side=side, seq=seq, wall_s=time.perf_counter() - start,
               accepted=ranks[0]["accepted"], reason=ranks[0]["reason"],
               peak=max(peaks) if None not in peaks else None, peaks=peaks,
               measure="counting allocator" if peaks is counted else "profiler",
               profiler_peak=max(profiled) if None not in profiled and seq <= PROFILER_MAX_SEQ else None,
               certified=max((r["certified"] or 0 for r in ranks), default=None) or None,
               binding=ranks[0].get("binding"), optimizer_offloaded=ranks[0].get("optimizer_offloaded"),
               host_bytes=max(r.get("host_bytes") or 0 for r in ranks),
               step_s=(statistics.median([max(t) for t in zip(*(r["step_seconds"] for r in ranks))])
                       if ranks[0].get("step_seconds") else None),
               holders=ranks[max(range(WORLD), key=lambda i: peaks[i] or 0)].get("holders"),
               **{k: v for k, v in kwargs.items() if k != "host_budget"})
    tokens = seq * kwargs.get("batch", 1) * (WORLD if side == "fsdp2" else 1)
    out["tokens_per_step"] = tokens
    out["tokens_per_s"] = tokens / out["step_s"] if out["step_s"] else None
    if os.environ.get("REACH_RUNS_FILE"):  # every run as it ends (a long sweep survives a crash)
        with open(os.environ["REACH_RUNS_FILE"], "a") as f:
            f.write(json.dumps(out, default=str) + "\n")
    log(f"  {side} L={seq} {({k: v for k, v in kwargs.items() if k != 'host_budget'})}: "
        f"peak {fmt_bytes(out['peak']) if out['peak'] else '-'}"
        + (f", certified {fmt_bytes(out['certified'])}" if out["certified"] else "")
        + (f", refused: {out['reason'][:160]}" if out["accepted"] is False else "")
        + (f", step {fmt_seconds(out['step_s'])}" if out["step_s"] else "") + f" ({out['wall_s']:.0f} s)")
    return out


# ------------------------------------------------------------------------------------ the certificate
def certified_total(model: str, seq: int, budget: str, host_budget: str, vocab: int, batch: int = 1):
    """(accepted, certified total bytes or None, binding line): the MoP trainer's own pre-launch check
    (recipes/trainer.check_mop_budget) on the meta model, here in one process for W = 4 ranks, E_p = 2, `batch`
    sequences per step."""
    import types

    import torch
    from torchtitan.components.loss import ChunkedLossWrapper

    from boundpass.core.errors import InfeasibleBudgetError
    from boundpass.recipes.mop import MoPOptions
    from boundpass.recipes.trainer import rope_to_seq_len, choose_mop_attention, mop_attention_tiles
    config = configure(trainer_args("mop", model, seq, ep=MOP_EP, ac="full", chunk_tokens=seq, budget=budget,
                              host_budget=host_budget, steps=2, batch=batch), vocab)
    bp = config.boundpass
    options = MoPOptions(pipelined_llep=bp.mop_pipelined_llep, dispatch_cap=bp.dispatch.cap,
                         dispatch_borrowed_slots=bp.dispatch.borrowed_slots, ring_dtp=bp.mop_ring_dtp,
                         vocab_block=bp.vocab.block,
                         attention_tiles=mop_attention_tiles(config, WORLD) if bp.attention.enable else 0)
    if options.ring_dtp and isinstance(config.loss, ChunkedLossWrapper.Config):
        config.loss = config.loss.loss_fn  # as the trainer does under the layout (its Ring-DTP head)
    # as torchtitan's trainer does before building: the job's settings into the model config (the RoPE tables sized to
    # --training.seq_len, not the flavor's max_seq_len: 18 MiB of buffers fewer at 4,096 tokens here)
    if bp.rope_to_seq_len:
        rope_to_seq_len(config)
    config.model_spec.model.update_from_config(config=config)
    with torch.device("meta"):
        meta = config.model_spec.model.build()
    dims = types.SimpleNamespace(world_size=WORLD, ep=config.parallelism.expert_parallel_degree)
    try:
        # as the trainer chooses: the whole exchange where the budget holds it, else the attention in tiles
        _, (table, _, _, _) = choose_mop_attention(meta, config, dims, options)
    except InfeasibleBudgetError as err:
        return False, None, f"{err.term}: {fmt_bytes(err.value_bytes)}"
    bind = table.binding()
    return True, table.total, f"{bind.name} ({fmt_bytes(bind.value)})"


def certified_longest(model: str, budget: str, host_budget: str, vocab: int, granule: int, limit: int,
                      log=print) -> dict:
    """The longest L (a multiple of W) the certificate accepts: doubling in steps of `granule` tokens, then
    bisection to W tokens."""
    checked = {}

    def ok(seq: int) -> bool:
        if seq not in checked:
            checked[seq] = certified_total(model, seq, budget, host_budget, vocab)
        return checked[seq][0]

    if not ok(granule):
        return dict(seq=0, checks=len(checked), first_refused=granule, refused_binding=checked[granule][2])
    lo, hi = granule, 2 * granule
    while ok(hi):
        if hi >= limit:
            return dict(seq=hi, total=checked[hi][1], binding=checked[hi][2], checks=len(checked),
                        first_refused=None, refused_binding=None)
        lo, hi = hi, 2 * hi
    while hi - lo > WORLD:
        mid = (lo + hi) // 2 // WORLD * WORLD
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    out = dict(seq=lo, total=checked[lo][1], binding=checked[lo][2], checks=len(checked), first_refused=hi,
               refused_binding=checked[hi][2])
    log(f"  certified longest L at {budget}: {lo} ({len(checked)} checks; {hi} refused: {checked[hi][2]})")
    return out


def rebind(data: dict, host_budget: str) -> None:
    """Name every boundpass point's binding term again with the current code (``ComposedBudget.binding``), each
    certificate's bytes checked to be the ones the run recorded: only the name may change."""
    for budget, side in data["boundpass"].items():
        cert = side["certified"]
        for key, seq in (("binding", cert.get("seq")), ("refused_binding", cert.get("first_refused"))):
            if seq:
                ok, total, line = certified_total(data["model"], seq, budget, host_budget, data["vocab"])
                if key == "binding" and total != cert["total"]:
                    raise RuntimeError(f"rebind: the certificate at {budget}, L = {seq} moved ({total} vs "
                                       f"{cert['total']}): run the sweep again")
                cert[key] = line
        for run in side["runs"]:
            if run.get("certified"):
                ok, total, line = certified_total(data["model"], run["seq"], budget, host_budget, data["vocab"],
                                                  batch=run.get("batch", 1))
                if total != run["certified"]:
                    raise RuntimeError(f"rebind: the certificate at {budget}, L = {run['seq']} moved ({total} vs "
                                       f"{run['certified']}): run the sweep again")
                run["binding"] = line


def _source_at_vocab(vocab: int):
    """The registry's model source with the bench's vocabulary (set_vocab, as the runs do)."""
    from boundpass.core.model_source import default_source
    source = default_source()

    class _AtVocab:
        name = getattr(source, "name", "torchtitan")

        def __getattr__(self, attr):
            return getattr(source, attr)

        def config(self, m, f, *, seq_len=None):
            cfg = source.config(m, f, seq_len=seq_len)
            cfg.vocab_size, cfg.tok_embeddings.num_embeddings, cfg.lm_head.out_features = vocab, vocab, vocab
            return cfg
    return _AtVocab()


def plan_longest(model: str, budget: str, host_budget: str, vocab: int, tiles: int = 0) -> dict:
    """`boundpass.plan --solve` on the same model (the registry's flavor at this vocabulary), W = 4, E_p = 2, one
    sequence per step, the operators the MoP run uses (``tiles``: its attention in tiles of that C_s)."""
    from boundpass.planning.full_scale import plan
    _, _, family, flavor = CONFIGS[model]
    start = time.perf_counter()
    result = plan(family, flavor, ranks=WORLD, ep=MOP_EP, context=1024, global_batch=1, budget=budget,
                  host_budget=host_budget, dtype="fp32", operators=("ring_dtp", "pipelined_llep", "offload_adamw"),
                  solve=True, source=_source_at_vocab(vocab), attention_tiles=tiles)
    return dict(seq=result.solve["value"], seconds=time.perf_counter() - start, attention_tiles=tiles)


def mop_tiles_at(model: str, seq: int, vocab: int) -> int:
    """The C_s the MoP trainer's attention in tiles runs at this length (0: tiles off)."""
    if not MOP_ATTENTION_TILES[0] or not seq:
        return 0
    from boundpass.recipes.trainer import mop_attention_tiles
    config = configure(trainer_args("mop", model, seq, ep=MOP_EP, ac="full", chunk_tokens=seq, budget="1GiB",
                              host_budget="16GiB", steps=2), vocab)
    return mop_attention_tiles(config, WORLD)


def _baseline_plan(model: str, ep: int, budget: str, vocab: int, *, routing: str, context: int = 1024,
                   loss_chunks: int = 8, solve: bool = True):
    """`plan` of stock torchtitan as the FSDP2 runs train: no operator (ZeRO-3 + EP, standard EP, AdamW on the
    device), FSDP2's data parallelism (``layout="dp"``: each of the W = 4 ranks a whole sequence, attention local),
    torchtitan's chunked loss in ``loss_chunks`` chunks."""
    from boundpass.planning.full_scale import plan
    _, _, family, flavor = CONFIGS[model]
    return plan(family, flavor, ranks=WORLD, ep=ep, context=context, global_batch=WORLD, budget=budget,
                host_budget="16GiB", dtype="fp32", operators=(), solve=solve, source=_source_at_vocab(vocab),
                routing=routing, layout="dp", loss_chunks=loss_chunks, do_trace=False)


def _loss_chunks(seq: int, chunk_tokens: int) -> int:
    return max(8, seq // chunk_tokens)  # what _args gives the FSDP2 runs (--loss.num_chunks)


def _chunkable(seq: int, step: int, chunk_tokens: int) -> int:
    """The nearest length from ``seq`` in direction ``step`` that torchtitan's ChunkedLossWrapper accepts (the
    sequence divisible by its chunk count)."""
    while seq % _loss_chunks(seq, chunk_tokens):
        seq += step
    return seq


def plan_baseline_longest(model: str, budgets: list[str], vocab: int, routing: str = "worst") -> dict:
    """plan's FSDP2 baseline against the measured one: {budget: {E_p: longest L}} of `plan --solve --layout dp
    --operators none --loss-chunks 8` (W = 4, 4 sequences per step: N = L per rank) for each E_p of the sweep.
    8 chunks is the fewest the runs use (``_loss_chunks``): the head's term is no smaller than at theirs.
    routing "worst": standard EP's hot rank receives E_p·N·k rows (the bound: what plan guarantees); "balanced":
    N·k (an estimate: the measured runs' router draws near-balanced routes)."""
    return {budget: {ep: _baseline_plan(model, ep, budget, vocab, routing=routing).solve["value"]
                     for ep in (1, 2, 4)} for budget in budgets}


def plan_baseline_peaks(data: dict, chunk_tokens: int = 256) -> list[dict]:
    """plan's FSDP2 baseline (worst and balanced routing) at every measured FSDP2 point: predicted per-rank peak
    beside the measured one."""
    out = []
    for v in data["fsdp"].values():
        ep = v["setting"]["ep"]
        for r in sorted(v["runs"], key=lambda r: r["seq"]):
            if not r.get("peak"):
                continue
            row = dict(ep=ep, seq=r["seq"], measured=r["peak"])
            for routing in ("worst", "balanced"):
                row[routing] = _baseline_plan(data["model"], ep, "1TiB", data["vocab"], routing=routing,
                                              context=r["seq"], loss_chunks=_loss_chunks(r["seq"], chunk_tokens),
                                              solve=False).table.total
            out.append(row)
    return out


def check_plan_baseline(model: str, data: dict, budgets: list[str], *, common: dict, log) -> None:
    """FSDP2 measured at plan's predicted FSDP2-best longest L (worst routing) for each budget, and at 1.1x it, in
    the E_p plan picks (appended to that setting's runs): plan never above means the first fits; within 10% means
    the second does not (or a measured longer fit says how far below plan is)."""
    for budget in budgets:
        per_ep = data["plan_baseline"][budget]
        ep = max(per_ep, key=lambda e: per_ep[e])
        name = f"FSDP2, EP={ep}, FullAC"
        if name not in data["fsdp"]:
            continue
        runs = data["fsdp"][name]["runs"]
        # lengths torchtitan's chunked loss takes (divisible by its chunk count): at or above plan's length (it
        # fitting says plan's does), at or below 1.1x it (it missing says 1.1x does)
        for seq in (_chunkable(per_ep[ep], +1, common["chunk_tokens"]),
                    _chunkable(per_ep[ep] * 11 // 10, -1, common["chunk_tokens"])):
            if seq in {r["seq"] for r in runs}:
                continue
            log(f"plan's baseline check at {budget}: {name} L={seq}")
            runs.append(run_point("fsdp2", model, seq, ep=ep, ac="full", **common, log=log))


# --------------------------------------------------------------------------------------------- sweep
def fsdp2_ladder(model: str, setting: dict, *, start: int, max_seq: int, limit: int, common: dict, log) -> list:
    """Stock runs at L = start, 2 start, ... until a step peaks above `limit` (the largest budget) or fails."""
    runs, seq = [], start
    while seq <= max_seq:
        run = run_point("fsdp2", model, seq, **setting, **common, log=log)
        runs.append(run)
        if run["peak"] is None or run["peak"] > limit:
            break
        seq *= 2
    return runs


def bisect_between(side, model, runs, budget_bytes, *, steps, granule, setting, common, log) -> None:
    """`steps` midpoints between the last fitting and the first missing length of `runs` (appended)."""
    for _ in range(steps):
        fit = max((r["seq"] for r in runs if fits_budget(r, budget_bytes)), default=None)
        miss = min((r["seq"] for r in runs if not fits_budget(r, budget_bytes) and (fit is None or r["seq"] > fit)),
                   default=None)
        if fit is None or miss is None or miss - fit <= granule:
            return
        mid = (fit + miss) // 2 // granule * granule
        if mid in {r["seq"] for r in runs}:
            return
        runs.append(run_point(side, model, mid, **setting, **common, log=log))


def longest_fit(runs: list, budget_bytes: int) -> int:
    """The longest measured length that fits, provided every shorter measured length fits too."""
    best = 0
    for run in sorted(runs, key=lambda r: r["seq"]):
        if not fits_budget(run, budget_bytes):
            break
        best = run["seq"]
    return best


def first_miss(runs: list, budget_bytes: int) -> int | None:
    """The shortest measured length that does not fit (after ``longest_fit``'s), None when every one fits."""
    return next((r["seq"] for r in sorted(runs, key=lambda r: r["seq"]) if not fits_budget(r, budget_bytes)), None)


def run(model: str, budgets: list[str], *, start: int, max_seq: int, fsdp_ep: list[int], chunk_tokens: int,
        host_budget: str, vocab: int, timed_steps: int, bisect: int, granule: int, bp_max_measured: int,
        try_cp: bool, selective: bool, assets: str, reuse: list[dict] = (), time_only_there: bool = False,
        check_plan: bool = False, sequences_at_best: int = 1, log=print) -> dict:
    """``reuse``: runs of an earlier sweep (REACH_RUNS_FILE lines) taken instead of running them again: the FSDP2
    ladders of the settings it has, its SelectiveAC / CP runs, and its boundpass runs of a budget."""
    common = dict(assets=assets, vocab=vocab, timed_steps=timed_steps, chunk_tokens=chunk_tokens,
                  host_budget=host_budget)
    limit = max(parse_bytes(b) for b in budgets)
    data = dict(model=model, vocab=vocab, budgets=budgets, world=WORLD, mop_ep=MOP_EP, fsdp={}, cp=None,
                selective=None, boundpass={}, plan={})
    for ep in fsdp_ep:
        name = f"FSDP2, EP={ep}, FullAC"
        setting = dict(ep=ep, ac="full")
        runs = [r for r in reuse if r["side"] == "fsdp2" and r.get("ep") == ep and r.get("ac") == "full"
                and not r.get("cp")]
        if not runs:
            log(f"{name}: ladder from {start}")
            runs = fsdp2_ladder(model, setting, start=start, max_seq=max_seq, limit=limit, common=common, log=log)
        for budget in budgets:
            bisect_between("fsdp2", model, runs, parse_bytes(budget), steps=bisect, granule=granule,
                           setting=setting, common=common, log=log)
        data["fsdp"][name] = dict(setting=setting, runs=runs)
    if check_plan:
        data["plan_baseline"] = plan_baseline_longest(model, budgets, vocab)
        check_plan_baseline(model, data, budgets, common=common, log=log)
    best_ep = _best_setting(data, budgets)
    data["selective"] = next((r for r in reuse if r["side"] == "fsdp2" and r.get("ac") == "selective"), None)
    data["cp"] = next((r for r in reuse if r["side"] == "fsdp2" and r.get("cp")), None)
    if selective and data["selective"] is None:
        log("FSDP2 SelectiveAC, at the best EP's first length")
        data["selective"] = run_point("fsdp2", model, start, ep=best_ep, ac="selective", **common, log=log)
    if try_cp and data["cp"] is None:
        log("FSDP2 + context parallelism (CP = 4), at the first length")
        data["cp"] = run_point("fsdp2", model, start, ep=1, ac="full", cp=WORLD, **common, log=log)
    for budget in budgets:
        log(f"boundpass at {budget}")
        cert = certified_longest(model, budget, host_budget, vocab, granule, max_seq * 64, log=log)
        try:
            predicted = plan_longest(model, budget, host_budget, vocab, tiles=mop_tiles_at(model, cert["seq"], vocab))
        except Exception as exc:  # noqa: BLE001 (reported beside the measurement)
            predicted = dict(seq=None, error=str(exc).splitlines()[0][:300])
        data["plan"][budget] = predicted
        log(f"  plan --solve: {predicted}")
        lengths, seq = [], start
        while seq <= min(cert["seq"], bp_max_measured):
            lengths.append(seq)
            seq *= 2
        if cert["seq"] and cert["seq"] <= bp_max_measured and cert["seq"] not in lengths:
            lengths.append(cert["seq"])
        fsdp_best = max(longest_fit(v["runs"], parse_bytes(budget)) for v in data["fsdp"].values())
        if fsdp_best and fsdp_best not in lengths and fsdp_best <= cert["seq"]:
            lengths.append(fsdp_best)  # step time at FSDP2-best's longest length
        runs = [r for r in reuse if r["side"] == "mop" and r.get("budget") == budget]
        # reused runs stand for their lengths; a length they lack (FSDP2-best's moved by new FSDP2 runs) runs here.
        # The step-time table reads boundpass's step at FSDP2-best's longest L only (time_only_there: the other
        # lengths run their measured step and no timed ones)
        have = {r["seq"] for r in runs}
        runs += [run_point("mop", model, L, ep=MOP_EP, ac="full", budget=budget,
                           **{**common, "timed_steps": 0 if time_only_there and L != fsdp_best else timed_steps},
                           log=log)
                 for L in sorted(lengths) if L not in have and (not have or L == fsdp_best)]
        if sequences_at_best > 1 and fsdp_best and fsdp_best <= cert["seq"] and not any(
                r["seq"] == fsdp_best and r.get("batch", 1) == sequences_at_best for r in runs):
            # the step time FSDP2-best is compared at: as many sequences per step as FSDP2's W ranks train
            runs.append(run_point("mop", model, fsdp_best, ep=MOP_EP, ac="full", budget=budget,
                                  batch=sequences_at_best, **common, log=log))
        data["boundpass"][budget] = dict(certified=cert, runs=runs)
    return data


def _best_setting(data: dict, budgets: list[str]) -> int:
    """The EP of the FSDP2 setting that reaches furthest at the largest budget."""
    budget = max(parse_bytes(b) for b in budgets)
    name = max(data["fsdp"], key=lambda n: longest_fit(data["fsdp"][n]["runs"], budget))
    return data["fsdp"][name]["setting"]["ep"]


# -------------------------------------------------------------------------------------------- report
def summary_rows(data: dict) -> list[dict]:
    rows = []
    for budget in data["budgets"]:
        b = parse_bytes(budget)
        per = {n: longest_fit(v["runs"], b) for n, v in data["fsdp"].items()}
        best_name = max(per, key=per.get)
        best = per[best_name]
        bp = data["boundpass"][budget]
        cert = bp["certified"]["seq"]
        measured = longest_fit(bp["runs"], b)
        at_best = max((r for r in bp["runs"] if r["seq"] == best and r.get("step_s")),
                      key=lambda r: r.get("batch", 1), default=None)
        fsdp_at_best = next((r for r in data["fsdp"][best_name]["runs"] if r["seq"] == best), None)
        # the runs stopped (--bp-max-measured) before one missed: the measured longest is a lower bound
        open_ended = measured > 0 and measured == max(r["seq"] for r in bp["runs"])
        rows.append(dict(budget=budget, fsdp_best=best, open_ended=open_ended, fsdp_best_setting=best_name, fsdp_each=per,
                         bp_certified=cert, bp_measured=measured, plan=data["plan"][budget].get("seq"),
                         reach_certified=cert / best if best else None,
                         reach_measured=measured / best if best else None,
                         step_fsdp=fsdp_at_best["step_s"] if fsdp_at_best else None,
                         step_bp=at_best["step_s"] if at_best else None,
                         tps_fsdp=fsdp_at_best["tokens_per_s"] if fsdp_at_best else None,
                         tps_bp=at_best["tokens_per_s"] if at_best else None,
                         bp_sequences=at_best.get("batch", 1) if at_best else None))
    return rows


def _first_miss(runs: list, budget_bytes: int):
    fit = longest_fit(runs, budget_bytes)
    return min((r for r in runs if r["seq"] > fit), key=lambda r: r["seq"], default=None)


def render(data: dict) -> str:
    meta = data["meta"]
    lines = [f"# Reach at equal per-rank budget: FSDP2-best vs boundpass's MoP layout ({data['world']} gloo ranks, "
             "CPU)" + (" — quick run" if data.get("quick") else ""), "",
             f"Model: torchtitan {data['model']} debug MoE, V = {data['vocab']:,}, fp32. Run: {meta['date_utc']}, "
             f"torch {meta['torch']}, {meta['nproc']} cores ({meta['processor']}); wall "
             f"{data['wall_seconds'] / 60:.0f} min. Command: `{data['command']}`.", "",
             "Per-rank peak = the largest over the 4 ranks of one whole training step (step 2: forward, backward, "
             "optimizer) at torch's allocator, counted by boundpass's counting CPU allocator (every block live, "
             "whatever thread frees it: the state live at the step's start, the batch, every activation); "
             "boundpass's host buffers (the offloaded optimizer state) left out by design. A length fits B when every rank's peak is <= B "
             "and, for boundpass, the trainer accepted B before launch. FSDP2 ranks each train a whole sequence "
             "(4 sequences per step); the MoP layout splits one sequence over the 4 ranks. Both sides run causal "
             "SDPA on torch's fused CPU kernel (MLA's v zero-padded to the qk head dim on both).", "",
             "## Longest sequence per budget", ""]
    rows = summary_rows(data)
    table = []
    for r in rows:
        table.append([fmt_bytes(parse_bytes(r["budget"])), f"{r['fsdp_best']:,}" if r["fsdp_best"] else "none",
                      r["fsdp_best_setting"] if r["fsdp_best"] else "-",
                      (">= " if r["open_ended"] else "") + f"{r['bp_measured']:,}" if r["bp_measured"] else "none",
                      f"{r['bp_certified']:,} (certified)",
                      f"{r['plan']:,}" if r["plan"] else "-",
                      (">= " if r["open_ended"] else "") + f"{r['reach_measured']:.2f}x" if r["reach_measured"] else "-",
                      f"{r['reach_certified']:.2f}x" if r["reach_certified"] else "-"])
    lines += [markdown_table(["budget/rank", "FSDP2-best longest L (measured)", "its setting",
                             "boundpass longest L (measured)", "boundpass longest L accepted by the certificate",
                             "plan --solve", "reach (measured)", "reach (certified / FSDP2-best measured)"], table)]
    lines += ["", "Each FSDP2 setting's longest measured L: " + "; ".join(
        f"{fmt_bytes(parse_bytes(r['budget']))}: " + ", ".join(f"{n} {L:,}" for n, L in r["fsdp_each"].items())
        for r in rows), ""]
    if data.get("plan_baseline"):
        lines += ["## plan's baseline against FSDP2-best (predicted vs measured)", "",
                  "`plan --solve --layout dp --operators none --loss-chunks 8`: stock torchtitan as the FSDP2 runs "
                  "train (ZeRO-3 + EP with torchtitan's all-to-all, AdamW on the device, FullAC), FSDP2's data "
                  "parallelism (each of the W = 4 ranks a whole sequence, attention local: N = L per rank), "
                  "torchtitan's chunked loss (8 chunks, the fewest the runs use), per E_p; beside FSDP2's measured "
                  "longest L of the same E_p. Worst-case routing (a hot rank receives E_p·N·k rows) is the bound "
                  "plan stands by; balanced routing (N·k) is the estimate beside it.", ""]
        balanced = data.get("plan_baseline_balanced") or {}
        table = []
        for r in rows:
            base = data["plan_baseline"][r["budget"]]
            for name, measured in r["fsdp_each"].items():
                ep = data["fsdp"][name]["setting"]["ep"]
                predicted = base.get(str(ep), base.get(ep))
                bal = (balanced.get(r["budget"]) or {})
                bal = bal.get(str(ep), bal.get(ep))
                miss = first_miss(data["fsdp"][name]["runs"], parse_bytes(r["budget"]))
                table.append([fmt_bytes(parse_bytes(r["budget"])), name, f"{measured:,}",
                              f"{miss:,}" if miss else "-", f"{predicted:,}",
                              f"{predicted / measured:.2f}" if measured else "-",
                              "yes" if miss is None or predicted < miss else "NO",
                              f"{bal:,}" if bal else "-", f"{bal / measured:.2f}" if bal and measured else "-"])
        lines += [markdown_table(["budget/rank", "FSDP2 setting", "measured longest L that fits",
                                  "first measured L that does not", "plan (worst routing)",
                                  "predicted / measured longest", "below the first miss", "plan (balanced routing)",
                                  "balanced / measured"], table), ""]
        best = []
        for r in rows:
            worst, bal = _plan_fsdp_best(data, r["budget"])
            best.append([fmt_bytes(parse_bytes(r["budget"])), f"{r['fsdp_best']:,}", f"{worst:,}",
                         f"{worst / r['fsdp_best']:.2f}" if r["fsdp_best"] else "-",
                         f"{bal:,}" if bal else "-", f"{bal / r['fsdp_best']:.2f}" if bal and r["fsdp_best"] else "-"])
        lines += ["FSDP2-best (the best E_p) as plan predicts it, against the measured:", "",
                  markdown_table(["budget/rank", "measured", "plan, worst routing", "ratio", "plan, balanced routing",
                                  "ratio"], best), ""]
        peaks = data.get("plan_baseline_peaks") or []
        if peaks:
            worst = [p["worst"] / p["measured"] for p in peaks]
            bal = [p["balanced"] / p["measured"] for p in peaks]
            lines += [f"Per-rank peak, plan's baseline at every measured FSDP2 point ({len(peaks)} points, plan at "
                      "the chunk count each run used): worst routing "
                      f"{min(worst):.3f}-{max(worst):.3f}x measured, balanced {min(bal):.3f}-{max(bal):.3f}x.", "",
                      markdown_table(["E_p", "L", "measured", "plan, worst routing", "ratio", "plan, balanced",
                                      "ratio"],
                                     [[str(p["ep"]), f"{p['seq']:,}", fmt_bytes(p["measured"]), fmt_bytes(p["worst"]),
                                       f"{p['worst'] / p['measured']:.3f}", fmt_bytes(p["balanced"]),
                                       f"{p['balanced'] / p['measured']:.3f}"] for p in peaks]), ""]
    lines += ["## Step time at FSDP2-best's longest length", ""]
    table = [[fmt_bytes(parse_bytes(r["budget"])), f"{r['fsdp_best']:,}" if r["fsdp_best"] else "-",
              fmt_seconds(r["step_fsdp"]) if r["step_fsdp"] else "-", fmt_seconds(r["step_bp"]) if r["step_bp"] else "-",
              f"{r['step_bp'] / r['step_fsdp']:.2f}" if r["step_bp"] and r["step_fsdp"] else "-",
              f"{r['tps_fsdp']:.0f}" if r["tps_fsdp"] else "-", f"{r['tps_bp']:.0f}" if r["tps_bp"] else "-",
              str(r["bp_sequences"] or "-")]
             for r in rows]
    lines += [markdown_table(["budget/rank", "L", "FSDP2-best step", "boundpass step", "ratio", "FSDP2-best tokens/s",
                             "boundpass tokens/s", "boundpass sequences per step"], table)]
    lines += ["", f"FSDP2 trains {WORLD} sequences of L per step (one per rank); the MoP layout splits each of its "
              "sequences over the ranks (1 per step: a quarter of FSDP2's work; 4: the same work, N = L tokens per "
              "rank). tokens/s compares the work done; the step-time ratio compares equal work only at 4.", "",
              "## Every run", ""]
    table = []
    for name, v in data["fsdp"].items():
        for r in sorted(v["runs"], key=lambda r: r["seq"]):
            table.append([name, f"{r['seq']:,}", fmt_bytes(r["peak"]) if r["peak"] else "-", "-", "-",
                          fmt_seconds(r["step_s"]) if r.get("step_s") else "-",
                          (r.get("failed") or "")[:120] or _holder(r)])
    for budget, v in data["boundpass"].items():
        for r in v["runs"]:
            ratio = f"{r['certified'] / r['peak']:.3f}" if r.get("certified") and r["peak"] else "-"
            table.append([f"boundpass MoP at {fmt_bytes(parse_bytes(budget))}"
                          + (f", {r['batch']} sequences" if r.get("batch", 1) > 1 else ""), f"{r['seq']:,}",
                          fmt_bytes(r["peak"]) if r["peak"] else "-",
                          fmt_bytes(r["certified"]) if r.get("certified") else "refused", ratio,
                          fmt_seconds(r["step_s"]) if r.get("step_s") else "-",
                          (r.get("binding") or r.get("reason") or r.get("failed") or "")[:120]])
    for label in ("selective", "cp"):
        r = data.get(label)
        if r:
            table.append([f"FSDP2, EP={r.get('ep')}, {'SelectiveAC' if label == 'selective' else 'FullAC, CP=4'}",
                          f"{r['seq']:,}", fmt_bytes(r["peak"]) if r.get("peak") else "-", "-", "-",
                          fmt_seconds(r["step_s"]) if r.get("step_s") else "-",
                          (r.get("failed") or "")[:200] or _holder(r)])
    lines += [markdown_table(["run", "L", "peak/rank (max)", "certified", "certified / measured", "step",
                             "binding term (boundpass) / largest holder at the peak (FSDP2) / failure"], table)]
    lines += ["", "## What binds at the first miss", ""]
    for r in rows:
        b = parse_bytes(r["budget"])
        name = r["fsdp_best_setting"]
        miss = _first_miss(data["fsdp"][name]["runs"], b)
        cert = data["boundpass"][r["budget"]]["certified"]
        lines.append(f"- {fmt_bytes(b)}: FSDP2-best ({name}) at L = {miss['seq']:,}: "
                     f"{fmt_bytes(miss['peak']) if miss and miss['peak'] else '-'}, {_holder(miss)}; "
                     if miss else f"- {fmt_bytes(b)}: FSDP2-best never missed up to the ladder's end; ")
        lines[-1] += (f"boundpass refused L = {cert['first_refused']:,}: {cert['refused_binding']}"
                      if cert.get("first_refused") else "boundpass: the certificate's search ended at its limit")
    lines += ["", *_simulated_section()]
    lines += ["", *targets_section([dict(target=t, figures=f, met=m) for t, f, m in _targets(data, rows)])]
    if data.get("notes"):
        lines += ["", "## Notes", "", *data["notes"]]
    return "\n".join(lines) + "\n"


def simulated_rows(plan_json: Path) -> list[dict]:
    """Paper-scale rows of bench/plan.py's run (docs/results/plan.json): boundpass's longest context against the
    best of plan's baseline variants (ZeRO-3 + EP, full logits, standard EP, AdamW on device or on the host), all
    predicted by the composed budget on fake tensors."""
    if not plan_json.is_file():
        return []
    plan_data = json.loads(plan_json.read_text())
    rows = []
    for row in plan_data["rows"]:
        variants = row["variants"]
        ours = variants.get("boundpass (all four)", {}).get("context")
        base = {name: v.get("context") for name, v in variants.items() if name.startswith("baseline")}
        best_name = max(base, key=lambda n: base[n] or 0)
        rows.append(dict(label=f"{row['class']} ({row['model']} {row['flavor']})", ranks=row["ranks"],
                         paper=row.get("paper_pair"), baseline=base[best_name], baseline_name=best_name,
                         boundpass=ours, date=plan_data["meta"]["date_utc"]))
    return rows


def _simulated_section() -> list[str]:
    rows = simulated_rows(Path(__file__).resolve().parents[1] / "docs" / "results" / "plan.json")
    if not rows:
        return []
    table = [[r["label"] + (" *" if r["paper"] else ""), str(r["ranks"]),
              f"{r['baseline']:,}" if r["baseline"] else "none fits", r["baseline_name"] if r["baseline"] else "-",
              f"{r['boundpass']:,}" if r["boundpass"] else "none fits",
              f"{r['boundpass'] / r['baseline']:.1f}x" if r["boundpass"] and r["baseline"] else "-"]
             for r in rows]
    return ["## At paper scale: simulated (predicted by the composed budget, fake tensors; nothing ran)", "",
            f"From bench/plan.py's run of {rows[0]['date']} (docs/results/plan.md: 139 GiB per rank, 256 GiB host "
            "per rank, bf16): the longest context per sequence. The baseline column is the best of plan's baseline "
            "variants: FSDP2 (ZeRO-3) with expert parallelism, full logits, AdamW on the device or on the host, in "
            "the layout plan composes (the sequence split over the ranks through the sequence-to-head exchange, "
            "which stands in for context parallelism: plan has no model of CP's ring attention); FSDP2's data "
            "parallelism (`--layout dp`, a whole sequence per rank) reaches shorter contexts than this at these "
            "scales, so it is not the column. Plan's baseline, not a measured FSDP2-best. `*` = the paper's model / "
            "rank pairing.", "",
            markdown_table(["model", "W", "baseline (best variant)", "which", "boundpass (all four)",
                            "reach"], table), ""]


def _plan_fsdp_best(data: dict, budget: str) -> tuple:
    """(worst-routing, balanced-routing) FSDP2-best longest L as plan predicts it: the best over E_p."""
    worst = max(data["plan_baseline"][budget].values())
    bal = (data.get("plan_baseline_balanced") or {}).get(budget)
    return worst, max(bal.values()) if bal else None


def _holder(run) -> str:
    holders = (run or {}).get("holders") or []
    return "; ".join(f"{op} {fmt_bytes(n)}" for op, n in holders[:2])


def _targets(data: dict, rows: list[dict]) -> list[tuple]:
    out = []
    for r in rows:
        if not r["fsdp_best"]:
            continue
        out.append((f"{fmt_bytes(parse_bytes(r['budget']))}: measured reach >= {TARGET_REACH:.0f}x FSDP2-best",
                    f"{r['bp_measured']:,}{' (runs stopped there)' if r['open_ended'] else ''} / "
                    f"{r['fsdp_best']:,} = {r['reach_measured']:.2f}x (certified {r['reach_certified']:.2f}x)",
                    r["reach_measured"] >= TARGET_REACH))
        if r["plan"]:
            ref = r["bp_certified"]
            out.append((f"{fmt_bytes(parse_bytes(r['budget']))}: plan's longest L within 10% of the accepted one, "
                        "never above", f"plan {r['plan']:,} vs certificate {ref:,}",
                        r["plan"] <= ref and r["plan"] >= 0.9 * ref))
        if data.get("plan_baseline") and r["fsdp_best"]:
            worst, bal = _plan_fsdp_best(data, r["budget"])
            for label, value in (("worst routing, plan's bound", worst), ("balanced routing, plan's estimate", bal)):
                if value:
                    out.append((f"{fmt_bytes(parse_bytes(r['budget']))}: plan's FSDP2-best longest L ({label}) "
                                "within 10% of the measured one, never above",
                                f"plan {value:,} vs measured {r['fsdp_best']:,} ({value / r['fsdp_best']:.2f})",
                                0.9 * r["fsdp_best"] <= value <= r["fsdp_best"]))
        if r["step_bp"] and r["step_fsdp"]:
            out.append((f"{fmt_bytes(parse_bytes(r['budget']))}: tokens/s at FSDP2-best's longest L >= FSDP2-best's",
                        f"{r['tps_bp']:.0f} vs {r['tps_fsdp']:.0f}", r["tps_bp"] >= r["tps_fsdp"]))
    for budget, v in data["boundpass"].items():
        for r in v["runs"]:
            if r.get("certified") and r["peak"]:
                seqs = f", {r['batch']} sequences" if r.get("batch", 1) > 1 else ""
                out.append((f"boundpass at {fmt_bytes(parse_bytes(budget))}, L = {r['seq']:,}{seqs}: measured <= "
                            "certified <= 1.10x measured", f"{r['certified'] / r['peak']:.3f}",
                            r["peak"] <= r["certified"] <= 1.10 * r["peak"]))
    return out


def _plan_baselines(data: dict, chunk_tokens: int = 256) -> None:
    data["plan_baseline"] = plan_baseline_longest(data["model"], data["budgets"], data["vocab"])
    data["plan_baseline_balanced"] = plan_baseline_longest(data["model"], data["budgets"], data["vocab"],
                                                           routing="balanced")
    data["plan_baseline_peaks"] = plan_baseline_peaks(data, chunk_tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deepseek_v3", choices=sorted(CONFIGS))
    p.add_argument("--budgets", default="384MiB,512MiB,1GiB")
    p.add_argument("--vocab", type=int, default=4096, help="the recipe tokenizer's vocabulary (recipes/assets.py)")
    p.add_argument("--start", type=int, default=512)
    p.add_argument("--max-seq", type=int, default=16384)
    p.add_argument("--fsdp-ep", default="1,2,4")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--host-budget", default="16GiB")
    p.add_argument("--timed-steps", type=int, default=2)
    p.add_argument("--bisect", type=int, default=1)
    p.add_argument("--granule", type=int, default=256)
    p.add_argument("--bp-max-measured", type=int, default=8192)
    p.add_argument("--try-cp", action="store_true")
    p.add_argument("--bp-attention-tiles", action="store_true",
                   help="the MoP side's attention in tiles with the whole sequence's tensors on the host")
    p.add_argument("--time-only-at-fsdp-best", action="store_true",
                   help="boundpass: timed steps only at FSDP2-best's longest L (what the step-time table reads)")
    p.add_argument("--selective", action="store_true")
    p.add_argument("--sequences-at-fsdp-best", type=int, default=1,
                   help="boundpass's timed step at FSDP2-best's L with this many sequences per step (4: as FSDP2's "
                        "4 ranks train)")
    p.add_argument("--check-plan-baseline", action="store_true",
                   help="FSDP2 also at plan's predicted FSDP2-best longest L per budget and at 1.1x it")
    p.add_argument("--notes", help="a markdown file whose lines are appended under Notes")
    p.add_argument("--out", default="reach", help="docs/results/<out>.json and .md")
    p.add_argument("--reuse", help="a REACH_RUNS_FILE of an earlier sweep: its runs are not run again")
    p.add_argument("--rerender", action="store_true", help="render docs/results/<out>.json again, run nothing")
    p.add_argument("--replan", action="store_true",
                   help="with --rerender: plan's predictions (seconds) again with the current code")
    p.add_argument("--rebind", action="store_true",
                   help="with --rerender: every boundpass point's binding term named again by the current code "
                        "(its certified bytes checked unchanged)")
    args = p.parse_args(argv)
    MOP_ATTENTION_TILES[0] = args.bp_attention_tiles
    if args.rerender:
        from bench.common import write_results
        data = json.loads((Path(__file__).resolve().parents[1] / "docs" / "results" / f"{args.out}.json").read_text())
        if args.notes:
            data["notes"] = Path(args.notes).read_text().splitlines()
        if args.replan:
            for budget in data["budgets"]:
                data["plan"][budget] = plan_longest(data["model"], budget, args.host_budget, data["vocab"])
        if args.replan or "plan_baseline" not in data:
            _plan_baselines(data)
        if args.rebind:
            rebind(data, args.host_budget)
        write_results(args.out, data, render(data))
        print(render(data))
        return 0
    from boundpass.recipes.assets import ensure_assets
    assets = str(Path(ensure_assets()["tokenizer"]).parent)
    started = time.perf_counter()
    data = run(args.model, args.budgets.split(","), start=args.start, max_seq=args.max_seq,
               fsdp_ep=[int(e) for e in args.fsdp_ep.split(",")], chunk_tokens=args.chunk_tokens,
               host_budget=args.host_budget, vocab=args.vocab, timed_steps=args.timed_steps, bisect=args.bisect,
               granule=args.granule, bp_max_measured=args.bp_max_measured, try_cp=args.try_cp,
               selective=args.selective, assets=assets, time_only_there=args.time_only_at_fsdp_best,
               check_plan=args.check_plan_baseline, sequences_at_best=args.sequences_at_fsdp_best,
               reuse=[json.loads(ln) for ln in Path(args.reuse).read_text().splitlines()] if args.reuse else ())
    _plan_baselines(data, args.chunk_tokens)
    data.update(meta=run_metadata(),
                command="python bench/reach.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    if args.notes:
        data["notes"] = Path(args.notes).read_text().splitlines()
    publish(args.out, data, render, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
