"""The vocab pass finds projection + cross-entropy by what the graph computes (issue 15, vocab half).

Each form: a tiny plain-PyTorch LM through `boundpass.compile`; the region is REWRITTEN (or SKIPPED with the
reason) and loss and every parameter gradient equal the uncompiled model's, with ignored labels (-100), a
ragged token count and a vocab that the strip width does not divide.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import boundpass
from boundpass.core.textwidth import flat

V, H, B, S = 301, 16, 3, 13      # N = 39 tokens (36 shifted); strips of 128 over V = 301: 128, 128, 45
BLOCK = 128
TOL = dict(rtol=1e-5, atol=1e-6)


class LM(nn.Module):
    """Embedding -> block -> vocab projection, written in one of the spellings of `h @ W.T`."""

    def __init__(self, head="linear", tied=False, bias=False):
        super().__init__()
        self.head, self.tied = head, tied
        self.emb = nn.Embedding(V, H)
        self.block = nn.Linear(H, H)
        if head == "linear" and tied != "functional":
            self.lm_head = nn.Linear(H, V, bias=bias)
            if tied:  # HF-style tying: the head module holds the embedding's Parameter
                self.lm_head.weight = self.emb.weight
        elif head in ("hv", "einsum_hv"):
            self.w_out = nn.Parameter(torch.randn(H, V) / H ** 0.5)
        elif not tied:
            self.w_out = nn.Parameter(torch.randn(V, H) / H ** 0.5)
        if bias and head != "linear":
            self.b_out = nn.Parameter(torch.randn(V))

    def weight(self):
        if self.tied:
            return self.emb.weight if self.tied == "functional" or self.head != "linear" else self.lm_head.weight
        return self.lm_head.weight if self.head == "linear" else self.w_out

    def forward(self, tokens):
        h = torch.tanh(self.block(self.emb(tokens)))
        w = self.weight()
        logits = {
            "linear": lambda: F.linear(h, w) if self.tied == "functional" else self.lm_head(h),
            "at_T": lambda: h @ w.T,
            "matmul_t": lambda: torch.matmul(h, w.t()),
            "transpose": lambda: h.matmul(w.transpose(0, 1)),
            "einsum": lambda: torch.einsum("bsh,vh->bsv", h, w),
            "einsum_ellipsis": lambda: torch.einsum("...h,vh->...v", h, w),
            "hv": lambda: h @ w,
            "einsum_hv": lambda: torch.einsum("bsh,hv->bsv", h, w),
            "einsum_swapped": lambda: torch.einsum("vh,bsh->bsv", w, h),
            "permute": lambda: h @ w.permute(1, 0),
            "mT": lambda: torch.matmul(h, w.mT),
        }[self.head]()
        if hasattr(self, "b_out"):
            logits = logits + self.b_out
        return logits


# ------------------------------------------------------------------------------------------- loss forms
def ce_mean(lg, y):
    return F.cross_entropy(lg.reshape(-1, V), y.reshape(-1))


def ce_sum_float(lg, y):
    return F.cross_entropy(lg.flatten(0, 1).float(), y.flatten(0, 1), reduction="sum", ignore_index=-100)


def ce_shifted(lg, y):
    return F.cross_entropy(lg[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1))


def ce_shifted_hf(lg, y):  # HF's causal-LM loss: logits[..., :-1, :].contiguous().view(-1, V)
    shift_logits, shift_labels = lg[..., :-1, :].contiguous(), y[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1), reduction="sum")


def nll_mean(lg, y):
    return F.nll_loss(F.log_softmax(lg.float(), dim=-1).view(-1, V), y.view(-1))


def nll_sum_shifted(lg, y):
    logp = torch.log_softmax(lg[:, 1:], -1)
    return F.nll_loss(logp.flatten(0, 1), y[:, :-1].flatten(), reduction="sum", ignore_index=-100)


def lse_masked_mean(lg, y):  # clamp the labels for gather, mask, divide by the valid count
    lg, y = lg.flatten(0, 1), y.flatten()
    mask = y != -100
    tgt = lg.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return ((torch.logsumexp(lg, dim=-1) - tgt) * mask).sum() / mask.sum()


def lse_where_sum_shifted(lg, y):
    lg, y = lg[:, :-1], y[:, 1:]
    mask = y != -100
    safe = torch.where(mask, y, 0)
    per = torch.logsumexp(lg, -1) - torch.gather(lg, -1, safe[..., None])[..., 0]
    return torch.where(mask, per, 0.0).sum()


def lse_selected_mean(lg, y):
    ignored = y == -100
    safe = y.masked_fill(ignored, 0)
    per = lg.logsumexp(-1) - lg.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return per[~ignored].mean()


def lse_masked_mean_over_all(lg, y):
    mask = (y != -100).float()
    per = torch.logsumexp(lg, -1) - lg.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (per * mask).mean()


def lse_take_along_masked_fill(lg, y):
    valid = ~(y == -100)
    tgt = torch.take_along_dim(lg, torch.where(valid, y, 0).unsqueeze(-1), dim=-1)[..., 0]
    per = torch.logsumexp(lg, dim=-1) - tgt
    return per.masked_fill(~valid, 0).sum() / valid.sum()


def lse_cast_twice(lg, y):  # each use spells the upcast again: two nodes, one value
    mask = y != -100
    tgt = lg.float().gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return ((lg.float().logsumexp(-1) - tgt) * mask).sum()


def lse_reversed_sign(lg, y):  # log-probabilities gathered, the minus after the mean
    mask = y != -100
    logp_t = lg.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lg, -1)
    return -logp_t[mask].mean()


def logp_gather_masked_mean(lg, y):
    logp = F.log_softmax(lg.float(), dim=-1)
    mask = y != -100
    nll = -logp.gather(-1, y.masked_fill(~mask, 0).unsqueeze(-1)).squeeze(-1)
    return (nll * mask).sum() / mask.sum()


def logp_gather_shifted_neg_after(lg, y):
    logp, y = torch.log_softmax(lg, -1)[:, :-1], y[:, 1:]
    mask = y != -100
    return -(torch.gather(logp, -1, torch.where(mask, y, 0)[..., None])[..., 0] * mask).sum() / mask.sum()


def lse_plain_mean(lg, y):  # no ignore_index at all (the batch holds no -100)
    return (torch.logsumexp(lg, -1) - lg.gather(-1, y.unsqueeze(-1)).squeeze(-1)).mean()


def lse_plain_sum_float(lg, y):
    lg = lg.float()
    return (torch.logsumexp(lg, -1) - lg.gather(-1, y.unsqueeze(-1)).squeeze(-1)).sum()


# ------------------------------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _batch(ignored=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    if ignored:
        labels[0, :5] = -100
        labels[2, 7] = -100
    return tokens, labels


def _run(model, loss_fn, ignored=True, **kw):
    """(compiled output, uncompiled output, report); gradients of both left on the two models."""
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    tokens, labels = _batch(ignored)
    kw = {"inner": "aot_eager", **kw}
    compiled = boundpass.compile(model, budget="1GiB", loss_fn=loss_fn, vocab_block=BLOCK, **kw)
    got = compiled(tokens, labels)
    want = loss_fn(reference(tokens), labels)
    return got, want, reference, boundpass.explain(compiled)


def _assert_exact(model, loss_fn, ignored=True):
    got, want, reference, report = _run(model, loss_fn, ignored)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, **TOL)
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, **TOL, msg=lambda m: f"{name}: {m}")
    assert not report.skipped_of("vocab"), [r.reason for r in report.skipped_of("vocab")]
    (region,) = report.rewritten_of("vocab")
    assert region.block == BLOCK and region.vocab == V and region.hidden == H
    # no [N, V] tensor left in the step
    for graph in (report.forward_graph, report.backward_graph):
        sizes = [n.meta["val"].numel() for n in graph.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        assert max(sizes) < B * S * V / 2
    assert flat(f"REWRITTEN vocab  {region.module_path}: {region.form}") in flat(str(report))
    return region


HEADS = ["linear", "at_T", "matmul_t", "transpose", "einsum", "einsum_ellipsis", "hv", "einsum_hv", "einsum_swapped",
         "permute", "mT"]
LOSSES = [ce_mean, ce_sum_float, ce_shifted, ce_shifted_hf, nll_mean, nll_sum_shifted, lse_masked_mean,
          lse_where_sum_shifted, lse_selected_mean, lse_masked_mean_over_all, lse_take_along_masked_fill,
          lse_cast_twice, lse_reversed_sign, logp_gather_masked_mean, logp_gather_shifted_neg_after]


# ------------------------------------------------------------------------------------------- rewritten
@pytest.mark.parametrize("head", HEADS)
def test_every_projection_spelling_is_rewritten_exactly(head):
    region = _assert_exact(LM(head), ce_shifted)
    assert region.form.endswith("cross_entropy")
    spelled = region.form.split("(")[0].split(" ")[0]
    assert spelled == ("linear" if head == "linear" else "einsum" if "einsum" in head else "matmul")


@pytest.mark.parametrize("loss_fn", LOSSES, ids=lambda f: f.__name__)
def test_every_cross_entropy_form_is_rewritten_exactly(loss_fn):
    region = _assert_exact(LM("at_T"), loss_fn)
    want = {"ce": "cross_entropy", "nll": "log_softmax + nll_loss", "lse": "logsumexp - gather",
            "logp": "-log_softmax.gather"}
    assert region.form.endswith(want[loss_fn.__name__.split("_")[0]])


@pytest.mark.parametrize("loss_fn", [lse_plain_mean, lse_plain_sum_float, ce_mean], ids=lambda f: f.__name__)
def test_forms_without_ignored_labels(loss_fn):
    _assert_exact(LM("einsum"), loss_fn, ignored=False)


@pytest.mark.parametrize("head,tied", [("linear", "module"), ("linear", "functional"), ("at_T", True),
                                       ("einsum", True)])
@pytest.mark.parametrize("loss_fn", [ce_shifted, nll_mean, lse_masked_mean, logp_gather_shifted_neg_after],
                         ids=lambda f: f.__name__)
def test_tied_embedding_gets_both_gradients(head, tied, loss_fn):
    model = LM(head, tied=tied)
    assert {n for n, _ in model.named_parameters()} == {"emb.weight", "block.weight", "block.bias"}
    _assert_exact(model, loss_fn)


def test_shift_is_applied_to_the_hidden_states():
    region = _assert_exact(LM("linear"), ce_shifted)
    assert region.tokens == B * (S - 1) and "[:, :-1]" in region.form
    region = _assert_exact(LM("linear"), lse_where_sum_shifted)
    assert region.tokens == B * (S - 1)


@pytest.mark.parametrize("loss_fn", [ce_shifted_hf, lse_where_sum_shifted, lse_masked_mean_over_all, nll_sum_shifted],
                         ids=lambda f: f.__name__)
def test_dynamic_shapes(loss_fn):
    model = LM("at_T")
    reference = copy.deepcopy(model)
    compiled = boundpass.compile(model, budget="1GiB", loss_fn=loss_fn, vocab_block=BLOCK, dynamic=True)
    for seq in (9, 17):
        tokens, labels = torch.randint(0, V, (2, seq)), torch.randint(0, V, (2, seq))
        labels[1, :3] = -100
        model.zero_grad(), reference.zero_grad()
        got, want = compiled(tokens, labels), loss_fn(reference(tokens), labels)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, **TOL)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL)
        assert len(boundpass.explain(compiled).rewritten_of("vocab")) == 1


@pytest.mark.parametrize("head,loss_fn", [("hv", lse_where_sum_shifted), ("einsum", nll_mean), ("linear", "z_loss")],
                         ids=lambda x: getattr(x, "__name__", x))
def test_inductor(head, loss_fn):
    loss_fn = z_loss_first if loss_fn == "z_loss" else loss_fn
    model = LM(head)
    got, want, reference, report = _run(model, loss_fn, inner="inductor")
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, **TOL)
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, **TOL)
    assert len(report.rewritten_of("vocab")) == 1 and "boundpass.ring_dtp_bwd" in report.backward_code


# ------------------------------------------------------------------------------------------- skipped
class ReturnsLogits(nn.Module):
    """HF-style: the model hands back a dict holding the logits, and the loss_fn passes it on."""

    def __init__(self):
        super().__init__()
        self.lm = LM("at_T")

    def forward(self, tokens):
        return {"logits": self.lm(tokens)}


def _skipped(model, loss_fn, reason, **kw):
    got, want, _, report = _run(model, loss_fn, **kw)
    torch.testing.assert_close(got, want, **TOL)
    assert not report.rewritten_of("vocab")
    (region,) = report.skipped_of("vocab")
    assert reason in region.reason, region.reason
    assert flat(f"SKIPPED   vocab  {region.module_path}: {region.reason}") in flat(str(report))
    return region


RETURNS_LOGITS = [
    lambda lg, y: (ce_shifted(lg, y), lg),
    lambda lg, y: (lse_masked_mean(lg, y), lg.detach()),
    lambda lg, y: (lse_cast_twice(lg, y), lg.float()),
    lambda lg, y: (nll_mean(lg, y), lg.float().view(-1, V)),
]
RETURNS_LOGITS_IDS = ["ce", "lse-detached", "lse-twin-cast", "nll-reshaped"]


@pytest.mark.parametrize("loss_fn", RETURNS_LOGITS, ids=RETURNS_LOGITS_IDS)
def test_returned_logits_kept_are_skipped_naming_the_module_and_the_fix(loss_fn):
    region = _skipped(LM("at_T"), loss_fn, "are also returned by the compiled graph", vocab_keep_logits=True)
    assert region.module_path in region.reason and "return only the loss" in region.reason


@pytest.mark.parametrize("loss_fn", RETURNS_LOGITS, ids=RETURNS_LOGITS_IDS)
def test_returned_logits_are_none_in_training_and_the_region_rewritten(loss_fn):
    """Liger-Kernel's convention: in training the logits only the caller reads are not materialised."""
    got, want, reference, report = _run(LM("at_T"), loss_fn)
    assert got[1] is None and want[1] is not None
    torch.testing.assert_close(got[0], want[0], **TOL)
    got[0].backward()
    want[0].backward()
    (region,) = report.rewritten_of("vocab")
    assert region.dropped_logits and "are None in training (vocab_keep_logits=True keeps them)" in flat(str(report))


