"""boundpass.measure.optimizer_phase: any torch optimizer's state and step workspace, measured by fake steps, against a real
step's state and its LiveStorageTracker peak; plan_optimizer's terms for optimizers kept on the device."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from boundpass.core.errors import BoundpassInputError
from boundpass.measure.memtrack import LiveStorageTracker, rss_peak_in_subprocess
from boundpass.measure.optimizer_phase import optimizer_phase
from boundpass.core.config import OptimizerConfig
from boundpass.passes.optimizer_swap import plan_optimizer

O = torch.optim
CASES = [
    (O.AdamW, {}), (O.AdamW, dict(foreach=True)), (O.AdamW, dict(foreach=False)), (O.AdamW, dict(fused=True)),
    (O.AdamW, dict(amsgrad=True)), (O.Adam, {}), (O.SGD, dict(momentum=0.9)), (O.SGD, dict(momentum=0.0)),
    (O.Adagrad, {}), (O.RMSprop, dict(momentum=0.9, centered=True)),
]
if hasattr(O, "Adafactor"):
    CASES.append((O.Adafactor, {}))
IDS = [f"{cls.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}" for cls, kw in CASES]


def _model(dtype) -> nn.Module:
    """Two linears of odd sizes, about 2.8 MB of fp32 parameters."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(333, 517), nn.GELU(), nn.Linear(517, 1031)).to(dtype)


def _backward(model, opt, dtype):
    opt.zero_grad(set_to_none=False)
    model(torch.randn(8, 333, dtype=dtype)).float().square().mean().backward()


def _state_tensors(opt):
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_prediction_matches_a_real_step(cls, kw, dtype):
    model = _model(dtype)
    opt = cls(model.parameters(), **kw)
    phase = optimizer_phase(opt)  # before any real step
    _backward(model, opt, dtype)
    opt.step()
    _backward(model, opt, dtype)
    params = list(model.parameters())
    grads, state = [p.grad for p in params], _state_tensors(opt)
    assert phase.state_bytes == _nbytes(state) == sum(phase.state_breakdown.values())
    with LiveStorageTracker() as tracker:  # the steady-state (second) step, params + grads + state live
        tracker.track_existing(params, grads, state)
        opt.step()
    measured = tracker.peak_bytes()
    predicted = 2 * _nbytes(params) + phase.state_bytes + phase.step_peak_bytes
    assert measured <= predicted <= 1.10 * measured, (phase, predicted, measured)
    assert optimizer_phase(opt).state_bytes == phase.state_bytes  # real state present: same answer


def test_state_breakdown_names_each_state():
    model = _model(torch.float32)
    numel = sum(p.numel() for p in model.parameters())
    adamw = optimizer_phase(O.AdamW(model.parameters(), amsgrad=True)).state_breakdown
    assert adamw == {"exp_avg": 4 * numel, "exp_avg_sq": 4 * numel, "max_exp_avg_sq": 4 * numel, "step": 4 * 4}
    assert optimizer_phase(O.SGD(model.parameters(), momentum=0.9)).state_breakdown == {"momentum_buffer": 4 * numel}
    sgd = optimizer_phase(O.SGD(model.parameters(), lr=0.1))
    assert (sgd.state_bytes, sgd.step_peak_bytes, sgd.describe()) == (0, 0, "no state")
    assert optimizer_phase(O.AdamW(model.parameters(), fused=True)).step_peak_bytes == 0


def test_frozen_parameters_hold_no_state():
    model = _model(torch.float32)
    model[0].weight.requires_grad_(False)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert optimizer_phase(O.SGD(model.parameters(), momentum=0.9)).state_bytes == 4 * numel


def test_the_real_optimizer_is_not_touched():
    model = _model(torch.float32)
    opt = O.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    optimizer_phase(opt)
    assert len(opt.state) == 0 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    _backward(model, opt, torch.float32)
    opt.step()
    state = [t.clone() for t in _state_tensors(opt)]
    optimizer_phase(opt)
    assert all(torch.equal(a, b) for a, b in zip(_state_tensors(opt), state))


def test_the_fake_steps_allocate_no_real_memory():
    # 64 MiB of parameters: a real AdamW step would add 128 MiB of moments plus its temporaries
    code = """
import torch
from boundpass.measure.optimizer_phase import optimizer_phase
def setup():
    lin = torch.nn.Linear(4096, 4096, bias=False)
    opt = torch.optim.AdamW(lin.parameters(), foreach=True)
    optimizer_phase(opt)  # warm: first-use imports and caches are not the measurement
    return opt
def measured(opt):
    assert optimizer_phase(opt).state_bytes == 2 * 4096 * 4096 * 4 + 4  # + the 0-dim fp32 step
"""
    grown = rss_peak_in_subprocess(code, env={"OMP_NUM_THREADS": "1"})
    assert grown < 16 * 2**20, grown


