"""boundpass.plan / the composed per-rank budget: prediction vs a measured training step, --solve, CLI, errors.

Measured: one steady-state training step (the second: AdamW state exists) of torchtitan's real deepseek_v3 debug
MoE model (cut to 3 blocks: 1 dense, 2 MoE) on CPU with real tensors, fp32, full activation checkpointing
(torchtitan's FullAC), AdamW; peak = boundpass.measure.memtrack.LiveStorageTracker's high-water mark of live tensor
storages (parameters, buffers and optimizer state counted from the start), not RSS. Predicted = the composed
budget (boundpass.bound.composed) of the same launch, no operator unless said.

Attention kernel: the composed budget counts a flash-style (O(N) per head) kernel. deepseek_v3's MLA has a qk
head dim (192) different from its v head dim (128), for which torch's stock SDPA on CPU takes the math path and
materialises [N, N] scores per head; so on one rank the inner attention is wrapped, as under the MoP layout,
with runtime/seq_to_head's SeqToHeadAttention (group None: no exchange), which zero-pads v so that SDPA runs its
fused kernel. The measurement is of that schedule (said so in docs/plan.md), not of the math path.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from boundpass.bound import composed
from boundpass.core.config import PLAN_VOCAB_BLOCK
from boundpass.core.errors import BoundpassInputError
from boundpass.planning.full_scale import make_input, model_config, model_shape, plan, shape_of_module

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = 3  # one dense + two MoE blocks

# (batch, sequence, vocab, loss head): predicted / measured recorded in docs/plan.md
ONE_RANK_CASES = [(1, 1024, 2048, "full logits"), (2, 512, 2048, "full logits"), (1, 2048, 2048, "full logits"),
                  (1, 1024, 32768, "full logits"), (1, 1024, 32768, "ring_dtp")]
# (world, E_p, batch, sequence, vocab, blocks kept: None = the whole 6-block debug model)
MOP_CASES = {"W2-Ep2-3blocks": (2, 2, 2, 256, 2048, LAYERS), "W4-Ep2-6blocks": (4, 2, 1, 512, 2048, None)}
# The MoP layout, measured at torch's allocator since 2026-12-03 (the layout now reduce-scatters through
# boundpass.backend.gloo_release: no gloo clone, which a live-storage tracker used to count): 1.068-1.073x on 2 gloo
# ranks, 1.062-1.069x on 4. Traced block terms, live storages (2026-12-01): 1.095x on 2 gloo ranks, 1.069x on 4.
# Hand-written terms before:
# 1.086x its measured peak on 2 gloo ranks (1.074x on a run where gloo still held an exchange
# pair: that timing only raises the measurement), 1.080x on 4 ranks with the whole debug model, after the ZeRO-3
# terms follow FSDP2's order (docs/plan.md). Measured once, not asserted here (over 10% on the 3-block cut):
# W=2 E_p=1 1.106x, W=4 E_p=2 1.116-1.122x, W=4 E_p=4 1.106-1.124x.
MOP_TIGHTNESS = 1.10


# the other torchtitan families on one rank, 3 blocks each (all MoE): (recipes name, plan name, flavor, dtype,
# b_acc of the launch; gpt_oss runs only in bf16 upstream: its combine's scatter_add fails on fp32 weights; a
# bf16 model under torch AdamW keeps bf16 moments and no fp32 master, so its launch says b_acc = 2)
FAMILIES = {"qwen3_moe": ("qwen3", "debugmodel_moe", torch.float32, 4),
            "gpt_oss": ("gpt_oss", "debugmodel", torch.bfloat16, 2)}
FAMILY_CASES = [(1, 512, 2048, "full logits"), (1, 1024, 2048, "full logits"), (1, 1024, 32768, "ring_dtp")]


def _trimmed_debug_model(vocab: int, seq: int, family: str = "deepseek_v3", dtype=torch.float32):
    from torchtitan.distributed.activation_checkpoint import FullAC

    from boundpass.recipes.models import build_debug_moe
    from boundpass.runtime.seq_to_head import SeqToHeadAttention
    model = build_debug_moe(family, vocab_size=vocab, seq_len=seq, dtype=dtype)
    for name in list(model.layers)[LAYERS:]:
        del model.layers[name]
    if family == "deepseek_v3":
        for block in model.layers.values():  # the fused kernel the bound counts (see the module docstring)
            block.attention.inner_attention = SeqToHeadAttention(block.attention.inner_attention, None)
    FullAC(FullAC.Config()).apply(model)
    return model


def _shape(model, name="deepseek_v3 debug (3 blocks)", package="deepseek_v3", flavor="debugmodel"):
    """The model's ModelShape, its blocks traced once per model object: the traced terms are symbolic in N, the
    same for every batch shape a fixture's model is measured at (kept on the model, freed with it)."""
    cached = getattr(model, "_test_plan_shape", None)
    if cached is None or cached[0] != name:
        cfg = model_config(package, flavor)
        cached = (name, shape_of_module(model, name=name, heads_config=cfg.layers[-1].attention,
                                        top_k=cfg.layers[-1].moe.router.top_k))
        model._test_plan_shape = cached
    return cached[1]


def _uses_traced_blocks(table, kinds=("moe",)):
    """The budget's block and head terms are the traced ones (named 'traced ...'), none of the hand-written ones
    (the head's gradient is in its trace too)."""
    names = [t.name for t in table.terms]
    for kind in kinds:
        assert any(t.kind == f"traced_{kind}_forward" and t.name.startswith("traced") for t in table.terms), names
    assert not any(t.kind in ("layer", "attention", "attention_saved", "dense", "moe", "grad_head")
                   for t in table.terms), names
    heads = [t for t in table.terms if t.kind == "head"]
    assert len(heads) == 1 and heads[0].name.startswith("traced head"), names


