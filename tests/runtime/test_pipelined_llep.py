"""PipelinedLLEP and LLEP vs standard EP: exactness (fwd + bwd, 1/2/4 gloo ranks), plan invariants, bound."""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError
from boundpass.measure.memtrack import LiveStorageTracker
from boundpass.runtime.llep_plan import ChunkedRoutes, lendable_experts, plan_llep
from boundpass.runtime.pipelined_llep import (borrowed_slot_count, bound_values, llep, llep_bound, num_chunks,
                                              pipelined_llep, pipelined_llep_backward, pipelined_llep_bound,
                                              pipelined_llep_forward, standard_ep, standard_ep_bound)
from boundpass.testing.distributed import run_on_ranks

TOL = dict(rtol=1e-12, atol=1e-12)  # fp64: exact up to summation order
ROUTINGS = ("balanced", "zipf", "one_expert", "one_rank", "empty_experts")


def _routing(kind, T, E, k, g):
    """[T, k] distinct expert ids per token (what torch.topk gives) for a routing family."""
    if kind == "one_rank":  # every route to rank 0's experts (needs e >= k)
        weights = torch.zeros(E, dtype=torch.float64)
        weights[:k] = 1
    elif kind == "zipf":
        weights = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
    elif kind == "empty_experts":  # experts 1, 3 and 4 and beyond E/2 never chosen
        weights = torch.zeros(E, dtype=torch.float64)
        weights[[0, 2, E // 2]] = 1
    else:
        weights = torch.ones(E, dtype=torch.float64)
    ids = torch.multinomial(weights.expand(T, E), k, generator=g) if T else torch.zeros(0, k, dtype=torch.int64)
    if kind == "one_expert" and T:  # every token's first choice is expert 0
        rest = torch.multinomial(torch.ones(T, E - 1, dtype=torch.float64), k - 1, generator=g) + 1
        ids = torch.cat([torch.zeros(T, 1, dtype=torch.int64), rest], 1)
    return ids


def _problem(seed, kind, tokens, H, I, E, k):
    """Every rank builds the same global problem: per-rank x, ids, scores, output gradients, all experts."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, H, generator=g, dtype=torch.float64) for T in tokens]
    ids = [_routing(kind, T, E, k, g) for T in tokens]
    scores = [torch.rand(T, k, generator=g, dtype=torch.float64) for T in tokens]
    grads = [torch.randn(T, H, generator=g, dtype=torch.float64) for T in tokens]
    experts = [torch.randn(E, *shape, generator=g, dtype=torch.float64) * 0.3 for shape in ((I, H), (H, I), (I, H))]
    return xs, ids, scores, grads, experts


def _run(fn, rank, world, problem, **kw):
    """(output, dx, dscores, dw1, dw2, dw3) of one schedule on this rank."""
    xs, ids, scores, grads, experts = problem
    e = experts[0].shape[0] // world
    x, s = xs[rank].clone().requires_grad_(), scores[rank].clone().requires_grad_()
    ws = [w[rank * e:(rank + 1) * e].clone().requires_grad_() for w in experts]
    out = fn(x, ids[rank], s, *ws, dist.group.WORLD if world > 1 else None, **kw)
    out.backward(grads[rank])
    # standard EP leaves experts no route reached without a grad (None); the others give zeros
    return [out.detach(), x.grad, s.grad] + [torch.zeros_like(w) if w.grad is None else w.grad for w in ws]


SCHEDULES = [  # (name, fn, kwargs): relocation forced (threshold 0, tiny pieces) unless said otherwise
    ("llep", llep, dict(min_piece=2, imbalance_threshold=0.0)),
    ("llep_fallback", llep, dict()),
    ("pipelined_strided", pipelined_llep, dict(cap=3, min_piece=2, imbalance_threshold=0.0)),
    ("pipelined_consecutive", pipelined_llep, dict(cap=4, min_piece=2, imbalance_threshold=0.0, strided=False)),
    ("pipelined_one_slot", pipelined_llep, dict(cap=5, alpha=1.0, min_piece=1, imbalance_threshold=0.0,
                                                max_borrowed=1)),
]


def _exactness_rank(rank, world, tokens, H, I, E, k):
    """Max |schedule - standard EP| over output and all grads, per routing and schedule, on this rank."""
    errors = {}
    for seed, kind in enumerate(ROUTINGS):
        problem = _problem(seed, kind, tokens, H, I, E, k)
        ref = _run(standard_ep, rank, world, problem)
        for name, fn, kw in SCHEDULES:
            got = _run(fn, rank, world, problem, **kw)
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{kind}/{name} rank {rank}: {m}")
            errors[kind, name] = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(got, ref))
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("world,tokens,E", [(2, (11, 11), 4), (4, (7, 0, 12, 3), 8)])
def test_llep_and_pipelined_match_standard_ep(world, tokens, E):
    """Balanced, Zipf, one expert, one rank, empty experts; equal and different T per rank (one rank empty)."""
    errors = run_on_ranks(_exactness_rank, world, tokens, 6, 5, E, 2, timeout_s=80)
    assert max(max(r.values()) for r in errors) <= 1e-12


def _random_rank(rank, world, seed, tokens, cap, alpha, strided):
    problem = _problem(seed, "zipf" if seed % 2 else "balanced", tokens, 4, 3, 4, 2)
    ref = _run(standard_ep, rank, world, problem)
    got = _run(pipelined_llep, rank, world, problem, cap=cap, alpha=alpha, min_piece=1, imbalance_threshold=0.0,
               strided=strided)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.distributed
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 10_000), tokens=st.tuples(st.integers(0, 9), st.integers(1, 9)),
       cap=st.integers(1, 6), alpha=st.sampled_from([1.0, 1.1, 2.0]), strided=st.booleans())
def test_random_routings_two_ranks(seed, tokens, cap, alpha, strided):
    run_on_ranks(_random_rank, 2, seed, tokens, cap, alpha, strided, timeout_s=60)


def test_single_process_matches_standard_ep():
    problem = _problem(0, "zipf", (13,), 6, 5, 3, 2)
    ref = _run(standard_ep, 0, 1, problem)
    for name, fn, kw in SCHEDULES:
        for a, b in zip(_run(fn, 0, 1, problem, **kw), ref):
            torch.testing.assert_close(a, b, **TOL)


# ------------------------------------------------------------------------------------------ plan
@settings(max_examples=60, deadline=None)
@given(data=st.data(), world=st.integers(1, 4), e=st.integers(1, 3), k=st.integers(1, 3), cap=st.integers(1, 7),
       alpha=st.sampled_from([1.0, 1.1, 1.5]), min_piece=st.integers(1, 8), slots=st.sampled_from([None, 0, 1, 2]),
       strided=st.booleans())
def test_plan_covers_every_route_and_chunks_respect_the_cap(data, world, e, k, cap, alpha, min_piece, slots,
                                                           strided):
    E = world * e
    counts = [data.draw(st.lists(st.integers(0, 12), min_size=E, max_size=E)) for _ in range(world)]
    tokens = [max(-(-sum(row) // k), 0) for row in counts]  # any counts; the cap uses routes / k
    plan = plan_llep(counts, alpha=alpha, min_piece=min_piece, imbalance_threshold=0.0, max_borrowed=slots)
    for ex, pieces in enumerate(plan.pieces):  # pieces tile [0, global count) in order
        starts, stops = [p[1] for p in pieces], [p[2] for p in pieces]
        assert starts == ([0] + stops)[:len(pieces)] and all(a < b for a, b in zip(starts, stops))
        assert (pieces[-1][2] if pieces else 0) == sum(row[ex] for row in counts)
        assert all(rank == plan.owner(ex) or ex in plan.borrowed[rank] for rank, _, _ in pieces)
    assert len(set(plan.transfers)) == len(plan.transfers)
    assert slots is None or all(len(b) <= slots for b in plan.borrowed)
    K = num_chunks(max(tokens), cap)
    routes = ChunkedRoutes(counts, plan, K, strided)
    for j in range(K):
        sends = [routes.send_splits(s, j) for s in range(world)]
        for d in range(world):
            recv = [n for s, _, n in routes.recv_runs(d, j)]
            assert sum(recv) == sum(sends[s][d] for s in range(world)) <= world * cap * k
        assert all(sum(row) <= -(-max(tokens) * k // K) <= cap * k for row in sends)
    assert [sum(routes.send_splits(s, j)[d] for j in range(K) for d in range(world)) for s in range(world)] \
        == [sum(row) for row in counts]


def _token_routes(rng, T, k, experts):
    """One rank's counts over E experts: each of T tokens picks k distinct experts of ``experts`` (weights 1/i^a)."""
    E, pool, a = experts
    weights = [1.0 / (i + 1) ** a for i in range(len(pool))]
    row = [0] * E
    for _ in range(T):
        picked = set()
        while len(picked) < k:
            picked.add(rng.choices(pool, weights)[0])
        for ex in picked:
            row[ex] += 1
    return row


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), world=st.integers(2, 4), e=st.sampled_from([1, 2, 3, 4, 8, 32]),
       T=st.sampled_from([1, 2, 3, 7, 64]), alpha=st.sampled_from([1.0, 1.1, 1.5]),
       min_piece=st.sampled_from([1, 4, 1024]), threshold=st.sampled_from([0.0, 1.3]),
       where=st.sampled_from(["anywhere", "rank 0", "some experts"]), skew=st.sampled_from([0.0, 1.2, 3.0]))
