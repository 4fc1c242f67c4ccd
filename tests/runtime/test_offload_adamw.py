"""OffloadStreamAdamW: exactness vs torch AdamW, clipping, checkpoints, migration, FSDP2, torchtitan, bounds, bad input.

Exactness is bit-for-bit (torch.equal): the update runs torch AdamW's single-tensor op sequence on flat fp32
slot views. The reference for bf16 working weights is torch AdamW on fp32 masters fed the bf16 grads upcast
to fp32, its params then cast to bf16: also bit-identical (tolerance 0).
"""
import io

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError
from boundpass.measure.memtrack import LiveStorageTracker
from boundpass.runtime import OffloadStreamAdamW
from boundpass.runtime.offload_adamw import (bound_values, offload_adamw_bound, offload_adamw_host_bound,
                                             offload_adamw_staging_bound, offload_optimizers_container,
                                             reference_adamw_bound)
from boundpass.testing.distributed import run_on_ranks

SHAPES = [(37, 100), (4097,), (64, 64), (3,), (5, 7)]


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _groups(params):
    """Three groups with different lr / weight decay / betas; tensors 0 and 1 are larger than β below."""
    return [{"params": params[:2]}, {"params": params[2:4], "lr": 3e-3, "weight_decay": 0.0},
            {"params": params[4:], "betas": (0.8, 0.95), "eps": 1e-6}]


def _set_grads(step, *param_lists, skip=()):
    g = torch.Generator().manual_seed(100 + step)
    for i, shape in enumerate(SHAPES):
        grad = None if i in skip else torch.randn(shape, generator=g)
        for params in param_lists:
            params[i].grad = None if grad is None else grad.to(params[i].dtype, copy=True)


def _assert_equal(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a.detach(), b.detach()), (a - b).abs().max()


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_fp32_bit_exact_groups_weight_decay_scheduler_skipped_grads(slots):
    ref_params, params = _params(), _params()
    ref = torch.optim.AdamW(_groups(ref_params), lr=1e-2, weight_decay=0.1, foreach=False, fused=False)
    opt = OffloadStreamAdamW(_groups(params), lr=1e-2, weight_decay=0.1, bucket_params=1000, staging_slots=slots)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in (ref, opt)]
    cosine = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=12) for o in (ref, opt)]
    for step in range(12):
        _set_grads(step, ref_params, params, skip={3} if step in (2, 5) else ())
        ref.step(), opt.step()
        for s in schedulers + cosine:
            s.step()
    _assert_equal(params, ref_params)
    assert [opt.state[p]["step"] for p in params] == [float(ref.state[p]["step"]) for p in ref_params]


def test_bf16_working_weights_bit_exact_vs_fp32_master_adamw_then_cast():
    masters, params = _params(), _params(torch.bfloat16)
    with torch.no_grad():  # both sides start from the same fp32 masters, so start bf16 params from them
        for m, p in zip(masters, params):
            m.copy_(p.float())
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=False)
    opt = OffloadStreamAdamW(params, lr=1e-2, weight_decay=0.1, bucket_params=777)
    for step in range(10):
        _set_grads(step, params)
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        ref.step(), opt.step()
    _assert_equal([opt.state[p]["master"] for p in params], masters)
    _assert_equal(params, [m.to(torch.bfloat16) for m in masters])
    assert all(p.dtype == torch.bfloat16 for p in params)


def test_grad_clipping_before_step():
    ref_params, params = _params(), _params()
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
    opt = OffloadStreamAdamW(params, lr=1e-2, bucket_params=2048)
    for step in range(10):
        _set_grads(step, ref_params, params)
        norms = [torch.nn.utils.clip_grad_norm_(ps, max_norm=0.5) for ps in (ref_params, params)]
        assert torch.equal(*norms) and norms[0] > 0.5  # clipping really acted
        ref.step(), opt.step()
    _assert_equal(params, ref_params)


