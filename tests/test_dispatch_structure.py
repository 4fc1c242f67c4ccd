"""A MoE block that is not torchtitan's (Mixtral-style, plain PyTorch): found by what it computes and reported
SKIPPED with its module path; the step stays exact; its data-dependent expert batches are bounded at their upper
bound, so the certificate holds under any routing and does not change with it."""
import copy

import pytest
import torch

import boundpass
from boundpass.testing.dense_lm import ce, lm_batches
from boundpass.testing.mixtral_lm import MixtralLM
from boundpass.testing.whole_step import measured_step_peak

MOE_HEAVY = dict(vocab=512, hidden=64, inter=1024, experts=4, top_k=2)  # the experts' batches dominate the step


def test_mixtral_style_block_is_reported_skipped_with_its_module_path():
    torch.manual_seed(0)
    model = MixtralLM()
    step = boundpass.compile(model, budget="1GiB", loss_fn=ce)
    step(*lm_batches(2048, 2, 64)[0]).backward()
    report = boundpass.explain(step)
    skipped = report.skipped_of("dispatch")
    assert [r.module_path for r in skipped] == ["moe"], [r.describe() for r in report.regions]
    assert "not torchtitan's RoutedExperts" in skipped[0].reason and "upper bound" in skipped[0].reason
    assert "SKIPPED   dispatch moe" in str(report)
    assert report.rewritten_of("vocab")  # the head is still rewritten


def test_top_k_that_routes_nothing_is_not_reported():
    """A top-k used for a metric (no grouping by expert, no combine) is not a MoE region."""
    class TopKMetric(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = self.lin(x)
            return h + torch.topk(h, 2, dim=-1).values.sum(-1, keepdim=True)

    step = boundpass.compile(TopKMetric(), budget="1GiB", loss_fn=lambda out, y: (out - y).pow(2).mean())
    step(torch.randn(4, 16), torch.randn(4, 16)).backward()
    assert not boundpass.explain(step).skipped_of("dispatch")


@pytest.mark.parametrize("adversarial", [False, True])
def test_mixtral_style_step_is_exact_and_bounded_under_any_routing(adversarial):
    torch.manual_seed(0)
    model = MixtralLM(**MOE_HEAVY)
    if adversarial:
        model.route_all_tokens_to_the_first_experts()
    reference = copy.deepcopy(model)
    batches = lm_batches(MOE_HEAVY["vocab"], 2, 512)
    step = boundpass.compile(model, budget="1GiB", loss_fn=ce)
    loss = step(*batches[0])
    loss.backward()
    # the reference is compiled the same way without boundpass: eager's fused RMSNorm differs in the last bit, and a
    # near-tie in the top-k then routes a token elsewhere (a real difference of the model, not of the rewrite)
    want = torch.compile(lambda t, y: ce(reference(t), y), backend="aot_eager")(*batches[0])
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    certified = boundpass.explain(step).table.total
    measured = measured_step_peak(step, model, None, batches)
    assert measured <= certified, (measured, certified)
    assert len(step.certificates) == 1  # the routing drawn changes neither the graph nor its certificate


def test_routing_changes_nothing_in_the_certificate():
    torch.manual_seed(0)
    balanced, skewed = MixtralLM(**MOE_HEAVY), MixtralLM(**MOE_HEAVY)
    skewed.route_all_tokens_to_the_first_experts()
    totals = []
    for model in (balanced, skewed):
        torch._dynamo.reset()
        step = boundpass.compile(model, budget="1GiB", loss_fn=ce)
        step(*lm_batches(MOE_HEAVY["vocab"], 2, 512)[0]).backward()
        totals.append(boundpass.explain(step).table.total)
    assert totals[0] == totals[1]