def test_llep_never_lends_a_helper_more_than_lendable_experts(seed, world, e, T, alpha, min_piece, threshold, where,
                                                              skew):
    """The planner's arithmetic (llep_plan.lendable_experts): for every routing of T k routes per rank, no helper
    borrows more experts, and a slot limit of that many changes no plan (the dispatch pass gives it to the op); cut
    below (E_p - 1) e only where proven (E_p = 2, alpha >= 1)."""
    import random
    rng = random.Random(seed)
    E = world * e
    k = rng.randint(1, e)
    pool = {"anywhere": list(range(E)), "rank 0": list(range(e)),
            "some experts": rng.sample(range(E), rng.randint(k, E))}[where]
    counts = [_token_routes(rng, T, k, (E, pool, skew)) for _ in range(world)]
    most = lendable_experts(T * k, e, world, alpha)
    assert most <= (world - 1) * e and (world == 2 or most == (world - 1) * e)
    kw = dict(alpha=alpha, min_piece=min_piece, imbalance_threshold=threshold)
    free, limited = plan_llep(counts, **kw), plan_llep(counts, **kw, max_borrowed=most)
    assert max(len(b) for b in free.borrowed) <= most, (counts, free.borrowed, most)
    assert (free.pieces, free.borrowed, free.transfers) == (limited.pieces, limited.borrowed, limited.transfers)