def _measured_step_peak(model, batch: int, seq: int, vocab: int, loss: str) -> int:
    from boundpass.measure.memtrack import LiveStorageTracker
    from boundpass.recipes.models import torchtitan_loss
    from boundpass.runtime import ring_dtp_loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loss_fn = torchtitan_loss()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    model._skip_lm_head = loss == "ring_dtp"

    def step():
        if loss == "ring_dtp":  # P = 1; strip width C = the composed budget's default
            h = model(tokens)
            value = ring_dtp_loss(h.reshape(-1, h.shape[-1]), model.lm_head.weight, labels.reshape(-1),
                                  vocab_size=vocab, block=PLAN_VOCAB_BLOCK) / (batch * seq)
        else:
            value = loss_fn(model(tokens), labels, batch * seq)
            value = value[0] if isinstance(value, tuple) else value
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with LiveStorageTracker() as tracker:
        tracker.track_existing(*model.parameters(), *model.buffers())
        # AdamW creates its state at its first step: given zero gradients (no forward or backward: the state is
        # sized by the parameters alone) it does so and leaves what a first training step leaves live. (A short
        # first training step would not: it leaves shape-keyed caches of its own length live, 16 KiB at 16 tokens.)
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tracker.reset_peak()
        step()                 # steady state: what the composed budget predicts
    return tracker.peak_bytes()


@pytest.fixture(scope="module")
def debug_models():
    built = {}

    def get(vocab):
        if vocab not in built:
            built[vocab] = _trimmed_debug_model(vocab, max(case[1] for case in ONE_RANK_CASES))
        return built[vocab]
    return get


@pytest.mark.parametrize("batch,seq,vocab,loss", ONE_RANK_CASES,
                         ids=[f"{b}x{s}-V{v}-{'ring' if l == 'ring_dtp' else 'full'}" for b, s, v, l in ONE_RANK_CASES])
def test_predicted_peak_is_within_10_percent_of_measured_and_never_below(debug_models, batch, seq, vocab, loss):
    model = debug_models(vocab)
    shape = _shape(model)
    assert (shape.layers, shape.moe_layers, shape.vocab) == (LAYERS, LAYERS - 1, vocab)
    ops = frozenset({"ring_dtp"}) if loss == "ring_dtp" else frozenset()
    launch = composed.Launch(ranks=1, ep=1, ring=1, tokens_per_rank=batch * seq, operators=ops, b=4, b_acc=4)
    table = composed.compose(shape, launch, budget=2**40)
    predicted = table.total
    measured = _measured_step_peak(model, batch, seq, vocab, loss)
    print(f"{batch}x{seq} V={vocab} {loss}: predicted {predicted} B, measured {measured} B, "
          f"ratio {predicted / measured:.4f}")
    assert measured <= predicted <= 1.10 * measured
    _uses_traced_blocks(table, ("dense", "moe"))
    # the state terms are exact: 12 bytes per fp32 parameter (weights, two AdamW moments), AdamW's fp32 step
    # counter per parameter tensor and the buffers persist, 4 more per parameter (gradients) by the optimizer step
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert table.sum("persistent") == 12 * params + 4 * len(list(model.parameters())) + buffers
    assert table.sum("grad") + table.sum("grad_embedding") == 4 * params


@pytest.fixture(scope="module")
def family_models():
    built = {}

    def get(family, vocab):
        if (family, vocab) not in built:
            built.clear()  # one at a time: qwen3's debug experts are 1.4 GB of fp32 state
            built[family, vocab] = _trimmed_debug_model(vocab, max(c[1] for c in FAMILY_CASES), family,
                                                        FAMILIES[family][2])
        return built[family, vocab]
    return get


# family-major order: consecutive cases share a family (and mostly a vocabulary), so family_models, which holds
# one model at a time, builds and traces 4 models instead of 6 (the two stacked parametrizations alternated)
@pytest.mark.parametrize("family,batch,seq,vocab,loss", [(f, *c) for f in FAMILIES for c in FAMILY_CASES],
                         ids=[f"{b}x{s}-V{v}-{'ring' if l == 'ring_dtp' else 'full'}-{f}"
                              for f in FAMILIES for b, s, v, l in FAMILY_CASES])
def test_traced_families_predicted_peak_is_within_10_percent_and_never_below(family_models, family, batch, seq,
                                                                              vocab, loss):
    """qwen3 MoE and gpt_oss on one rank: their blocks traced through the step analysis (block_trace)."""
    package, flavor, dtype, b_acc = FAMILIES[family]
    model = family_models(family, vocab)
    shape = _shape(model, name=f"{package} debug (3 blocks)", package=package, flavor=flavor)
    b = torch.empty((), dtype=dtype).element_size()
    assert shape.traced and shape.traced_b == b and shape.moe_layers == LAYERS
    ops = frozenset({"ring_dtp"}) if loss == "ring_dtp" else frozenset()
    launch = composed.Launch(ranks=1, ep=1, ring=1, tokens_per_rank=batch * seq, operators=ops, b=b, b_acc=b_acc)
    table = composed.compose(shape, launch, budget=2**40)
    _uses_traced_blocks(table)
    predicted = table.total
    measured = _measured_step_peak(model, batch, seq, vocab, loss)
    print(f"{family} {batch}x{seq} V={vocab} {loss}: predicted {predicted} B, measured {measured} B, "
          f"ratio {predicted / measured:.4f}")
    assert measured <= predicted <= 1.10 * measured


