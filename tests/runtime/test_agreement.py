"""Issue 19: ranks agree or fail loudly (same error on every rank), no NaN where torch has zeros, no silent
garbage (meta / mixed devices, lse gradient, optimizer state keys), CLI cost-model inputs.

Each 2-rank test runs all its cases in one gloo process group with a short timeout: a hang fails in a minute.
"""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from boundpass.core.errors import BoundpassInputError
from boundpass.runtime.agreement import global_max_tokens
from boundpass.runtime.ring_dtp import reference_loss, ring_dtp_loss, vocab_shard_range
from boundpass.testing.distributed import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _outcome(fn):
    try:
        fn()
    except BoundpassInputError as err:
        return str(err)
    return None


# ------------------------------------------------------------------------------------------- Ring-DTP
def _ring_call(rank, *, V=12, H=4, N=6, dtype=torch.float64, branch="auto", bad_label=False, meta=False):
    g = torch.Generator().manual_seed(rank)
    start, stop = vocab_shard_range(V, 2, rank)
    h = torch.randn(N, H, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(stop - start, H, generator=g, dtype=dtype, device="meta" if meta else "cpu")
    y = torch.randint(0, V, (N,), generator=g)
    if bad_label:
        y[0] = V + 3
    return lambda: ring_dtp_loss(h, w, y, vocab_size=V, group=dist.group.WORLD, branch=branch).backward()


RING_CASES = {  # case -> settings of rank 1 (rank 0 uses the defaults)
    "V": dict(V=13), "H": dict(H=5), "dtype": dict(dtype=torch.float32), "branch": dict(branch="weights"),
    "bad_label": dict(bad_label=True), "meta": dict(meta=True),
}


def _ring_mismatch_rank(rank, world):
    out = {name: _outcome(_ring_call(rank, **(kw if rank == 1 else {}))) for name, kw in RING_CASES.items()}
    out["agreed"] = _outcome(_ring_call(rank, N=3 + 5 * rank))  # unequal N, same settings: runs
    return out


def test_ring_dtp_mismatched_fields_refused_on_every_rank_with_the_same_message():
    r0, r1 = run_on_ranks(_ring_mismatch_rank, 2, timeout_s=60)
    for name, want in (("V", "vocab size V (rank 0: 12, rank 1: 13)"), ("H", "hidden size H (rank 0: 4, rank 1: 5)"),
                       ("dtype", "input dtype (rank 0: torch.float64, rank 1: torch.float32)"),
                       ("branch", "branch (rank 0: 'auto', rank 1: 'weights')")):
        assert r0[name] is not None and r0[name] == r1[name], name
        assert want in r0[name] and "must agree" in r0[name], r0[name]
    assert "out of range" in r1["bad_label"] and "rank 1 of the ring of 2 refused its input" in r0["bad_label"]
    assert "meta" in r1["meta"] and "rank 1 of the ring of 2 refused its input" in r0["meta"]
    assert r0["agreed"] is None and r1["agreed"] is None


def _ring_ignored_rank(rank, world, V, H, counts, ignored_ranks, normalise):
    torch.manual_seed(0)
    hs = [torch.randn(n, H, dtype=torch.float64) for n in counts]
    weight = torch.randn(V, H, dtype=torch.float64)
    ys = [torch.randint(0, V, (n,)) for n in counts]
    for r in ignored_ranks:
        ys[r][:] = -100
    start, stop = vocab_shard_range(V, world, rank)
    results = []
    for ours in (True, False):
        h = hs[rank].clone().requires_grad_()
        w = (weight[start:stop] if ours else weight).clone().requires_grad_()
        y = ys[rank]
        if normalise == "global":  # torchtitan: sum over this rank / valid tokens over every rank
            valid = torch.tensor((y != -100).sum().item())
            dist.all_reduce(valid)
            loss = (ring_dtp_loss(h, w, y, vocab_size=V, group=dist.group.WORLD) if ours
                    else reference_loss(h, w, y, vocab_size=V)) / valid
        else:  # this rank's mean (torch's reduction="mean")
            loss = (ring_dtp_loss(h, w, y, vocab_size=V, group=dist.group.WORLD) / (y != -100).sum() if ours
                    else F.cross_entropy(h @ w.t(), y))
        loss.backward()
        dw = w.grad
        if not ours:  # the reference's dW of the whole vocab: sum over ranks, then this rank's rows
            dist.all_reduce(dw)
            dw = dw[start:stop]
        results.append((loss.detach(), h.grad, dw))
    return results


@pytest.mark.parametrize("counts,ignored,normalise", [((5, 7), (0, 1), "global"), ((5, 7), (0, 1), "mean"),
                                                      ((5, 7), (1,), "mean"), ((6, 3), (1,), "global")])
def test_all_ignored_batches_equal_torch_through_ring_dtp(counts, ignored, normalise):
    """Zero valid tokens: the loss is NaN (0/0) like torch's, every gradient exactly torch's (zeros, no NaN)."""
    for (loss, dh, dw), (ref_loss, ref_dh, ref_dw) in run_on_ranks(_ring_ignored_rank, 2, 11, 4, counts, ignored,
                                                                   normalise, timeout_s=60):
        assert torch.equal(loss.isnan(), ref_loss.isnan())
        if not ref_loss.isnan():
            torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        assert not dh.isnan().any() and not dw.isnan().any()
        torch.testing.assert_close(dh, ref_dh, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dw, ref_dw, rtol=1e-12, atol=1e-12)


def test_all_ignored_single_device_mean_and_nan_grad_match_torch():
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    y = torch.full((6,), -100)
    loss = ring_dtp_loss(h, w, y, vocab_size=9) / (y != -100).sum()  # 0 / 0: grad_loss = inf
    loss.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.t(), y)
    ref.backward()
    assert loss.isnan() and ref.isnan()
    assert torch.equal(h.grad, h2.grad) and torch.equal(w.grad, w2.grad) and not h.grad.any()


