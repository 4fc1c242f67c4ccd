"""Issue 19 through `boundpass.compile`: ranks holding different N compile one schedule, recompile together, and a
fully ignored batch gives the uncompiled model's gradients (zeros), never NaN.

The knobs every rank must share (Ring-DTP's branch, PipelinedLLEP's cap c and so its chunk count) are chosen from
the group's largest N and the narrowest cap (collectives at compile time), so every compile must run on every
rank at the same call: `BoundedModule.forward` all-gathers each rank's input signature once per call and group
and compiles each new combination on every rank at once (docs/compile.md, "Ranks holding different N").
Each 2-rank test has a hard timeout: a hang fails the test, it does not wait for gloo's 30 minutes.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import boundpass
from boundpass.testing.dense_lm import DenseLM
from boundpass.testing.distributed import run_on_ranks


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _sum_ce(out, labels):
    return F.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="sum")


def _mean_ce(out, labels):
    return F.cross_entropy(out.flatten(0, 1).float(), labels.flatten())


def _batch(vocab, b, s, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, s), generator=g), torch.randint(0, vocab, (b, s), generator=g)


# ------------------------------------------------------------------------------- Ring-DTP, unequal N
def _ring_rank(rank, world, vocab, shapes, grid=False):
    """Each call: (B, S) of this rank; returns per call (loss err, grad err, branch, compiles so far, N_max).

    grid: 4 ranks, rings {0, 1} and {2, 3}, and {0, 2} / {1, 3} as a second agreement group (standing in for EP
    groups: the forward treats both alike), so a change on rank 3 reaches rank 0 only through rank 1 or 2."""
    torch.manual_seed(0)
    model = DenseLM(vocab, hidden=16, inter=64).double()
    reference = copy.deepcopy(model)
    ring = dist.group.WORLD
    if grid:
        from boundpass.runtime.ring_dtp import group_name_of
        rings = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        ring, column = rings[rank // 2], columns[rank % 2]
    compiled = boundpass.compile(model, budget="1GiB", loss_fn=_sum_ce, ring_group=ring)
    if grid:
        compiled.ep_groups.append(group_name_of(column))
    out = []
    for call, per_rank in enumerate(shapes):
        b, s = per_rank[rank]
        tokens, labels = _batch(vocab, b, s, seed=10 * call + rank)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        loss = compiled(tokens, labels)
        loss.backward()
        want = _sum_ce(reference(tokens), labels)
        want.backward()
        for module in (model, reference):  # the data-parallel gradient sum (DDP / FSDP / all_reduce)
            for p in module.parameters():
                dist.all_reduce(p.grad, group=ring)
        grad_err = max((p.grad - q.grad).abs().max().item() / q.grad.abs().max().clamp_min(1e-30).item()
                       for p, q in zip(model.parameters(), reference.parameters()))
        region = boundpass.explain(compiled).rewritten_of("vocab")[0]
        out.append((abs(loss.item() - want.item()) / abs(want.item()), grad_err, region.branch,
                    len(compiled.reports), compiled.ring_n_max))
    return out


@pytest.mark.distributed
def test_ring_unequal_tokens_compile_one_branch_and_recompile_together():
    """Rank 0 holds 1x16 tokens, rank 1 2x64 (the ring's N_max 128 >= V/P = 128: 'weights'; rank 0 alone would
    pick 'activations' and the ring would hang). Then only rank 1 grows to 2x128: both ranks recompile (rank 0's
    inputs did not change) and no rank waits. Then the first shapes again: no compile (already compiled)."""
    vocab = 256
    shapes = [((1, 16), (2, 64)), ((1, 16), (2, 128)), ((1, 16), (2, 64))]
    r0, r1 = run_on_ranks(_ring_rank, 2, vocab, shapes, timeout_s=120)
    for rank_calls in (r0, r1):
        for loss_err, grad_err, branch, _, _ in rank_calls:
            assert loss_err < 1e-12 and grad_err < 1e-10 and branch == "weights", rank_calls
    assert [c[3] for c in r0] == [c[3] for c in r1] == [1, 2, 2]  # compiles: together, once per combination
    assert [c[4] for c in r0] == [c[4] for c in r1] == [128, 256, 256]  # the ring's N_max at the compiles


@pytest.mark.distributed
def test_a_change_on_one_rank_makes_every_rank_of_a_ring_x_ep_grid_compile():
    """4 ranks, rings {0,1} {2,3} x groups {0,2} {1,3}: only rank 3 grows; rank 0 sees no changed signature in its
    own groups, yet its ring partner compiles, so it must compile too (the flag crosses the grid)."""
    shapes = [((1, 16), (1, 16), (1, 16), (2, 64)), ((1, 16), (1, 16), (1, 16), (2, 128))]
    results = run_on_ranks(_ring_rank, 4, 256, shapes, True, timeout_s=120)
    for rank_calls in results:
        assert [c[3] for c in rank_calls] == [1, 2], results
        for loss_err, grad_err, _, _, _ in rank_calls:
            assert loss_err < 1e-12 and grad_err < 1e-10, rank_calls
    assert [c[4] for c in results[0]] == [16, 16] and [c[4] for c in results[3]] == [128, 256]


def _too_small_max_rank(rank, world):
    model = DenseLM(256, hidden=16, inter=64).double()
    compiled = boundpass.compile(model, budget="1GiB", loss_fn=_sum_ce, ring_group=dist.group.WORLD,
                                 max_tokens_per_rank=64)
    tokens, labels = _batch(256, 1 + rank, 64, seed=rank)  # rank 1 holds 128 > 64
    try:
        compiled(tokens, labels)
    except boundpass.BoundpassInputError as exc:
        return str(exc)
    return None


@pytest.mark.distributed
def test_max_tokens_per_rank_exceeded_on_one_rank_raises_on_every_rank():
    r0, r1 = run_on_ranks(_too_small_max_rank, 2, timeout_s=120)
    assert r0 is not None and r1 is not None, (r0, r1)
    assert "max_tokens_per_rank=64 but a rank of the ring holds 128" in r0 and r0.split("; this rank")[0] == \
        r1.split("; this rank")[0]


# ------------------------------------------------------------------------------------- EP = 2, B = 1 vs 2
def _ep_rank(rank, world, batches, ring=False):
    from boundpass.recipes.models import apply_cpu_device_fix
    apply_cpu_device_fix()
    from test_compile_dispatch import SEQ, VOCAB, _ce, _dispatch_regions, _ep_model, _step_both

    model = _ep_model("deepseek_v3", 2, world)
    ref = _ep_model("deepseek_v3", 2, world)
    ref.load_state_dict(model.state_dict())
    compiled = boundpass.compile(model, budget="4GiB", loss_fn=_ce, ring_group=dist.group.WORLD if ring else None)
    out = []
    for call, per_rank in enumerate(batches):
        g = torch.Generator().manual_seed(10 * call + rank)
        b = per_rank[rank]
        tokens, labels = torch.randint(0, VOCAB, (b, SEQ), generator=g), torch.randint(0, VOCAB, (b, SEQ), generator=g)
        loss, ref_loss, worst = _step_both(compiled, model, ref, tokens, labels)
        if ring:  # a replicated lm_head under Ring-DTP: its gradient is the data-parallel sum's, not this rank's
            worst = 0.0
            assert [r.module_path for r in boundpass.explain(compiled).rewritten_of("vocab")]
        caps = [(r.rewritten, r.ep_size, r.cap) for r in _dispatch_regions(compiled)]
        out.append((loss, ref_loss, worst, caps, len(compiled.reports)))
    return out


@pytest.mark.distributed
@pytest.mark.torchtitan
def test_expert_parallel_unequal_batches_agree_on_the_cap():
    """EP = 2, B = 1 on rank 0 and B = 2 on rank 1 (32 vs 64 tokens): one cap on both ranks (from the EP group's
    64 tokens; each rank's own would be 32 vs 64 and gloo aborts). Then only rank 1 grows to B = 3: both recompile."""
    pytest.importorskip("torchtitan")
    from test_compile_dispatch import GRAD_TOL, LOSS_TOL, SEQ
    r0, r1 = run_on_ranks(_ep_rank, 2, [(1, 2), (1, 3)], timeout_s=150)
    for call, (a, b) in enumerate(zip(r0, r1)):
        for loss, ref_loss, worst, caps, _ in (a, b):
            assert caps and all(ok and ep == 2 for ok, ep, _ in caps), caps
            assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss), (call, loss, ref_loss)
            assert worst <= GRAD_TOL, (call, worst)
        assert a[3] == b[3], (call, a[3], b[3])  # the same cap c on both ranks
        assert a[4] == b[4] == call + 1           # compiled together
    assert {c for _, _, c in r0[0][3]} == {2 * SEQ} and {c for _, _, c in r0[1][3]} == {3 * SEQ}