def _mop_prediction(world, ep, batch, seq, vocab, layers):
    """(predicted per-rank peak, whether the blocks' terms are the wide traces) of a steady-state training step
    under the MoP layout, composed here in the test process: the traces are the same on every rank."""
    from boundpass.recipes.mop import build_model, mop_config
    cfg = mop_config("deepseek_v3", world=world, ep=ep, seq_len=seq, vocab_size=vocab)
    shape = shape_of_module(build_model(cfg, layers=layers), name="deepseek_v3 debug",
                            heads_config=cfg.model_spec.model.layers[0].attention,
                            top_k=cfg.model_spec.model.layers[1].moe.router.top_k, traces="wide")
    launch = composed.Launch(ranks=world, ep=ep, ring=world, tokens_per_rank=batch * seq // world,
                             operators=frozenset(), b=4, b_acc=4)
    table = composed.compose(shape, launch, budget=1 << 40)
    # W > 1: the blocks traced without their routed experts, those and the exchange hand-written (docs/plan.md)
    traced = composed.uses_wide_trace(shape, launch) and \
        any(t.kind == "traced_moe_forward_ffn" and t.name.startswith("traced") for t in table.terms) and \
        any(t.kind == "dispatch" for t in table.terms) and any(t.kind == "attention_exchange" for t in table.terms) \
        and not any(t.kind in ("layer", "attention", "attention_saved", "dense", "moe") for t in table.terms)
    return table.total, traced


