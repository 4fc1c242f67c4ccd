"""The MoP layout on torchtitan's deepseek_v3 debug MoE model: 3 training steps on 4 gloo ranks (W = 4 sequence
shards, FSDP2 dense weights, sequence-to-head attention, E_p = 2 expert parallelism) match the same model
trained on one rank with the same global batch. Three layouts: the plain one (torchtitan's EP dispatcher,
full-logits head); with both bounded operators (PipelinedLLEP dispatch over the EP group with a small chunk
cap, so every MoE layer runs several chunks; Ring-DTP head over the 4-rank ring); and the operators under
adversarial routing (every token picks experts 0..2, all owned by EP rank 0), against a one-rank reference with
the same routing.

Tolerance: the forward is the same function (attention per head on the full sequence, every other op per token;
MLA's attention runs the fused SDPA kernel on zero-padded v instead of the reference's math path, so step 1's
loss agrees to rounding: 1e-6 relative); what differs is how gradients are summed: each rank's partial gradient,
reduce-scattered, instead of one sum over the whole batch. In fp32 that moves the dense weights by 4.0e-6 to
7.4e-6 (measured, the three layouts) after 3 AdamW steps: bound 2e-5 relative (L2 per tensor). torchtitan's
GroupedExperts runs the expert matmuls in bf16, so each rank's partial expert-weight gradient is rounded to bf16
(unit roundoff 2^-8 = 3.9e-3) before the sum: routed experts and the router gate they feed move by 2.0e-3 to 2.8e-3
(measured): bound 5e-3. Losses (global, all-reduced) within 1e-5 relative (measured: 3.2e-7). The test prints
these worst figures. (Until 2026-12-03 it ran 5 steps: ~3e-6 and ~2e-3 then.) A wrong position, head, shard or expert placement
gives O(1) differences.
"""

import pytest
import torch

pytest.importorskip("torchtitan")
from boundpass.testing.distributed import run_on_ranks  # noqa: E402

pytestmark = [pytest.mark.torchtitan, pytest.mark.distributed]

NAME, SEQ, BATCH, VOCAB, LAYERS, STEPS, LR = "deepseek_v3", 32, 2, 256, 3, 3, 1e-3
CAP = 4  # PipelinedLLEP chunk cap c: 16 tokens per rank x top-3 -> several chunks per layer
HOT = (0, 1, 2)  # adversarial routing: every token to these experts (EP rank 0's)
LOSS_RTOL, WEIGHT_RTOL, BF16_EXPERT_RTOL = 1e-5, 2e-5, 5e-3
BF16_PATHS = ("moe.routed_experts.inner_experts.", "moe.router.gate.")


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _composed_bounds():
    """The composed per-rank budget (boundpass.bound.composed) of the 4-rank launch per layout, traced once here in the
    test process (the block traces are the same on every rank): AdamW on the device, every block checkpointed,
    fp32 (b = b_acc = 4); standard EP at worst-case routing and full logits, or PipelinedLLEP (cap CAP) and
    Ring-DTP (P = W)."""
    from boundpass.bound import composed
    from boundpass.planning.full_scale import shape_of_module
    from boundpass.recipes.mop import build_model, mop_config
    world, ep = 4, 2
    cfg = mop_config(NAME, world=world, ep=ep, seq_len=SEQ, vocab_size=VOCAB)
    shape = shape_of_module(build_model(cfg, layers=LAYERS), name=NAME,
                            heads_config=cfg.model_spec.model.layers[0].attention,
                            top_k=cfg.model_spec.model.layers[1].moe.router.top_k, traces="wide")
    bounds = {}
    for ops in (False, True):
        launch = composed.Launch(ranks=world, ep=ep, ring=world, tokens_per_rank=BATCH * SEQ // world,
                                 operators=frozenset({"pipelined_llep", "ring_dtp"} if ops else ()), b=4, b_acc=4,
                                 dispatch_cap=CAP if ops else None)
        bounds[ops] = composed.compose(shape, launch, budget=1 << 40).total
    return bounds