def test_returned_logits_stay_in_eval():
    model = LM("at_T").eval()
    loss_fn = RETURNS_LOGITS[0]
    with torch.no_grad():
        got, want, _, report = _run(model, loss_fn)
    torch.testing.assert_close(got[1], want[1], **TOL)


def test_model_returning_its_logits_in_a_dict_is_skipped_when_kept():
    loss_fn = lambda out, y: (ce_mean(out["logits"], y), out)  # noqa: E731
    region = _skipped(ReturnsLogits(), loss_fn, "are also returned by the compiled graph", vocab_keep_logits=True)
    assert region.module_path == "model.lm" and "model.lm (" in region.reason


@pytest.mark.parametrize("loss_fn,reason", [
    (lambda lg, y: ce_shifted(lg, y) + lg.pow(2).mean(), "used elsewhere"),
    (lambda lg, y: F.cross_entropy(lg[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1), label_smoothing=0.1),
     "label smoothing"),
    (lambda lg, y: F.nll_loss(F.log_softmax(lg, -1).flatten(0, 1), y.flatten(), weight=torch.ones(V)),
     "class weights"),
    (lambda lg, y: F.nll_loss(F.log_softmax(lg, -1).flatten(0, 1), y.flatten(), reduction="none").sum(),
     "per-token"),
    (lambda lg, y: F.cross_entropy(lg.transpose(1, 2), y), "not [N, V] logits"),
    (lambda lg, y: F.nll_loss(lg.flatten(0, 1), y.flatten()), "not log_softmax"),
    # hand-written label smoothing: the logits feed the smoothing term too
    (lambda lg, y: 0.9 * lse_masked_mean(lg, y) - 0.1 * F.log_softmax(lg, -1).mean(), "used elsewhere"),
    (lambda lg, y: F.cross_entropy(lg.half().float().flatten(0, 1), y.flatten()), "would change the numerics"),
    (lambda lg, y: F.cross_entropy(lg.reshape(B, S * V).reshape(B * S, V), y.flatten()), "moves the vocab dim"),
    # not a full reduction of the per-token losses
    (lambda lg, y: (torch.logsumexp(lg, -1) - lg.gather(-1, y.clamp(min=0)[..., None])[..., 0]).sum(-1).mean(),
     "not a recognised reduction"),
    # log-probabilities of the labels weighted by something that is not a mask (a policy-gradient loss)
    (lambda lg, y: -(F.log_softmax(lg, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0] * torch.ones(B, S)).sum(),
     "not a recognised reduction"),
    # clamped labels with no mask: ignored tokens count as class 0
    (lambda lg, y: (torch.logsumexp(lg, -1) - lg.gather(-1, y.clamp(min=0)[..., None])[..., 0]).sum(),
     "not masked"),
])
def test_unrewritable_forms_are_skipped_with_a_reason(loss_fn, reason):
    _skipped(LM("matmul_t"), loss_fn, reason)


