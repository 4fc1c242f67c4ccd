"""Sequence-to-head (Ulysses) attention: exact vs unsharded SDPA on 2 and 4 gloo ranks (fwd + bwd, causal,
RoPE at global positions, GQA split and replicated), refusals, and its sympy bound measured both ways."""
import pytest
import torch

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError
from boundpass.runtime.seq_to_head import (check_head_counts, seq_to_head_bound, shard_positions, shard_sequence)
from boundpass.testing.distributed import run_on_ranks

pytestmark = pytest.mark.distributed

# (B, L, A_q, A_kv, D, causal, rope, dtype): MHA, GQA split (A_kv % W == 0), GQA replicated (A_kv < W), MQA
CASES = [
    (1, 32, 8, 8, 16, True, True, "float64"),
    (2, 32, 8, 4, 16, True, True, "float64"),
    (2, 32, 8, 2, 16, True, False, "float64"),
    (2, 32, 4, 1, 8, False, True, "float64"),
    (2, 32, 8, 2, 16, True, True, "float32"),
    (1, 32, 8, 8, (24, 16), True, True, "float64"),  # MLA-like: v head dim < qk head dim (v zero-padded)
    (1, 32, 4, 4, (8, 16), True, False, "float64"),  # v head dim > qk head dim (q, k zero-padded)
]
TOL = {"float64": dict(rtol=1e-12, atol=1e-12), "float32": dict(rtol=1e-5, atol=1e-5)}
# bound measured at these (B, L, A_q, A_kv, D, dtype): MHA, GQA split, GQA replicated, bf16 (fp32 lse)
BOUND_CASES = [(1, 64, 8, 8, 16, "float64"), (2, 64, 8, 2, 16, "float64"), (2, 64, 4, 1, 32, "float64"),
               (2, 64, 8, 8, 16, "bfloat16"), (1, 64, 8, 8, (24, 16), "float64")]


def _rope(x, positions):
    """Rotary embedding of [B, L, heads, D] at integer positions [L] (the standard complex rotation)."""
    D = x.shape[-1]
    freqs = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = positions.to(torch.float64)[:, None] * freqs[None]                       # [L, D/2]
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]                # [1, L, 1, D/2]
    xc = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], D // 2, 2))
    return torch.view_as_real(xc * rot).reshape(x.shape).to(x.dtype)


def _problem(B, L, A_q, A_kv, D, dtype, seed=0):
    """q, k, v, output gradient; D is one head dim or (qk head dim, v head dim)."""
    D_qk, D_v = (D, D) if isinstance(D, int) else D
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, L, A_q, D_qk), (B, L, A_kv, D_qk), (B, L, A_kv, D_v), (B, L, A_q, D_v)]
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(getattr(torch, dtype)) for s in shapes]


