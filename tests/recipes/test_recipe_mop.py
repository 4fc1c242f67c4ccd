"""The MoP layout selected from the recipe: torchtitan's own Trainer with `--boundpass.layout mop`.

Stock torchtitan on 1 rank (`deepseek_v3_debug`) vs the MoP layout on 2 gloo ranks (`deepseek_v3_debug_mop`:
W = 2 sequence shards of the SAME global batch, E_p = 2, PipelinedLLEP dispatch, Ring-DTP head, FullAC), 3 steps,
2 sequences of 64 tokens. Both start from one seed checkpoint (torchtitan's `--checkpoint.create_seed_checkpoint`,
loaded with `--checkpoint.initial_load_path`): torchtitan initialises the sharded parameters of a multi-rank run
from per-rank random streams on CPU, so without the seed every weight differs from the 1-rank init (measured:
relative difference ~1.4 on every matrix; and since DTensor random ops have no CPU generator, every rank draws
the same values, so the two halves of each sharded matrix are equal, RingDTPHead's vocab shards as much as
torchtitan's FSDP2 tok_embeddings shards).

Tolerance, and why:
- fp32 parameters (`--training.mixed_precision_param float32`): the forward is the same function (attention per
  head over the whole sequence, every other op per token, Ring-DTP = the same cross-entropy summed in another
  order); what differs is the summation order of gradients (two half-batch partial gradients reduce-scattered
  instead of one sum) and torchtitan's bf16 expert matmuls, whose per-rank partial gradients are rounded to bf16
  before the sum. Measured: losses within 1.7e-7 relative over 3 steps (step 2 bitwise), grad norm 3e-5.
  Bound 2e-6 relative: 12x the measured drift. How small a real error is at this scale (random init, 64 tokens):
  feeding rank 1 the positions of rank 0's tokens (a wrong RoPE shard) moved the losses by 4.8e-6, 5.4e-5 and
  4.5e-5 (measured, then reverted): caught at every step. A wrong token count or batch is O(1).
- bf16 mixed precision (the config's default): FSDP2 computes every gradient in bf16 (unit roundoff 3.9e-3)
  and reduces in fp32, so each rank's half-batch gradient is rounded once before the sum instead of the whole
  batch's; after one AdamW step that shows as 7.9e-5 relative in the loss (measured, step 2). Bound 5e-4 from
  step 2 on (6x); step 1 (same weights, no update yet) measured 8.6e-8: bound 1e-6, as in fp32.
The fail-fast test: an infeasible `--boundpass.budget` under the layout raises boundpass's InfeasibleBudgetError
naming the binding term of the composed per-rank budget, from inside torchtitan's parallelize call (the model is
still on meta: nothing of size allocated).
"""
import json
import os
import traceback

import pytest

pytest.importorskip("torchtitan")

from boundpass.testing.distributed import run_on_ranks  # noqa: E402
from boundpass.core.units import parse_bytes  # noqa: E402

pytestmark = [pytest.mark.torchtitan, pytest.mark.distributed]

FP32_RTOL, BF16_RTOL, STEP1_RTOL = 2e-6, 5e-4, 1e-6
SHORT = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "3",
         "--lr_scheduler.decay_ratio", "0"]
# the fp32 MoP run also swaps the optimizer for OffloadStreamAdamW (bitwise the same update as the fused AdamW here)
PRECISIONS = {"fp32": ["--training.mixed_precision_param", "float32"], "bf16": []}
# the fp32 run's attention in tiles (--boundpass.attention.enable with its tile given: runtime/seq_to_head_tiles.py)
MOP_EXTRA = {"fp32": ["--boundpass.optimizer.offload", "True", "--boundpass.attention.enable",
                      "--boundpass.attention.chunk", "32"],
             "bf16": ["--boundpass.budget", "4GiB", "--boundpass.measure_peak"]}
OFFLOAD_BUDGET = "300MiB"
REFUSED = {  # launch -> what the error must say
    "ragged": (["--training.seq_len", "63"], "pad or trim the sequence to 62 or 64 tokens"),
    "pipeline": (["--parallelism.pipeline_parallel_degree", "2"], "--parallelism.pipeline_parallel_degree 1"),
    "ep": (["--parallelism.expert_parallel_degree", "4"], "E_p = 4 must divide the W = 2 ranks"),
    "budget without FullAC": (["--boundpass.budget", "4GiB", "activation-checkpoint:selective"],
                              "Add activation-checkpoint:full"),
    "feed-forward pass": (["--boundpass.feed_forward.enable"], "--boundpass.feed_forward.no-enable"),
}


