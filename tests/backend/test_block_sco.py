"""SCO across the block graphs of a per-block compile (boundpass/backend/block_compile.py, sco_pass.find_block_sco,
runtime/sco.py BlockSCO), on one process: a plain-PyTorch trunk of checkpointed blocks, each block compiled on its
own with ``CompiledBlocks.backend`` as torchtitan's apply_compile does. Each block's checkpoint boundary is its graph
input; one graph serves every block; the shared runtime offloads a forward prefix of the blocks and prefetches
block l-1's boundary while block l's backward runs. Checked: loss and every gradient bitwise equal to the
uncompiled model's, the runtime's log (what was offloaded, kept, prefetched), sco_enable="auto" offloading the fewest
blocks that make the budget fit, and the allocator's peak of the whole step under the certified peak.
"""
import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from boundpass.backend.block_compile import CompiledBlocks
from boundpass.backend.compiler import state_terms_of
from boundpass.core.config import Config
from boundpass.core.errors import InfeasibleBudgetError
from boundpass.testing.whole_step import allocator_peak_of

L, N, H, F = 6, 1024, 64, 128   # boundary N x H fp32 = 256 KiB per block


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, F), nn.Linear(F, H)

    def body(self, x):
        return x + self.down(torch.tanh(self.up(x)))

    def forward(self, x):  # torchtitan's FullAC: the whole block under a non-reentrant checkpoint
        return checkpoint(self.body, x, use_reentrant=False)


class Trunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(L))

    def forward(self, x, w):  # x: the first block's input (an embedding's output in a language model)
        h = x
        for block in self.layers:
            h = block(h)
        # a loss that saves nothing of size N x H (mul saves only w): once forward returns, the hidden states live
        # only where the blocks keep them, as in a trainer whose loss head has run its backward
        return (h * w).sum()


def _compiled(model, *, budget=2**30, host_budget=None, sco_enable=True):
    config = Config(budget=budget, host_budget=host_budget, sco={"enable": sco_enable}, dispatch={"enable": False})
    terms, _ = state_terms_of(model, None, budget=budget, host_budget=host_budget, knobs=config.optimizer)
    blocks = CompiledBlocks(model, list(model.layers), config, state_terms=terms, optimizer_plan=None)
    for block in model.layers:
        block.compile(backend=blocks.backend, fullgraph=True)
    return blocks


def _step(model, blocks, x, w):
    """One training step: the first block's input is made inside it (as an embedding would), no tensor of the
    step is held by the caller."""
    if blocks is not None:
        blocks.begin_step()
    for p in model.parameters():
        p.grad = None
    # an embedding's output: made in the step, requires grad, held by nothing but the first block (x * a scalar
    # leaf; the mul saves only x, which the test holds anyway)
    loss = model(x * torch.ones((), requires_grad=True), w)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]  # the next step rebinds .grad: these stay


@pytest.fixture
def models():
    torch._dynamo.reset()  # every test compiles fresh copies of the blocks (Dynamo guards on each module)
    torch.manual_seed(0)
    ref = Trunk()
    return ref, copy.deepcopy(ref), (torch.randn(N, H), torch.randn(H))


def test_every_block_offloaded_exact_and_prefetched(models):
    ref, model, x = models
    blocks = _compiled(model, sco_enable=True)
    for step in range(2):
        want_loss, want_grads = _step(ref, None, *x)
        if blocks.sco_runtime is not None:  # created at the first block graph's compile
            blocks.sco_runtime.events.clear()
        loss, grads = _step(model, blocks, *x)
        assert torch.equal(loss, want_loss), step
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads)), step
        kinds = [(e.kind, e.layer) for e in blocks.sco_runtime.events if e.kind != "free"]
        # forward offloads blocks 0..3; backward restores 3 (nothing prefetched it), each reload prefetches the next
        assert [k for k in kinds if k[0] == "offload"] == [("offload", i) for i in range(L)], kinds
        assert [k for k in kinds if k[0] == "prefetch"] == [("prefetch", i) for i in range(L - 2, -1, -1)], kinds
        assert [k for k in kinds if k[0] == "restore"] == [("restore", i) for i in range(L - 1, -1, -1)], kinds
        assert blocks.sco_runtime.peak_restored_live() <= 2
    assert len(blocks.graph_saved) == 1 and blocks.runs == [0] * L  # one graph serves every block
    assert blocks.sco_count == L
    plan = blocks.sco_plans[0]
    assert plan.rewritten and plan.dynamic, plan.lines()
    host = [t for t in blocks.certificates[0].table.terms if t.kind == "host" and "SCO" in t.name]
    assert host and host[0].value == L * N * H * 4


def _certified_and_measured(model, blocks, x):
    _step(model, blocks, *x)  # compiles; the next step is the steady one
    # SCO's host pool is live from step 1 on; on CPU it is the same memory as the "device"
    pool = list(blocks.sco_runtime._pool.values()) if blocks.sco_runtime is not None else []
    state = [*model.parameters(), *pool, *x]
    (_, _), peak = allocator_peak_of(lambda: _step(model, blocks, *x), state)
    # the test holds x and w (its batch); the loss head's two scalars and the input's scale (the loss, its gradient,
    # the leaf) are not the trunk's
    peak -= sum(t.numel() * t.element_size() for t in x) + 3 * 4
    host = max(t.host_total for t in [c.table for c in blocks.certificates] + blocks.phase_tables())
    return blocks.certified_peak(), host, peak


def test_auto_offloads_the_fewest_blocks_that_fit_and_the_step_stays_under_its_certificate(models):
    ref, model, x = models
    kept_model, all_model = copy.deepcopy(ref), copy.deepcopy(ref)
    kept, _, _ = _certified_and_measured(kept_model, _compiled(kept_model, sco_enable=False), x)
    every, _, _ = _certified_and_measured(all_model, _compiled(all_model, sco_enable=True), x)
    assert every < kept - N * H * 4  # offloading saves at least one boundary of the step's peak
    budget = (kept + every) // 2
    blocks = _compiled(model, budget=budget, sco_enable="auto")
    certified, host, measured = _certified_and_measured(model, blocks, x)
    trials = blocks.certificates[0].sco_trials  # offloaded count -> certified peak, as the planner tried them
    count = blocks.sco_count
    assert 0 < count < L and trials[count] <= budget < trials[count - 1], (count, trials, budget)
    assert certified <= budget
    assert host == count * N * H * 4
    # on CPU the host pool is the same memory as the device: the allocator sees both
    assert measured <= certified + host, (measured, certified, host)
    assert certified + host <= 1.10 * measured, (measured, certified, host)
    want_out, want_grads = _step(ref, None, *x)
    out, grads = _step(model, blocks, *x)
    assert torch.equal(out, want_out) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    assert sum(blocks.sco_runtime.offloaded) == count


def test_a_budget_that_offloading_every_block_cannot_meet_is_refused_before_the_block_runs(models):
    ref, model, x = models
    kept_model = copy.deepcopy(ref)
    full, _, _ = _certified_and_measured(kept_model, _compiled(kept_model, sco_enable=False), x)
    boundary = N * H * 4
    blocks = _compiled(model, budget=full - (L + 1) * boundary, sco_enable="auto")
    with pytest.raises(Exception) as err:  # raised inside Dynamo's backend (the trainer unwraps it)
        _step(model, blocks, *x)
    inner = getattr(err.value, "inner_exception", err.value)
    assert isinstance(inner, InfeasibleBudgetError), err.value
    assert "budget" in str(inner) and "SCO" in str(inner), str(inner)
    assert blocks.runs == [], "a block ran before its graph's certificate was checked"