def _sharded_vs_reference(rank, world, B, L, A_q, A_kv, D, causal, rope, dtype, positions="global"):
    """Max |sharded - unsharded| over the output and dq/dk/dv of this rank's tokens (RoPE inside the graph)."""
    import torch.distributed as dist
    from boundpass.runtime.seq_to_head import sdpa_blnh, seq_to_head_attention
    qf, kf, vf, gf = _problem(B, L, A_q, A_kv, D, dtype)
    s = shard_sequence(L, rank, world)
    q, k, v = (t[:, s].clone().requires_grad_() for t in (qf, kf, vf))
    pos = shard_positions(L, rank, world)[0] if positions == "global" else torch.arange(L // world)
    qr, kr = (_rope(q, pos), _rope(k, pos)) if rope else (q, k)
    out = seq_to_head_attention(qr, kr, v, dist.group.WORLD, is_causal=causal)
    out.backward(gf[:, s])
    ref_in = [t.clone().requires_grad_() for t in (qf, kf, vf)]
    full = torch.arange(L)
    qr_f, kr_f = (_rope(ref_in[0], full), _rope(ref_in[1], full)) if rope else ref_in[:2]
    ref = sdpa_blnh(qr_f, kr_f, ref_in[2], enable_gqa=A_q != A_kv, is_causal=causal)
    ref.backward(gf)
    pairs = [(out, ref[:, s]), (q.grad, ref_in[0].grad[:, s]), (k.grad, ref_in[1].grad[:, s]),
             (v.grad, ref_in[2].grad[:, s])]
    ok = all(torch.allclose(a, b, **TOL[dtype]) for a, b in pairs)
    return ok, max((a - b).abs().max().item() for a, b in pairs)


def _measure_bound(rank, world, B, L, A_q, A_kv, D, dtype):
    """(peak, bound) bytes of one fwd + bwd on this rank; q/k/v, the output grad tracked from the start."""
    import torch.distributed as dist
    from boundpass.measure.memtrack import LiveStorageTracker
    from boundpass.runtime.seq_to_head import seq_to_head_attention
    qf, kf, vf, gf = _problem(B, L, A_q, A_kv, D, dtype, seed=1)
    s = shard_sequence(L, rank, world)
    q, k, v, go = (t[:, s].clone() for t in (qf, kf, vf, gf))
    for t in (q, k, v):
        t.requires_grad_()
    with LiveStorageTracker() as tracker:
        tracker.track_existing(q, k, v, go)
        out = seq_to_head_attention(q, k, v, dist.group.WORLD)
        out.backward(go)
    b = q.element_size()
    bound = sym.evaluate(seq_to_head_bound(), dict(N=B * L // world, W=world, A_q=A_q, A_kv=A_kv, b=b,
                                                    D_h=D if isinstance(D, int) else max(D),
                                                    b_acc=4 if dtype == "bfloat16" else b))
    return tracker.peak_bytes(), bound


def _ragged(rank, world):
    """Rank world-1 holds one token fewer: every rank must raise the same clear error (not a gloo error)."""
    import torch.distributed as dist
    from boundpass.runtime.seq_to_head import seq_to_head_attention
    n = 8 - (rank == world - 1)
    q, k, v = (torch.randn(1, n, 4, 8) for _ in range(3))
    try:
        seq_to_head_attention(q, k, v, dist.group.WORLD)
    except BoundpassInputError as e:
        return str(e)
    return None


def _all_on_ranks(rank, world, exact_cases, bound_cases):
    """One process group per world size (spawning dominates the cost): every check of that size."""
    return dict(exact=[_sharded_vs_reference(rank, world, *c) for c in exact_cases],
                local_positions=_sharded_vs_reference(rank, world, *CASES[0][:-1], "float64", positions="local"),
                bound=[_measure_bound(rank, world, *c) for c in bound_cases],
                bound_dropping=[_measure_bound_dropping_caller(rank, world, *c) for c in bound_cases],
                ragged=_ragged(rank, world))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"W{w}")
def ranks(request):
    world = request.param
    return world, run_on_ranks(_all_on_ranks, world, CASES, BOUND_CASES, timeout_s=240)


def test_exact_vs_unsharded_sdpa(ranks):
    world, results = ranks
    for rank, res in enumerate(results):
        for case, (ok, err) in zip(CASES, res["exact"]):
            assert ok, f"W={world} rank {rank} {case}: max |sharded - reference| = {err:.3e}"


def test_rope_needs_global_positions(ranks):
    """Negative control: RoPE at shard-local positions differs from the reference (the test can fail)."""
    world, results = ranks
    assert not all(res["local_positions"][0] for res in results)
    assert max(res["local_positions"][1] for res in results) > 1e-3


# bound / measured allowed: the project's 1.25 for one op at its own scale. Measured (6 repeats, every rank): the
# peaks are the same every time (the exchange frees its buffers, so gloo's worker threads cannot keep an earlier
# exchange alive); a caller that keeps its tensors is measured at the bound (1.08x for unequal head dims: the
# zero-padded v), one that drops them at 1.03-1.12x (2026-12-06, after the bound stopped counting a dropping
# caller's output and output gradient at the kernel's backward where A_kv = A_q; 1.09-1.23x before)
TIGHTNESS = {"bound": 1.25, "bound_dropping": 1.25}