def _argv(tmp, name, config, extra):
    # extra last: a tyro subcommand (activation-checkpoint:...) takes every argument after it
    return ["--module", "boundpass.recipes", "--config", config, *SHORT, "--dump_folder", f"{tmp}/{name}",
            "--boundpass.record_losses", os.path.join(tmp, f"{name}.jsonl"), *extra]


def _seeded(tmp):
    return ["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.initial_load_path",
            f"{tmp}/seed/checkpoint/step-0"]


def _losses(path):
    with open(path) as f:
        return {row["step"]: row["loss"] for row in map(json.loads, f)}


def _stock_one_rank(rank, world, tmp, assets):
    """The seed checkpoint (torchtitan's own init of the 1-rank model), then stock torchtitan from it."""
    os.environ["BOUNDPASS_ASSETS"] = assets
    from boundpass.recipes.train import train_in_process
    seed = train_in_process(_argv(tmp, "seed", "deepseek_v3_debug",
                                  ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]))
    head_std = float(seed.model_parts[0].lm_head.weight.detach().float().std())
    for precision, flags in PRECISIONS.items():
        train_in_process(_argv(tmp, f"stock_{precision}", "deepseek_v3_debug", [*_seeded(tmp), *flags]))
    return head_std


def _mop_two_ranks(rank, world, tmp, assets):
    os.environ["BOUNDPASS_ASSETS"] = assets
    from boundpass.core.errors import BoundpassInputError, InfeasibleBudgetError
    from boundpass.recipes.train import build_in_process, train_in_process
    facts = {}

    # refused before anything is built (each message names the flag or the lengths to use)
    facts["refused"] = {}
    for name, (extra, _) in REFUSED.items():
        with pytest.raises(BoundpassInputError) as refused:
            build_in_process(_argv(tmp, "refused", "deepseek_v3_debug_mop", extra))
        facts["refused"][name] = str(refused.value)

    # an infeasible budget: the composed per-rank budget of this launch, checked on the meta model
    try:
        build_in_process(_argv(tmp, "tight", "deepseek_v3_debug_mop", ["--boundpass.budget", "64MiB"]))
        facts["infeasible"] = None
    except InfeasibleBudgetError as err:
        frames = [f.name for f in traceback.extract_tb(err.__traceback__)]
        facts["infeasible"] = dict(term=err.term, knob=err.knob, value=err.value_bytes, budget=err.budget_bytes,
                                   message=str(err), in_parallelize="parallelize_under_mop" in frames,
                                   materialised="init_weights" in frames or "to_empty" in frames)

    # a budget that fits only with AdamW's state on the host (composed: 391 MiB with it on the device): the default
    # --boundpass.optimizer.offload auto offloads it; RingDTPHead was initialised by torchtitan's init walk
    # --boundpass.attention.enable without a tile: the planner keeps the whole exchange where the budget holds it
    trainer = build_in_process(_argv(tmp, "fits", "deepseek_v3_debug_mop", ["--boundpass.budget", OFFLOAD_BUDGET,
                                                                          "--boundpass.attention.enable"]))
    try:
        model = trainer.model_parts[0]
        head = model.lm_head
        local = head.weight.to_local().detach()
        facts.update(
            budget_total=trainer.mop_budget.total, offload=trainer.mop_offload,
            optimizers=sorted({type(o).__name__ for o in trainer.optimizers.optimizers}), head=type(head).__name__,
            head_shape=tuple(head.weight.shape),
            local_rows=local.shape[0], head_std=float(local.float().std()), head_finite=bool(local.isfinite().all()),
            attention={type(b.attention.inner_attention).__name__ for b in model.layers.values()},
            fits_tiles={b.attention.inner_attention.tiles for b in model.layers.values()},
            tiles_unneeded=trainer.mop_tiles_unneeded,
            loss=trainer.loss_fn.__qualname__,
            ep=trainer.parallel_dims.ep)
    finally:
        trainer.close()

    for precision, flags in PRECISIONS.items():
        argv = _argv(tmp, f"mop_{precision}", "deepseek_v3_debug_mop", [*_seeded(tmp), *flags, *MOP_EXTRA[precision]])
        if precision == "bf16":  # AdamW on the device: the whole step's live storage is the rank's device memory
            facts.update(_train_measuring_last_step(build_in_process(argv)))
        else:
            layers = train_in_process(argv).model_parts[0].layers.values()
            facts["tiles"] = {b.attention.inner_attention.tiles for b in layers}
    return facts