def _mop_step_peak(rank, world, ep, batch, seq, vocab, layers):
    """This rank's measured peak of a steady-state training step under the MoP layout (FSDP2 dense weights,
    sequence-to-head attention, torchtitan EP; parallelize_mop's defaults, operators off)."""
    from boundpass.recipes.mop import build_model, mop_config, parallelize_mop, shard_batch  # before torchtitan
    from torchtitan.distributed.activation_checkpoint import FullAC

    from boundpass.recipes.models import torchtitan_loss
    from boundpass.testing.whole_step import allocator_peak_of
    cfg = mop_config("deepseek_v3", world=world, ep=ep, seq_len=seq, vocab_size=vocab)
    model = build_model(cfg, layers=layers)
    parallelize_mop(model, cfg, world=world, ac_config=FullAC.Config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torchtitan_loss()
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # the second step is the steady state (AdamW state exists)
        tokens, labels = (torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(2))
        tokens, labels, positions = shard_batch(tokens, labels, rank, world)

        def step():
            loss, _ = loss_fn(model(tokens, positions=positions), labels, torch.tensor(batch * seq))
            loss.backward()
            opt.step()
            opt.zero_grad()
        # torch's allocator, what C++ allocates included (kernel workspaces, collective buffers)
        _, peak = allocator_peak_of(step, [*model.parameters(), *model.buffers(), *(
            t for st in opt.state.values() for t in st.values() if torch.is_tensor(t))])
    return peak


@pytest.mark.parametrize("case", MOP_CASES)
def test_predicted_peak_under_the_mop_layout_on_gloo_ranks(case):
    from boundpass.testing.distributed import run_on_ranks
    world, ep, *rest = MOP_CASES[case]
    measured_per_rank = run_on_ranks(_mop_step_peak, world, ep, *rest, timeout_s=300)
    predicted, traced = _mop_prediction(world, ep, *rest)
    assert traced
    for rank, measured in enumerate(measured_per_rank):
        print(f"MoP {case} rank {rank}: predicted {predicted} B, measured {measured} B, "
              f"ratio {predicted / measured:.4f}")
        assert measured <= predicted <= MOP_TIGHTNESS * measured, (rank, measured, predicted)


def test_model_shape_of_the_config_matches_the_built_model():
    from boundpass.recipes.models import build_debug_moe
    shape = model_shape("deepseek_v3", "debugmodel")
    built = build_debug_moe("deepseek_v3")
    assert shape.params == sum(p.numel() for p in built.parameters()) == 33_014_016
    assert (shape.layers, shape.moe_layers, shape.experts, shape.top_k, shape.dense_hidden) == (6, 5, 8, 3, 1024)


def test_solve_gives_a_context_that_fits_and_the_next_size_up_does_not():
    result = plan("deepseek_v3", "debugmodel", ranks=2, ep=2, context=4096, budget="900MiB", host_budget="1GiB",
                  dtype="fp32", do_trace=False, solve=True)
    answer = result.solve
    assert answer["value"] > 0 and answer["next"] > answer["value"]
    inp = result.inputs
    shape = result.shape
    # OffloadStreamAdamW's bucket and PipelinedLLEP's chunk cap are knobs: the answer fits at the values the planner
    # takes there, the next size up at none, not even the narrowest
    assert answer["optimizer_bucket"] >= 1 and answer["dispatch_cap"] >= 1
    for context, fits, bucket, cap in ((answer["value"], True, answer["optimizer_bucket"], answer["dispatch_cap"]),
                                       (answer["next"], False, 1, 1)):
        n = context * inp.global_batch // inp.ranks
        table = composed.compose(shape, composed.Launch(ranks=2, ep=2, ring=2, tokens_per_rank=n, b=4,
                                                        optimizer_bucket=bucket, dispatch_cap=cap,
                                                        sequences_per_step=inp.global_batch,
                                                        held_batch_per_token=composed.trainer_held_batch(2)),
                                 budget=inp.budget, host_budget=inp.host_budget)
        assert table.fits() is fits, (context, table.total, inp.budget)


def test_the_planner_fits_the_composed_bucket_widest_first_and_the_next_one_up_does_not():
    """composed_bucket (the recipe's MoP beta) is the planner's rule on the composed budget: the widest fitting."""
    from boundpass.planning import planner
    result = plan("deepseek_v3", "debugmodel", ranks=2, ep=2, context=64, budget="2GiB", host_budget="4GiB",
                  dtype="fp32", do_trace=False)
    shape, host = result.shape, 4 << 30

    def launch(beta):  # few tokens: the optimizer phase (gradients + S·beta staging) is the step's peak
        return composed.Launch(ranks=2, ep=2, ring=2, tokens_per_rank=64, b=4, operators=frozenset(
            {"offload_adamw", "ring_dtp"}), optimizer_bucket=beta)

    def total(beta):
        return composed.compose(shape, launch(beta), budget=1 << 40, host_budget=host).total

    wide = 1 << 24  # S·beta·4 B = 512 MiB: past the activations
    budget = total(wide // 2)
    assert total(1) < budget < total(wide)  # the staging term binds across the range
    beta = planner.composed_bucket(shape, launch, budget=budget, host_budget=host, hi=wide)
    assert beta == wide // 2 and total(beta + 1) > budget
    # nothing fits: the narrowest bucket, for the check that follows to name what binds
    assert planner.composed_bucket(shape, launch, budget=total(1) - 1, host_budget=host, hi=wide) == 1


def test_the_planner_takes_the_dispatch_knee_when_the_budget_allows_it_else_the_widest_cap_that_fits(monkeypatch):
    """composed_dispatch_cap (the recipe's MoP c, plan's table) is the knob rule on the composed budget: the knee of
    the dispatch time model when the budget allows it, else the widest c that fits, the next one up not fitting."""
    from boundpass.bound import cost_model
    from boundpass.planning import planner
    result = plan("deepseek_v3", "debugmodel", ranks=4, ep=2, context=4096, budget="2GiB", host_budget="4GiB",
                  dtype="fp32", do_trace=False)
    shape, host, n = result.shape, 4 << 30, 1024
    launch = composed.Launch(ranks=4, ep=2, ring=4, tokens_per_rank=n, b=4,
                             operators=frozenset({"pipelined_llep", "ring_dtp"}))

    def total(c):
        return composed.compose(shape, dataclasses.replace(launch, dispatch_cap=c), budget=1 << 40,
                                host_budget=host).total

    knee = cost_model.pipelined_llep_knee(lo=1, hi=n, N=n, H=shape.hidden, I=shape.expert_hidden, E=shape.experts,
                                          E_p=2, k=shape.top_k, b=4, costs=cost_model.costs_for("cpu"))
    assert 1 < knee < n and total(knee) < total(n)
    roomy = planner.planned_launch(shape, launch, budget=total(n), host_budget=host)
    assert roomy.dispatch_cap == knee  # never past the knee because the budget allows it
    # the budget's branch: with the knee at N (a time model that wants one chunk), the widest c that fits; here the
    # dispatch term binds from c = 513 on (below that the attention backward does)
    monkeypatch.setattr(cost_model, "pipelined_llep_knee", lambda **kw: n)
    tight = (total(512) + total(n)) // 2
    c = planner.composed_dispatch_cap(shape, launch, budget=tight, host_budget=host)
    assert 512 <= c < n and total(c) <= tight < total(c + 1)
    # nothing fits: c = 1, for the check that follows to name what binds there
    assert planner.composed_dispatch_cap(shape, launch, budget=total(1) - 1, host_budget=host) == 1
    # plan --solve reads the knobs at their narrowest; a user's cap is kept
    assert planner.narrowest_knobs(launch).dispatch_cap == 1
    fixed = dataclasses.replace(launch, dispatch_cap=64)
    assert planner.planned_launch(shape, fixed, budget=total(n), host_budget=host).dispatch_cap == 64


def test_the_buffer_term_at_a_context_is_what_torchtitans_trainer_builds_at_that_sequence_length():
    """torchtitan's trainer rebuilds each block's RoPE table at --training.seq_len (update_from_config); a plan with a
    context counts the buffers at that length (N·W/G positions), not at the flavor's max_seq_len."""
    from torchtitan.trainer import Trainer

    from boundpass.planning.full_scale import launch_of, model_config
    result = plan("deepseek_v3", "debugmodel", ranks=4, ep=2, context=4096, global_batch=2, budget="2GiB",
                  host_budget="4GiB", dtype="fp32", do_trace=False)
    shape, launch = result.shape, launch_of(result.inputs)
    assert shape.rope_positions == 16_384 and shape.rope_bytes_per_position == 6 * 32 * 8  # 6 blocks' complex64 [L, 32]
    assert launch.sequences_per_step == 2 and launch.tokens_per_rank == 4096 * 2 // 4
    cfg = model_config("deepseek_v3", "debugmodel")
    job = Trainer.Config()
    job.training.seq_len = 4096
    cfg.update_from_config(config=job)  # what the trainer does before it builds the model
    with torch.device("meta"):
        built = sum(b.numel() * b.element_size() for b in cfg.build().buffers())  # on meta: every buffer its own
    term = next(t for t in result.table.terms if t.name.startswith("buffers"))
    assert term.value == built < shape.buffer_bytes
    # without a context (N given) nothing says the sequence length: the buffers as the flavor builds them
    as_built = plan("deepseek_v3", "debugmodel", ranks=4, ep=2, tokens_per_rank=2048, budget="2GiB",
                    host_budget="4GiB", dtype="fp32", do_trace=False)
    assert next(t for t in as_built.table.terms if t.name.startswith("buffers")).value == shape.buffer_bytes


def test_the_exchange_adds_nothing_to_the_attention_backward_where_the_gathered_copies_replace_one_ranks():
    """The composed budget's exchange terms (boundpass.bound.composed.exchange_terms) at W = 4: the attention-backward
    sub-phase takes the backward's own difference, 0 for a dropping caller with A_kv = A_q (the gathered copies take
    the place of the one-rank tensors), positive under GQA (the caller's output and gradient stay counted); the
    forward's term is one q (deepseek_v3's MLA shape)."""
    from boundpass.core import symbols as sym
    terms = {kind: formula for _, formula, kind, _, _ in composed.exchange_terms()}
    mha = dict(N=1024, W=4, A_q=16, A_kv=16, D_h=192, b=4, b_acc=4)
    q = 1024 * 16 * 192 * 4
    assert sym.evaluate(terms["attention_exchange_backward"], mha) == 0
    assert sym.evaluate(terms["attention_exchange"], mha) == q
    assert sym.evaluate(terms["attention_exchange_backward"], {**mha, "A_kv": 4}) > 0
    assert sym.evaluate(terms["attention_exchange_backward"], {**mha, "W": 1}) == 0  # one rank: nothing exchanged


def test_operators_only_lower_the_bound_and_the_binding_term_names_a_knob():
    kw = dict(ranks=8, ep=8, context=65_536, budget="139GiB", host_budget="256GiB", do_trace=False)
    base = plan("gpt_oss", "120b", operators=(), **kw)
    full = plan("gpt_oss", "120b", **kw)
    assert full.table.total < base.table.total
    assert not base.fits  # 117B params on 8 ranks: AdamW state alone is over 139 GiB
    bind = base.table.binding()
    assert bind.name.startswith("optimizer state on device") and "offload_adamw" in bind.knob
    from boundpass.core.errors import InfeasibleBudgetError
    with pytest.raises(InfeasibleBudgetError, match="binding term : optimizer state on device") as err:
        composed.check(base.shape, composed.Launch(ranks=8, ep=8, ring=8, tokens_per_rank=8192, operators=frozenset()),
                       budget=base.inputs.budget, host_budget=base.inputs.host_budget)
    assert err.value.value_bytes == bind.value and "offload_adamw" in err.value.knob
    assert composed.check(full.shape, composed.Launch(ranks=8, ep=8, ring=8, tokens_per_rank=8192),
                          budget=full.inputs.budget, host_budget=full.inputs.host_budget).fits()


def test_cli_json_parses_and_exit_code_says_fit():
    cmd = [sys.executable, "-m", "boundpass", "plan", "deepseek_v3", "debugmodel", "-W", "1", "-N", "256",
           "--budget", "2GiB", "--dtype", "fp32", "--operators", "none", "--json", "--solve"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert "leaked" not in out.stderr, out.stderr  # triton's nanobind teardown noise stays out of the terminal
    data = json.loads(out.stdout)
    assert data["fits"] is True and data["device_peak_bytes"] <= data["budget_bytes"]
    names = [t["term"] for t in data["terms"]]
    assert any(n.startswith("traced head: final norm + vocab projection + loss (full logits") for n in names)
    assert not any(n.startswith("vocab projection + loss") for n in names)  # the hand-written head is replaced
    assert any(n.startswith("block terms: traced") for n in data["trace_notes"])
    traced = {t["term"]: t["traced_bytes"] for t in data["terms"]}
    boundary = next(n for n in names if n.startswith("checkpoint boundaries (device)"))
    assert traced[boundary] == 6 * 256 * 256 * 4  # 6 blocks keep their [256, 256] fp32 input
    assert data["solve"]["value"] >= 256


@pytest.mark.parametrize("kwargs,match", [
    (dict(model="llama9", flavor="x"), "unknown model"),
    (dict(flavor="700B"), "unknown flavor"),
    (dict(ep=3), "E_p = 3 does not divide W = 16"),
    (dict(ring=5), "ring degree P = 5 does not divide"),
    (dict(context=1000), "do not split evenly over W = 16"),
    (dict(budget="139 GiBs"), "unknown unit"),
    (dict(operators=("ring_dtp", "zero_bubble")), "unknown operators"),
    (dict(tokens_per_rank=4096), "exactly one of"),
])
def test_bad_input_is_refused_before_any_model_is_built(kwargs, match):
    args = dict(model="deepseek_v3", flavor="671B", ranks=16, ep=8, context=65_536)
    args.update(kwargs)
    with pytest.raises(BoundpassInputError, match=match):
        make_input(args.pop("model"), args.pop("flavor"), **args)


def test_degree_that_does_not_divide_the_experts_or_heads_is_refused():
    with pytest.raises(BoundpassInputError, match="does not divide gpt_oss 120b's E = 128"):
        plan("gpt_oss", "120b", ranks=256, ep=256, context=2**20, do_trace=False)
    with pytest.raises(BoundpassInputError, match="W must divide 64"):
        plan("gpt_oss", "120b", ranks=128, ep=8, context=2**20, do_trace=False)


def test_search_picks_knobs_that_fit_and_reports_none_when_nothing_can():
    from boundpass.planning.full_scale import CostModel
    kw = dict(ranks=2, context=8192, host_budget="1GiB", dtype="fp32", do_trace=False)
    result = plan("deepseek_v3", "debugmodel", ep=2, budget="2GiB", search=CostModel(), **kw)
    best = result.search["best"]
    assert best is not None and result.search["candidates"] > 1
    knobs = best["knobs"]
    launch = composed.Launch(tokens_per_rank=4096, b=4, ranks=2, held_batch_per_token=composed.trainer_held_batch(2),
                             sequences_per_step=1, **knobs)
    table = composed.compose(result.shape, launch, budget=result.inputs.budget, host_budget=result.inputs.host_budget)
    assert table.fits() and table.total == best["peak_bytes"]
    assert best["step_seconds"] == pytest.approx(sum(v for k, v in best["parts"].items() if k != "total"))
    nothing = plan("deepseek_v3", "debugmodel", ep=2, budget="64MiB", search=True, **kw)
    assert nothing.search["best"] is None


def test_gradients_follow_the_phases_of_a_step():
    """Gradients by phase: none of the blocks' while the head runs, all at the optimizer step; accumulation
    (microbatches) makes them persistent; a tied embedding has no gradient of its own; total_formula (one sympy
    expression in N) agrees with compose's phase-by-phase total."""
    import dataclasses

    import sympy
    shape = model_shape("deepseek_v3", "debugmodel")
    launch = composed.Launch(ranks=2, ep=2, ring=2, tokens_per_rank=2048, operators=frozenset(), b=4, b_acc=4)
    table = composed.compose(shape, launch, budget=1 << 40)
    theta = -(-shape.params // 2) * 4
    assert table.sum("grad") + table.sum("grad_embedding") == theta
    assert table.sum("grad_head") < table.sum("grad_moe") < table.sum("grad_dense") <= table.sum("grad") < theta
    phases = table.phases()
    assert table.total == table.sum("persistent") + max(phases.values())
    assert phases["step"] == theta  # fused AdamW: every gradient, nothing else above the persistent state
    accumulated = composed.compose(shape, dataclasses.replace(launch, grad_accumulation=4), budget=1 << 40)
    assert accumulated.sum("persistent") == table.sum("persistent") + theta > 0
    assert accumulated.total > table.total
    tied = composed.compose(dataclasses.replace(shape, tied_embeddings=True), launch, budget=1 << 40)
    assert tied.sum("grad_embedding") == 0 and tied.sum("grad") == theta
    for n in (512, 2048, 65536):
        expr = composed.total_formula(shape, dataclasses.replace(launch, tokens_per_rank=n))
        exact = composed.compose(shape, dataclasses.replace(launch, tokens_per_rank=n), budget=1 << 40).total
        assert int(sympy.ceiling(expr.subs(composed.sym.N, n))) == exact, n
    with pytest.raises(BoundpassInputError, match="grad_accumulation must be a positive int"):
        composed.compose(shape, dataclasses.replace(launch, grad_accumulation=0), budget=1 << 40)


def test_exchange_terms_built_unevaluated_are_the_evaluated_max():
    """composed.exchange_terms builds its Max unevaluated (sympy's pairwise comparisons of the parts took ~0.6 s
    of every plan at W > 1): it must be the very expression sympy's evaluation gives (no part dominated)."""
    import sympy
    W = composed.sym.W
    for (_, formula, *_), part in zip(composed.exchange_terms(), ("peak", "saved")):
        full = composed.attention_bound(part)
        evaluated = sympy.Max(0, full - full.subs(W, 1))
        if part == "peak":
            saved = composed.attention_bound("saved")
            evaluated = sympy.Max(evaluated, saved - saved.subs(W, 1))
        assert formula == evaluated and str(formula) == str(evaluated), part


def test_plan_report_says_which_block_terms_are_traced_and_why_not():
    """plan traces every family's blocks in the launch's dtype (bf16 by default); gpt_oss in fp32 (which
    torchtitan cannot run) keeps the hand-written block terms, and the report says why; at W > 1 the blocks'
    traces without their routed experts stand beside the hand-written dispatch and exchange terms."""
    kw = dict(tokens_per_rank=512, budget="64GiB", do_trace=False)
    for model, flavor in (("qwen3", "debugmodel_moe"), ("gpt_oss", "debugmodel"), ("deepseek_v3", "debugmodel")):
        result = plan(model, flavor, ranks=1, **kw)
        assert any(n.startswith("block terms: traced") for n in result.trace_notes), (model, result.trace_notes)
        assert any(t.kind == "traced_moe_forward" and t.name.startswith("traced") for t in result.table.terms)
        assert not any(t.kind in ("layer", "attention", "moe") for t in result.table.terms)
    fp32 = plan("gpt_oss", "debugmodel", ranks=1, dtype="fp32", **kw)
    assert any("hand-written (gpt_oss runs only in bf16" in n for n in fp32.trace_notes), fp32.trace_notes
    wide = plan("qwen3", "debugmodel_moe", ranks=2, ep=2, **kw)
    assert any(n.startswith("block terms: traced on one rank without the routed experts") for n in wide.trace_notes)
    kinds = {t.kind for t in wide.table.terms}
    assert {"traced_moe_forward_ffn", "dispatch", "attention_exchange"} <= kinds and "moe" not in kinds


def test_borrowed_slots_move_the_dispatch_term_by_their_experts():
    """dispatch_borrowed_slots (s_b): PipelinedLLEP's backward holds s_b borrowed experts' weights and their gradients
    (2 s_b Wx), its forward their weights; None is LLEP's default e = E/E_p; more slots than the other ranks' experts
    count as those, more than LLEP's planner ever lends one helper for N k routes per rank (lendable_experts: 2 of
    the 4 here) as those; 0 none."""
    from boundpass.runtime.llep_plan import lendable_experts
    import dataclasses
    shape = model_shape("deepseek_v3", "debugmodel")
    launch = composed.Launch(ranks=2, ep=2, ring=2, tokens_per_rank=2048, b=4, b_acc=4)

    def terms(slots):
        table = composed.compose(shape, dataclasses.replace(launch, dispatch_borrowed_slots=slots), budget=1 << 40)
        return [next(t.value for t in table.terms if t.name == f"expert dispatch (PipelinedLLEP, routing-independent)"
                     f", its {part}") for part in ("forward", "backward")]
    e = shape.experts // 2
    expert = 3 * shape.expert_hidden * shape.hidden * 4  # Wx at b = 4
    lent = lendable_experts(launch.tokens_per_rank * shape.top_k, e, 2)
    assert 1 < lent < e
    assert terms(None) == terms(e) == terms(e + 5) == terms(lent) != terms(lent - 1)
    (f0, b0), (f1, b1), (fe, be) = terms(0), terms(1), terms(None)
    assert (f1 - f0, b1 - b0) == (expert, 2 * expert) and (fe - f0, be - b0) == (lent * expert, 2 * lent * expert)


# ------------------------------------------------------------------------------ FSDP2's data-parallel baseline
@pytest.mark.parametrize("batch,seq,hidden,vocab,chunks,dtype", [
    (1, 512, 64, 1000, 8, torch.float32), (2, 512, 64, 1000, 8, torch.float32),
    (1, 2048, 32, 4096, 8, torch.float32), (1, 1024, 64, 4096, 4, torch.float32),
    (1, 1024, 64, 4096, 8, torch.bfloat16)])
def test_torchtitans_chunked_loss_stays_under_its_term(batch, seq, hidden, vocab, chunks, dtype):
    """composed.chunked_loss_bound against torchtitan's own ChunkedLossWrapper (its CrossEntropyLoss per chunk, each
    chunk's backward at once, the fp32 gradient accumulator, then the hidden states' backward), measured with the
    live-storage tracker: sound, and within 1.25x (one op at its own scale). Several sequences per batch make the
    chunks copies (the sequence split is not contiguous then)."""
    import importlib

    import sympy
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    from boundpass.core import symbols as sym
    from boundpass.measure.memtrack import LiveStorageTracker
    rd = importlib.import_module("boundpass.runtime.ring_dtp")
    wrapper = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=chunks, loss_fn=CrossEntropyLoss.Config()))
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype)
    wrapper.set_lm_head(head)
    x = torch.randn(batch, seq, hidden, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq))
    labels[0, :7] = -100  # ignore_index rows
    tracker = LiveStorageTracker().track_existing(x, labels, head.weight)
    with tracker:
        h = x * 1.0  # the decoder's output, as the model hands it over
        loss, _ = wrapper(h, labels, (labels != -100).sum())
        loss.backward()
        del h, loss
    # the composed head term (the weight shard and its gradient counted by their own terms at P = 1) + those two +
    # the decoder output and its gradient
    shard = sympy.ceiling(sym.V / sym.P) * sym.H * sym.b
    mixed = dtype != torch.float32
    full = rd.reference_bound(mixed_precision=mixed) - shard * (2 - sympy.Min(1, sym.P - 1))
    expr = composed.chunked_loss_bound(full, chunks) + 2 * sym.V * sym.H * sym.b + 2 * sym.N * sym.H * sym.b
    bound = sym.evaluate(expr, dict(N=batch * seq, H=hidden, V=vocab, P=1, b=x.element_size(), b_acc=4, b_idx=8))
    measured = tracker.peak_bytes()
    assert measured <= bound <= 1.25 * measured, (measured, bound, bound / measured)
    assert bound < sym.evaluate(full + 2 * sym.V * sym.H * sym.b + 2 * sym.N * sym.H * sym.b,
                                dict(N=batch * seq, H=hidden, V=vocab, P=1, b=x.element_size(), b_acc=4, b_idx=8))