@pytest.mark.parametrize("caller", ["bound", "bound_dropping"], ids=["caller-keeps", "caller-drops"])
def test_bound_both_ways(ranks, caller):
    world, results = ranks
    for rank, res in enumerate(results):
        for case, (peak, bound) in zip(BOUND_CASES, res[caller]):
            assert peak <= bound, f"W={world} rank {rank} {case}: measured {peak} B > bound {bound} B"
            assert bound <= TIGHTNESS[caller] * peak, \
                f"W={world} rank {rank} {case}: bound {bound} B > {TIGHTNESS[caller]} x {peak} B"


def _measure_bound_dropping_caller(rank, world, B, L, A_q, A_kv, D, dtype):
    """(peak, bound) of one fwd + bwd for a caller like torchtitan's attention: q/k/v are projections of a narrow
    input, the output goes through an output projection, all made inside the measurement, so q/k/v are held only
    by the op and the output gradient only by autograd. bound: seq_to_head_bound(caller_keeps_inputs=False), the
    composed budget's, plus what is the caller's: the gradients of the narrow input and of the projection weights
    and the output projection's result (small here)."""
    import torch.distributed as dist
    from boundpass.measure.memtrack import LiveStorageTracker
    from boundpass.runtime.seq_to_head import seq_to_head_attention
    qf, kf, vf, _ = _problem(B, L, A_q, A_kv, D, dtype, seed=1)
    n = L // world
    shapes = [(B, n, *t.shape[2:]) for t in (qf, kf, vf)]
    g = torch.Generator().manual_seed(2 + rank)
    x = torch.randn(B, n, 4, generator=g, dtype=torch.float64).to(qf.dtype).requires_grad_()
    ws = [torch.randn(4, sh[2] * sh[3], generator=g, dtype=torch.float64).to(qf.dtype).requires_grad_()
          for sh in shapes]
    wo = torch.randn(A_q * vf.shape[3], 4, generator=g, dtype=torch.float64).to(qf.dtype).requires_grad_()
    with LiveStorageTracker() as tracker:
        q, k, v = ((x @ w).view(sh) for w, sh in zip(ws, shapes))
        out = seq_to_head_attention(q, k, v, dist.group.WORLD if world > 1 else None)
        del q, k, v
        (out.flatten(2) @ wo).sum().backward()
    b = qf.element_size()
    callers = sum(t.numel() for t in (x, *ws, wo)) * b + B * n * 4 * b
    bound = sym.evaluate(seq_to_head_bound(caller_keeps_inputs=False),
                         dict(N=B * L // world, W=world, A_q=A_q, A_kv=A_kv, b=b,
                              D_h=D if isinstance(D, int) else max(D), b_acc=4 if dtype == "bfloat16" else b))
    return tracker.peak_bytes(), bound + callers


def _measure_bound_one_rank(B, L, A_q, A_kv, D, dtype, caller_keeps_inputs):
    """(peak, bound) bytes of one fwd + bwd with no group (W = 1: no exchange). caller_keeps_inputs: q/k/v are leaf
    tensors the caller holds and the output gradient is tracked from the start; else q/k/v are projections of a
    narrow input made inside the measurement and held only by the op, and the output gradient is not counted
    (torchtitan's attention modules: autograd passes it on), as the composed budget assumes."""
    from boundpass.measure.memtrack import LiveStorageTracker
    from boundpass.runtime.seq_to_head import seq_to_head_attention
    qf, kf, vf, go = _problem(B, L, A_q, A_kv, D, dtype, seed=1)
    b = qf.element_size()
    bound = sym.evaluate(seq_to_head_bound(caller_keeps_inputs=caller_keeps_inputs),
                         dict(N=B * L, W=1, A_q=A_q, A_kv=A_kv, b=b, D_h=D if isinstance(D, int) else max(D),
                              b_acc=4 if dtype == "bfloat16" else b))
    if not caller_keeps_inputs:
        return _measure_bound_dropping_caller(0, 1, B, L, A_q, A_kv, D, dtype)
    q, k, v = (t.requires_grad_() for t in (qf, kf, vf))
    with LiveStorageTracker() as tracker:
        tracker.track_existing(q, k, v, go)
        seq_to_head_attention(q, k, v, None).backward(go)
    return tracker.peak_bytes(), bound


