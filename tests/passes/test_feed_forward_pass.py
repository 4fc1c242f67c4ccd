"""The feed-forward pass (boundpass/passes/feed_forward_pass.py): a block's MLP => boundpass::row_blocks through
boundpass.compile (feed_forward_enable=True): found by structure (the norm joining it where only it reads the norm),
loss and gradients against the unrewritten model, the whole step certified both ways at torch's allocator and below
the unrewritten step's peak, the rows per block at the knee and refused just below the least certificate; skipped
with the reason where an intermediate is read elsewhere; torchtitan's dense block and shared experts."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import boundpass
from boundpass.testing.dense_lm import DenseLM, ce, lm_batches
from boundpass.testing.whole_step import allocator_step_peak, assert_step_matches


def _close_step(step, model, plain, batch, *, rtol=1e-5, atol=1e-5, loss_fn=ce):
    assert_step_matches(step, model, plain, batch, loss_fn, rtol=rtol, atol=atol)


def _certified_both_ways_and_below_unrewritten(step, model, plain, batches, gone: int):
    """The step's peak at torch's allocator within its certificate (<= 1.10x), and at least ``gone`` bytes below the
    same model's step without the pass; the certificate."""
    model.zero_grad(set_to_none=True)
    measured = allocator_step_peak(step, model, None, batches)
    cert = step.certificates[-1]
    assert measured <= cert.table.total <= 1.10 * measured, (cert.table.total, measured)
    off = boundpass.compile(copy.deepcopy(plain), loss_fn=ce, budget="1GiB")
    unrewritten = allocator_step_peak(off, off.model, None, batches)
    assert measured <= unrewritten - gone, (measured, unrewritten)
    return cert


def test_rewritten_exact_certified_both_ways_below_the_unrewritten_and_refused_just_below():
    plain = DenseLM(vocab=512, hidden=64, inter=2048)
    batches = lm_batches(512, 1, 2048, n=3)
    model = copy.deepcopy(plain)
    step = boundpass.compile(model, loss_fn=ce, budget="1GiB", feed_forward_enable=True)
    _close_step(step, model, copy.deepcopy(plain), batches[0])
    (region,) = boundpass.explain(step).rewritten_of("feed_forward")
    assert region.norm and region.width == 2048 and region.length == 2048, region.describe()
    knob = next(k for k in step.certificates[-1].planner.knobs if k.name == "feed_forward_chunk")
    assert knob.why == "knee" and knob.lo <= knob.value == knob.knee <= 2048 and region.chunk == knob.value
    assert "feed_forward_chunk = " in boundpass.explain(step).text(graph="none")

    # at least two [L, inter] fp32 intermediates of the whole sequence are gone
    cert = _certified_both_ways_and_below_unrewritten(step, model, plain, batches, 2 * 2048 * 2048 * 4)

    least = cert.total_at(**{k.name: k.lo for k in cert.planner.knobs})
    tight = boundpass.compile(copy.deepcopy(plain), loss_fn=ce, budget=least - 1, feed_forward_enable=True)
    with pytest.raises(boundpass.InfeasibleBudgetError, match="cannot be met"):
        tight(*batches[0])
    assert all(p.grad is None for p in tight.model.parameters())


def test_the_users_rows_per_block():
    plain = DenseLM(vocab=256, hidden=32, inter=512)
    model = copy.deepcopy(plain)
    step = boundpass.compile(model, loss_fn=ce, budget="1GiB", feed_forward_enable=True, feed_forward_chunk=96)
    _close_step(step, model, plain, lm_batches(256, 2, 500, n=1)[0])
    assert boundpass.explain(step).rewritten_of("feed_forward")[0].chunk == 96