def test_the_dp_layout_is_fsdp2s_data_parallel_baseline():
    """layout="dp" (stock torchtitan's FSDP2: whole sequences per rank): no sequence-to-head exchange term, the
    attention's hand-written terms at one rank, heads need not divide W; torchtitan's chunked loss replaces the
    full-logits head term; standard EP's forward alone in the forward sub-phases. Bad layouts are refused before
    any model is built."""
    kw = dict(ranks=4, ep=2, context=2048, global_batch=4, budget="2GiB", host_budget="4GiB", dtype="fp32",
              operators=(), do_trace=False)
    mop = plan("deepseek_v3", "debugmodel", **kw)
    dp = plan("deepseek_v3", "debugmodel", layout="dp", **kw)
    chunked = plan("deepseek_v3", "debugmodel", layout="dp", loss_chunks=8, **kw)
    kinds = lambda r: {t.kind: t for t in r.table.terms}  # noqa: E731
    assert any(k.startswith("attention_exchange") for k in kinds(mop)) and not any(
        k.startswith("attention_exchange") for k in kinds(dp))
    assert dp.table.total < mop.table.total  # the same N per rank, nothing exchanged
    head = lambda r: next(t for t in r.table.terms if t.name.startswith("vocab projection"))  # noqa: E731
    assert "chunked loss, 8 chunks" in head(chunked).name and head(chunked).value < head(dp).value
    assert kinds(dp)["dispatch_forward"].value < kinds(dp)["dispatch"].value
    # 16 heads over 3 ranks: the MoP layout cannot split them, data parallelism does not need to
    three = dict(kw, ranks=3, ep=1, global_batch=3, context=1024)
    with pytest.raises(BoundpassInputError, match="W must divide"):
        plan("deepseek_v3", "debugmodel", **three)
    assert plan("deepseek_v3", "debugmodel", layout="dp", **three).table.total > 0
    with pytest.raises(BoundpassInputError, match="whole sequences"):
        make_input("deepseek_v3", "debugmodel", ranks=4, context=1024, global_batch=2, layout="dp")
    with pytest.raises(BoundpassInputError, match="layout must be"):
        make_input("deepseek_v3", "debugmodel", ranks=4, context=1024, global_batch=4, layout="tp")
    with pytest.raises(BoundpassInputError, match="loss_chunks"):
        make_input("deepseek_v3", "debugmodel", ranks=4, context=1024, global_batch=4, loss_chunks=0)