def test_a_container_sums_its_optimizers():
    a, b = _model(torch.float32), _model(torch.bfloat16)
    container = types.SimpleNamespace(optimizers=[O.AdamW(a.parameters()), O.SGD(b.parameters(), momentum=0.9)])
    pa, pb = (optimizer_phase(o) for o in container.optimizers)
    both = optimizer_phase(container)
    assert both.state_bytes == pa.state_bytes + pb.state_bytes
    assert both.step_peak_bytes == max(pa.step_peak_bytes, pb.step_peak_bytes)  # stepped one after the other
    assert both.name == "AdamW+SGD" and both.state_breakdown["momentum_buffer"] == pb.state_bytes


class NeedsModel(O.Optimizer):
    def __init__(self, params, model_name):
        super().__init__(params, dict(lr=1.0))

    def step(self, closure=None):
        pass


class ReadsNumpy(O.Optimizer):
    def __init__(self, params, lr=1.0):
        super().__init__(params, dict(lr=lr))

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                p.grad.numpy()


@pytest.mark.parametrize("make,match", [
    (lambda ps: NeedsModel(ps, "x"), "NeedsModel.*cannot be constructed.*model_name"),
    (lambda ps: ReadsNumpy(ps), "ReadsNumpy.step.*cannot run on fake tensors"),
    (lambda ps: O.LBFGS(ps), "LBFGS.step.*closure"),
])
def test_an_optimizer_that_cannot_be_faked_is_refused_by_name(make, match):
    opt = make(_model(torch.float32).parameters())
    with pytest.raises(BoundpassInputError, match=match):
        optimizer_phase(opt)
    with pytest.raises(BoundpassInputError, match=match):
        plan_optimizer(opt, budget=2**30, persistent=0)


def test_plan_optimizer_budgets_any_kept_optimizer():
    model = _model(torch.float32)
    pg = 2 * _nbytes(list(model.parameters()))
    for opt in (O.SGD(model.parameters(), momentum=0.9), O.RMSprop(model.parameters()), O.AdamW(model.parameters())):
        phase = optimizer_phase(opt)
        plan = plan_optimizer(opt, budget=2**30, persistent=pg)
        name = type(opt).__name__
        assert not plan.offloaded and plan.optimizer is opt
        (state, workspace) = plan.terms
        assert state.name == f"optimizer state ({name}: {phase.describe()})" and state.kind == "persistent"
        assert workspace.name == f"optimizer step workspace ({name})" and workspace.kind == "step"
        assert (state.value, workspace.value) == (phase.state_bytes, phase.step_peak_bytes)
        assert int(state.formula) == state.value and int(workspace.formula) == workspace.value
    # AdamW offloads ("auto") once parameters + gradients + its measured state and workspace exceed the budget
    phase = optimizer_phase(O.AdamW(model.parameters()))
    tight = plan_optimizer(O.AdamW(model.parameters()), budget=pg + phase.state_bytes, persistent=pg)
    assert tight.offloaded and "exceed the budget" in tight.reason
    roomy = plan_optimizer(O.AdamW(model.parameters()), budget=pg + phase.state_bytes + phase.step_peak_bytes,
                           persistent=pg)
    assert not roomy.offloaded and "optimizer_offload=True" in roomy.terms[0].knob
    with pytest.raises(BoundpassInputError, match="needs torch.optim.AdamW"):
        plan_optimizer(O.SGD(model.parameters()), budget=2**30, persistent=pg, knobs=OptimizerConfig(offload=True))


def test_fake_cuda_parameters_use_the_cuda_defaults():
    # parameters that are themselves fake (boundpass.measure.simulate) on "cuda", on a CPU-only build: torch picks foreach
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        params = [nn.Parameter(torch.empty(300, 77, device="cuda")), nn.Parameter(torch.empty(129, 300, device="cuda"))]
    numel = sum(p.numel() for p in params)
    default = optimizer_phase(O.AdamW(params))
    foreach = optimizer_phase(O.AdamW(params, foreach=True))
    assert default == foreach and default.state_bytes == 2 * 4 * numel + 2 * 4
    assert optimizer_phase(O.AdamW(params, fused=True)).step_peak_bytes == 0