class SharedHidden(nn.Module):
    """An MLP whose activation is also read by a second head: not walked in blocks (the activation is needed
    whole)."""

    def __init__(self, vocab=256, hidden=32, inter=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.up, self.down = nn.Linear(hidden, inter), nn.Linear(inter, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        a = F.gelu(self.up(self.emb(tokens)))
        return self.head(self.down(a)) + a.mean(-1, keepdim=True)


def test_an_intermediate_read_elsewhere_is_skipped_with_the_reason():
    step = boundpass.compile(SharedHidden(), loss_fn=ce, budget="1GiB", feed_forward_enable=True)
    step(*lm_batches(256, 1, 64, n=1)[0]).backward()
    report = boundpass.explain(step)
    assert not report.rewritten_of("feed_forward")
    (skipped,) = report.skipped_of("feed_forward")
    assert "used outside the region" in skipped.reason


class NormTwoReaders(nn.Module):
    """A norm whose result two parts read (as an MoE block's ffn_norm: the router and the experts), in bf16: it
    stays out of any region and runs in row blocks alone."""

    def __init__(self, vocab=256, hidden=64):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, hidden)
        self.norm = nn.RMSNorm(hidden)
        self.gate, self.value = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        n = self.norm(h)   # bf16 in and out, fp32 inside (torch's rms_norm)
        return self.head(h + torch.sigmoid(self.gate(n)) * self.value(n))


def test_a_norm_read_by_several_parts_runs_in_row_blocks_alone_exact_and_certified_both_ways():
    plain = NormTwoReaders().to(torch.bfloat16)
    batches = lm_batches(256, 1, 2048, n=3)
    model = copy.deepcopy(plain)
    step = boundpass.compile(model, loss_fn=ce, budget="1GiB", feed_forward_enable=True)
    _close_step(step, model, copy.deepcopy(plain), batches[0], rtol=2e-2, atol=2e-2)
    (region,) = boundpass.explain(step).rewritten_of("feed_forward")
    assert region.readers == 2 and "norm alone" in region.describe(), region.describe()
    assert 64 <= region.chunk < 2048   # in blocks: its elementwise work against the launches (the knee)
    # the norm's fp32 copy of its input, saved whole for its backward, is gone
    _certified_both_ways_and_below_unrewritten(step, model, plain, batches, 2048 * 64 * 4)


def test_off_by_default():
    step = boundpass.compile(DenseLM(vocab=256, hidden=32, inter=128), loss_fn=ce, budget="1GiB")
    step(*lm_batches(256, 1, 64, n=1)[0]).backward()
    assert not boundpass.explain(step).rewritten_of("feed_forward")


@pytest.mark.torchtitan
def test_torchtitans_dense_block_and_shared_experts_are_rewritten():
    """deepseek_v3: block 0's dense feed-forward with its norm, every MoE block's shared experts (the norm is read by
    the router too: it stays out, in row blocks alone), beside the attention, dispatch and vocab passes."""
    pytest.importorskip("torchtitan")
    from boundpass.recipes.models import build_debug_moe

    def loss(logits, labels):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    model = build_debug_moe("deepseek_v3", vocab_size=512, seq_len=128)
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, loss_fn=loss, budget="8GiB", attention_enable=True, feed_forward_enable=True)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 512, (2, 128), generator=g), torch.randint(0, 512, (2, 128), generator=g)
    _close_step(step, model, plain, batch, rtol=1e-4, atol=1e-4, loss_fn=loss)
    report = boundpass.explain(step)
    regions = report.rewritten_of("feed_forward")
    paths = sorted(r.module_path for r in regions)
    # the MoE blocks' ffn_norm (read by the router, the routed and the shared experts) and the final norm (read by
    # the head) in row blocks alone: their results whole, their intermediates per block
    moe = [f"model.layers.{i}.{part}" for i in range(1, len(model.layers)) for part in ("ffn_norm",
                                                                                       "moe.shared_experts.w2")]
    assert paths == sorted(["model.layers.0.feed_forward.w2", *moe, "model.norm"]), paths
    assert [r.norm for r in regions if "feed_forward" in r.module_path] == [True]
    alone = [r for r in regions if r.readers]
    assert len(alone) == len(model.layers) and all("norm alone" in r.describe() for r in alone)
    assert all(r.readers >= 2 for r in alone if "ffn_norm" in r.module_path), [r.describe() for r in alone]
    assert report.rewritten_of("attention") and report.rewritten_of("dispatch") and report.rewritten_of("vocab")