def test_lendable_experts_is_attained_and_caps_the_slot_count():
    """qwen3 MoE debug's shape (E = 64 over E_p = 2, k = 8, T = 128 per rank): routes spread evenly over rank 0's 32
    experts make LLEP lend the helper 15 of them, exactly lendable_experts; s_b (LLEP's default e = 32, or a larger
    limit) is cut to 15, a smaller one kept; without a static T, nothing is cut."""
    row = [32] * 32 + [0] * 32  # 128 tokens x 8 routes, 32 per expert of rank 0
    assert lendable_experts(128 * 8, 32, 2) == 15
    assert [len(b) for b in plan_llep([row, row]).borrowed] == [0, 15]
    assert borrowed_slot_count(None, 32, 2, 128 * 8) == borrowed_slot_count(-1, 32, 2, 128 * 8) == 15
    assert borrowed_slot_count(8, 32, 2, 128 * 8) == 8 and borrowed_slot_count(None, 32, 2) == 32
    assert lendable_experts(128 * 8, 32, 1) == 0 and lendable_experts(0, 32, 2) == 0
    assert lendable_experts(128 * 8, 32, 2, alpha=2.0) == 0  # one rank may compute everything: no lending
    assert lendable_experts(128 * 8, 32, 4) == 96 and lendable_experts(128 * 8, 32, 2, alpha=0.9) == 32  # not proven


def test_fallback_when_balanced_and_relocation_when_skewed():
    assert not plan_llep([[5, 5], [5, 5]]).relocated
    skewed = plan_llep([[40, 0], [40, 0]], min_piece=4)
    assert skewed.relocated and skewed.transfers == [(0, 1)] and skewed.borrowed == [[], [0]]


def test_bad_input_is_refused():
    x, w = torch.zeros(4, 6), torch.zeros(2, 5, 6)
    ids, scores = torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2)
    with pytest.raises(BoundpassInputError):
        standard_ep(x, ids + 2, scores, w, w.transpose(1, 2), w)  # expert 2 of E = 2
    with pytest.raises(BoundpassInputError):
        pipelined_llep(x, ids, scores[:3], w, w.transpose(1, 2), w, cap=2)
    with pytest.raises(BoundpassInputError):
        pipelined_llep(x, ids, scores, w, w.transpose(1, 2), w, cap=0)


# ----------------------------------------------------------------------------------------- bound
BOUND_SHAPE = dict(T=64, H=16, I=8, E=4, k=2, cap=8)