def test_state_dict_round_trip_and_resume_is_identical():
    params = _params(torch.bfloat16)
    opt = OffloadStreamAdamW(_groups(params), lr=1e-2, bucket_params=1500)
    for step in range(4):
        _set_grads(step, params)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert set(saved["state"][0]) == {"step", "master", "exp_avg", "exp_avg_sq"}
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = OffloadStreamAdamW(_groups(resumed_params), lr=0.5, bucket_params=999, staging_slots=3)
    resumed.load_state_dict(saved)
    for key in ("master", "exp_avg", "exp_avg_sq"):  # nothing lost, masters keep their fp32 bits
        _assert_equal([resumed.state[p][key] for p in resumed_params], [opt.state[p][key] for p in params])
    assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for g in opt.param_groups]
    for step in range(4, 9):
        _set_grads(step, params, resumed_params)
        opt.step(), resumed.step()
    _assert_equal(resumed_params, params)


def test_loading_its_own_state_dict_in_place_keeps_the_state():
    """A checkpointer that loads into the tensors state_dict() returned, then passes them back (torchtitan's DCP)."""
    params, ref_params = _params(), _params()
    opt = OffloadStreamAdamW(_groups(params), lr=1e-2, bucket_params=1500)
    ref = OffloadStreamAdamW(_groups(ref_params), lr=1e-2, bucket_params=1500)
    for step in range(3):
        _set_grads(step, params, ref_params)
        opt.step(), ref.step()
    in_place = opt.state_dict()  # aliases opt's own host state
    opt.load_state_dict(in_place)
    for step in range(3, 6):
        _set_grads(step, params, ref_params)
        opt.step(), ref.step()
    _assert_equal(params, ref_params)


def test_from_adamw_migrates_state_names_and_hyperparameters():
    ref_params, params = _params(), _params()
    named = lambda ps: [{"params": [(f"p{i}", p) for i, p in enumerate(ps[:3])]},
                        {"params": [(f"q{i}", p) for i, p in enumerate(ps[3:])], "weight_decay": 0.0}]
    ref, torch_before = (torch.optim.AdamW(named(ps), lr=1e-2, weight_decay=0.1, foreach=False)
                         for ps in (ref_params, params))
    for step in range(3):
        _set_grads(step, ref_params, params)
        ref.step(), torch_before.step()
    opt = OffloadStreamAdamW.from_adamw(torch_before, bucket_params=1000)
    assert [g["param_names"] for g in opt.param_groups] == [g["param_names"] for g in ref.param_groups]
    assert opt.param_groups[1]["weight_decay"] == 0.0 and opt.param_groups[0]["lr"] == 1e-2
    del torch_before
    for step in range(3, 10):
        _set_grads(step, ref_params, params)
        ref.step(), opt.step()
    _assert_equal(params, ref_params)


def test_weights_loaded_after_migration_become_the_masters():
    """A checkpointer that loads model weights after the optimizer exists must not be undone by stale masters."""
    ref_params, params = _params(), _params()
    opt = OffloadStreamAdamW.from_adamw(torch.optim.AdamW(params, lr=1e-2), bucket_params=500)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
    with torch.no_grad():
        for p, q, new in zip(params, ref_params, _params(seed=1)):
            p.copy_(new), q.copy_(new)
    assert torch.equal(opt.state_dict()["state"][1]["master"], params[1])
    for step in range(3):
        _set_grads(step, ref_params, params)
        ref.step(), opt.step()
    _assert_equal(params, ref_params)


def test_tensor_larger_than_beta_is_split_into_flat_ranges():
    params = _params()
    opt = OffloadStreamAdamW(params, bucket_params=999)
    buckets = opt._buckets()
    covered = {i: [] for i in range(len(params))}
    for start, stop, pieces in buckets:
        assert 0 < stop - start <= 999 and sum(hi - lo for _, lo, hi, _ in pieces) == stop - start
        for i, lo, hi, at in pieces:
            covered[i].append((lo, hi))
    for i, p in enumerate(params):  # every element of every tensor exactly once, in order
        ranges = covered[i]
        assert ranges[0][0] == 0 and ranges[-1][1] == p.numel()
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert len(covered[1]) == 5  # 4097 elements over buckets of 999