def test_lse_output_gradient_is_exact():
    """A z-loss on lse gets exact gradients (was: dropped silently)."""
    h = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 3, -100, 10, 4, 4, 9])

    def op(h, w):
        return torch.ops.boundpass.ring_dtp_fwd(h, w, y, 11, "", 4, -100, "auto", [])
    assert torch.autograd.gradcheck(op, (h, w))
    assert torch.autograd.gradcheck(lambda h, w: op(h, w)[1], (h, w))  # through lse alone
    loss, lse = op(h, w)
    (loss + 1e-2 * lse.square().sum()).backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logits = h2 @ w2.t()
    (F.cross_entropy(logits, y, reduction="sum") + 1e-2 * logits.logsumexp(1).square().sum()).backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-12, atol=1e-12)


def test_meta_and_mixed_device_inputs_refused_not_garbage():
    h, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 3])
    w_meta = torch.randn(5, 3, device="meta")
    with pytest.raises(BoundpassInputError, match="meta tensors for w "):
        ring_dtp_loss(h, w_meta, y, vocab_size=5)   # was: uninitialised memory from the fake kernel
    from boundpass.runtime.ring_dtp import ring_dtp_forward
    with pytest.raises(BoundpassInputError, match="meta tensors for h, w, labels"):
        ring_dtp_forward(h.to("meta"), w_meta, y.to("meta"), 5)
    out = ring_dtp_loss(h.to("meta"), w_meta, y.to("meta"), vocab_size=5)  # all-meta: shape propagation
    assert out.device.type == "meta"
    from boundpass.runtime.pipelined_llep import pipelined_llep
    x, ids, sc = torch.randn(4, 3), torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1)
    w1, w2, w3 = torch.randn(2, 5, 3), torch.randn(2, 3, 5), torch.randn(2, 5, 3)
    with pytest.raises(BoundpassInputError, match="meta tensors for w1"):
        pipelined_llep(x, ids, sc, w1.to("meta"), w2, w3, cap=2)


