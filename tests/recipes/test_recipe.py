"""The torchtitan recipe end to end (short version; bench/e2e.py records the 20-step comparison).

Each test runs torchtitan's own Trainer (`boundpass.recipes.train.train_in_process`, the same parsing as the
command line) several times inside gloo ranks started once, so torch/torchtitan imports are paid once.

Tolerance, and why: with boundpass on, the vocab region (lm_head -> cross-entropy) runs as Ring-DTP instead of
torchtitan's ChunkedLossWrapper: the same function, summed in a different order, so step 1's loss agrees to
fp32 rounding; and the optimizer may be OffloadStreamAdamW (fp32 host masters, same AdamW update) instead of
torch's fused AdamW. torchtitan's grouped experts run in bf16 and FSDP2 computes in bf16 (mixed precision),
so a rounding-level change in a gradient grows to ~1e-5 relative in later losses (measured: <= 2e-5 over 4
steps at 1 rank, EP = 2 likewise). We allow 1e-4 relative per step: ten times the measured drift, and far
below the loss change of one step (~4e-2 relative), so a wrong gradient or a skipped update cannot pass.
The short runs stay within the early steps; over 20 steps MoE routing flips make any rounding-level change
(torchtitan's own loss chunk count included) separate the curves by ~1e-2: docs/results/e2e.md measures that
control next to boundpass. Save -> resume must continue bitwise (same code, same state): compared exactly.
"""
import json
import os

import pytest

pytest.importorskip("torchtitan")

from boundpass.testing.distributed import run_on_ranks  # noqa: E402

pytestmark = [pytest.mark.torchtitan, pytest.mark.distributed]

REL_TOL = 1e-4
SHORT = ["--training.seq_len", "64", "--training.local_batch_size", "2",
         # constant LR after warm-up: the schedule must not depend on the total step count when resuming
         "--lr_scheduler.decay_ratio", "0"]


def _losses(path):
    with open(path) as f:
        return {row["step"]: row["loss"] for row in map(json.loads, f)}


def _train(tmp, name, config, extra):
    from boundpass.recipes.train import train_in_process
    trainer = train_in_process(["--module", "boundpass.recipes", "--config", config, *SHORT, *extra,
                                "--boundpass.record_losses", os.path.join(tmp, f"{name}.jsonl")])
    return trainer.summary()


def _stock_vs_boundpass(rank, world, tmp, assets):
    os.environ["BOUNDPASS_ASSETS"] = assets
    stock = _train(tmp, "stock", "deepseek_v3_debug", ["--training.steps", "3", "--dump_folder", f"{tmp}/stock"])
    # offload forced: the run also exercises the OptimizersContainer swap and the rebuilt LR schedulers
    bp = _train(tmp, "bp", "deepseek_v3_debug", ["--training.steps", "3", "--dump_folder", f"{tmp}/bp",
                                                 "--boundpass.budget", "2GiB", "--boundpass.optimizer.offload", "True"])
    # chunked attention and the feed-forwards in row blocks through torchtitan's per-block compile (inside each
    # block's checkpoint body)
    attention = _train(tmp, "attention", "deepseek_v3_debug", [
        "--training.steps", "3", "--dump_folder", f"{tmp}/attention", "--compile.enable", "--compile.backend",
        "aot_eager", "--boundpass.budget", "2GiB", "--boundpass.attention.enable", "--boundpass.feed_forward.enable"])
    return stock, bp, attention


def _certify_only(rank, world, tmp, assets):
    """The certify-only run and a real step of the same configuration (every pass that runs a block op of its own:
    attention and feed-forward in blocks, SCO offloading each boundary): their certificates."""
    os.environ["BOUNDPASS_ASSETS"] = assets
    from boundpass.recipes.train import train_in_process
    args = ["--module", "boundpass.recipes", "--config", "deepseek_v3_debug", "--training.seq_len", "512",
            "--training.local_batch_size", "1", "--compile.enable", "--compile.backend", "aot_eager",
            "--boundpass.budget", "2GiB", "--boundpass.no-report", "--boundpass.attention.enable",
            "--boundpass.feed_forward.enable", "--boundpass.sco.enable", "True"]
    trainer = train_in_process([*args, "--training.steps", "3", "--dump_folder", f"{tmp}/certify",
                                "--boundpass.certify_only", "--boundpass.record_losses",
                                os.path.join(tmp, "certify.jsonl")])
    dry = (trainer.step, trainer.certified_peak(), trainer.certified_host(), len(trainer._tables()),
           any(p.grad is not None for p in trainer.model_parts[0].parameters()), trainer.blocks.sco_runtime.offloaded, trainer.blocks.dry)
    del trainer
    real = train_in_process([*args, "--training.steps", "1", "--dump_folder", f"{tmp}/real"])
    return dry, (real.certified_peak(), real.certified_host(), real.blocks.sco_runtime.offloaded)