def test_attention_tiles_plan_the_mop_layouts_attention_on_the_host():
    """plan --attention-tiles C_s: the blocks traced with the MoP layout's attention in tiles (runtime/
    seq_to_head_tiles.py) and its host rows a host term: at a long context the device total drops by more than the
    whole-sequence attention tensors the exchange held, the exchange's own term is O(C_s), and the host term is what
    the op's host bound says at this launch. Refused off the MoP layout and for a negative tile."""
    from boundpass.core import symbols as sym
    from boundpass.runtime import seq_to_head_tiles as st
    kw = dict(ranks=4, ep=2, context=16_384, global_batch=1, budget="2GiB", host_budget="4GiB", dtype="fp32",
              operators=("ring_dtp", "pipelined_llep", "offload_adamw"), do_trace=False)
    whole = plan("deepseek_v3", "debugmodel", **kw)
    tiles = plan("deepseek_v3", "debugmodel", attention_tiles=256, **kw)
    N = 4096
    one = N * 16 * 192 * 4                        # one [N, 16 heads, 192] fp32 tensor of the rank's tokens
    assert whole.table.total - tiles.table.total > 2 * one, (whole.table.total, tiles.table.total)
    terms = {t.kind: t for t in tiles.table.terms}
    assert terms["attention_exchange"].value < one / 8
    host = next(t for t in tiles.table.terms if t.kind == "host" and "sequence-to-head tiles" in t.name)
    expected = st.seq_to_head_tiles_host_bound("backward").xreplace({st.ca.D_v_sym: sym.D_h}).xreplace(
        {sym.N: N, sym.A_q: 16, sym.A_kv: 16, sym.D_h: 192, sym.b: 4, sym.b_acc: 4})
    assert host.value == int(expected)
    assert "attention in tiles of C_s=256" in tiles.render()
    with pytest.raises(BoundpassInputError, match="attention_tiles"):
        make_input("deepseek_v3", "debugmodel", ranks=4, context=1024, global_batch=4, layout="dp",
                   attention_tiles=256)
    with pytest.raises(BoundpassInputError, match="attention_tiles"):
        make_input("deepseek_v3", "debugmodel", ranks=4, context=1024, attention_tiles=-1)