def _measure_rank(rank, world, kind, alpha, dtype=torch.float64, compute=None, overlap=True):
    """Live-storage peak of the eager forward then backward (inputs, output and its gradient counted)."""
    s = BOUND_SHAPE
    g = torch.Generator().manual_seed(rank)
    e = s["E"] // world
    x = torch.randn(s["T"], s["H"], generator=g, dtype=torch.float64).to(dtype)
    ids = (torch.arange(s["k"]).repeat(s["T"], 1) if kind == "adversarial"  # every token to experts 0..k-1
           else _routing(kind, s["T"], s["E"], s["k"], g))
    scores = torch.rand(s["T"], s["k"], generator=g, dtype=torch.float64).to(dtype)
    ws = [torch.randn(e, *shape, generator=g, dtype=torch.float64).to(dtype)
          for shape in ((s["I"], s["H"]), (s["H"], s["I"]), (s["I"], s["H"]))]
    grad = torch.randn(s["T"], s["H"], generator=g, dtype=torch.float64).to(dtype)
    args = (dist.group.WORLD.group_name, s["cap"], alpha, 2, 0.0, e, True)
    tracker = LiveStorageTracker().track_existing(x, ids, scores, *ws, grad)
    with tracker, torch.no_grad():
        out, counts, perm = pipelined_llep_forward(x, ids, scores, *ws, *args, (), compute, overlap)
        grads = pipelined_llep_backward(grad, x, ids, scores, *ws, counts, perm, *args, compute, overlap)
        del grads
    return tracker.peak_bytes()


@pytest.mark.distributed
def test_bound_holds_for_every_routing_and_is_tight_under_adversarial_routing():
    s, world = BOUND_SHAPE, 2
    bound = sym.evaluate(pipelined_llep_bound(mixed_precision=False),  # one number: no routing in it
                         bound_values(torch.float64, N=s["T"], H=s["H"], I=s["I"], E=s["E"], E_p=world, k=s["k"],
                                      c=s["cap"]))
    cases = [(kind, 1.1) for kind in ROUTINGS + ("adversarial",)] + [("adversarial", float(world))]
    peaks = run_on_ranks(_measure_many, world, cases, timeout_s=80)
    for rank_peaks in peaks:
        for case, measured in zip(cases, rank_peaks):
            assert measured <= bound, (case, measured, bound)
    # alpha = E_p: capacity = all routes, nothing relocates, rank 0 receives E_p c k rows in every chunk
    assert bound <= 1.25 * peaks[0][-1], (peaks[0][-1], bound)


def _measure_many(rank, world, cases, dtype=torch.float64, compute=None, overlap=True):
    return [_measure_rank(rank, world, kind, alpha, dtype, compute, overlap) for kind, alpha in cases]


@pytest.mark.distributed
def test_bound_without_overlap_holds_and_is_tight():
    """overlap=False (each collective waited for at once: one receive buffer, one result buffer) has its own bound."""
    s, world = BOUND_SHAPE, 2
    bound = sym.evaluate(pipelined_llep_bound(mixed_precision=False, overlap=False),
                         bound_values(torch.float64, N=s["T"], H=s["H"], I=s["I"], E=s["E"], E_p=world, k=s["k"],
                                      c=s["cap"]))
    cases = [("zipf", 1.1), ("adversarial", 1.1), ("adversarial", float(world))]
    peaks = run_on_ranks(_measure_many, world, cases, torch.float64, None, False, timeout_s=80)
    for rank_peaks in peaks:
        for case, measured in zip(cases, rank_peaks):
            assert measured <= bound, (case, measured, bound)
    assert bound <= 1.25 * peaks[0][-1], (peaks[0][-1], bound)


@pytest.mark.distributed
def test_bound_holds_with_bf16_expert_matmuls_on_fp32_inputs():
    """torchtitan's experts run in bf16 on an fp32 model: the op casts per block; narrow_compute counts the casts."""
    s, world = BOUND_SHAPE, 2
    bound = sym.evaluate(pipelined_llep_bound(mixed_precision=False, narrow_compute=True),
                         bound_values(torch.float32, N=s["T"], H=s["H"], I=s["I"], E=s["E"], E_p=world, k=s["k"],
                                      c=s["cap"]))
    cases = [("zipf", 1.1), ("adversarial", float(world))]
    for rank_peaks in run_on_ranks(_measure_many, world, cases, torch.float32, torch.bfloat16, timeout_s=80):
        for case, measured in zip(cases, rank_peaks):
            assert measured <= bound, (case, measured, bound)