def test_logits_used_for_a_metric_are_skipped_naming_the_user():
    loss_fn = lambda lg, y: (ce_mean(lg, y), (lg.argmax(-1) == y).float().mean())  # noqa: E731
    region = _skipped(LM("linear"), loss_fn, "used elsewhere too (['argmax'])")
    assert region.module_path == "model.lm_head" and "model.lm_head" in region.reason


@pytest.mark.parametrize("loss_fn", [
    lambda lg, y: F.cross_entropy(lg.flatten(0, 1), y.flatten(), label_smoothing=0.1),
    lambda lg, y: F.nll_loss(F.log_softmax(lg, -1).flatten(0, 1), y.flatten(), reduction="none").sum(),
    lambda lg, y: (torch.logsumexp(lg, -1) - lg.gather(-1, y.clamp(min=0)[..., None])[..., 0]).sum(),
], ids=["label-smoothing", "nll-none", "lse-unmasked-clamp"])
def test_skip_lines_name_the_projection_module(loss_fn):
    assert _skipped(LM("linear"), loss_fn, "").module_path == "model.lm_head"


@pytest.mark.parametrize("head", ["linear", "at_T", "einsum"])
def test_bias_is_skipped(head):
    _skipped(LM(head, bias=True), ce_shifted, "bias")