def test_boundaries_and_gradients_are_never_both_whole_in_a_blocks_backward():
    """freed_moe / freed_dense (docs/plan.md): below k finished MoE blocks k boundaries are freed and the other
    L_moe - 1 - k have no gradient shard yet, so the backward sub-phases take (L_moe - 1)·Min(N·H·b, the smallest MoE
    block's shard) off; the first block, the only dense one, runs with every other boundary gone. Nothing is taken
    when boundaries are offloaded (SCO) or gradients accumulate. Under W > 1 the wide trace holds the block's own
    unsharded gradients as its backward writes them: the hand-written grads_* terms keep only the routed experts'
    gathered weights and gradients."""
    shape = model_shape("deepseek_v3", "debugmodel")
    H, b, W = shape.hidden, 4, 4
    shard = shape.min_moe_block_params // W * b
    ops = frozenset({"ring_dtp", "pipelined_llep", "offload_adamw"})
    for n in (64, 16_384):  # the boundary the smaller at 64 tokens, the gradient shard at 16,384
        launch = composed.Launch(ranks=W, ep=2, ring=W, tokens_per_rank=n, operators=ops, b=b, b_acc=4)
        table = composed.compose(shape, launch, budget=1 << 40)
        assert table.sum("freed_moe") == -(shape.moe_layers - 1) * min(n * H * b, shard), n
        assert table.sum("freed_dense") == -(shape.layers - 1) * n * H * b
        accumulated = composed.compose(shape, dataclasses.replace(launch, grad_accumulation=2), budget=1 << 40)
        assert not {"freed_moe", "freed_dense"} & {t.kind for t in accumulated.terms}
    offloading = composed.Launch(ranks=W, ep=2, ring=W, tokens_per_rank=4096, operators=ops | {"sco"}, b=b, b_acc=4)
    sco = composed.compose(shape, offloading, budget=1 << 40, host_budget=1 << 40)
    assert composed.symbol_values(shape, offloading, host_budget=1 << 40)[composed.sym.L_off] > 0
    assert sco.sum("freed_moe") == sco.sum("freed_dense") == 0
    traced = plan("deepseek_v3", "debugmodel", ranks=W, ep=2, context=8192, budget="2GiB", host_budget="4GiB",
                  dtype="fp32", operators=tuple(ops))
    s = traced.table.sum
    assert any(t.kind == "traced_moe_tail_backward" for t in traced.table.terms)
    experts = 2 * (shape.experts // 2) * 3 * shape.expert_hidden * H * b  # this rank's E/E_p experts, gathered + grads
    assert s("grads_ffn_moe") == 0 and s("grads_attention_moe") == s("grads_tail_moe") == experts
    assert s("grads_ffn_dense") == s("grads_attention_dense") == s("grads_tail_dense") == 0
    assert s("grads_reduce_moe") > s("grads_reduce_dense") > 0