# ------------------------------------------------------------------------- reference-schedule bounds
REF_SHAPE = dict(T=64, H=16, I=8, E=4, k=2)
REF_SCHEDULES = (("standard_ep", standard_ep, dict()), ("llep", llep, dict(min_piece=2, imbalance_threshold=0.0)))


def _reference_peaks_rank(rank, world, dtype):
    """(schedule, routing, measured peak, bound at the realized R) of standard EP and LLEP on this rank.

    Autograd forward + backward; x, ids, scores, experts and the output gradient are counted, as in the bound.
    """
    s = REF_SHAPE
    e, out = s["E"] // world, []
    for seed, kind in enumerate(ROUTINGS + ("adversarial",)):
        g = torch.Generator().manual_seed(seed)  # every rank builds every rank's ids: R is known locally
        ids = [torch.arange(s["k"]).repeat(s["T"], 1) if kind == "adversarial"
               else _routing(kind, s["T"], s["E"], s["k"], g) for _ in range(world)]
        counts = [torch.bincount(i.reshape(-1), minlength=s["E"]).tolist() for i in ids]
        for name, fn, kw in REF_SCHEDULES:
            if name == "llep":
                plan = plan_llep(counts, **kw)
                R = sum(n for _, _, n in ChunkedRoutes(counts, plan, 1).recv_runs(rank, 0))
                expr, s_b = llep_bound(), len(plan.borrowed[rank])
            else:
                R = sum(row[rank * e + j] for row in counts for j in range(e))
                expr, s_b = standard_ep_bound(), 0
            x = torch.randn(s["T"], s["H"], generator=g).to(dtype)
            scores = torch.rand(s["T"], s["k"], generator=g).to(dtype)
            ws = [torch.randn(e, *shape, generator=g).to(dtype) for shape in ((s["I"], s["H"]), (s["H"], s["I"]),
                                                                              (s["I"], s["H"]))]
            grad = torch.randn(s["T"], s["H"], generator=g).to(dtype)
            tracker = LiveStorageTracker().track_existing(x, ids[rank], scores, *ws, grad)
            leaves = [t.requires_grad_() for t in (x, scores, *ws)]
            if name == "standard_ep":  # the forward alone (a checkpointed block's recompute) against its own part
                forward = LiveStorageTracker().track_existing(x, ids[rank], scores, *ws)
                with forward:
                    y = fn(x, ids[rank], scores, *ws, dist.group.WORLD, **kw)
                    del y
                bound_f = sym.evaluate(standard_ep_bound("forward"), bound_values(
                    dtype, N=s["T"], H=s["H"], I=s["I"], E=s["E"], E_p=world, k=s["k"], R=R))
                out.append(("standard_ep forward", kind, R, forward.peak_bytes(), bound_f))
            with tracker:
                y = fn(x, ids[rank], scores, *ws, dist.group.WORLD, **kw)
                grads = torch.autograd.grad(y, leaves, grad, allow_unused=True)
                del y, grads
            bound = sym.evaluate(expr, bound_values(dtype, N=s["T"], H=s["H"], I=s["I"], E=s["E"], E_p=world,
                                                    k=s["k"], s_b=s_b, R=R))
            out.append((name, kind, R, tracker.peak_bytes(), bound))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_standard_ep_and_llep_peaks_stay_under_their_bounds(dtype):
    """Realized-R bounds hold on both ranks, every routing; bf16 includes the combine's fp32 temporaries."""
    for rank, results in enumerate(run_on_ranks(_reference_peaks_rank, 2, dtype, timeout_s=60)):
        for name, kind, R, measured, bound in results:
            assert measured <= bound, (dtype, name, kind, rank, R, measured, bound)
        whole = {(kind, R): bound for name, kind, R, _, bound in results if name == "standard_ep"}
        for name, kind, R, measured, bound in results:
            if name == "standard_ep forward":  # the forward's part is below the whole op's, and not loose
                assert bound < whole[(kind, R)] and bound <= 1.6 * measured, (dtype, kind, rank, measured, bound)