def z_loss_shared_lse(lg, y):  # the hand-written CE's own log-sum-exp feeds a z-loss
    lse = torch.logsumexp(lg, -1)
    per = lse - lg.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    mask = y != -100
    return (per * mask).sum() / mask.sum() + 1e-2 * (lse ** 2 * mask).sum() / mask.sum()


def z_loss_first(lg, y):  # OLMo-style: a separate logsumexp of the logits, computed before the cross-entropy
    z = 1e-2 * lg.logsumexp(-1).pow(2).mean()
    return F.cross_entropy(lg.view(-1, V), y.view(-1), reduction="sum") / (y != -100).sum() + z


def z_loss_after(lg, y):
    return ce_sum_float(lg, y) + 1e-2 * (lg.logsumexp(dim=-1).pow(2) * (y != -100)).sum()


@pytest.mark.parametrize("loss_fn", [z_loss_shared_lse, z_loss_first, z_loss_after], ids=lambda f: f.__name__)
@pytest.mark.parametrize("head", ["linear", "at_T"])
def test_z_loss_is_served_by_the_ops_lse(head, loss_fn):
    region = _assert_exact(LM(head), loss_fn)
    assert "z-loss" in region.form


def test_z_loss_on_the_unshifted_logits_of_a_shifted_loss_is_skipped():
    def loss_fn(lg, y):  # the op sees S - 1 positions, the z-loss all S: the [N, V] logits must exist
        return ce_shifted(lg, y) + 1e-2 * lg.logsumexp(-1).pow(2).mean()
    _skipped(LM("at_T"), loss_fn, "used elsewhere too")


