"""The attention pass (boundpass/passes/attention_pass.py): scaled_dot_product_attention => chunked attention through
boundpass.compile (attention_enable=True): rewritten where the op computes the call exactly, skipped with the reason
otherwise; loss and gradients against the unrewritten model; the whole step certified both ways at torch's
allocator; the tile chosen at the knee and refused just below the least certificate; torchtitan's attention."""
import copy

import pytest
import torch
import torch.nn.functional as F

import boundpass
from boundpass.testing.whole_step import allocator_step_peak, assert_step_matches

from boundpass.testing.attention_lm import LM, V  # noqa: E402


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _batch(length, seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, length), generator=g), torch.randint(0, V, (batch, length), generator=g)


def _close_step(step, model, plain, batch, *, rtol=1e-5, atol=1e-5):
    """The compiled step's loss and every gradient against the unrewritten model's (fp32: reordered sums only)."""
    assert_step_matches(step, model, plain, batch, _loss, rtol=rtol, atol=atol)


def test_rewritten_exact_certified_both_ways_and_refused_just_below():
    model = LM()
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, loss_fn=_loss, budget="1GiB", attention_enable=True)
    batch = _batch(512)
    _close_step(step, model, plain, batch)
    report = boundpass.explain(step)
    regions = report.rewritten_of("attention")
    assert len(regions) == 2 and all(r.causal and r.heads == 4 and r.kv_heads == 2 and r.v_head_dim == 24
                                     for r in regions)
    # the whole sublayer in query blocks, k and v made per key tile, the norm before it joined (only it reads it)
    assert all(r.blocks and r.kv_blocks and r.norm for r in regions), [r.describe() for r in regions]
    knob = next(k for k in step.certificates[-1].planner.knobs if k.name == "attention_chunk")
    assert knob.why == "knee" and knob.lo <= knob.value == knob.knee <= 512
    assert "attention_chunk = " in report.text(graph="none")

    model.zero_grad(set_to_none=True)
    measured = allocator_step_peak(step, model, None, [_batch(512, seed) for seed in range(3)])
    cert = step.certificates[-1]
    assert measured <= cert.table.total <= 1.10 * measured, (cert.table.total, measured)

    least = cert.total_at(**{k.name: k.lo for k in cert.planner.knobs})
    tight = boundpass.compile(copy.deepcopy(plain), loss_fn=_loss, budget=least - 1, attention_enable=True)
    with pytest.raises(boundpass.InfeasibleBudgetError, match="cannot be met"):
        tight(*batch)
    assert all(p.grad is None for p in tight.model.parameters())


class _NormReadOutside(LM):
    """Each block's norm output also read outside the attention (a parallel block's MLP reads it so)."""

    def forward(self, tokens):
        h = self.emb(tokens)
        for norm, attn in zip(self.norms, self.attn):
            n = norm(h)
            h = h + attn(n) + 0.5 * n
        return self.head(h)


def test_a_norm_read_outside_the_sublayer_stays_outside_it():
    model = _NormReadOutside()
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, loss_fn=_loss, budget="1GiB", attention_enable=True)
    _close_step(step, model, plain, _batch(256))
    regions = boundpass.explain(step).rewritten_of("attention")
    assert len(regions) == 2 and all(r.blocks and r.kv_blocks and not r.norm for r in regions), \
        [r.describe() for r in regions]