# ------------------------------------------------------------------------------------ all-ignored batch
def _assert_all_ignored_like_torch(loss_fn, extra=()):
    torch.manual_seed(0)
    vocab = 512
    model = DenseLM(vocab, hidden=16, inter=64)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, vocab, (2, 32))
    labels = torch.full((2, 32), -100)
    compiled = boundpass.compile(model, budget="1GiB", loss_fn=loss_fn)
    got = compiled(tokens, labels, *extra)
    want = loss_fn(reference(tokens), labels, *extra)
    got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
    assert [r.module_path for r in boundpass.explain(compiled).rewritten_of("vocab")] == ["model.head"]
    got.backward()
    want.backward()
    assert want.isnan() and got.isnan()  # 0 / 0, as torch gives
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert not p.grad.isnan().any(), name
        assert torch.equal(p.grad, q.grad), name  # zeros: nothing reaches the loss
    assert not any(p.grad.any() for p in model.parameters())


def test_all_ignored_batch_mean_normalisation_gives_zero_gradients():
    _assert_all_ignored_like_torch(_mean_ce)


@pytest.mark.torchtitan
def test_all_ignored_batch_torchtitan_global_valid_tokens_gives_zero_gradients():
    pytest.importorskip("torchtitan")
    from boundpass.recipes.models import torchtitan_loss
    _assert_all_ignored_like_torch(torchtitan_loss(), extra=(torch.tensor(0.0),))


@pytest.mark.distributed
@pytest.mark.torchtitan
def test_ring_and_expert_parallel_groups_compile_together():
    """Ring-DTP over WORLD and EP = 2 over torchtitan's EP group (two groups): unequal B, then only rank 1 grows."""
    pytest.importorskip("torchtitan")
    from test_compile_dispatch import LOSS_TOL, SEQ
    r0, r1 = run_on_ranks(_ep_rank, 2, [(1, 2), (1, 3)], True, timeout_s=150)
    for call, (a, b) in enumerate(zip(r0, r1)):
        for loss, ref_loss, _, caps, _ in (a, b):
            assert caps and all(ok and ep == 2 for ok, ep, _ in caps), caps
            assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss), (call, loss, ref_loss)
        assert a[3] == b[3] and a[4] == b[4] == call + 1, (call, a, b)
    assert {c for _, _, c in r0[1][3]} == {3 * SEQ}