def _train_measuring_last_step(trainer):
    """Train; the last step (data, fwd, bwd, clip, optimizer) runs under a LiveStorageTracker that counts this rank's
    parameter shards, buffers and optimizer state from the start. Returns its peak and the composed budget."""
    import torch
    from boundpass.measure.memtrack import LiveStorageTracker
    facts = {}
    model, train_step = trainer.model_parts[0], trainer.train_step

    def measured_train_step(data_iterator):
        if trainer.step != trainer.config.training.steps:
            return train_step(data_iterator)
        state = [t for o in trainer.optimizers.optimizers for st in o.state.values() for t in st.values()
                 if torch.is_tensor(t)]
        with LiveStorageTracker() as tracker:
            tracker.track_existing(*[getattr(t, "_local_tensor", t) for t in
                                     [*model.parameters(), *model.buffers(), *state]])
            train_step(data_iterator)
        facts["peak"] = tracker.peak_bytes()

    trainer.train_step = measured_train_step
    try:
        trainer.train()
        # PipelinedLLEP from the dispatch pass: the block graphs compiled at step 1 by torchtitan's per-block compile
        backend = model._mop.dispatch_backend
        facts.update(dispatch=list(model._mop.dispatch), graphs=backend.graphs,
                     rewritten={r.module_path for r in backend.regions if r.rewritten},
                     skipped=[r.reason for r in backend.regions if not r.rewritten],
                     caps={r.cap for r in backend.regions if r.rewritten}, option_cap=model._mop.options.cap,
                     tokens=trainer.config.training.seq_len * trainer.config.training.local_batch_size
                     // trainer.parallel_dims.world_size,
                     head_regions=[(r.rewritten, r.vocab) for r in model._mop.head_backend.regions])
    finally:
        trainer.close()
    facts["bound"] = trainer.mop_budget.total
    # --boundpass.measure_peak: every step's allocator peak (torch's profiler), logged beside the composed budget
    facts["allocator_peaks"] = [peak for _, peak in trainer.peaks]
    facts["certified"] = trainer.certified_peak()
    return facts


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from boundpass.recipes.assets import ensure_assets
    tmp = tmp_path_factory.mktemp("recipe_mop")
    assets = tmp / "assets"
    ensure_assets(assets)
    head_std = run_on_ranks(_stock_one_rank, 1, str(tmp), str(assets), timeout_s=300)[0]
    facts = run_on_ranks(_mop_two_ranks, 2, str(tmp), str(assets), timeout_s=400)
    return tmp, head_std, facts


def test_layout_is_built_by_the_trainer(runs):
    _, head_std, facts = runs
    for rank, f in enumerate(facts):
        assert f["attention"] == {"SeqToHeadAttention"}, f
        assert f["fits_tiles"] == {0} and f["tiles_unneeded"], f   # the whole exchange: the budget holds it
        # deepseek_v3 debug: 5 MoE blocks on PipelinedLLEP, from the dispatch pass in the block graphs torchtitan's
        # per-block compile handed boundpass (the dense block 0's and one graph the MoE blocks share)
        assert f["ep"] == 2 and f["dispatch"] == [f"layers.{i}.moe.routed_experts" for i in range(1, 6)], f
        assert f["graphs"] == 2 and f["rewritten"] == {"moe.routed_experts"} and f["skipped"] == [], f
        assert f["head_regions"] == [(True, 32_768)], f  # Ring-DTP from the vocab pass: the head step compiled once
        assert f["head"] == "RingDTPHead" and f["head_shape"] == (32_768, 256) and f["local_rows"] == 16_384, f
        assert "mop_loss" in f["loss"], f
        # torchtitan's init walk reached RingDTPHead._init_self_parameters: lm_head's own init (trunc. normal,
        # std H^-1/2 truncated: 0.0617 on the 1-rank model), not to_empty's uninitialised memory
        assert f["head_finite"] and f["head_std"] == pytest.approx(head_std, rel=0.05), (f["head_std"], head_std)
        assert f["offload"] and f["optimizers"] == ["OffloadStreamAdamW"], f
        assert f["budget_total"] <= parse_bytes(OFFLOAD_BUDGET), f