# ------------------------------------------------------------------- the pipelined schedule, chunk by chunk
def _sparse_rank(rank, world, strided):
    """Every source sends one route to the last rank's experts, the rest to rank 0's: the last rank receives
    nothing in most chunks (the layout says which). Pipelined (overlapped) vs standard EP, and overlap on/off
    bit-equal."""
    from boundpass.runtime.pipelined_llep import schedule_of
    T, H, I, E, k, cap = 12, 6, 5, 2 * world, 2, 2
    g = torch.Generator().manual_seed(5)
    xs, ids, scores, grads, experts = _problem(5, "one_rank", (T,) * world, H, I, E, k)
    for t in ids:  # token 0 of every source: its second choice moves to the last rank's first expert
        t[0, 1] = E - 2
    problem = (xs, ids, scores, grads, experts)
    ref = _run(standard_ep, rank, world, problem)
    kw = dict(cap=cap, min_piece=1, imbalance_threshold=100.0, strided=strided)  # no relocation: rank 0 stays hot
    got = _run(pipelined_llep, rank, world, problem, **kw)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)
    counts = [torch.bincount(i.reshape(-1), minlength=E).tolist() for i in ids]
    _, _, lay = schedule_of(counts, k, cap, strided, 1.1, 1, 100.0, E // world, world - 1)
    empty_chunks = sum(1 for r in lay.rows if r == 0)
    # the eager pair with and without overlap: the same operations in the same order, so the same bits
    e = E // world
    ws = [w[rank * e:(rank + 1) * e].clone() for w in experts]
    args = (dist.group.WORLD.group_name, cap, 1.1, 1, 100.0, e, strided)
    outs = []
    for overlap in (True, False):
        out, cnt, perm = pipelined_llep_forward(xs[rank], ids[rank], scores[rank], *ws, *args, (), None, overlap)
        outs.append((out, *pipelined_llep_backward(grads[rank], xs[rank], ids[rank], scores[rank], *ws, cnt, perm,
                                                   *args, None, overlap)))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    return lay.K, empty_chunks


@pytest.mark.distributed
@pytest.mark.parametrize("strided", [True, False])
def test_pipelined_rank_receiving_nothing_in_some_chunks(strided):
    K, empty = run_on_ranks(_sparse_rank, 2, strided, timeout_s=60)[1]
    assert K > 1 and 0 < empty < K, (K, empty)  # the last rank: some chunks empty, not all


def test_graph_bound_reads_unlimited_borrowing_as_every_other_ranks_experts():
    """An op node with max_borrowed -1 (no limit) is charged the slots a helper can fill, never -1 slots (which
    subtracted three experts' weights and gradients); one rank has no one to borrow from: 0 slots."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from boundpass.core import symbols as sym
    from boundpass.measure.step_peak import op_bound

    with FakeTensorMode():
        vals = [torch.empty(16, 8), torch.zeros(16, 2, dtype=torch.int64), torch.empty(16, 2),
                torch.empty(4, 6, 8), torch.empty(4, 8, 6), torch.empty(4, 6, 8)]

    def charged(slots):
        graph = fx.Graph()
        inputs = []
        for i, v in enumerate(vals):
            node = graph.placeholder(f"a{i}")
            node.meta["val"] = v
            inputs.append(node)
        op = graph.call_function(torch.ops.boundpass.pipelined_llep_fwd.default,
                                 (*inputs, "", 0, 1.1, 1024, 1.3, slots, True, [], torch.float32))
        return int(op_bound(op, {}).subs(sym.c, 4))  # the op's registered contract; c stays symbolic

    assert charged(-1) == charged(0) > 0
    assert charged(1) > charged(0)


def test_an_infeasible_dispatch_names_the_borrowed_slots_it_holds():
    """When the PipelinedLLEP op binds even at c = 1, the fix names dispatch_borrowed_slots and one slot's bytes while
    the op lends slots (EP > 1), and not on one EP rank (0 slots: fewer cannot help)."""
    import torch.fx as fx
    from boundpass.passes.dispatch_pass import dispatch_fix as _dispatch_fix
    from boundpass.passes.dispatch_pass import DispatchRegion

    def region(slots):
        graph = fx.Graph()
        op = graph.call_function(torch.ops.boundpass.pipelined_llep_fwd.default,
                                 tuple([None] * 11) + (slots, True, [], torch.bfloat16))
        return DispatchRegion(module_path="layers.1.moe", rewritten=True, tokens=128, hidden=256, inter=768,
                              experts=64, local_experts=32, top_k=8, ep_size=2, group_name="g", dtype=torch.bfloat16,
                              op_node=op)
    fix = _dispatch_fix(region(8), 128)
    assert "tokens per rank N (now 128)" in fix
    assert "dispatch_borrowed_slots, now 8: 2.25 MiB each" in fix, fix  # 2 x 3 x 256 x 768 bf16 elements
    assert "borrowed" not in _dispatch_fix(region(0), 128)
