"""boundpass.compile(..., optimizer=...): AdamW -> OffloadStreamAdamW when the budget needs it, state migrated."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import boundpass
from boundpass.runtime import OffloadStreamAdamW


class TinyLM(nn.Module):
    def __init__(self, vocab=2000, hidden=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        return self.lm_head(torch.tanh(self.emb(tokens)))


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def _batch(step, vocab=2000):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (2, 32), generator=g), torch.randint(0, vocab, (2, 32), generator=g)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


PARAM_BYTES = 2 * 2000 * 64 * 4  # embedding + lm_head, fp32


def _train(step_fn, optimizer, model, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        optimizer.zero_grad()
        loss = step_fn(*_batch(step))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _pair():
    """Two identical models, each compiled by boundpass: the optimizer is the only difference between them."""
    model = TinyLM()
    reference = copy.deepcopy(model)
    return model, reference


def test_offloaded_training_is_bit_identical_to_torch_adamw():
    # Same compiled graph on both sides, so the gradients are identical and any difference is the optimizer's.
    # (Against the *uncompiled* model, Adam amplifies the rewrite's 1e-7 gradient rounding on near-zero
    # gradients; the rewrite itself is tested in test_compile_vocab.py.)
    model, reference = _pair()
    compiled = boundpass.compile(model, budget="64MiB", loss_fn=loss_fn, optimizer_offload=True,
                                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False))
    assert isinstance(compiled.optimizer, OffloadStreamAdamW)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    baseline = boundpass.compile(reference, budget="64MiB", loss_fn=loss_fn, optimizer=ref_opt,
                                 optimizer_offload=False)
    assert _train(compiled, compiled.optimizer, model, 5) == _train(baseline, ref_opt, reference, 5)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    text = str(boundpass.explain(compiled))
    assert "OPTIMIZER OffloadStreamAdamW: offloaded (asked)" in text and "optimizer staging" in text


def test_existing_state_is_migrated():
    model, reference = _pair()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    _train(lambda t, y: loss_fn(model(t), y), adamw, model, 2)
    _train(lambda t, y: loss_fn(reference(t), y), ref_opt, reference, 2)
    compiled = boundpass.compile(model, budget="64MiB", loss_fn=loss_fn, optimizer=adamw, optimizer_offload=True)
    baseline = boundpass.compile(reference, budget="64MiB", loss_fn=loss_fn, optimizer=ref_opt,
                                 optimizer_offload=False)
    assert _train(compiled, compiled.optimizer, model, 3, start=2) == _train(baseline, ref_opt, reference, 3, start=2)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_the_replaced_optimizer_refuses_to_step():
    adamw = torch.optim.AdamW(TinyLM().parameters())
    boundpass.compile(TinyLM(), budget="64MiB", loss_fn=loss_fn, optimizer=adamw, optimizer_offload=True)
    with pytest.raises(boundpass.BoundpassError, match="step compiled.optimizer"):
        adamw.step()


def test_auto_keeps_adamw_when_it_fits_and_offloads_when_it_does_not():
    roomy = boundpass.compile(TinyLM(), budget="64MiB", loss_fn=loss_fn,
                              optimizer=torch.optim.AdamW(TinyLM().parameters()))
    assert isinstance(roomy.optimizer, torch.optim.AdamW) and not roomy.optimizer_plan.offloaded
    # parameters + gradients fit, their AdamW moments (as large again) do not
    model = TinyLM()
    tight = boundpass.compile(model, budget=int(PARAM_BYTES * 2.8), loss_fn=loss_fn,
                              optimizer=torch.optim.AdamW(model.parameters()))
    assert isinstance(tight.optimizer, OffloadStreamAdamW)
    assert "exceed the budget" in tight.optimizer_plan.reason
    tight(*_batch(0)).backward()
    tight.optimizer.step()
    table = boundpass.explain(tight).table
    assert table.fits() and table.host_total == 12 * model.lm_head.weight.numel() * 2


def test_kept_optimizer_that_does_not_fit_names_the_offload_knob():
    model = TinyLM()
    with pytest.raises(boundpass.InfeasibleBudgetError) as info:
        boundpass.compile(model, budget=int(PARAM_BYTES * 2.5), loss_fn=loss_fn,
                          optimizer=torch.optim.AdamW(model.parameters()), optimizer_offload=False)
    assert info.value.term.startswith("optimizer state") and "optimizer_offload=True" in info.value.knob


def test_host_budget_is_checked_before_anything_runs():
    model = TinyLM()
    with pytest.raises(boundpass.InfeasibleBudgetError) as info:
        boundpass.compile(model, budget="64MiB", host_budget="1MiB", loss_fn=loss_fn,
                          optimizer=torch.optim.AdamW(model.parameters()), optimizer_offload=True)
    assert info.value.term.startswith("optimizer state on host") and "host budget" in str(info.value)


@pytest.mark.parametrize("kwargs,match", [
    (dict(optimizer_offload="yes"), "optimizer.offload"), (dict(optimizer_slots=0), "optimizer.slots"),
    (dict(optimizer_bucket=-1), "optimizer.bucket"), (dict(host_budget="lots"), "host_budget"),
])
def test_bad_optimizer_arguments_fail_clearly(kwargs, match):
    model = TinyLM()
    with pytest.raises(boundpass.BoundpassInputError, match=match):
        boundpass.compile(model, budget="64MiB", loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters()),
                          **kwargs)


def test_unsupported_optimizer_cannot_be_offloaded():
    model = TinyLM()
    with pytest.raises(boundpass.BoundpassInputError, match="needs torch.optim.AdamW"):
        boundpass.compile(model, budget="64MiB", loss_fn=loss_fn, optimizer=torch.optim.SGD(model.parameters()),
                          optimizer_offload=True)


def test_torchtitan_optimizers_container_is_offloaded_in_place():
    pytest.importorskip("torchtitan")
    from boundpass.recipes.models import debug_moe_config
    model = TinyLM()
    cfg = debug_moe_config("deepseek_v3")
    container = cfg.optimizer.build(model_parts=[model])
    compiled = boundpass.compile(model, budget="64MiB", loss_fn=loss_fn, optimizer=container, optimizer_offload=True)
    assert compiled.optimizer is container
    assert all(isinstance(o, OffloadStreamAdamW) for o in container.optimizers)
    container.zero_grad()
    compiled(*_batch(0)).backward()
    before = model.lm_head.weight.detach().clone()
    container.step()
    assert not torch.equal(before, model.lm_head.weight)


def test_slots_and_bucket_are_chosen_to_fit_what_is_left():
    from boundpass.core.config import OptimizerConfig
    from boundpass.passes.optimizer_swap import plan_optimizer
    model = TinyLM()  # 256,000 parameters
    roomy = plan_optimizer(torch.optim.AdamW(model.parameters()), budget=PARAM_BYTES * 2 + 64 * 2**20,
                           persistent=PARAM_BYTES * 2, knobs=OptimizerConfig(offload=True))
    # the knee on this CPU (docs/knobs.md): one bucket of the whole model (16·Θ = 4 MiB fits the cache) and one
    # slot (the CPU runs the slots in program order: a second one would cost 4 MiB and no time)
    assert (roomy.optimizer.staging_slots, roomy.optimizer.bucket_params) == (1, 256_000)
    assert [(k.name, k.why) for k in roomy.knobs] == [("optimizer_bucket", "knee"), ("optimizer_slots", "knee")]
    # 1 MiB left: two slots of 65,536 elements (2 MiB) do not fit, one slot of 65,536 does
    tight = plan_optimizer(torch.optim.AdamW(model.parameters()), budget=PARAM_BYTES * 2 + 2**20,
                           persistent=PARAM_BYTES * 2, knobs=OptimizerConfig(offload=True))
    assert (tight.optimizer.staging_slots, tight.optimizer.bucket_params) == (1, 2**20 // 16)
    assert sum(t.value for t in tight.terms if t.kind == "step") <= 2**20
    assert [(k.name, k.why, k.widest_fitting) for k in tight.knobs] == [("optimizer_bucket", "budget", 2**20 // 16),
                                                                          ("optimizer_slots", "knee", 1)]
