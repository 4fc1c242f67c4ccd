"""Knobs at the knee (issue 18): the cost model's knee, and the planner's rule min(budget's widest, knee)."""
import copy
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import boundpass
from boundpass.bound import cost_model as cm
from boundpass.core.textwidth import flat

V, H, BATCH, SEQ = 8192, 32, 2, 512          # N = 1,024: the whole-vocab strip (32 MiB) misses the CPU "cache"


class TinyLM(nn.Module):
    def __init__(self, vocab=V, hidden=H):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        return self.lm_head(torch.tanh(self.emb(tokens)))


def titan_style_ce(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=-100)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, V, (BATCH, SEQ), generator=g)
    labels[0, :7] = -100
    return tokens, labels


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _knob(compiled):
    (knob,) = [k for k in boundpass.explain(compiled).certificate.planner.knobs if k.name == "vocab_block"]
    return knob


def _model_knee():
    return cm.ring_dtp_knee(lo=128, hi=V, N=BATCH * SEQ, H=H, V=V, costs=cm.costs_for("cpu"))


# ------------------------------------------------------------------------------------------ the planner
def test_loose_budget_takes_the_knee_not_the_widest_that_fits():
    knee = _model_knee()
    assert 128 <= knee < V, "this shape must have a knee below the whole vocab"
    model = TinyLM()
    compiled = boundpass.compile(model, budget="4GiB", loss_fn=titan_style_ce)
    compiled(*_batch())
    knob = _knob(compiled)
    assert knob.widest_fitting == V                    # the budget alone would allow the whole-vocab strip
    assert (knob.value, knob.why, knob.knee) == (knee, "knee", knee)
    assert boundpass.explain(compiled).rewritten_of("vocab")[0].block == knee
    text = flat(boundpass.explain(compiled).text())
    assert f"vocab_block = {knee} (knee; knee {knee}" in text and f"the budget alone allows {V}" in text
    # the memory the knee leaves to the rest of the step
    cert = boundpass.explain(compiled).certificate
    assert cert.table.total < cert.total_at(vocab_block=V)


def test_tight_budget_takes_the_budgets_value_below_the_knee():
    knee = _model_knee()
    probe = boundpass.compile(TinyLM(), budget="4GiB", loss_fn=titan_style_ce)
    probe(*_batch())
    cert = boundpass.explain(probe).certificate
    budget = cert.total_at(vocab_block=knee // 4)
    assert budget < cert.total_at(vocab_block=knee), "the strip must bind at this shape"
    torch._dynamo.reset()
    tight = boundpass.compile(TinyLM(), budget=budget, loss_fn=titan_style_ce)
    tight(*_batch())
    knob = _knob(tight)
    assert knob.why == "budget" and knob.value == knob.widest_fitting
    assert knee // 4 <= knob.value < knee and boundpass.explain(tight).table.fits()


def test_the_users_value_wins_over_the_knee():
    compiled = boundpass.compile(TinyLM(), budget="4GiB", loss_fn=titan_style_ce, vocab_block=V)
    compiled(*_batch())
    knob = _knob(compiled)
    assert (knob.value, knob.why, knob.widest_fitting) == (V, "user", V)


def test_the_step_is_exact_at_the_knee():
    model = TinyLM()
    reference = copy.deepcopy(model)
    tokens, labels = _batch(1)
    compiled = boundpass.compile(model, budget="4GiB", loss_fn=titan_style_ce)
    loss = compiled(tokens, labels)
    loss.backward()
    assert _knob(compiled).why == "knee"
    ref = titan_style_ce(reference(tokens), labels)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-3)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_knob_without_a_time_model_still_takes_the_widest_that_fits():
    from boundpass.planning.planner import Knob, StepPlanner

    class Peak:  # a graph peak of 10 B per unit of the knob
        def evaluate(self, values):
            return 10 * values[knob.symbol], None

    import sympy
    knob = Knob("dispatch_cap", sympy.Symbol("c"), lo=1, hi=100, arg="cap", ops=())
    planner = StepPlanner(budget=500, host_budget=None, state_terms=[], knobs=[knob], symbol_values={})
    planner.choose(Peak())
    assert (knob.value, knob.why, knob.widest_fitting) == (50, "budget", 50)
    planner.budget = 10_000
    planner.choose(Peak())
    assert (knob.value, knob.why) == (100, "widest")
    knob.knee = 20
    planner.choose(Peak())
    assert (knob.value, knob.why, knob.widest_fitting) == (20, "knee", 100)
    planner.budget = 150
    planner.choose(Peak())
    assert (knob.value, knob.why, knob.widest_fitting) == (15, "budget", 15)


