"""SCO runtime: bit-exact gradients on torchtitan deepseek_v3 and qwen3 MoE (FullAC, SelectiveAC), the plan, the host pool,
the ≤ 2 restored boundaries window, bounds both ways, monotone device bytes, bad input.

Measured device bytes come from the handle's ledger: the storage sizes of the exact boundary tensors (block
inputs saved by the checkpoint, and the restored copies), added when saved/allocated and removed by storage
finalizers, sampled after every event. On CPU host and device are the same memory, so this is the only
honest device figure here (a whole-process measure cannot tell the two apart).
"""
import copy

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError
from boundpass.runtime import apply_sco
from boundpass.runtime.sco import bound_values, planned_offloaded_layers, sco_device_bound, sco_host_bound

SEQ, BATCH, VOCAB, STEPS, LAYERS = 16, 1, 256, 2, 4


def _step_grads(model, tokens):
    model(tokens).float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.fixture(scope="module")
def deepseek_runs():
    """Per AC policy: reference grads without SCO, and per offloaded-layer count the grads and step logs."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from boundpass.recipes.models import build_debug_moe
    base = build_debug_moe("deepseek_v3", vocab_size=VOCAB, seq_len=SEQ)
    for name in list(base.layers)[LAYERS:]:  # fewer MoE layers keep the test fast; the schedule is the same
        del base.layers[name]
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]
    H = base.tok_embeddings.embedding_dim
    boundary_bytes = BATCH * SEQ * H * 4
    runs = {}
    for policy, counts in ((FullAC, (0, 2, LAYERS)), (SelectiveAC, (2, LAYERS))):
        model = copy.deepcopy(base)
        policy(policy.Config()).apply(model)
        ref = [_step_grads(model, t) for t in batches]
        for count in counts:
            handle = apply_sco(model.layers, count * boundary_bytes)
            steps = []
            for t in batches:
                handle.events.clear()
                grads = _step_grads(model, t)
                steps.append(dict(grads=grads, events=list(handle.events), offloaded=list(handle.offloaded),
                                  pool=handle.host_pool_bytes, offloaded_bytes=handle.offloaded_bytes(),
                                  peak=handle.peak_device_boundary_bytes(), restored=handle.peak_restored_live()))
            handle.remove()
            runs[policy.__name__, count] = (ref, steps)
    return runs, boundary_bytes, len(base.layers), H


@pytest.mark.parametrize("policy,count", [("FullAC", 0), ("FullAC", 2), ("FullAC", LAYERS), ("SelectiveAC", 2),
                                          ("SelectiveAC", LAYERS)])
def test_deepseek_grads_bit_exact_plan_pool_window_and_bound(deepseek_runs, policy, count):
    runs, boundary_bytes, L, H = deepseek_runs
    ref, steps = runs[policy, count]
    budget = count * boundary_bytes
    values = bound_values(N=BATCH * SEQ, H=H, b=4, L=L, host_budget=budget)
    assert values[sym.L_off] == count == planned_offloaded_layers([boundary_bytes] * L, budget)
    bound = sym.evaluate(sco_device_bound(), values)
    for want, got in zip(ref, steps):
        assert all(torch.equal(a, b) for a, b in zip(want, got["grads"]))
        assert got["offloaded"] == [i < count for i in range(L)]
        assert got["offloaded_bytes"] == count * boundary_bytes
        # the pool is reused: same bytes every step, exactly the host term, within the budget
        assert got["pool"] == sym.evaluate(sco_host_bound(), values) <= budget
        assert got["restored"] <= 2
        assert got["peak"] <= bound <= 1.25 * got["peak"]
        kinds = [e.kind for e in got["events"]]
        assert kinds.count("offload") == count and kinds.count("keep") == L - count
        assert kinds.count("restore") == count
        assert got["events"][-1].device_boundary_bytes == 0  # every boundary and restored copy was freed


QWEN_LAYERS = 2


@pytest.fixture(scope="module")
def qwen3_runs():
    """qwen3 MoE debug model (64 experts, top-8, GQA) cut to 2 layers, FullAC, 0 / 1 / 2 offloaded (SelectiveAC on
    qwen3 runs compiled, in test_compile_sco.py)."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    from boundpass.recipes.models import build_debug_moe
    base = build_debug_moe("qwen3_moe", vocab_size=VOCAB, seq_len=SEQ)
    for name in list(base.layers)[QWEN_LAYERS:]:
        del base.layers[name]
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    boundary_bytes = BATCH * SEQ * base.tok_embeddings.embedding_dim * 4
    runs = {}
    for policy, counts in ((FullAC, (0, 1, QWEN_LAYERS)),):
        model = copy.deepcopy(base)
        policy(policy.Config()).apply(model)
        ref = _step_grads(model, tokens)
        for count in counts:
            handle = apply_sco(model.layers, max(count * boundary_bytes, 0))
            steps = []
            for _ in range(STEPS):
                handle.events.clear()
                steps.append(dict(grads=_step_grads(model, tokens), offloaded=list(handle.offloaded),
                                  offloaded_bytes=handle.offloaded_bytes(), pool=handle.host_pool_bytes,
                                  peak=handle.peak_device_boundary_bytes(), restored=handle.peak_restored_live(),
                                  end=handle.events[-1].device_boundary_bytes))
            handle.remove()
            runs[policy.__name__, count] = (ref, steps)
    return runs, boundary_bytes, base.tok_embeddings.embedding_dim


