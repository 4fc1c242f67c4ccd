"""Ranks fail together (issue 33, item 8): a refusal on one rank, or a difference in setup between ranks, reaches
every rank through the exchange compile already makes, and every rank raises within seconds, never waiting for a
peer in a collective until the process group's timeout. Each test has a hard timeout well below gloo's."""
import time

import pytest
import torch
import torch.distributed as dist

import boundpass
from boundpass.testing.dense_lm import DenseLM
from boundpass.testing.distributed import run_on_ranks


def _sum_ce(out, labels):
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="sum")


def _outcome(fn):
    start = time.monotonic()
    try:
        fn()
        what = "ran"
    except boundpass.BoundpassError as err:
        what = type(err).__name__
    return what, time.monotonic() - start


def _budget_refused_on_one_rank(rank, world):
    """Rank 1's budget is too small for its step (caught, as a launcher would to log it); rank 0's fits."""
    torch.manual_seed(0)
    model = DenseLM(2048, hidden=16, inter=64).double()
    step = boundpass.compile(model, budget="1GiB" if rank == 0 else "1536KiB", loss_fn=_sum_ce,
                             ring_group=dist.group.WORLD)
    tokens = torch.randint(0, 2048, (4, 256))

    def train():
        step(tokens, tokens).backward()
    first = _outcome(train)
    second = _outcome(train)  # after catching the error, a second try must not hang either
    return first, second


def test_a_budget_refused_on_one_rank_stops_every_rank():
    out = run_on_ranks(_budget_refused_on_one_rank, 2, timeout_s=240)
    (first0, _), (first1, _) = out
    assert first1[0] == "InfeasibleBudgetError"
    assert first0[0] == "PeerRefusedError"
    assert first0[1] < 60 and first1[1] < 60


def _ring_on_one_rank(rank, world):
    model = DenseLM(512, hidden=16, inter=64)
    return _outcome(lambda: boundpass.compile(model, budget="1GiB", loss_fn=_sum_ce,
                                              ring_group=dist.group.WORLD if rank == 0 else None))


def test_ring_group_given_on_one_rank_only_is_refused_on_both():
    out = run_on_ranks(_ring_on_one_rank, 2, timeout_s=120)
    assert [o[0] for o in out] == ["BoundpassInputError", "BoundpassInputError"], out


def _state_refused_on_one_rank(rank, world):
    model = DenseLM(512, hidden=16, inter=64)
    return _outcome(lambda: boundpass.compile(model, budget="1GiB" if rank == 0 else 1024, loss_fn=_sum_ce,
                                              ring_group=dist.group.WORLD))


def test_state_refused_at_compile_on_one_rank_stops_both():
    out = run_on_ranks(_state_refused_on_one_rank, 2, timeout_s=120)
    assert [o[0] for o in out] == ["PeerRefusedError", "InfeasibleBudgetError"], out