def _train(rank, world, ep, ops=False, skew=False, built=None):
    """STEPS AdamW steps; returns (global loss per step, full weights on rank 0, layout facts, what was built).

    Under the layout every block is checkpointed (torchtitan's FullAC, recompute is the same arithmetic) and
    the last step runs under a LiveStorageTracker that counts this rank's parameter shards, optimizer state
    and buffers from the start: facts["peak"] is the rank's measured peak of one whole training step; the step before
    it is measured at torch's allocator the same way (facts["allocator_peak"]).

    built: another layout's (model, its initial parameters and buffers, facts, loss) with the same operators: its
    weights and buffers are put back to the initial ones and this run trains that model again (its compiled block
    graphs and head step are reused: a 4-rank compile costs ~10 s here); routing is then set on the laid-out model."""
    from boundpass.recipes.models import torchtitan_loss
    from boundpass.recipes.mop import build_model, mop_config, mop_loss, parallelize_mop
    from boundpass.testing.routing import route_all_to
    from torchtitan.distributed.activation_checkpoint import FullAC
    if built is not None:
        model, initial, built_facts, loss_fn = built
        with torch.no_grad():
            for t, t0 in zip([*model.parameters(), *model.buffers()], initial):
                t.copy_(t0)
        if skew:
            route_all_to(model, HOT)
        return _steps(rank, world, model, dict(built_facts), loss_fn) + (built,)
    cfg = mop_config(NAME, world=world, ep=ep, seq_len=SEQ, vocab_size=VOCAB)
    model = build_model(cfg, layers=LAYERS)  # layer 0 dense + 2 MoE layers keep the test cheap
    if skew:
        route_all_to(model, HOT)
    facts = {}
    if world > 1:
        parallelize_mop(model, cfg, world=world, ac_config=FullAC.Config(), pipelined_llep=ops, ring_dtp=ops,
                        dispatch_cap=CAP)
        routed = model.layers["1"].moe.routed_experts
        facts.update(ep=routed.token_dispatcher.ep_mesh.size(), experts=routed.inner_experts.w1_EFD.shape[0],
                     attention={type(b.attention.inner_attention).__name__ for b in model.layers.values()},
                     head=type(model.lm_head).__name__,
                     head_rows=model.lm_head.weight.to_local().shape[0] if ops else None)
    loss_fn = mop_loss(model) if world > 1 else torchtitan_loss()
    with torch.no_grad():
        initial = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    return _steps(rank, world, model, facts, loss_fn) + ((model, initial, dict(facts), loss_fn),)