@pytest.mark.parametrize("policy,count", [("FullAC", 0), ("FullAC", 1), ("FullAC", QWEN_LAYERS)])
def test_qwen3_grads_bit_exact_plan_pool_window_and_bound(qwen3_runs, policy, count):
    runs, boundary_bytes, H = qwen3_runs
    ref, steps = runs[policy, count]
    values = bound_values(N=BATCH * SEQ, H=H, b=4, L=QWEN_LAYERS, host_budget=count * boundary_bytes)
    bound = sym.evaluate(sco_device_bound(), values)
    for got in steps:  # the same tokens every step: the pool must be reused, the grads identical each time
        assert all(torch.equal(a, b) for a, b in zip(ref, got["grads"]))
        assert got["offloaded"] == [i < count for i in range(QWEN_LAYERS)]
        assert got["offloaded_bytes"] == got["pool"] == count * boundary_bytes
        assert got["restored"] <= 2 and got["end"] == 0
        assert got["peak"] <= bound <= 1.25 * got["peak"]


def _mlp_stack(layers, width, seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(
        checkpoint_wrapper(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                                               torch.nn.Linear(width, width)))
        for _ in range(layers))


def _run_stack(blocks, x):
    h = x * 1  # a fresh first boundary: a leaf the test keeps would stay on the device whatever SCO does
    for block in blocks:
        h = block(h)
    h.pow(2).sum().backward()


def test_device_bytes_fall_monotonically_and_bound_holds_both_ways_at_every_budget():
    L, N, H = 8, 64, 32
    blocks = _mlp_stack(L, H)
    x = torch.randn(N, H, requires_grad=True)
    boundary = N * H * 4
    peaks = []
    for budget in [0, boundary - 1] + [k * boundary + k for k in range(1, L + 1)]:
        handle = apply_sco(blocks, budget)
        for _ in range(2):  # the second step reuses the pool
            handle.events.clear()
            _run_stack(blocks, x)
        values = bound_values(N=N, H=H, b=4, L=L, host_budget=budget)
        measured = handle.peak_device_boundary_bytes()
        assert measured <= sym.evaluate(sco_device_bound(), values) <= 1.25 * measured
        assert handle.offloaded_bytes() == handle.host_pool_bytes == sym.evaluate(sco_host_bound(), values) <= budget
        assert handle.peak_restored_live() <= 2
        peaks.append(measured)
        handle.remove()
    assert peaks == sorted(peaks, reverse=True) and peaks[0] == L * boundary and peaks[-1] == 2 * boundary


def test_greedy_plan_stops_at_first_boundary_that_does_not_fit():
    assert planned_offloaded_layers([10, 10, 5, 5], 24) == 2  # the 5s would fit, but the offload set is a prefix
    assert planned_offloaded_layers([10, 10], 0) == 0
    assert planned_offloaded_layers([10, 10], 20) == 2


def test_remove_uninstalls_and_releases_the_pool():
    blocks = _mlp_stack(3, 16)
    x = torch.randn(4, 16, requires_grad=True)
    handle = apply_sco(blocks, 10**6)
    _run_stack(blocks, x)
    assert handle.host_pool_bytes == 3 * 4 * 16 * 4
    handle.remove()
    handle.events.clear()
    _run_stack(blocks, x)
    assert handle.events == [] and handle.host_pool_bytes == 0


def test_second_forward_before_backward_is_refused_not_corrupted():
    blocks = _mlp_stack(2, 16)
    x = torch.randn(4, 16, requires_grad=True)
    handle = apply_sco(blocks, 10**6)
    h = blocks[1](blocks[0](x))
    with pytest.raises(BoundpassInputError, match="still waiting for its backward"):
        blocks[1](blocks[0](x))
    h.sum().backward()  # the first graph is intact
    handle.remove()


@pytest.mark.parametrize("blocks,budget", [([], 0), ([torch.nn.Linear(2, 2)], -1), ([torch.nn.Linear(2, 2)], 1.5),
                                           (["not a module"], 0)])
def test_bad_input(blocks, budget):
    with pytest.raises(BoundpassInputError):
        apply_sco(blocks, budget)