def test_a_non_vocab_logsumexp_is_not_a_region():
    """A logsumexp that is not `lse - gather` (an attention-style softmax denominator) is left alone, silently."""
    def loss_fn(lg, y):
        return ce_mean(lg, y) + torch.logsumexp(y.float(), -1).sum() * 0
    _, _, _, report = _run(LM("linear"), loss_fn)
    assert len(report.rewritten_of("vocab")) == 1 and not report.skipped_of("vocab")


# ------------------------------------------------------------------------------------------- over a ring
class ScaledHead(LM):
    """The projection weight is computed (not a parameter): its row gradients cannot be completed over a ring."""

    def forward(self, tokens):
        return torch.tanh(self.block(self.emb(tokens))) @ (2 * self.w_out).T


def _shifted_on_ring(rank, world):
    import torch.distributed as dist
    torch.manual_seed(0)
    model = LM("at_T", tied=True).double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, V, (2, 9 + 4 * rank), generator=g)   # different N per rank
    labels = torch.randint(0, V, (2, 9 + 4 * rank), generator=g)
    labels[0, :3] = -100
    compiled = boundpass.compile(model, budget="1GiB", loss_fn=ce_shifted_hf, ring_group=dist.group.WORLD,
                                 vocab_block=BLOCK)
    loss = compiled(tokens, labels)
    loss.backward()
    want = ce_shifted_hf(reference(tokens), labels)
    want.backward()
    for module in (model, reference):  # the data-parallel gradient sum
        for p in module.parameters():
            dist.all_reduce(p.grad)
    errors = [(p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())]
    rewritten = [r.form for r in boundpass.explain(compiled).rewritten_of("vocab")]
    torch._dynamo.reset()
    scaled = boundpass.compile(ScaledHead("at_T"), budget="1GiB", loss_fn=ce_shifted, ring_group=dist.group.WORLD)
    scaled(tokens, labels)
    skipped = [r.reason for r in boundpass.explain(scaled).skipped_of("vocab")]
    return (loss - want).abs().item(), max(errors), rewritten, skipped


