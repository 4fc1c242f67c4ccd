"""Knobs at the knee (issue 18): the cost model's knee, and the planner's rule min(budget's widest, knee)."""
import copy
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import boundpass
from boundpass import cost_model as cm
from boundpass.textwidth import flat

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
    from boundpass.planner import Knob, StepPlanner

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
