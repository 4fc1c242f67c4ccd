"""Ring-DTP runtime op: exactness vs the full-logits reference (1-4 gloo ranks), bounds both ways, bad input."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError
from boundpass.measure.memtrack import LiveStorageTracker
from boundpass.runtime import ring_dtp
from boundpass.runtime.ring_dtp import (choose_branch, reference_loss, ring_dtp_backward, ring_dtp_bound,
                                        ring_dtp_forward, ring_dtp_loss, vocab_shard_range, vocab_shard_sizes)
from boundpass.testing.distributed import run_on_ranks

# Tolerances: fp64 is exact up to summation order (1e-12 relative). bf16 inputs: loss and dW accumulate in
# fp32 in both schedules (1e-3 rel); dh differs by bf16 rounding of the per-strip products that Ring-DTP sums
# in fp32 while the reference rounds one bf16 matmul (2e-2 rel, a few bf16 ulps).
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _problem(seed, token_counts, H, V, dtype, ignore_every=5, all_ignored=()):
    """Every rank builds the same global problem: per-rank batches, labels, and the full weight."""
    g = torch.Generator().manual_seed(seed)
    hs = [torch.randn(n, H, generator=g, dtype=torch.float64).to(dtype) for n in token_counts]
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    labels = [torch.randint(0, V, (n,), generator=g) for n in token_counts]
    for r, y in enumerate(labels):
        y[::ignore_every] = -100
        if r in all_ignored:
            y[:] = -100
    return hs, weight, labels


def _global_reference(hs, weight, labels):
    """d(sum over ranks of loss_r) by plain autograd over the full logits, on one process."""
    w = weight.clone().requires_grad_()
    hr = [x.clone().requires_grad_() for x in hs]
    losses = [reference_loss(x, w, y, vocab_size=weight.shape[0]) for x, y in zip(hr, labels)]
    sum(losses).backward()
    return [l.detach() for l in losses], [x.grad for x in hr], w.grad


def _ring_rank(rank, world, token_counts, H, V, dtype, branch, block, all_ignored):
    hs, weight, labels = _problem(7, token_counts, H, V, dtype, all_ignored=all_ignored)
    ref_losses, ref_dh, ref_dw = _global_reference(hs, weight, labels)
    start, stop = vocab_shard_range(V, world, rank)
    h = hs[rank].clone().requires_grad_()
    w = weight[start:stop].clone().requires_grad_()
    loss = ring_dtp_loss(h, w, labels[rank], vocab_size=V, group=dist.group.WORLD, block=block, branch=branch)
    loss.backward()
    return loss.detach(), h.grad, w.grad, ref_losses[rank], ref_dh[rank], ref_dw[start:stop]


def _assert_close(got, want, dtype):
    torch.testing.assert_close(got.to(torch.float64), want.to(torch.float64), **TOL[dtype])


@pytest.mark.distributed
@pytest.mark.parametrize("world,token_counts,V,branch,block,all_ignored", [
    (2, (12, 12), 50, "activations", 7, ()),
    (2, (40, 9), 31, "weights", 0, ()),            # uneven V/P, different N per rank
    (3, (5, 17, 11), 53, "activations", 4, (1,)),  # uneven shards, one rank all ignore_index
    (3, (5, 17, 11), 53, "weights", 4, (1,)),
    (4, (13, 8, 21, 2), 97, "weights", 10, ()),
    (4, (13, 8, 21, 2), 97, "activations", 0, (3,)),
    (4, (30, 30, 30, 30), 64, "auto", 5, ()),
])
def test_ring_matches_full_logits_fp64(world, token_counts, V, branch, block, all_ignored):
    results = run_on_ranks(_ring_rank, world, token_counts, 8, V, torch.float64, branch, block, all_ignored,
                           timeout_s=120)
    for loss, dh, dw, ref_loss, ref_dh, ref_dw in results:
        _assert_close(loss, ref_loss, torch.float64)
        _assert_close(dh, ref_dh, torch.float64)
        _assert_close(dw, ref_dw, torch.float64)


@pytest.mark.distributed
@pytest.mark.parametrize("branch", ["activations", "weights"])
def test_ring_bf16_two_ranks(branch):
    results = run_on_ranks(_ring_rank, 2, (64, 48), 32, 301, torch.bfloat16, branch, 64, (), timeout_s=120)
    for loss, dh, dw, ref_loss, ref_dh, ref_dw in results:
        assert loss.dtype == torch.float32 and dh.dtype == torch.bfloat16
        _assert_close(loss, ref_loss, torch.bfloat16)
        _assert_close(dh, ref_dh, torch.bfloat16)
        _assert_close(dw, ref_dw, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [0, 1, 17, 1000])
def test_single_device_vocab_blocked(dtype, block):
    hs, weight, labels = _problem(3, (45,), 24, 211, dtype)
    ref_losses, ref_dh, ref_dw = _global_reference(hs, weight, labels)
    h, w = hs[0].clone().requires_grad_(), weight.clone().requires_grad_()
    loss = ring_dtp_loss(h, w, labels[0], vocab_size=211, block=block)
    loss.backward()
    _assert_close(loss.detach(), ref_losses[0], dtype)
    _assert_close(h.grad, ref_dh[0], dtype)
    _assert_close(w.grad, ref_dw, dtype)


def test_all_ignored_gives_zero_loss_and_grads():
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    loss = ring_dtp_loss(h, w, torch.full((6,), -100), vocab_size=9, block=4)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_gradcheck_and_opcheck():
    h = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 3, -100, 10, 4, 4, 9])
    assert torch.autograd.gradcheck(lambda h, w: ring_dtp_loss(h, w, y, vocab_size=11, block=4), (h, w))
    torch.library.opcheck(torch.ops.boundpass.ring_dtp_fwd.default, (h, w, y, 11, "", 4, -100, "auto", []))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), v=st.integers(2, 90), block=st.integers(0, 100), seed=st.integers(0, 2**16))
def test_property_single_device(n, v, block, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, 6, generator=g, dtype=torch.float64)
    w = torch.randn(v, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.2] = -100
    loss, lse = ring_dtp_forward(h, w, y, v, block=block)
    torch.testing.assert_close(loss, reference_loss(h, w, y, vocab_size=v), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(h @ w.t(), dim=1), rtol=1e-12, atol=1e-12)


def test_shards_and_branch_choice():
    assert vocab_shard_sizes(10, 4) == [3, 3, 2, 2] and sum(vocab_shard_sizes(200_000, 7)) == 200_000
    assert vocab_shard_range(10, 4, 2) == (6, 8)
    assert choose_branch(16_384, 200_000, 8) == "activations"   # N < V/P: the batch is the smaller payload
    assert choose_branch(32_768, 200_000, 8) == "weights"


def test_bad_input_is_refused():
    h, w = torch.randn(4, 3), torch.randn(5, 3)
    with pytest.raises(BoundpassInputError, match="1 <= P <= V"):
        vocab_shard_sizes(3, 4)
    with pytest.raises(BoundpassInputError, match="out of range"):
        ring_dtp_forward(h, w, torch.tensor([0, 1, 7, 2]), 5)
    with pytest.raises(BoundpassInputError, match="must hold vocab rows"):
        ring_dtp_forward(h, w, torch.tensor([0, 1, 2, 2]), 6)
    with pytest.raises(BoundpassInputError, match="branch"):
        ring_dtp_forward(h, w, torch.tensor([0, 1, 2, 2]), 5, branch="sideways")
    with pytest.raises(BoundpassInputError, match="mismatch"):
        ring_dtp_forward(h, torch.randn(5, 4), torch.tensor([0, 1, 2, 2]), 5)


# ------------------------------------------------------------------------------------------- bounds
def _measured_peak(h, w, labels, V, block, branch, token_counts=(), group_name=""):
    """Live-storage peak of the eager forward then backward (inputs counted; forward outputs kept)."""
    tracker = LiveStorageTracker()
    tracker.track_existing(h, w, labels)
    with tracker:
        loss, lse = ring_dtp_forward(h, w, labels, V, group_name, block, -100, branch, token_counts)
        grad = torch.ones((), dtype=loss.dtype, device=loss.device)
        dh, dw = ring_dtp_backward(grad, h, w, labels, lse, V, group_name, block, -100, branch, token_counts)
        del dh, dw
    return tracker.peak_bytes()


@pytest.mark.parametrize("dtype,branch,N,V,block", [
    (torch.float32, "weights", 1024, 512, 0),
    (torch.float32, "activations", 256, 8192, 0),
    (torch.float32, "activations", 256, 8192, 1024),
    (torch.bfloat16, "weights", 1024, 512, 0),
    (torch.bfloat16, "activations", 256, 8192, 2048),
])
def test_bound_sound_and_tight_single_device(dtype, branch, N, V, block):
    H = 128
    h, w = torch.randn(N, H).to(dtype), torch.randn(V, H).to(dtype)
    labels = torch.randint(0, V, (N,))
    measured = _measured_peak(h, w, labels, V, block, branch)
    values = ring_dtp.bound_values(dtype, N=N, H=H, V=V, P=1, C=block or V)
    bound = sym.evaluate(ring_dtp_bound(branch, mixed_precision=dtype != torch.float32), values)
    assert measured <= bound, (measured, bound)
    assert bound <= 1.25 * measured, (measured, bound)


def _measure_rank(rank, world, token_counts, H, V, branch, block):
    g = torch.Generator().manual_seed(rank)
    h = torch.randn(token_counts[rank], H, generator=g)
    start, stop = vocab_shard_range(V, world, rank)
    w = torch.randn(stop - start, H, generator=g)
    labels = torch.randint(0, V, (token_counts[rank],), generator=g)
    return _measured_peak(h, w, labels, V, block, branch, group_name=dist.group.WORLD.group_name)


@pytest.mark.distributed
@pytest.mark.parametrize("branch,token_counts,V,block", [
    ("weights", (1024, 768, 1024), 1500, 0),
    ("activations", (256, 192, 256), 12_000, 0),
    ("activations", (256, 192, 256), 12_000, 1000),
])
def test_bound_sound_and_tight_on_a_ring(branch, token_counts, V, block):
    H, world = 128, len(token_counts)
    peaks = run_on_ranks(_measure_rank, world, token_counts, H, V, branch, block, timeout_s=120)
    formula = ring_dtp_bound(branch, mixed_precision=False)
    for rank, measured in enumerate(peaks):
        values = ring_dtp.bound_values(torch.float32, N=token_counts[rank], N_max=max(token_counts), H=H, V=V,
                                       P=world, C=block or -(-V // world))
        bound = sym.evaluate(formula, values)
        assert measured <= bound, (rank, measured, bound)
        if token_counts[rank] == max(token_counts):  # tightness at the op's own (largest) scale
            assert bound <= 1.25 * measured, (rank, measured, bound)


def test_reference_bound_matches_measured_standard_schedule():
    N, H, V = 512, 64, 4096
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    tracker = LiveStorageTracker()
    tracker.track_existing(h, w, labels)
    with tracker:
        reference_loss(h, w, labels, vocab_size=V).backward()
    values = ring_dtp.bound_values(torch.float32, N=N, H=H, V=V, P=1)
    bound = sym.evaluate(ring_dtp.reference_bound(mixed_precision=False), values)
    assert tracker.peak_bytes() <= bound <= 1.25 * tracker.peak_bytes()


def _simulated_paper_peak(tokens: int, block: int) -> int:
    """Live-storage peak of Ring-DTP fwd+bwd on rank 3 of 8 under fake tensors (H = 7,168, V = 200,000)."""
    from boundpass.measure.simulate import simulated_rank
    P, H, V = 8, 7168, 200_000
    with simulated_rank(3, P, device="cpu") as sim:  # fake cuda lacks some CPU-build kernels
        start, stop = vocab_shard_range(V, P, sim.rank)
        h = torch.empty(tokens, H, device=sim.device)
        w = torch.empty(stop - start, H, device=sim.device)
        labels = torch.zeros(tokens, dtype=torch.int64, device=sim.device)
        return _measured_peak(h, w, labels, V, block, choose_branch(tokens, V, P), token_counts=(tokens,) * P,
                              group_name=sim.group.group_name)


@pytest.mark.parametrize("tokens,block", [(16_384, 0), (32_768, 0), (16_384, 4096), (32_768, 4096)])
def test_bound_sound_and_tight_simulated_at_paper_scale(tokens, block):
    """P = 8, H = 7,168, V = 200,000, fp32 (docs/design.md §2): nothing is allocated.

    Measured in a fresh interpreter: after other tests have compiled graphs in this process, the fake-tensor
    peak of the same code reads one [N, H] buffer higher (seen after the dynamic-shape compile tests; cause not
    yet found), and a bound test must not depend on test order.
    """
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_ring_dtp as t; "
            f"print(t._simulated_paper_peak({tokens}, {block}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    measured = int(out.stdout.strip().splitlines()[-1])
    P, H, V = 8, 7168, 200_000
    branch = choose_branch(tokens, V, P)
    values = ring_dtp.bound_values(torch.float32, N=tokens, H=H, V=V, P=P, C=block or None)
    bound = sym.evaluate(ring_dtp_bound(branch, mixed_precision=False), values)
    standard = sym.evaluate(ring_dtp.reference_bound(mixed_precision=False), values)
    assert measured <= bound <= 1.25 * measured, (measured, bound)
    assert bound <= 0.2 * standard  # docs/design.md §2 target: >= 80% below the standard schedule
