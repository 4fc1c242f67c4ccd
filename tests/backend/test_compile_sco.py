"""boundpass.compile(..., host_budget=, sco_enable=): checkpoint-boundary offload inside compiled graphs.

Exactness: SCO vs the same compiled model without SCO is bit-equal (the recomputation reads a bitwise copy);
vs the uncompiled model within the state tolerance of aot_autograd's decompositions. Device bytes are MEASURED
by the SCO ledger (storage finalizers on the exact boundary tensors and restored copies, sampled after every
offload / keep / prefetch / restore / free), in the order the compiled graphs actually ran.
"""
import copy
import re

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import boundpass
from boundpass.core import symbols as sym
from boundpass.passes import sco_pass
from boundpass.runtime.sco import bound_values, sco_compiled_device_bound, sco_host_bound
from boundpass.core.textwidth import flat

SEQ, VOCAB, STEPS = 16, 256, 2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _square_loss(out, labels):
    return out.float().pow(2).mean()


def _grads(model):
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _torchtitan_model(name, layers, policy):
    pytest.importorskip("torchtitan")
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from boundpass.recipes.models import build_debug_moe
    model = build_debug_moe(name, vocab_size=VOCAB, seq_len=SEQ)
    for key in list(model.layers)[layers:]:  # fewer MoE layers keep it fast; the schedule is the same
        del model.layers[key]
    {"FullAC": FullAC, "SelectiveAC": SelectiveAC}[policy](
        {"FullAC": FullAC, "SelectiveAC": SelectiveAC}[policy].Config()).apply(model)
    return model


def _run(compiled, model, batches, runtime_of):
    """Train steps; per step the grads and (when SCO runs) what its ledger saw."""
    steps = []
    for tokens in batches:
        runtime = runtime_of()
        if runtime is not None:
            runtime.events.clear()
        compiled(tokens).backward()
        runtime = runtime_of()
        record = dict(grads=_grads(model))
        if runtime is not None:
            record.update(offloaded=runtime.offloaded_bytes(), pool=runtime.host_pool_bytes,
                          peak=runtime.peak_device_boundary_bytes(), restored=runtime.peak_restored_live(),
                          end=runtime.events[-1].device_boundary_bytes, waiting=len(runtime._handles),
                          kinds=[e.kind for e in runtime.events])
        steps.append(record)
    return steps


CASES = [("deepseek_v3", 3, "FullAC", (0, 1, 3)), ("qwen3_moe", 2, "SelectiveAC", (1, 2))]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def model_runs(request):
    name, layers, policy, counts = request.param
    base = _torchtitan_model(name, layers, policy)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (1, SEQ), generator=gen) for _ in range(STEPS)]
    eager = copy.deepcopy(base)
    reference = []
    for tokens in batches:
        _square_loss(eager(tokens), None).backward()
        reference.append(_grads(eager))
    del eager
    H = base.tok_embeddings.embedding_dim
    boundary = SEQ * H * 4
    runs = {}
    # the compiled reference without SCO: sco_enable=False, or (cheaper, one compile less) sco_enable=True with a
    # host budget
    # that fits no boundary, which leaves the graphs untouched
    for count in ((None,) if 0 not in counts else ()) + counts:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        compiled = boundpass.compile(model, budget="8GiB", loss_fn=_square_loss, sco_enable=count is not None,
                                     host_budget=None if count is None else max(count * boundary, boundary - 1))
        steps = _run(compiled, model, batches, lambda: compiled.sco_plans[-1].runtime if compiled.sco_plans else None)
        if not runs:  # the compiled reference: vs uncompiled, then its grads are what every SCO run must equal
            compiled_grads = [step.pop("grads") for step in steps]
            for step, want, got in zip(steps, reference, compiled_grads):
                step["none_match"] = all((a is None) == (b is None) for a, b in zip(want, got))
                step["rel_vs_eager"] = max(_rel(b, a) for a, b in zip(want, got) if a is not None)
            reference.clear()
        for step, want in zip(steps, compiled_grads):  # compare now, keep no grads (qwen3: 80M per copy)
            got = step.pop("grads", want)
            step["bit_equal"] = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(want, got))
        runs[count] = dict(steps=steps, plan=compiled.sco_plans[-1],
                           text=flat(boundpass.explain(compiled).text("none")),
                           table=boundpass.explain(compiled).table)
        del model, compiled
    return dict(name=name, layers=layers, counts=counts, runs=runs, boundary=boundary, H=H)