def test_the_tile_the_budget_allows_and_the_users_tile():
    """A budget between the least and the knee's certificate narrows the tile below the knee ("budget"); the user's
    tile is used as given ("user"), and both steps stay exact."""
    plain = LM()
    batch = _batch(512)
    probe = boundpass.compile(copy.deepcopy(plain), loss_fn=_loss, budget="1GiB", attention_enable=True)
    probe(*batch)
    cert = probe.certificates[-1]
    knob = next(k for k in cert.planner.knobs if k.name == "attention_chunk")
    narrow = cert.total_at(attention_chunk=knob.lo, vocab_block=V)
    wide = cert.total_at(attention_chunk=knob.value, vocab_block=V)
    assert narrow < wide
    model = copy.deepcopy(plain)
    step = boundpass.compile(model, loss_fn=_loss, budget=(narrow + wide) // 2, attention_enable=True)
    _close_step(step, model, copy.deepcopy(plain), batch)
    chosen = next(k for k in step.certificates[-1].planner.knobs if k.name == "attention_chunk")
    assert chosen.why == "budget" and knob.lo <= chosen.value < knob.value
    model = copy.deepcopy(plain)
    step = boundpass.compile(model, loss_fn=_loss, budget="1GiB", attention_enable=True, attention_chunk=96)
    _close_step(step, model, copy.deepcopy(plain), batch)
    assert boundpass.explain(step).rewritten_of("attention")[0].chunk == 96


def test_no_square_of_the_length_where_torch_takes_the_math_path():
    """Unequal head dims keep torch's SDPA on its math path on this CPU ([B, A_q, L, L] scores in forward and
    backward); rewritten, the certified step is below what the unrewritten step measures."""
    batch = _batch(1024, batch=1)
    plain = LM(layers=1)
    off = boundpass.compile(copy.deepcopy(plain), loss_fn=_loss, budget="4GiB")
    on = boundpass.compile(copy.deepcopy(plain), loss_fn=_loss, budget="4GiB", attention_enable=True)
    measured_off = allocator_step_peak(off, off.model, None, [batch, batch])
    measured_on = allocator_step_peak(on, on.model, None, [batch, batch])
    scores = 4 * 1024 * 1024 * 4                       # one [A_q, L, L] fp32 tensor
    assert measured_off > 2 * scores
    assert on.certificates[-1].table.total < measured_off - scores, (on.certificates[-1].table.total, measured_off)
    assert measured_on <= on.certificates[-1].table.total


@pytest.mark.parametrize("kw,reason", [
    (dict(mask="window"), "an attention mask other than the causal one"),
    (dict(mask="input"), "an attention mask computed from the graph's inputs"),
    (dict(dropout=0.1), "attention dropout"),
])
def test_what_the_op_cannot_compute_is_skipped_with_the_reason(kw, reason):
    model = LM(layers=1, **kw)
    step = boundpass.compile(model, loss_fn=_loss, budget="1GiB", attention_enable=True)
    step(*_batch(64)).backward()
    report = boundpass.explain(step)
    assert not report.rewritten_of("attention")
    assert len(report.skipped_of("attention")) == 1
    assert reason in report.skipped_of("attention")[0].reason


def test_query_blocks_hold_less_than_the_call_alone_certified_both_ways():
    """The sublayer walked in query blocks never holds q, the attention output, their gradients or dq whole: the
    step's measured peak is below the call rewritten alone, and the certificate holds it both ways."""
    plain = LM(layers=1, heads=8, kv_heads=2, d=32, dv=48)
    batch = _batch(1024, batch=1)
    peaks = {}
    for blocks in (True, False):
        step = boundpass.compile(copy.deepcopy(plain), loss_fn=_loss, budget="4GiB", attention_enable=True,
                                 attention_query_blocks=blocks, attention_chunk=128)
        measured = allocator_step_peak(step, step.model, None, [batch, batch])
        certified = step.certificates[-1].table.total
        assert measured <= certified <= 1.10 * measured, (blocks, certified, measured)
        assert [r.blocks for r in boundpass.explain(step).rewritten_of("attention")] == [blocks]
        peaks[blocks] = measured
    assert peaks[True] < 0.8 * peaks[False], peaks


def test_k_v_q_do_on_the_host_certified_both_ways_and_the_host_budget_checked():
    """attention.offload (the default): k, v and the backward's q, dO and dq on the host, read back a tile at a time.
    The step is as exact as with them on the device; its device certificate is below that one's by about those bytes and
    holds the measured peak both ways (the pool made by the first step is host memory, not counted); the table's host
    row is exactly the pool the op holds; a host budget below it is refused before anything runs, naming the row and
    the knob."""
    from boundpass.runtime import host_tiles
    plain = LM(layers=1, heads=8, kv_heads=2, d=32, dv=24)
    batch = _batch(1024, batch=1)
    certified = {}
    for offload in (True, False):
        model = copy.deepcopy(plain)
        step = boundpass.compile(model, loss_fn=_loss, budget="4GiB", attention_enable=True,
                                 attention_offload=offload, attention_chunk=128)
        host_tiles.clear_pool()
        _close_step(step, model, copy.deepcopy(plain), batch)
        model.zero_grad(set_to_none=True)
        measured = allocator_step_peak(step, model, None, [batch, batch])
        table = step.certificates[-1].table
        assert measured <= table.total <= 1.10 * measured, (offload, table.total, measured)
        (region,) = boundpass.explain(step).rewritten_of("attention")
        assert region.host == offload and ("on the host" in region.describe()) == offload
        host = [t for t in table.terms if t.kind == "host" and "attention" in t.name]
        assert [t.value for t in host] == ([host_tiles.pool_bytes()] if offload else []), (host, offload)
        certified[offload] = table.total
    # what the on-device schedule's key-outer pass holds whole: q, dO [1, 8, L, 32 + 24] and dq [1, 8, L, 32] in fp32
    # (k and v are freed by then), less at most the two tiles of each on the device
    whole, tiles = 1024 * 8 * (32 + 24 + 32) * 4, 2 * 128 * 8 * (32 + 24 + 32) * 4
    assert whole - tiles <= certified[False] - certified[True] <= whole, (certified, whole)
    tight = boundpass.compile(copy.deepcopy(plain), loss_fn=_loss, budget="4GiB", host_budget="1MiB",
                              attention_enable=True, attention_chunk=128)
    with pytest.raises(boundpass.InfeasibleBudgetError, match="attention k / v") as err:
        tight(*batch)
    assert "attention.offload=False" in str(err.value)


def test_a_query_path_that_mixes_positions_is_not_walked():
    """A query read from the previous position (torch.roll along the sequence) cannot be cut into query blocks:
    the call alone is rewritten, the region says why, and the step stays exact."""
    model = LM(layers=1, shifted_query=True)
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, loss_fn=_loss, budget="1GiB", attention_enable=True)
    _close_step(step, model, plain, _batch(128))
    (region,) = boundpass.explain(step).rewritten_of("attention")
    assert not region.blocks and "roll" in region.blocks_reason, region.describe()
    assert "not in query blocks" in region.describe()