# -------------------------------------------------------------------------------------- PipelinedLLEP
def _llep_call(rank, *, e=2, I=5, H=4, k=2, T=6, dtype=torch.float64, cap=3, strided=True, alpha=1.1,
               min_piece=1024, imbalance_threshold=1.3, max_borrowed=None, bad_id=False, meta=False, schedule="pipe"):
    from boundpass.runtime.pipelined_llep import llep, pipelined_llep
    g = torch.Generator().manual_seed(rank)
    E = 4  # ids in [0, 4): valid for every e >= 2
    x = torch.randn(T, H, generator=g, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, E, (T, k), generator=g)
    if bad_id:
        ids[0, 0] = 99
    sc = torch.rand(T, k, generator=g, dtype=dtype)
    ws = [torch.randn(*shape, generator=g, dtype=dtype) for shape in ((e, I, H), (e, H, I), (e, I, H))]
    if meta:
        ws[0] = ws[0].to("meta")
    kw = dict(alpha=alpha, min_piece=min_piece, imbalance_threshold=imbalance_threshold, max_borrowed=max_borrowed)
    if schedule == "llep":
        return lambda: llep(x, ids, sc, *ws, group=dist.group.WORLD, **kw).sum().backward()
    return lambda: pipelined_llep(x, ids, sc, *ws, dist.group.WORLD, cap=cap, strided=strided,
                                  **kw).sum().backward()


LLEP_CASES = {
    "experts E": dict(e=3), "expert hidden I": dict(I=6), "hidden size H": dict(H=5), "top-k k": dict(k=1),
    "x dtype": dict(dtype=torch.float32), "cap c": dict(cap=4), "strided": dict(strided=False),
    "alpha": dict(alpha=1.2), "min_piece": dict(min_piece=8), "imbalance_threshold": dict(imbalance_threshold=0.0),
    "max_borrowed": dict(max_borrowed=1), "schedule": dict(schedule="llep"),
    "bad_id": dict(bad_id=True), "meta": dict(meta=True), "cap0": dict(cap=0),
}


def _llep_mismatch_rank(rank, world):
    out = {name: _outcome(_llep_call(rank, **(kw if rank == 1 else {}))) for name, kw in LLEP_CASES.items()}
    out["agreed"] = _outcome(_llep_call(rank, T=2 + 9 * rank, cap=2))  # unequal T, same settings: runs
    return out


def test_pipelined_llep_mismatched_fields_refused_on_every_rank_with_the_same_message():
    r0, r1 = run_on_ranks(_llep_mismatch_rank, 2, timeout_s=60)
    for name in LLEP_CASES:
        if name in ("bad_id", "meta", "cap0"):
            continue
        assert r0[name] is not None and r0[name] == r1[name], (name, r0[name], r1[name])
        assert "must agree on" in r0[name] and f"{name} (rank 0: " in r0[name], r0[name]
    assert "experts E (rank 0: 4, rank 1: 6)" in r0["experts E"]
    assert "cap c (rank 0: 3, rank 1: 4)" in r0["cap c"]
    assert "alpha (rank 0: 1.1, rank 1: 1.2)" in r0["alpha"]
    for name, local in (("bad_id", "expert ids"), ("meta", "meta"), ("cap0", "cap c must be >= 1")):
        assert local in r1[name] and "rank 1 of the EP group of 2 refused its input" in r0[name], (name, r0, r1)
    assert r0["agreed"] is None and r1["agreed"] is None


# ------------------------------------------------------------------------------ unequal per-rank counts
def _unequal_counts_rank(rank, world, cases):
    from boundpass.runtime.pipelined_llep import pipelined_llep, standard_ep
    errors = []
    for n0, n1, V in cases:
        n = (n0, n1)[rank]
        assert global_max_tokens(n, dist.group.WORLD) == max(n0, n1)
        g = torch.Generator().manual_seed(100 * n0 + n1)
        hs = [torch.randn(m, 4, generator=g, dtype=torch.float64) for m in (n0, n1)]
        weight = torch.randn(V, 4, generator=g, dtype=torch.float64)
        ys = [torch.randint(0, V, (m,), generator=g) for m in (n0, n1)]
        start, stop = vocab_shard_range(V, 2, rank)
        h, w = hs[rank].clone().requires_grad_(), weight[start:stop].clone().requires_grad_()
        loss = ring_dtp_loss(h, w, ys[rank], vocab_size=V, group=dist.group.WORLD)  # branch "auto": from N_max
        loss.backward()
        ref = reference_loss(hs[rank], weight, ys[rank], vocab_size=V)
        errors.append(abs(loss.item() - ref.item()))
        x = torch.randn(n, 4, dtype=torch.float64)
        ids = torch.randint(0, 4, (n, 2))
        sc = torch.rand(n, 2, dtype=torch.float64)
        ws = [torch.randn(*s, dtype=torch.float64) for s in ((2, 3, 4), (2, 4, 3), (2, 3, 4))]
        out = pipelined_llep(x, ids, sc, *ws, dist.group.WORLD, cap=max(1, min(n0, n1) // 2))
        errors.append((out - standard_ep(x, ids, sc, *ws, group=dist.group.WORLD)).abs().max().item())
    return errors


@settings(max_examples=2, deadline=None)
@given(cases=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40), st.integers(2, 60)), min_size=4, max_size=4))
def test_property_unequal_token_counts_per_rank_agree_and_match(cases):
    for errors in run_on_ranks(_unequal_counts_rank, 2, cases, timeout_s=90):
        assert max(errors) < 1e-10