def _steps(rank, world, model, facts, loss_fn):
    """_train's STEPS AdamW steps on a built model: (losses, full weights on rank 0, facts)."""
    import torch.distributed as dist
    from boundpass.measure.memtrack import LiveStorageTracker
    from boundpass.recipes.mop import shard_batch
    from boundpass.testing.whole_step import allocator_peak_of
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        tokens, labels = _batch(step)
        positions = None
        if world > 1:
            tokens, labels, positions = shard_batch(tokens, labels, rank, world)

        def one_step():
            loss, _ = loss_fn(model(tokens, positions=positions), labels, torch.tensor(BATCH * SEQ))
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        if world > 1 and step >= STEPS - 2:
            # the persistent state counted from the start. Step STEPS-1: torch's allocator, what C++ allocates
            # included (kernel workspaces, collective buffers); step STEPS: the live storages of tensors
            # (LiveStorageTracker); the budget is asserted against both
            def state():
                return [*model.parameters(), *model.buffers(), *(
                    t for st in opt.state.values() for t in st.values() if torch.is_tensor(t))]
            if step == STEPS - 2:
                loss, facts["allocator_peak"] = allocator_peak_of(one_step, state())  # the list not held here
            else:
                with LiveStorageTracker() as tracker:
                    tracker.track_existing(*map(_local, state()))
                    loss = one_step()
                facts["peak"] = tracker.peak_bytes()
        else:
            loss = one_step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)  # each rank's loss is its tokens' share of the global mean
        losses.append(total.item())
    if world > 1:  # the blocks compiled at the first forward: what the dispatch pass rewrote is known now
        facts.update(_dispatch_facts(model))
    weights = {n.replace("_checkpoint_wrapped_module.", ""):  # FullAC's wrapper adds a level to the names
               (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for n, p in model.named_parameters()}
    return losses, (weights if rank == 0 else None), facts


def _dispatch_facts(model) -> dict:
    """Where the layout's operators came from: the routed-experts modules the dispatch pass rewrote in the block
    graphs torchtitan's per-block compile handed it, whether any module's forward was replaced (it must not be: the
    op comes from the pass), how many block graphs the backend compiled, and the head step's vocab region."""
    from torchtitan.models.common.moe import RoutedExperts

    from boundpass.backend.gloo_release import fsdp_param_groups, uses_releasing_reduce_scatter
    backend, head = model._mop.dispatch_backend, model._mop.head_backend
    groups = [g for _, g in fsdp_param_groups(model)]
    return dict(dispatch=list(model._mop.dispatch), graphs=backend.graphs if backend is not None else 0,
                # the layout put every FSDP2 group's gloo reduce-scatter on the releasing one (what the budget counts)
                releasing=(sum(map(uses_releasing_reduce_scatter, groups)), len(groups)),
                # Ring-DTP from the vocab pass: the head step's gather + projection + loss rewritten (the backend
                # refuses a graph where the weight's all-gather remains)
                head_regions=[(r.rewritten, r.vocab) for r in head.regions] if head is not None else [],
                # torchtitan's EP sets an instance forward itself (its local_map wrapper): look for one of boundpass's
                replaced=[n for n, m in model.named_modules() if isinstance(m, RoutedExperts) and "forward" in vars(m)
                          and str(getattr(vars(m)["forward"], "__module__", "")).startswith("boundpass")])


LAYOUTS = {"plain": dict(ops=False, skew=False), "operators": dict(ops=True, skew=False),
           "operators_all_to_rank0": dict(ops=True, skew=True)}


def _every_run(rank, world):
    """Everything this module trains, in one launch per world size (each launch costs ~8 s of spawning and imports
    per rank): at W = 1 the references (both routings, and one step of each model in OTHER), at W = 4 every layout
    and one step of each model in OTHER. Each run starts from the same seed's weights: an adversarial-routing run on
    the model of the run before it, its weights and buffers put back (at W = 4 one 4-rank compile less)."""
    if world == 1:
        *plain, built = _train(rank, 1, 1, False, False)
        train = {False: tuple(plain), True: _train(rank, 1, 1, False, True, built)[:3]}
        del built
    else:
        train, built = {}, {}
        for name, kw in LAYOUTS.items():  # the adversarial-routing layout retrains the operator layout's model
            *train[name], built[kw["ops"]] = _train(rank, world, 2, kw["ops"], kw["skew"], built.get(kw["ops"]))
            train[name] = tuple(train[name])
        built.clear()
    return train, {name: _one_step(rank, world, name) for name in OTHER}


@pytest.fixture(scope="module")
def launches():
    """(W = 1's results, W = 4's results per rank, the composed bounds per operator set)."""
    return run_on_ranks(_every_run, 1, timeout_s=400)[0], run_on_ranks(_every_run, 4, timeout_s=900), \
        _composed_bounds()


@pytest.fixture(scope="module")
def runs(launches):
    (single, _), wide, bounds = launches
    out = {}
    for name, kw in LAYOUTS.items():
        ranks = [train[name] for train, _ in wide]
        for _, _, facts in ranks:
            facts["bound"] = bounds[kw["ops"]]
        out[name] = (single[kw["skew"]], ranks)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_is_what_it_says(runs, layout):
    _, mop = runs[layout]
    facts = mop[0][2]
    assert facts["attention"] == {"SeqToHeadAttention"}
    assert facts["ep"] == 2 and facts["experts"] == 8  # 4 of 8 experts on each EP rank
    assert facts["releasing"][0] == facts["releasing"][1] > 0, facts["releasing"]
    if LAYOUTS[layout]["ops"]:
        # through the pass: torchtitan's per-block compile handed the blocks' graphs to boundpass's dispatch backend
        # (the dense block 0 and the MoE blocks, which share one graph; FullAC's recompute is inside them)
        assert facts["dispatch"] == ["layers.1.moe.routed_experts", "layers.2.moe.routed_experts"]
        assert facts["replaced"] == [] and facts["graphs"] == 2, facts  # one recompile per block would be more
        assert facts["head"] == "RingDTPHead" and facts["head_rows"] == VOCAB // 4  # a quarter of the vocab
        assert facts["head_regions"] == [(True, VOCAB)], facts  # one compile of the head step, rewritten
    else:
        assert facts["dispatch"] == [] and facts["head"] != "RingDTPHead"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_rank_peak_within_composed_budget(runs, layout):
    """The composed budget of the layout (W = 4, E_p = 2) against each rank's measured peak of a whole training
    step, both ways: torch's allocator (what C++ allocates included: collective buffers, kernel workspaces)
    <= budget <= 1.10 x that; and the live storages of the next step <= budget. Until gloo's all-gather outputs were
    released when FSDP2 drops them (boundpass/backend/gloo_release.py) a worker thread could keep one alive into the next
    block's backward: up to 1.080x the budget under all-to-one routing with the CPU busy (docs/mop.md)."""
    _, mop = runs[layout]
    print(f"{layout}: torch's allocator / composed budget per rank "
          + ", ".join(f"{facts['allocator_peak'] / facts['bound']:.3f}" for _, _, facts in mop)
          + "; live storages / composed budget "
          + ", ".join(f"{facts['peak'] / facts['bound']:.3f}" for _, _, facts in mop))
    for rank, (_, _, facts) in enumerate(mop):
        measured, bound = facts["allocator_peak"], facts["bound"]
        assert measured <= bound, f"rank {rank}: allocator peak {measured} B > bound {bound} B"
        assert bound <= 1.10 * measured, f"rank {rank}: bound {bound} B > 1.10 x allocator peak {measured} B"
        assert 0 < facts["peak"] <= bound, f"rank {rank}: live storages {facts['peak']} B > bound {bound} B"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mop_matches_single_rank(runs, layout):
    (ref_losses, ref_weights, _), mop = runs[layout]
    for rank, (losses, _, _) in enumerate(mop):
        assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL), f"rank {rank}: {losses} vs {ref_losses}"
    assert mop[0][0][0] == pytest.approx(ref_losses[0], rel=1e-6)  # step 1: same weights, same function
    weights = mop[0][1]
    assert weights.keys() == ref_weights.keys()
    worst = {True: 0.0, False: 0.0}
    for n, ref in ref_weights.items():
        rel = ((weights[n] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        bf16 = any(p in n for p in BF16_PATHS)
        assert rel <= (BF16_EXPERT_RTOL if bf16 else WEIGHT_RTOL), f"{n}: {rel:.2e}"
        worst[bf16] = max(worst[bf16], rel)
    losses = max(abs(a - b) / abs(b) for a, b in zip(mop[0][0], ref_losses))
    print(f"{layout}: worst weight rel-L2 after {STEPS} steps (bf16 expert paths, other) {worst[True]:.2e}, "
          f"{worst[False]:.2e}; worst loss rel {losses:.1e}")
    # the weights moved (the comparison is not between two initialisations)
    moved = max(((weights[n] - w0).norm() / w0.norm().clamp_min(1e-30)).item()
                for n, w0 in _initial_weights().items())
    assert moved > 10 * BF16_EXPERT_RTOL


def _initial_weights():
    """The weights every run starts from (the W = 1 reference's build)."""
    from boundpass.recipes.mop import build_model, mop_config
    model = build_model(mop_config(NAME, world=1, ep=1, seq_len=SEQ, vocab_size=VOCAB), layers=LAYERS)
    return {n: p.detach() for n, p in model.named_parameters()}


# ---- the other torchtitan MoE models under the layout: one step's loss and gradients vs one rank -------------------
# qwen3 MoE (GQA, q/k norms) in fp32 with both operators; gpt_oss with the Ring-DTP head but torchtitan's EP
# dispatcher (its experts have biases and a clamped activation: PipelinedLLEP refuses them, tested below), in bf16
# because its experts return bf16 whatever the input dtype (torchtitan runs it in bf16 only). Same weights, same
# batch, the same function: what differs is the order of sums (per-rank partial gradients reduce-scattered).
# Two blocks each (qwen3's debug blocks hold 64 experts, 38 M parameters: one step of 3 blocks on 4 ranks cost 22 s
# here, of 2 blocks 9 s); two cover what a third would: the gradient of one block's input through the next block.
# Tolerances (relative L2 per gradient tensor), measured worst in brackets: qwen3's experts and the router gate
# they feed 1e-2 (2.4e-3: bf16 expert matmuls, one bf16 product per rank's rows vs one over all rows); its other
# gradients 5e-3 (1.3e-3: every qwen3 block is MoE, so every input gradient passes a bf16 expert backward —
# unlike deepseek's dense first block); gpt_oss, bf16 end to end: 3e-2 (7.6e-3; bf16 unit roundoff 3.9e-3).
# Losses: 1e-6 (qwen3, equal) and 1e-4 (gpt_oss, 8e-8). A wrong shard, head or expert gives O(1) errors.
OTHER_LAYERS = 2
OTHER = {"qwen3_moe": dict(ops=True, dtype="float32", loss_rtol=1e-6, dense_rtol=5e-3, bf16_rtol=1e-2),
         "gpt_oss": dict(ops=False, dtype="bfloat16", loss_rtol=1e-4, dense_rtol=3e-2, bf16_rtol=3e-2)}


def _one_step(rank, world, name):
    import torch.distributed as dist
    from boundpass.recipes.models import torchtitan_loss
    from boundpass.recipes.mop import build_model, mop_config, mop_loss, parallelize_mop, shard_batch
    spec = OTHER[name]
    cfg = mop_config(name, world=max(world, 2), ep=2, seq_len=SEQ, vocab_size=VOCAB, param_dtype=spec["dtype"])
    model = build_model(cfg, layers=OTHER_LAYERS).to(getattr(torch, spec["dtype"]))
    tokens, labels = _batch(0)
    positions, loss_fn, facts = None, torchtitan_loss(), {}
    if world > 1:
        parallelize_mop(model, cfg, world=world, pipelined_llep=spec["ops"], ring_dtp=True, dispatch_cap=CAP)
        tokens, labels, positions = shard_batch(tokens, labels, rank, world)
        loss_fn = mop_loss(model)
    loss, _ = loss_fn(model(tokens, positions=positions), labels, torch.tensor(BATCH * SEQ))
    loss.backward()
    if world > 1:
        facts = dict(_dispatch_facts(model), head=type(model.lm_head).__name__)
    total = loss.detach().float().clone()
    if world > 1:
        dist.all_reduce(total)
    grads = {n.replace("_checkpoint_wrapped_module.", ""):
             None if p.grad is None else (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
             for n, p in model.named_parameters()}
    return total.item(), (grads if rank == 0 else None), facts


@pytest.fixture(scope="module")
def other_models(launches):
    (_, single), wide, _ = launches
    return {name: (single[name], [one_step[name] for _, one_step in wide]) for name in OTHER}


@pytest.mark.parametrize("name", OTHER)
def test_other_models_one_step_matches_single_rank(other_models, name):
    spec = OTHER[name]
    (ref_loss, ref_grads, _), mop = other_models[name]
    assert mop[0][2]["head"] == "RingDTPHead" and mop[0][2]["head_regions"] == [(True, VOCAB)]
    print(name, "PipelinedLLEP regions:", mop[0][2]["dispatch"])
    assert bool(mop[0][2]["dispatch"]) == spec["ops"] and mop[0][2]["replaced"] == []
    for rank, (loss, _, _) in enumerate(mop):
        assert loss == pytest.approx(ref_loss, rel=spec["loss_rtol"]), f"rank {rank}: {loss} vs {ref_loss}"
    grads = mop[0][1]
    assert grads.keys() == ref_grads.keys()
    worst = {}
    unused = {n for n, g in ref_grads.items() if g is None}
    assert unused == {n for n, g in grads.items() if g is None}, "different parameters received no gradient"
    for n, ref in ref_grads.items():
        if ref is None:
            continue
        rel = ((grads[n] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        bf16 = spec["dtype"] == "bfloat16" or any(p in n for p in ("moe.routed_experts.", "moe.router.gate."))
        assert rel <= (spec["bf16_rtol"] if bf16 else spec["dense_rtol"]), f"{name} {n}: {rel:.2e}"
        worst[bf16] = max(worst.get(bf16, 0.0), rel)
    print(f"{name}: loss {mop[0][0]:.8f} vs {ref_loss:.8f}; worst gradient rel-L2 (bf16 paths, other): "
          f"{worst.get(True, 0):.2e}, {worst.get(False, 0):.2e}")


def test_pipelined_llep_refuses_experts_it_does_not_compute():
    from boundpass.core.errors import BoundpassInputError
    from boundpass.recipes.models import build_debug_moe
    from boundpass.recipes.mop import apply_pipelined_llep
    model = build_debug_moe("gpt_oss", vocab_size=VOCAB, seq_len=SEQ)
    with pytest.raises(BoundpassInputError, match="experts GptOssGroupedExperts compute something other than torchtitan's SwiGLU"):
        apply_pipelined_llep(model, CAP)


def test_ring_dtp_refuses_a_vocabulary_the_ring_does_not_divide_before_parallelizing():
    from boundpass.core.errors import BoundpassInputError
    from boundpass.recipes.models import build_debug_moe
    from boundpass.recipes.mop import MoPOptions, prepare_mop

    class _Mesh:  # prepare_mop reads only the ring's size before anything is wrapped or sharded
        def size(self):
            return 3

    class _Dims:
        def get_mesh(self, name):
            return _Mesh()

    model = build_debug_moe("deepseek_v3", vocab_size=VOCAB, seq_len=SEQ)  # 256 rows: 3 ranks do not divide them
    with pytest.raises(BoundpassInputError, match=r"vocabulary \(256\) must divide by the 3 ranks"):
        prepare_mop(model, _Dims(), MoPOptions(sequence_to_head=False, ring_dtp=True))
    assert model.lm_head is not None  # refused before the head was taken out of the model