def _rel(a, b):  # fp32 norms: ample for a 2e-3 tolerance, and the qwen3 experts are 80M elements
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_exact_plan_window_bound_and_no_leaks(model_runs):
    m = model_runs
    off = m["runs"][None if None in m["runs"] else 0]
    if None in m["runs"]:
        assert not off["plan"].regions and off["plan"].reason == "off (sco_enable=False)"
    else:
        assert off["plan"].runtime is None and not off["plan"].rewritten  # nothing offloaded: graphs untouched
    for step in off["steps"]:  # compiled vs uncompiled: decomposition rounding only
        assert step["none_match"] and step["rel_vs_eager"] < 2e-3
    L = m["layers"]
    for count in m["counts"]:
        run = m["runs"][count]
        plan = run["plan"]
        assert len(plan.eligible) == L and plan.offloaded == count
        assert [r.offloaded for r in plan.eligible] == [i < count for i in range(L)]
        assert f"{count} boundaries offloaded" in run["text"]
        values = bound_values(N=SEQ, H=m["H"], b=4, L=L, host_budget=count * m["boundary"])
        bound = sym.evaluate(sco_compiled_device_bound(), values)
        terms = {t.name.split(" (")[0]: t for t in run["table"].terms}
        if count:
            assert terms["SCO boundary pool on host"].value == sym.evaluate(sco_host_bound(), values)
        for step in run["steps"]:
            assert step["bit_equal"]  # every gradient torch.equal to the same compiled model without SCO
            if count == 0:
                assert "host budget fits none" in run["text"] and "offloaded" not in step
                continue
            assert plan.rewritten
            assert step["offloaded"] == count * m["boundary"] == plan.offloaded_bytes
            assert step["pool"] == count * m["boundary"]          # reused across steps, never grown
            assert step["kinds"].count("offload") == count and step["kinds"].count("keep") == L - count
            assert step["kinds"].count("restore") == count
            assert step["restored"] <= 2
            assert step["end"] == 0 and step["waiting"] == 0      # every boundary freed, no handle left over
            assert step["peak"] <= bound <= 1.25 * step["peak"]


def _mlp(layers=4, width=16, seed=0):
    torch.manual_seed(seed)

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                checkpoint_wrapper(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()))
                for _ in range(layers))

        def forward(self, x):
            h = x * 1  # the first boundary is computed in the graph (a graph input would be the caller's)
            for block in self.blocks:
                h = block(h)
            return h

    return Stack()


def _asap_reloads(graph_module):
    """An adversarial but legal schedule: every sco_reload runs as soon as its inputs exist."""
    graph = graph_module.graph
    reload = torch.ops.boundpass.sco_reload.default
    nodes = list(graph.nodes)
    placed, order = set(), []
    pending = [n for n in nodes if n.op != "output"]
    while pending:
        ready = [n for n in pending if all(a in placed for a in n.all_input_nodes)]
        pick = next((n for n in ready if n.target is reload), ready[0])
        order.append(pick)
        placed.add(pick)
        pending.remove(pick)
    anchor = next(iter(graph.nodes))
    for node in order[1:]:
        anchor.append(node)
        anchor = node
    graph.lint()
    graph_module.recompile()