def test_mop_layout_follows_stock_torchtitan(runs):
    tmp, _, _ = runs
    for precision, rtol in (("fp32", FP32_RTOL), ("bf16", BF16_RTOL)):
        stock, mop = _losses(tmp / f"stock_{precision}.jsonl"), _losses(tmp / f"mop_{precision}.jsonl")
        assert sorted(stock) == sorted(mop) == [1, 2, 3], (stock, mop)
        assert stock[3] < stock[1] - 0.3, stock  # it trains: a skipped update would show here
        for step in stock:
            assert mop[step] == pytest.approx(stock[step], rel=STEP1_RTOL if step == 1 else rtol), \
                (precision, step, stock, mop)


def test_refusals_and_infeasible_budget_fail_fast(runs):
    _, _, facts = runs
    for f in facts:
        for name, (_, says) in REFUSED.items():
            assert says in f["refused"][name], (name, f["refused"][name])
        err = f["infeasible"]
        assert err is not None, "a 64 MiB budget was accepted"
        assert err["budget"] == 64 << 20 and "cannot be met" in err["message"], err
        # optimizer.offload auto already moved AdamW's state to the host: what binds is another term
        assert not err["term"].startswith("optimizer state on device"), err["term"]
        assert err["term"] in err["message"] and err["knob"] and err["knob"] in err["message"], err
        assert err["in_parallelize"] and not err["materialised"], err  # raised on the meta model


def test_measured_step_within_the_checked_budget(runs):
    """The budget the recipe checks before launch should hold for what the layout then does: the last bf16 step's
    measured live storage per rank <= the composed per-rank budget (b = 4: conservative for bf16 activations).

    At V = 32,768 the step peaks in the embedding's backward under FSDP2 (gathered weight + dense unsharded
    gradient + reduce-scatter input): the composed budget missed that term until it was measured here (420 MiB
    bf16 / 436 MiB fp32 per rank vs 410 MiB composed); tests/recipes/test_mop.py's V = 256 cannot see it.

    torch's allocator (--boundpass.measure_peak) sees what the live-storage tracker cannot, inside C++ ops: with stock
    gloo its reduce-scatter's 32 MiB clone of the embedding's gradient (the recipe now installs boundpass's
    releasing reduce-scatter under MoP), and FSDP2's bf16 copies of that gradient before its cast to the fp32 reduce
    dtype (composed.Launch.fsdp_param_b). Before both, the allocator measured up to 496 MB against 457 MB composed;
    now 445-455 MB against 474 MB (the tracker: 440 MB)."""
    _, _, facts = runs
    for rank, f in enumerate(facts):
        print(f"rank {rank}: measured {f['peak']} B, composed {f['bound']} B, ratio {f['bound'] / f['peak']:.3f}")
        assert 0 < f["peak"] <= f["bound"], f"rank {rank}: measured {f['peak']} B > composed {f['bound']} B"
        # --boundpass.measure_peak: each step's allocator peak logged beside the composed budget, which it stays under
        print(f"rank {rank}: allocator peaks per step {f['allocator_peaks']} B")
        assert f["certified"] == f["bound"] and len(f["allocator_peaks"]) == 3, f
        assert all(0 < p <= f["bound"] for p in f["allocator_peaks"]), f
        # and tight, on the steady steps (the first has no optimizer state yet): measured 1.04-1.06x here
        assert f["bound"] <= 1.10 * max(f["allocator_peaks"][1:]), f
        # PipelinedLLEP runs the chunk cap the budget was certified at: the planner's (planner.planned_launch), at
        # most the N tokens a rank holds, written into every rewritten op (was config's 4,096 under the layout)
        assert f["caps"] == {f["option_cap"]} and 1 <= f["option_cap"] <= f["tokens"], f
        # the fp32 run: --boundpass.attention.enable under the layout with its tile given, every block's attention in
        # tiles (runtime/seq_to_head_tiles.py) of C_s = 32, the rank's tokens of a sequence; its losses follow stock's
        # within the fp32 tolerances above
        assert f["tiles"] == {32}, f