def test_a_causal_mask_built_in_the_graph_is_proved_and_dropped():
    """A boolean mask computed from no input (torch.ones(L, L).tril(), as Hugging Face's sdpa path builds one from
    aranges under torch.compile) is evaluated at the traced length, found to be the causal one, and the call is
    rewritten as causal attention without it (its nodes erased with the call); the step stays exact."""
    model = LM(layers=1, mask="tensor")
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, loss_fn=_loss, budget="1GiB", attention_enable=True)
    _close_step(step, model, plain, _batch(128))
    (region,) = boundpass.explain(step).rewritten_of("attention")
    assert region.causal and region.blocks, region.describe()
    assert "tril" not in boundpass.explain(step).graph_code


def test_off_by_default():
    step = boundpass.compile(LM(layers=1), loss_fn=_loss, budget="1GiB")
    step(*_batch(64)).backward()
    assert not boundpass.explain(step).rewritten_of("attention")
    assert not boundpass.explain(step).skipped_of("attention")


@pytest.mark.torchtitan
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_torchtitans_attention_is_rewritten(family):
    """torchtitan's SDPA attention (MLA for deepseek_v3, GQA for qwen3) in every block, beside the other passes."""
    pytest.importorskip("torchtitan")
    from boundpass.recipes.models import build_debug_moe
    model = build_debug_moe(family, vocab_size=512, seq_len=128)
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, loss_fn=_loss, budget="8GiB", attention_enable=True)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 512, (2, 128), generator=g), torch.randint(0, 512, (2, 128), generator=g)
    _close_step(step, model, plain, batch, rtol=1e-4, atol=1e-4)
    report = boundpass.explain(step)
    assert len(report.rewritten_of("attention")) == len(model.layers)
    # MLA / GQA with RoPE (qwen3's fused q/k/v projection too): position-wise, k and v made per key tile
    assert all(r.blocks and r.kv_blocks for r in report.rewritten_of("attention"))
    # MLA: attention_norm is read by the query and key / value paths alone, so it joins them (its fp32 intermediates
    # per block); qwen3's is read by the fused q/k/v projection both paths share, outside either: it stays outside
    joined = [r.norm and "norm + query path" in r.describe() for r in report.rewritten_of("attention")]
    assert all(joined) if family == "deepseek_v3" else not any(joined), joined
    assert report.rewritten_of("vocab") and report.rewritten_of("dispatch")


@pytest.mark.parametrize("length", [512, 1024])
def test_torchs_fused_kernel_is_certified_with_its_workspace(length):
    """Attention left to torch's fused CPU kernel (equal head dims): its per-thread blocks and the query-gradient
    accumulator are counted (boundpass/measure/aten_contracts.py), so the certificate holds the step both ways."""
    plain = LM(dv=16)
    step = boundpass.compile(plain, loss_fn=_loss, budget="1GiB")
    measured = allocator_step_peak(step, plain, None, [_batch(length, seed) for seed in range(2)])
    certified = step.certificates[-1].table.total
    assert measured <= certified <= 1.10 * measured, (certified, measured)