@pytest.mark.parametrize("ordered", [True, False])
def test_no_reordering_can_hoist_a_reload_past_the_window(monkeypatch, ordered):
    """ASAP-schedule the reloads of the compiled backward (a legal reordering any compiler could pick).

    With the reload ordered after every reader of the next boundary, ≤ 2 restored boundaries are live
    whatever the order. The control without that ordering shows what it prevents: all reloads hoisted.
    """
    monkeypatch.setattr(sco_pass, "ORDER_RELOADS", ordered)
    real = sco_pass.eager_callable

    def adversarial(graph):
        if any(n.target is torch.ops.boundpass.sco_reload.default for n in graph.graph.nodes):
            _asap_reloads(graph)
        return real(graph)
    monkeypatch.setattr(sco_pass, "eager_callable", adversarial)
    layers, width, rows = 5, 16, 8
    model = _mlp(layers, width)
    reference = copy.deepcopy(model)
    x = torch.randn(rows, width)
    compiled = boundpass.compile(model, budget="1GiB", loss_fn=_square_loss, sco_enable=True,
                                 host_budget=layers * rows * width * 4)
    compiled(x).backward()
    runtime = compiled.sco_plans[-1].runtime
    _square_loss(reference(x), None).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    if ordered:
        assert runtime.peak_restored_live() <= 2
    else:
        assert runtime.peak_restored_live() == layers  # every reload ran first