def test_torchtitan_optimizers_container_swap_schedulers_and_checkpoint():
    pytest.importorskip("torchtitan")
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))

    config = OptimizersContainer.Config(implementation="for-loop", param_groups=[
        ParamGroupConfig(pattern=r"bias$", optimizer_name="AdamW", optimizer_kwargs=dict(lr=1e-2, weight_decay=0.0)),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                         optimizer_kwargs=dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))])
    ref_model, model_a = model(), model()
    ref = config.build(model_parts=[ref_model])
    ours = offload_optimizers_container(config.build(model_parts=[model_a]), bucket_params=50)
    assert all(isinstance(o, OffloadStreamAdamW) for o in ours)
    lr_ref, lr_ours = (LRSchedulersContainer(c, lambda s: 1.0 / (s + 1)) for c in (ref, ours))
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        x = torch.randn(3, 8, generator=g)
        for m, c, s in ((ref_model, ref, lr_ref), (model_a, ours, lr_ours)):
            c.zero_grad()
            m(x).square().sum().backward()
            c.step(), s.step()
    _assert_equal(model_a.parameters(), ref_model.parameters())
    flat = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in ours.state_dict().items()}
    assert any(k.endswith(".master") for k in flat)
    model_b = model()
    model_b.load_state_dict(model_a.state_dict())
    resumed = offload_optimizers_container(config.build(model_parts=[model_b]), bucket_params=64)
    resumed.load_state_dict(flat)
    x = torch.randn(3, 8, generator=g)
    for m, c in ((model_a, ours), (model_b, resumed)):
        c.zero_grad()
        m(x).square().sum().backward()
        c.step()
    _assert_equal(model_b.parameters(), model_a.parameters())


def _fsdp_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 8))
        for module in (model[0], model[2], model):
            fully_shard(module, mesh=mesh)
        return model

    ref_model, model, resumed_model = build(), build(), build()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    opt = OffloadStreamAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_params=100)
    g = torch.Generator().manual_seed(rank)
    for step in range(6):
        x = torch.randn(4, 16, generator=g)
        runs = [(ref_model, ref), (model, opt)] + ([(resumed_model, resumed)] if step == 5 else [])
        for m, o in runs:
            m(x).square().sum().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)  # DTensor grads: the norm is all-reduced
            o.step()
            o.zero_grad()
        if step == 4:  # resume from a DTensor state dict on a fresh model/optimizer
            resumed_model.load_state_dict(model.state_dict())
            resumed = OffloadStreamAdamW(resumed_model.parameters(), lr=1e-2, weight_decay=0.1, bucket_params=64)
            state = opt.state_dict()
            assert isinstance(state["state"][0]["exp_avg"], DTensor)
            resumed.load_state_dict(state)
    local = lambda m: [p.to_local().clone() for p in m.parameters()]
    return local(ref_model), local(model), local(resumed_model)


@pytest.mark.distributed
def test_fsdp2_sharded_params_two_gloo_ranks():
    for ref, ours, resumed in run_on_ranks(_fsdp_rank, 2, timeout_s=120):
        _assert_equal(ours, ref)
        _assert_equal(resumed, ours)


@pytest.mark.parametrize("dtype,slots", [(torch.bfloat16, 2), (torch.float32, 3)])
def test_bound_sound_and_tight_on_fake_cuda(dtype, slots):
    shapes, beta = [(1024, 1000), (1000,), (3000, 700), (5,)], 200_000
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = [torch.nn.Parameter(torch.empty(s, device="cuda", dtype=dtype)) for s in shapes]
        for p in params:  # set directly: autograd on fake cuda aborts a CPU-only build, and step needs none
            p.grad = torch.empty_like(p)
        opt = OffloadStreamAdamW(params, bucket_params=beta, staging_slots=slots)
        values = bound_values(b=params[0].element_size(), Theta=opt.numel, beta=beta, S=slots)
        with LiveStorageTracker() as tracker:
            tracker.track_existing(params, [p.grad for p in params])
            for _ in range(2):  # the first step also allocates the host state
                opt.step()
                device_peak = tracker.peak_bytes("cuda")
                tracker.reset_peak()
                assert device_peak <= sym.evaluate(offload_adamw_bound(), values) <= 1.25 * device_peak
                assert tracker.live_bytes("cpu") == sym.evaluate(offload_adamw_host_bound(), values)
                assert tracker.live_bytes("cuda") == 2 * opt.numel * params[0].element_size()  # slots freed
    assert opt.planned_bytes()["device"] == sym.evaluate(offload_adamw_bound(), values)