def _ep2_save_resume(rank, world, tmp, assets):
    os.environ["BOUNDPASS_ASSETS"] = assets
    on = ["--boundpass.budget", "2GiB", "--boundpass.optimizer.offload", "True", "--dump_folder", f"{tmp}/ep2",
          "--checkpoint.enable", "--checkpoint.interval", "1"]
    full = _train(tmp, "full", "deepseek_v3_debug_ep2", [*on, "--training.steps", "3"])
    resumed = _train(tmp, "resumed", "deepseek_v3_debug_ep2", [*on, "--training.steps", "3",
                                                               "--checkpoint.load_step", "1"])
    return full, resumed


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from boundpass.recipes.assets import ensure_assets
    root = tmp_path_factory.mktemp("assets") / "a"
    ensure_assets(root)
    return str(root)


def test_one_rank_boundpass_follows_stock_torchtitan(tmp_path, assets):
    stock_summary, bp_summary, attention_summary = run_on_ranks(_stock_vs_boundpass, 1, str(tmp_path), assets,
                                                                timeout_s=400)[0]
    assert stock_summary == "boundpass off"
    assert "vocab regions rewritten: 1, skipped: 0" in bp_summary, bp_summary
    assert "OffloadStreamAdamW" in bp_summary or "offloaded" in bp_summary, bp_summary
    stock, bp = _losses(tmp_path / "stock.jsonl"), _losses(tmp_path / "bp.jsonl")
    assert sorted(stock) == sorted(bp) == [1, 2, 3]
    assert stock[3] < stock[1] - 0.3, stock  # it trains: a skipped update would show here
    for step in stock:
        assert bp[step] == pytest.approx(stock[step], rel=REL_TOL), (step, stock, bp)
    # every block graph's attention sublayer (inside its checkpoint body) walked in query blocks, k and v made per
    # key tile from the block's rows (the value padded for torch's fused kernel read unpadded); reordered sums: the
    # losses within the same tolerance
    assert attention_summary.count("REWRITTEN attention attention.inner_attention") == 2, attention_summary
    assert attention_summary.count("query path + k / v path + scaled_dot_product_attention + output projection => "
                                   "boundpass::attention_blocks") == 2, attention_summary
    # block 0's dense feed-forward with its norm, the MoE blocks' shared experts (one block graph each)
    assert "REWRITTEN feed_forward feed_forward.w2: norm + up projections" in attention_summary, attention_summary
    assert "REWRITTEN feed_forward moe.shared_experts.w2: up projections" in attention_summary, attention_summary
    attention = _losses(tmp_path / "attention.jsonl")
    for step in stock:
        assert attention[step] == pytest.approx(stock[step], rel=REL_TOL), (step, stock, attention)


def test_certify_only_stops_after_the_first_forward_with_the_whole_steps_certificate(tmp_path, assets):
    """--boundpass.certify_only: step 1's forward compiles every graph (each block graph, the head) and checks it
    against the budget, its blocks computing nothing; the trainer stops there, before any backward or optimizer
    step, with the certificate a real step of the same configuration gets (device and host, to the byte)."""
    dry, real = run_on_ranks(_certify_only, 1, str(tmp_path), assets, timeout_s=400)[0]
    step, certified, host, tables, grads, offloaded, dry_blocks = dry
    assert dry_blocks                                   # the block graphs did not compute
    assert step == 1 and tables >= 3 and 0 < certified <= 2 * 2 ** 30 and host > 0
    assert not grads                                    # no backward ran
    assert not (tmp_path / "certify.jsonl").exists()    # no step was logged
    assert any(offloaded) and offloaded == real[2]      # SCO's decisions, recorded for the blocks that did not run
    assert (certified, host) == real[:2], (dry, real)


def test_ep2_over_gloo_trains_and_resumes_identically(tmp_path, assets):
    # trains, saves and resumes: 300 s ran out once on a 2-core machine loaded by other work
    summaries = run_on_ranks(_ep2_save_resume, 2, str(tmp_path), assets, timeout_s=600)
    for full_summary, _ in summaries:
        assert "vocab regions rewritten: 1, skipped: 0" in full_summary, full_summary
    full, resumed = _losses(tmp_path / "full.jsonl"), _losses(tmp_path / "resumed.jsonl")
    assert sorted(full) == [1, 2, 3] and sorted(resumed) == [2, 3], (full, resumed)
    assert full[3] < full[1], full
    assert resumed[2] == full[2] and resumed[3] == full[3], (full, resumed)  # the 2nd step checks the moments


def test_rope_to_seq_len_sizes_every_blocks_table_to_the_trained_length():
    """--boundpass.rope_to_seq_len: torchtitan's debug flavors stop at 16,384 RoPE positions; the flag sizes every
    block's table to the trained length, with boundpass off too (it is the model's config)."""
    from boundpass.recipes.config_registry import deepseek_v3_debug
    from boundpass.recipes.trainer import rope_to_seq_len
    config = deepseek_v3_debug()
    assert {layer.attention.rope.max_seq_len for layer in config.model_spec.model.layers} == {16384}
    config.training.seq_len = 32768
    rope_to_seq_len(config)
    assert {layer.attention.rope.max_seq_len for layer in config.model_spec.model.layers} == {32768}