def test_inductor_schedule_keeps_each_reload_after_the_previous_boundary_dies(tmp_path, monkeypatch):
    """Inductor (its scheduler, fusion and memory reordering) compiles the rewritten backward; in the wrapper code
    it actually runs, each reload comes after the last use of the boundary restored before it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._inductor.utils import run_and_get_code
    layers, width, rows = 3, 8, 4
    model = _mlp(layers, width)
    x = torch.randn(rows, width)
    compiled = boundpass.compile(model, budget="1GiB", loss_fn=_square_loss, sco_enable=True, inner="inductor",
                                 host_budget=layers * rows * width * 4)
    _, codes = run_and_get_code(lambda: compiled(x).backward())
    runtime = compiled.sco_plans[-1].runtime
    assert runtime.offloaded_bytes() == layers * rows * width * 4 and runtime.peak_restored_live() <= 2
    backward = next(c for c in codes if "sco_reload" in c)
    lines = backward.splitlines()
    reloads = {}  # layer -> (line index, output buffer)
    for i, line in enumerate(lines):
        found = re.match(r"\s*(\w+) = torch\.ops\.boundpass\.sco_reload\.default\((.*)\)", line)
        if found:
            layer = int(re.search(r", (\d+), \[", found.group(2)).group(1))
            reloads[layer] = (i, found.group(1))
    assert sorted(reloads) == list(range(layers))
    for layer in range(layers - 1):
        at, _ = reloads[layer]
        _, previous = reloads[layer + 1]
        uses = [i for i, line in enumerate(lines) if re.search(rf"\b{previous}\b", line)]
        assert max(uses) < at, f"layer {layer}'s reload runs while layer {layer + 1}'s boundary is still read"


def _certified_total(layers, width, rows, offloaded):
    """The certified step peak of the MLP with exactly ``offloaded`` boundaries on the host (bytes)."""
    boundary = rows * width * 4
    model = _mlp(layers, width)
    compiled = boundpass.compile(model, budget="1GiB", loss_fn=_square_loss, sco_enable=offloaded > 0,
                                 host_budget=max(offloaded * boundary, 1))
    compiled(torch.randn(rows, width)).backward()
    assert compiled.sco_plans[-1].offloaded == offloaded
    return boundpass.explain(compiled).table.total


def test_explain_and_auto_offloads_only_what_the_device_budget_needs():
    layers, width, rows = 4, 64, 1024  # boundaries (256 KiB) dominate the weights (16 KiB)
    boundary = rows * width * 4
    totals = [_certified_total(layers, width, rows, k) for k in (1, 2)]
    assert totals[1] < totals[0]  # each boundary offloaded lowers the certified peak
    model = _mlp(layers, width)
    compiled = boundpass.compile(model, budget=totals[1], loss_fn=_square_loss, host_budget=10 * boundary)
    compiled(torch.randn(rows, width)).backward()
    plan = compiled.sco_plans[-1]
    assert plan.offloaded == 2 and plan.runtime.offloaded_bytes() == 2 * boundary
    text = flat(boundpass.explain(compiled).text("none"))
    assert "OFFLOADED sco model.blocks.1" in text and "KEPT sco model.blocks.2" in text
    assert "the device budget fits without offloading it" in text and "SCO boundary pool on host" in text


def test_sco_max_layers_caps_the_offloaded_boundaries():
    """sco.max_layers (sco_max_layers=): at most that many boundaries go to the host, whatever the pool holds; the
    certificate is the one of a pool that holds exactly that many."""
    layers, width, rows = 4, 64, 1024
    model = _mlp(layers, width)
    compiled = boundpass.compile(model, budget="1GiB", loss_fn=_square_loss, sco_enable=True, sco_max_layers=2,
                                 host_budget="1GiB")
    compiled(torch.randn(rows, width)).backward()
    plan = compiled.sco_plans[-1]
    assert (plan.most, plan.offloaded, plan.capped) == (2, 2, True)
    assert "past sco_max_layers=2" in flat(boundpass.explain(compiled).text("none"))  # why the others are kept
    assert boundpass.explain(compiled).table.total == _certified_total(layers, width, rows, 2)


def test_no_checkpointed_blocks_is_explained():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    compiled = boundpass.compile(model, budget="1GiB", loss_fn=_square_loss, host_budget="1MiB", sco_enable=True)
    compiled(torch.randn(2, 8)).backward()
    assert "no checkpointed blocks" in flat(boundpass.explain(compiled).text("none"))


def test_infeasible_device_budget_names_the_peak_and_its_knob():
    layers, width, rows = 4, 64, 1024  # boundaries (256 KiB) dominate the weights (16 KiB)
    every = _certified_total(layers, width, rows, layers)
    model = _mlp(layers, width)
    compiled = boundpass.compile(model, budget=every - 1, loss_fn=_square_loss, host_budget="1GiB", sco_enable=True)
    with pytest.raises(boundpass.InfeasibleBudgetError) as info:
        compiled(torch.randn(rows, width))
    # every boundary is already on the host: more offload cannot help, so it is not offered
    assert "peak at" in str(info.value) and "tokens per rank" in info.value.knob and "sco" not in info.value.knob


def test_infeasible_host_budget_names_the_host_budget_knob():
    layers, width, rows = 4, 64, 1024  # boundaries (256 KiB) dominate the weights (16 KiB)
    boundary = rows * width * 4
    two = _certified_total(layers, width, rows, 2)
    model = _mlp(layers, width)
    compiled = boundpass.compile(model, budget=two, loss_fn=_square_loss, host_budget=boundary)
    with pytest.raises(boundpass.InfeasibleBudgetError) as info:
        compiled(torch.randn(rows, width))
    assert "host_budget" in info.value.knob and "holds 1 of 4" in info.value.knob


def test_bad_sco_value():
    with pytest.raises(boundpass.BoundpassInputError, match="sco.enable"):
        boundpass.compile(torch.nn.Linear(2, 2), budget="1GiB", sco_enable="yes")


@pytest.mark.parametrize("roomy", [True, False])
def test_unmatched_regions_are_kept_noted_and_rebudgeted(monkeypatch, roomy):
    """When the partitioned graph does not show the boundaries the plan counted on, nothing is offloaded, explain
    says why, the device term is corrected to every boundary on the device, and a budget that no longer fits
    raises before any real compute."""
    layers, width, rows = 4, 64, 1024  # boundaries (256 KiB) dominate the weights (16 KiB)
    every = _certified_total(layers, width, rows, layers)
    monkeypatch.setattr(sco_pass, "_joint_boundaries", lambda joint: [])
    boundary = rows * width * 4
    model = _mlp(layers, width)
    state = 2 * sum(p.numel() * 4 for p in model.parameters())
    compiled = boundpass.compile(model, budget="1GiB" if roomy else every, loss_fn=_square_loss,
                                 host_budget=layers * boundary, sco_enable=True)
    if not roomy:  # the plan counted on offloading every boundary; the graphs keep them: the check sees it
        with pytest.raises(boundpass.InfeasibleBudgetError, match="cannot be met"):
            compiled(torch.randn(rows, width))
        return
    compiled(torch.randn(rows, width)).backward()
    plan = compiled.sco_plans[-1]
    assert plan.offloaded == 0 and plan.runtime.offloaded_bytes() == 0 and not plan.rewritten
    assert "the joint graph has 0 checkpoint regions" in flat(boundpass.explain(compiled).text("none"))
    assert boundpass.explain(compiled).table.total > every