@pytest.mark.distributed
def test_shifted_tied_matmul_over_a_ring_of_two_ranks():
    from boundpass.testing.distributed import run_on_ranks
    for loss_err, grad_err, rewritten, skipped in run_on_ranks(_shifted_on_ring, 2, timeout_s=180):
        assert loss_err < 1e-10 and grad_err < 1e-10
        assert rewritten == ["matmul(h, W.T) -> [..., :-1, :] -> contiguous -> view -> cross_entropy"]
        assert len(skipped) == 1 and "is not a parameter" in skipped[0]


def test_rewrite_keeps_mutations_nobody_reads():
    """Regression: the pass's dead-code sweep deleted in-place methods whose result is unused (a hand-written MoE's
    out.index_add_, a counter buffer's add_), silently changing the model."""
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64, bias=False)
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, tokens):
            self.calls.add_(1)
            h = self.emb(tokens)
            out = torch.zeros_like(h)
            out.index_add_(1, torch.arange(h.shape[1]), h * 2)
            return self.head(out)

    model = Counting()
    reference = copy.deepcopy(model)
    tokens, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    loss_fn = lambda lg, y: torch.nn.functional.cross_entropy(lg.flatten(0, 1), y.flatten())  # noqa: E731
    step = boundpass.compile(model, budget="1GiB", loss_fn=loss_fn)
    loss = step(tokens, labels)
    assert boundpass.explain(step).rewritten_of("vocab")
    torch.testing.assert_close(loss, loss_fn(reference(tokens), labels))
    assert int(model.calls) == 1