def test_reference_adamw_bound_matches_fused_adamw_on_fake_tensors():
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = [torch.nn.Parameter(torch.empty(s)) for s in SHAPES]
        for p in params:
            p.grad = torch.empty_like(p)
        numel = sum(p.numel() for p in params)
        with LiveStorageTracker() as tracker:
            tracker.track_existing(params, [p.grad for p in params])
            torch.optim.AdamW(params, fused=True).step()
    bound = sym.evaluate(reference_adamw_bound(mixed_precision=False), bound_values(b=4, Theta=numel))
    assert tracker.peak_bytes() == bound + 4 * len(params)  # + one fp32 step counter per tensor (not in the bound)


def test_staging_transient_on_real_cpu_within_bound():
    params, beta, slots = _params(), 1000, 2
    opt = OffloadStreamAdamW(params, bucket_params=beta, staging_slots=slots)
    _set_grads(0, params)
    opt.step()  # allocates the host state
    _set_grads(1, params)
    with LiveStorageTracker() as tracker:
        tracker.track_existing(params, [p.grad for p in params], *opt._host.values())
        before = tracker.live_bytes()
        opt.step()
        transient = tracker.peak_bytes() - before
    staging = sym.evaluate(offload_adamw_staging_bound(), bound_values(b=4, Theta=opt.numel, beta=beta, S=slots))
    assert transient <= staging <= 1.25 * transient
    assert tracker.live_bytes() == before


@pytest.mark.parametrize("make,match", [
    (lambda: OffloadStreamAdamW(_params(), bucket_params=0), "bucket_params"),
    (lambda: OffloadStreamAdamW(_params(), bucket_params=2.5), "bucket_params"),
    (lambda: OffloadStreamAdamW(_params(), bucket_params=True), "bucket_params"),
    (lambda: OffloadStreamAdamW(_params(), bucket_params=64, staging_slots=0), "staging_slots"),
    (lambda: OffloadStreamAdamW(_params(), bucket_params=64, amsgrad=True), "amsgrad"),
    (lambda: OffloadStreamAdamW(_params(), bucket_params=64, maximize=True), "maximize"),
    (lambda: OffloadStreamAdamW(_params(), bucket_params=64, lr=-1.0), "lr >= 0"),
    (lambda: OffloadStreamAdamW(_params(), bucket_params=64, host_device="meta"), "host_device"),
    (lambda: OffloadStreamAdamW([torch.zeros(3, dtype=torch.int64)], bucket_params=64), "int64"),
    (lambda: OffloadStreamAdamW([torch.zeros(3, dtype=torch.complex64)], bucket_params=64), "complex64"),
    (lambda: OffloadStreamAdamW([torch.zeros(3, dtype=torch.float64)], bucket_params=64), "float64"),
    (lambda: OffloadStreamAdamW([torch.zeros(4, 4).t()], bucket_params=64), "contiguous"),
    (lambda: OffloadStreamAdamW([torch.zeros(3), torch.zeros(3, device="meta")], bucket_params=64), "one device"),
    (lambda: OffloadStreamAdamW.from_adamw(torch.optim.AdamW(_params(), amsgrad=True), bucket_params=64), "amsgrad"),
    (lambda: OffloadStreamAdamW.from_adamw(torch.optim.Adam(_params(), weight_decay=0.1), bucket_params=64),
     "coupled"),
])
def test_bad_input_is_refused_clearly(make, match):
    with pytest.raises(BoundpassInputError, match=match):
        make()


def test_bad_grads_and_late_groups_refused_before_allocation():
    params = _params()
    opt = OffloadStreamAdamW(params, bucket_params=64)
    params[0].grad = torch.zeros(params[0].shape).to_sparse()
    with pytest.raises(BoundpassInputError, match="dense"):
        opt.step()
    params[0].grad = torch.zeros(params[0].shape[::-1]).t()
    with pytest.raises(BoundpassInputError, match="contiguous"):
        opt.step()
    assert opt._host is None  # nothing allocated
    _set_grads(0, params)
    opt.step()
    with pytest.raises(BoundpassInputError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    with pytest.raises(BoundpassInputError, match="groups have sizes"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]})