# -------------------------------------------------------------------------------------- OffloadStreamAdamW
def _adamw_state():
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    ref = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    ref.step()
    return params, ref.state_dict()


@pytest.mark.parametrize("edit,match", [
    (lambda sd: sd["state"][0].pop("exp_avg"), "lacks exp_avg"),
    (lambda sd: sd["state"][1].pop("exp_avg_sq"), "lacks exp_avg_sq"),
    (lambda sd: sd["state"][0].pop("step"), "lacks step"),
    (lambda sd: sd["state"][0].__setitem__("exp_avg", torch.zeros(4, 3)), r"shape \(4, 3\), its param \(3, 4\)"),
    (lambda sd: sd["state"][1].__setitem__("exp_avg_sq", torch.zeros(6)), r"shape \(6,\)"),
    (lambda sd: sd["state"][0].__setitem__("exp_avg", torch.zeros(3, 4, dtype=torch.int64)), "floating"),
    (lambda sd: sd["state"].__setitem__(7, sd["state"][0]), "no saved param group"),
])
def test_offload_adamw_load_state_dict_refuses_missing_or_misshaped_keys(edit, match):
    from boundpass.runtime.offload_adamw import OffloadStreamAdamW
    params, sd = _adamw_state()
    opt = OffloadStreamAdamW(params, lr=1e-2, bucket_params=8)
    edit(sd)
    with pytest.raises(BoundpassInputError, match=match):
        opt.load_state_dict(sd)
    assert opt._host is None  # refused before anything was allocated


def test_offload_adamw_loads_a_state_with_a_never_stepped_param():
    from boundpass.runtime.offload_adamw import OffloadStreamAdamW
    params, sd = _adamw_state()
    sd["state"].pop(1)
    opt = OffloadStreamAdamW(params, lr=1e-2, bucket_params=8)
    opt.load_state_dict(sd)
    assert torch.equal(opt.state[params[0]]["exp_avg"], sd["state"][0]["exp_avg"])
    assert not opt.state[params[1]]["exp_avg"].any()


# ------------------------------------------------------------------------------------------------ CLI
def _cli(*extra):
    cmd = [sys.executable, "-m", "boundpass", "plan", "deepseek_v3", "debugmodel", "-W", "1", "-N", "256",
           "--budget", "2GiB", "--dtype", "fp32", "--no-trace", *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("flag,value", [("--flops", "0"), ("--link-inter", "0"), ("--link-intra", "-1"),
                                        ("--host-link", "nan"), ("--flops", "inf"), ("--gpus-per-node", "0")])
def test_cost_model_inputs_validated(flag, value):
    from boundpass.planning.full_scale import CostModel
    name = flag[2:].replace("-", "_")
    with pytest.raises(BoundpassInputError, match=flag[2:]):
        CostModel(**{name: int(value) if name == "gpus_per_node" else float(value)})


def test_cli_refuses_zero_flops_and_names_the_solve_ceiling():
    out = _cli("--search", "--flops", "0")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "flops must be a finite number > 0" in out.stderr
    out = _cli("--solve", "--budget", "1000000000TiB")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # the report wraps at 120 columns
    assert "search stopped at its ceiling" in text and "does not fit" not in text.split("solve:")[1]