# -------------------------------------------------------------------------------------- the cost model
SHAPES = [dict(N=4096, H=128, V=65536), dict(N=1024, H=32, V=8192), dict(N=16384, H=7168, V=25_000, P=8),
          dict(N=512, H=64, V=4096)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_knee_does_not_grow_when_launches_get_cheaper(device, shape):
    base = cm.costs_for(device)
    hi = -(-shape["V"] // shape.get("P", 1))
    knees = [cm.ring_dtp_knee(lo=128, hi=hi, costs=replace(base, launch_s=base.launch_s * f), **shape)
             for f in (8.0, 4.0, 2.0, 1.0, 0.5, 0.25, 0.0)]
    assert all(128 <= k <= hi for k in knees)
    assert knees == sorted(knees, reverse=True), knees


@pytest.mark.parametrize("shape", SHAPES)
def test_the_knee_is_the_smallest_value_within_the_tolerance(shape):
    costs = cm.costs_for("cpu")
    hi = -(-shape["V"] // shape.get("P", 1))
    times = {C: cm.ring_dtp_seconds(C, costs=costs, **shape) for C in cm.candidates(128, hi)}
    knee = cm.ring_dtp_knee(lo=128, hi=hi, costs=costs, **shape)
    best = min(times.values())
    assert times[knee] <= (1 + cm.KNEE_TOLERANCE) * best
    assert all(t > (1 + cm.KNEE_TOLERANCE) * best for C, t in times.items() if C < knee)
    # a looser tolerance never gives a wider knee; zero tolerance gives the fastest width
    assert cm.ring_dtp_knee(lo=128, hi=hi, costs=costs, tolerance=0.2, **shape) <= knee
    assert cm.ring_dtp_knee(lo=128, hi=hi, costs=costs, tolerance=0.0, **shape) == min(times, key=times.get)


def test_calibration_recovers_the_constants_of_a_modelled_curve():
    shape = dict(N=4096, H=128, V=65536)
    true = replace(cm.costs_for("cpu"), launch_s=40e-6)
    points = {C: cm.ring_dtp_seconds(C, costs=true, **shape) for C in (2048, 4096, 8192, 16384, 65536)}
    fitted = cm.calibrate(points, base=cm.costs_for("cpu"), **shape)
    assert fitted.launch_s == pytest.approx(true.launch_s, rel=0.5)
    for C, t in points.items():
        assert cm.ring_dtp_seconds(C, costs=fitted, **shape) == pytest.approx(t, rel=0.02)


def test_recalibrated_constants_are_read_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "costs.json"
    path.write_text('{"cuda": {"launch_s": 1e-9}}')
    monkeypatch.setenv("BOUNDPASS_COSTS", str(path))
    assert cm.costs_for("cuda").launch_s == 1e-9 and cm.costs_for("cpu") == cm.DEVICE_COSTS["cpu"]


# ------------------------------------------------------------------------ PipelinedLLEP: the dispatch cap c
DISPATCH_SHAPE = dict(N=1024, H=256, I=256, E=16, k=4)      # bench/dispatch.py --knee-only's shape


@pytest.mark.parametrize("E_p", [2, 4])
def test_one_chunk_is_not_the_dispatch_knee_where_its_transfer_outweighs_a_chunks_cost(E_p):
    """One chunk hides none of its all-to-all bytes behind the experts, two hide half: at the bench's shape on this
    CPU's fitted constants half the transfer outweighs one more chunk's fixed cost (as measured: c = 512 ran at
    0.81-1.04x c = 1,024 in docs/results/dispatch_knee.md), so the modelled best is at a few chunks, not at c = N,
    and the knee at or below it."""
    costs = cm.costs_for("cpu")
    N = DISPATCH_SHAPE["N"]
    times = {c: cm.pipelined_llep_seconds(c, E_p=E_p, costs=costs, **DISPATCH_SHAPE) for c in cm.candidates(1, N)}
    knee = cm.pipelined_llep_knee(lo=1, hi=N, E_p=E_p, costs=costs, **DISPATCH_SHAPE)
    assert times[N // 2] < times[N]
    assert knee <= min(times, key=times.get) < N
    # without an EP group there is nothing to hide and nothing to exchange: one chunk is the fastest
    alone = {c: cm.pipelined_llep_seconds(c, E_p=1, costs=costs, **DISPATCH_SHAPE) for c in cm.candidates(1, N)}
    assert min(alone, key=alone.get) == N


# The attention sublayer in query blocks at torchtitan's deepseek_v3 MLA shape (16 heads, D 192, D_v 128, bf16, a kv
# program, on the host): seconds of one forward + backward per (L, C_s), measured by bench/attention_knee.py
# (docs/results/attention_knee.md, 2026-12-07); the blocks constants of the time model are fitted to them.
ATTENTION_BLOCKS_CURVE = {
    2048: {64: 2.801, 128: 1.628, 256: 1.260, 512: 1.316, 1024: 1.656},
    4096: {64: 10.041, 128: 5.660, 256: 3.895, 512: 4.711, 1024: 5.098},
    8192: {128: 20.676, 256: 13.647, 512: 14.772, 1024: 16.297},
}


@pytest.mark.parametrize("length", sorted(ATTENTION_BLOCKS_CURVE))
def test_the_attention_blocks_knee_is_the_measured_one(length):
    curve = ATTENTION_BLOCKS_CURVE[length]
    shape = dict(lo=min(curve), hi=max(curve), B=1, L=length, A_q=16, D=192, D_v=128)
    model = cm.chunked_attention_knee(blocks=True, **shape)
    assert model == cm.knee(curve) == 256
    for C, seconds in curve.items():   # the curve's shape, not only its knee
        modelled = cm.chunked_attention_seconds(C, B=1, L=length, A_q=16, D=192, D_v=128, blocks=True)
        assert 0.8 <= modelled / seconds <= 1.2, (C, modelled, seconds)
    # the kernels' own constants (one forward + backward of the tile math) would take a narrower, slower tile there
    assert cm.chunked_attention_knee(**shape) <= model


@pytest.mark.parametrize("E_p", [2, 4])
def test_the_dispatch_knee_narrows_as_transfers_get_slower_and_widens_as_collectives_get_dearer(E_p):
    base = cm.costs_for("cpu")

    def knee(**changes):
        return cm.pipelined_llep_knee(lo=1, hi=DISPATCH_SHAPE["N"], E_p=E_p, costs=replace(base, **changes),
                                      **DISPATCH_SHAPE)
    slower = [knee(alltoall_bandwidth=base.alltoall_bandwidth * f) for f in (4.0, 1.0, 0.25, 0.0625)]
    dearer = [knee(collective_s=base.collective_s * f) for f in (0.25, 1.0, 4.0, 16.0)]
    assert slower == sorted(slower, reverse=True), slower   # more to hide: more, narrower chunks
    assert dearer == sorted(dearer), dearer                  # each chunk costs more: fewer, wider chunks


def test_dispatch_calibration_recovers_the_constants_of_modelled_curves():
    """Curves made by the model at known latency and rate (each scaled by its own load factor, as 4 ranks on 2 cores
    are) give those figures back, to the fit's grid step (10^(1/8))."""
    true = replace(cm.costs_for("cpu"), collective_s=5e-4, alltoall_bandwidth=3e8)
    curves = [(E_p, {c: load * cm.pipelined_llep_seconds(c, E_p=E_p, costs=true, **DISPATCH_SHAPE)
                     for c in (16, 32, 64, 128, 256, 512, 1024)})
              for E_p, load in ((2, 1.0), (4, 2.1))]
    fitted = cm.calibrate_dispatch(curves, window=1e9, **DISPATCH_SHAPE)
    assert fitted.collective_s == pytest.approx(true.collective_s, rel=0.34)
    assert fitted.alltoall_bandwidth == pytest.approx(true.alltoall_bandwidth, rel=0.34)
    for E_p in (2, 4):
        assert cm.pipelined_llep_knee(lo=1, hi=1024, E_p=E_p, costs=fitted, **DISPATCH_SHAPE) == \
            cm.pipelined_llep_knee(lo=1, hi=1024, E_p=E_p, costs=true, **DISPATCH_SHAPE)


# ------------------------------------------------------------------ OffloadStreamAdamW: the bucket β, slots S
OPT_H = 256                                    # Θ = 2·V·H = 4,194,304: a whole-model slot (64 MiB) misses the cache


def _opt_knee():
    theta = 2 * V * OPT_H
    return cm.offload_adamw_knee(Theta=theta, tensors=2, b=4, costs=cm.costs_for("cpu"), lo=cm.OPT_MIN_BUCKET,
                                 hi=theta), theta


def _opt_knobs(compiled):
    knobs = {k.name: k for k in boundpass.explain(compiled).optimizer.knobs}
    return knobs["optimizer_bucket"], knobs["optimizer_slots"]


def _offloaded(budget, **kwargs):
    model = TinyLM(hidden=OPT_H)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = boundpass.compile(model, budget=budget, loss_fn=titan_style_ce, optimizer=opt,
                                 optimizer_offload=True, **kwargs)
    compiled(*_batch()).backward()
    compiled.optimizer.step()
    return compiled


def test_optimizer_takes_the_knee_of_beta_and_s_at_a_loose_budget():
    (knee_beta, knee_slots), theta = _opt_knee()
    assert cm.OPT_MIN_BUCKET < knee_beta < theta and knee_slots == 1, "this Θ must have a knee below the whole model"
    compiled = _offloaded("4GiB")
    beta, slots = _opt_knobs(compiled)
    assert (beta.value, beta.why, beta.knee, beta.widest_fitting) == (knee_beta, "knee", knee_beta, theta)
    assert (slots.value, slots.why, slots.knee) == (1, "knee", 1) and slots.widest_fitting > 1
    opt = compiled.optimizer
    assert (opt.bucket_params, opt.staging_slots) == (knee_beta, 1)
    report = boundpass.explain(compiled)
    (staging,) = [t for t in report.table.terms if t.name.startswith("optimizer staging")]
    assert staging.value == 16 * knee_beta       # the staging certified is the knee's, not the whole model's
    text = flat(report.text("none"))
    assert (f"optimizer_bucket = {knee_beta} (knee; knee {knee_beta} (boundpass/bound/cost_model.py); "
            f"the budget alone allows {theta}; range 1..{theta})") in text
    assert "optimizer_slots = 1 (knee; knee 1 (boundpass/bound/cost_model.py)" in text


def test_a_tight_budget_forces_a_bucket_below_the_knee():
    (knee_beta, _), theta = _opt_knee()
    probe = _offloaded("4GiB")
    table = boundpass.explain(probe).table
    (staging,) = [t for t in table.terms if t.name.startswith("optimizer staging")]
    step_phase = table.sum("persistent") + table.sum("step")     # the optimizer phase, at the knee's staging
    budget = step_phase - staging.value + 16 * (knee_beta // 4)
    assert step_phase == table.total, "the optimizer phase must be the step's peak at this shape"
    torch._dynamo.reset()
    tight = _offloaded(budget)
    beta, slots = _opt_knobs(tight)
    assert beta.why == "budget" and beta.value == beta.widest_fitting and knee_beta // 4 <= beta.value < knee_beta
    assert tight.optimizer.bucket_params == beta.value and boundpass.explain(tight).table.fits()
    assert f"optimizer_bucket = {beta.value} (budget; knee {knee_beta}" in flat(boundpass.explain(tight).text("none"))


def test_the_users_bucket_and_slots_win_over_the_knee():
    (_, _), theta = _opt_knee()
    compiled = _offloaded("4GiB", optimizer_bucket=theta, optimizer_slots=3)
    beta, slots = _opt_knobs(compiled)
    assert (beta.value, beta.why, slots.value, slots.why) == (theta, "user", 3, "user")
    assert (compiled.optimizer.bucket_params, compiled.optimizer.staging_slots) == (theta, 3)
    assert f"optimizer_bucket = {theta} (user;" in flat(boundpass.explain(compiled).text("none"))


def test_the_optimizer_step_is_exact_at_the_knee():
    model = TinyLM(hidden=OPT_H)
    reference = copy.deepcopy(model)
    compiled = boundpass.compile(model, budget="4GiB", loss_fn=titan_style_ce,
                                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), optimizer_offload=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    for seed in range(2):
        tokens, labels = _batch(seed)
        compiled(tokens, labels).backward()
        titan_style_ce(reference(tokens), labels).backward()
        for p, q in zip(model.parameters(), reference.parameters()):   # the same grads into both optimizers
            q.grad = p.grad.clone()
        compiled.optimizer.step()
        ref_opt.step()
        compiled.optimizer.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    assert _opt_knobs(compiled)[0].why == "knee" and compiled.optimizer.bucket_params < 2 * V * OPT_H
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_optimizer_model_knee_is_the_least_staging_within_the_tolerance(device):
    costs = cm.costs_for(device)
    for theta, tensors in ((4 << 20, 2), (45_617_664, 39), (1 << 30, 300)):
        hi = min(theta, 1 << 24)
        beta, slots = cm.offload_adamw_knee(Theta=theta, tensors=tensors, costs=costs, hi=hi)
        times = {(b, s): cm.offload_adamw_seconds(b, s, Theta=theta, tensors=tensors, costs=costs)
                 for b in cm.candidates(cm.OPT_MIN_BUCKET, hi) for s in range(1, cm.OPT_MAX_SLOTS + 1)}
        best = min(times.values())
        assert times[(beta, slots)] <= (1 + cm.KNEE_TOLERANCE) * best
        assert all(t > (1 + cm.KNEE_TOLERANCE) * best for (b, s), t in times.items() if b * s < beta * slots)
        if not costs.overlap:  # program order: a second slot buys nothing
            assert slots == 1
        else:                  # streams: one slot cannot overlap the copies with the update
            assert slots >= 2


def test_the_optimizer_model_without_overlap_is_additive_and_with_overlap_near_the_link_floor():
    theta, cpu, cuda = 1 << 26, cm.costs_for("cpu"), cm.costs_for("cuda")
    # CPU: the bytes are independent of β, only the per-bucket ops and the cache regime change
    fine, coarse = (cm.offload_adamw_seconds(b, 1, Theta=theta, costs=cpu) for b in (1 << 12, 1 << 13))
    nb = (theta >> 12) - (theta >> 13)
    assert fine - coarse == pytest.approx(nb * cm.OPT_BUCKET_LAUNCHES * cpu.launch_s, rel=1e-6)
    assert cm.offload_adamw_seconds(1 << 20, 3, Theta=theta, costs=cpu) == cm.offload_adamw_seconds(
        1 << 20, 1, Theta=theta, costs=cpu)
    # CUDA: at the knee with two slots the step is within 1.2x of the 12·Θ link floor (docs/offload_adamw.md)
    beta, slots = cm.offload_adamw_knee(Theta=theta, costs=cuda, hi=1 << 24)
    floor = cm.OPT_LINK_BYTES * theta / cuda.link_bandwidth
    assert cm.offload_adamw_seconds(beta, slots, Theta=theta, costs=cuda) <= 1.2 * floor
    assert cm.offload_adamw_seconds(beta, 1, Theta=theta, costs=cuda) > 2 * floor  # no overlap with one slot


def test_optimizer_calibration_recovers_the_constants_of_a_modelled_curve():
    theta = 45_617_664
    true = replace(cm.costs_for("cpu"), launch_s=9e-6, cache_bandwidth=30e9)
    points = {b: cm.offload_adamw_seconds(b, 1, Theta=theta, tensors=39, costs=true)
              for b in (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20)}   # slots of 64 KiB .. 16 MiB: all in cache
    fitted = cm.calibrate_optimizer(points, Theta=theta, tensors=39, base=cm.costs_for("cpu"))
    assert fitted.launch_s == pytest.approx(true.launch_s, rel=0.05)
    assert fitted.cache_bandwidth == pytest.approx(true.cache_bandwidth, rel=0.05)
    cuda = cm.calibrate_optimizer({}, Theta=theta, base=cm.costs_for("cuda"), link_bandwidth=21e9)
    assert cuda.link_bandwidth == 21e9 and cuda.launch_s == cm.costs_for("cuda").launch_s


# ----------------------------------------------------------------------------- SCO: how many boundaries
def _stack(layers=4, width=64):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    torch.manual_seed(0)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(checkpoint_wrapper(nn.Sequential(nn.Linear(width, width), nn.GELU()))
                                        for _ in range(layers))

        def forward(self, x):
            h = x * 1            # a computed first boundary (a graph input would be the caller's)
            for block in self.blocks:
                h = block(h)
            return h
    return Stack()


def _square(out, labels):
    return out.float().pow(2).mean()


def _sco_compiled(budget, rows=1024, **kwargs):
    torch._dynamo.reset()
    compiled = boundpass.compile(_stack(), budget=budget, loss_fn=_square, **kwargs)
    compiled(torch.randn(rows, 64)).backward()
    return compiled


def test_sco_model_never_rewards_offloading():
    for device in ("cpu", "cuda"):
        costs = cm.costs_for(device)
        times = [cm.sco_seconds(n, boundary_bytes=64 << 20, forward_s=1e-3, backward_s=3e-3, costs=costs)
                 for n in range(9)]
        assert times[0] == 0 and times == sorted(times) and len(set(times)) == 9
        assert cm.sco_knee(8, boundary_bytes=64 << 20, costs=costs) == 0
    # CUDA: a transfer hidden behind the compute costs its launches only, except the deepest reload (not prefetched)
    cuda = cm.costs_for("cuda")
    move = (8 << 20) / cuda.link_bandwidth
    hidden = cm.sco_seconds(3, boundary_bytes=8 << 20, forward_s=1.0, backward_s=1.0, costs=cuda)
    assert hidden == pytest.approx(move + 3 * cm.SCO_LAUNCHES * cuda.launch_s)
    exposed = cm.sco_seconds(3, boundary_bytes=8 << 20, costs=cuda)
    assert exposed == pytest.approx(move + 3 * (cm.SCO_LAUNCHES * cuda.launch_s + 2 * move))


def test_sco_offloads_none_at_a_loose_budget_and_the_fewest_the_budget_needs():
    loose = _sco_compiled("1GiB", host_budget="1GiB")
    plan = loose.sco_plans[-1]
    assert plan.most == 4 and plan.offloaded == 0
    text = flat(boundpass.explain(loose).text("none"))
    assert ("sco offloaded boundaries = 0 (knee; knee 0 (fewest: boundpass/bound/cost_model.py); the budget alone "
            "allows as few as 0; range 0..4)") in text
    # the certified peak at 1 and 2 offloaded, each from sco_enable=True with a host pool of that many boundaries
    boundary = 1024 * 64 * 4
    totals = [boundpass.explain(_sco_compiled("1GiB", host_budget=k * boundary, sco_enable=True)).table.total
              for k in (1, 2)]
    assert totals[1] < totals[0]
    tight = _sco_compiled(totals[1], host_budget="1GiB")
    assert tight.sco_plans[-1].offloaded == 2
    text = flat(boundpass.explain(tight).text("none"))
    assert "sco offloaded boundaries = 2 (budget; knee 0 (fewest: boundpass/bound/cost_model.py); the budget alone " \
           "allows as few as 2; range 0..4)" in text


def test_sco_true_is_the_users_count():
    boundary = 1024 * 64 * 4
    compiled = _sco_compiled("1GiB", host_budget=3 * boundary, sco_enable=True)
    assert compiled.sco_plans[-1].offloaded == 3
    text = flat(boundpass.explain(compiled).text("none"))
    assert "sco offloaded boundaries = 3 (user; knee 0 (fewest: boundpass/bound/cost_model.py); the budget alone: " \
           "not searched; range 0..3)" in text