@pytest.mark.parametrize("caller_keeps_inputs", [True, False], ids=["caller-keeps", "caller-drops"])
def test_bound_both_ways_on_one_rank(caller_keeps_inputs):
    """W = 1: no exchange buffers or gathered copies are counted, and the bound still holds (padded head dims,
    GQA, bf16) for a caller that keeps its q/k/v and for one that does not (the composed budget's case)."""
    for case in BOUND_CASES:
        peak, bound = _measure_bound_one_rank(*case, caller_keeps_inputs)
        assert peak <= bound, f"W=1 {case}: measured {peak} B > bound {bound} B"
        assert bound <= 1.25 * peak, f"W=1 {case}: bound {bound} B > 1.25 x {peak} B"


def test_ragged_last_shard_refused_on_every_rank(ranks):
    world, results = ranks
    messages = [res["ragged"] for res in results]
    assert all(m is not None and "ragged last shard" in m and f"W={world}" in m for m in messages), messages
    assert len(set(messages)) == 1


def test_head_counts():
    assert check_head_counts(8, 8, 4) == 1       # split
    assert check_head_counts(8, 2, 4) == 2       # each kv head replicated on 2 ranks
    assert check_head_counts(16, 1, 8) == 8      # MQA
    with pytest.raises(BoundpassInputError, match="A_q=6 is not a multiple of W=4"):
        check_head_counts(6, 6, 4)
    with pytest.raises(BoundpassInputError, match="cannot place A_kv=6 kv heads on W=4"):
        check_head_counts(12, 6, 4)
    with pytest.raises(BoundpassInputError, match="multiple of kv heads"):
        check_head_counts(8, 3, 2)


def test_shard_sequence_refuses_ragged():
    assert shard_sequence(12, 2, 4) == slice(6, 9)
    assert shard_positions(12, 3, 4).tolist() == [[9, 10, 11]]
    with pytest.raises(BoundpassInputError, match="ragged.*pad or trim the sequence to 12 or 16"):
        shard_sequence(13, 0, 4)


def test_unequal_head_dims_keep_the_fused_kernel():
    """MLA's v head dim differs from qk's: SDPA would fall back to the [N, N] math path; padded, it does not."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from boundpass.runtime.seq_to_head import sdpa_blnh, seq_to_head_attention

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v, _ = _problem(1, 16, 4, 4, (24, 16), "float64")
    with Ops() as ours:
        out = seq_to_head_attention(q, k, v, None)
    with Ops() as plain:
        ref = sdpa_blnh(q, k, v)
    assert "aten._safe_softmax.default" in plain.names          # the math path (scores materialised)
    assert not any("softmax" in n for n in ours.names)            # the fused kernel
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_single_rank_is_plain_attention():
    from boundpass.runtime.seq_to_head import sdpa_blnh, seq_to_head_attention
    q, k, v, _ = _problem(2, 16, 4, 2, 8, "float64")
    torch.testing.assert_close(seq_to_head_attention(q, k, v, None), sdpa_blnh(q, k, v, enable_gqa=True),
                               rtol=0, atol=0)


def test_bound_symbols_and_growth():
    bound = seq_to_head_bound()
    assert {s.name for s in bound.free_symbols} == {"N", "W", "A_q", "A_kv", "D_h", "b", "b_acc"}
    at = dict(N=1024, W=8, A_q=32, A_kv=8, D_h=128, b=2, b_acc=4)
    # linear in the per-rank tokens (no N x N term) and smaller without the caller's tensors
    assert sym.evaluate(bound, {**at, "N": 2048}) == 2 * sym.evaluate(bound, at)
    assert sym.evaluate(seq_to_head_bound(count_io=False), at) < sym.evaluate(bound, at)
    # one rank exchanges nothing: less than the same tokens' bound at W = 2 (exchange buffers, gathered copies)
    one = {**at, "W": 1, "A_kv": 8}
    assert sym.evaluate(bound, one) < sym.evaluate(bound, {**one, "W": 2})
    # what attention holds for its backward is part of its peak
    for w in (1, 8):
        assert sym.evaluate(seq_to_head_bound(part="saved"), {**at, "W": w}) < sym.evaluate(bound, {**at, "W": w})
    with pytest.raises(BoundpassInputError, match="part must be"):
        seq_to_head_bound(part="kernel")
