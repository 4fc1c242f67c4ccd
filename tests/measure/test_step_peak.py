"""The bound boundpass.compile certifies is the peak of the whole step, derived from its graphs.

Measured = boundpass.testing.whole_step.measured_step_peak: one steady-state step (forward, backward, optimizer
step, zero_grad) with real tensors under LiveStorageTracker, parameters, buffers and optimizer state counted as
live from the start; boundpass's custom ops run under the tracker, so their strips and chunks count. Every case
asserts measured <= predicted <= 1.10 x measured, and that the smallest budget compile accepts is >= measured.
"""
import warnings

import pytest
import torch

import boundpass
from boundpass.core.errors import InfeasibleBudgetError
from boundpass.testing.dense_lm import DenseLM, ce, lm_batches, smoothed_ce
from boundpass.testing.whole_step import measured_step_peak

warnings.filterwarnings("ignore", message="In CPU autocast")
TIGHT = 1.10
# The certificate counts tensor bytes; a step's process RSS also grows by what no tensor holds (Python objects and
# autograd nodes in pymalloc's 1 MiB arenas, glibc's page rounding of each mmap'd storage). On the plain LM's
# ~105 MiB step that came to -300 KiB..+20 KiB against the certificate over 4 runs (CI failed once on +20 KiB),
# so the RSS check allows 1 MiB of it. Byte-exact soundness is the tracker's and the allocator's tests here; this
# one catches memory only RSS sees (Inductor's kernels, BLAS buffers) at MiB scale.
RSS_NON_TENSOR = 1 << 20


def _check(step, model, opt, batches):
    measured = measured_step_peak(step, model, opt, batches)
    report = boundpass.explain(step)
    predicted = report.table.total
    assert measured <= predicted <= TIGHT * measured, (measured, predicted, report.table.render())
    return measured, predicted, report


@pytest.mark.parametrize("case", ["adamw", "sgd", "smoothing", "dynamic"])
def test_plain_pytorch_lm_whole_step(case):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DenseLM()
    loss_fn = smoothed_ce if case == "smoothing" else ce
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if case == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    step = boundpass.compile(model, budget="4GiB", loss_fn=loss_fn, optimizer=opt, dynamic=(case == "dynamic"))
    batches = lm_batches(4096, 2, 256)
    measured, predicted, report = _check(step, model, step.optimizer or opt, batches)
    if case == "smoothing":
        assert report.skipped_of("vocab") and not report.rewritten_of("vocab")
        # the [N, V] logits are in the certified peak: the old table left them out
        assert predicted > 2 * 512 * 4096 * 4
    else:
        assert report.rewritten_of("vocab")
    if case == "dynamic":
        # one certificate symbolic in the sequence length; the graph is guarded on it fitting the budget, so a
        # longer batch that would not fit recompiles and is refused before it runs
        formula = next(t for t in report.table.terms if t.name.startswith("activations + op workspace")).formula
        assert formula.free_symbols
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = boundpass.compile(model, budget=predicted + (64 << 10), loss_fn=loss_fn, optimizer=opt, dynamic=True)
        measured_step_peak(step, model, opt, lm_batches(4096, 2, 256))
        with pytest.raises(InfeasibleBudgetError):
            step(*lm_batches(4096, 2, 512)[0])


def test_label_smoothing_budget_below_its_logits_is_refused_before_compute():
    """Regression: the old table accepted a label-smoothed LM at a budget an order of magnitude below its peak."""
    torch._dynamo.reset()
    model = DenseLM()
    opt = torch.optim.AdamW(model.parameters())
    step = boundpass.compile(model, budget="24MiB", loss_fn=smoothed_ce, optimizer=opt)
    with pytest.raises(InfeasibleBudgetError) as err:
        step(*lm_batches(4096, 2, 256)[0])
    text = str(err.value)
    assert "peak at" in text and "to fix" in text and "reduce tokens per rank" in err.value.knob
    assert all(p.grad is None for p in model.parameters())  # raised before any real compute


# Blocks kept in the whole-step cases: deepseek_v3's dense block and two of its five MoE blocks, qwen3's first three
# of eight, gpt_oss's first two blocks. The certificate walks every node of the step's graphs and each further MoE
# block repeats the same nodes, so the check is the same on fewer of them. (qwen3 once kept all 8 blocks: cut to 2
# its certificate was 1.12x its measured step; since the buffers and gradient storages are counted, it is within
# 1 KB of the measured step at 2, 3 and 8 blocks, measured 2026-12-03; 8 blocks took 33 s, 3 take 8 s.) gpt_oss cut
# to 2 was certified 23 KB BELOW its measured step until the gradient storages were counted from the backward (its
# expert-bias gradients are [E, n] views of [E + 1, n] buffers, kept whole by AccumulateGrad; 402,575,200 B
# certified vs 402,598,452 B measured, 2026-12-01): the case that caught it.
KEEP_BLOCKS = {"deepseek_v3": 3, "qwen3_moe": 3, "gpt_oss": 2}


def _trimmed(model, name):
    for key in list(model.layers)[KEEP_BLOCKS.get(name, len(model.layers)):]:
        del model.layers[key]
    return model


@pytest.fixture(scope="module")
def torchtitan_models():
    pytest.importorskip("torchtitan")
    from boundpass.recipes.models import build_debug_moe, torchtitan_loss
    return build_debug_moe, torchtitan_loss


@pytest.mark.torchtitan
@pytest.mark.parametrize("name,dispatch,dtype", [("deepseek_v3", True, torch.float32),
                                                  ("deepseek_v3", False, torch.float32),
                                                  ("qwen3_moe", True, torch.float32),
                                                  ("gpt_oss", True, torch.bfloat16)])
def test_torchtitan_debug_models_whole_step(torchtitan_models, name, dispatch, dtype):
    build_debug_moe, torchtitan_loss = torchtitan_models
    torch._dynamo.reset()
    vocab, seq = 8192, 128
    model = _trimmed(build_debug_moe(name, vocab_size=vocab, seq_len=seq, dtype=dtype), name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = boundpass.compile(model, budget="8GiB", loss_fn=torchtitan_loss(), optimizer=opt, dispatch_enable=dispatch)
    # a compiling step, then one measured: the shapes are fixed
    _, _, report = _check(step, model, step.optimizer, lm_batches(vocab, 2, seq, n=2, with_count=True))
    assert bool(report.rewritten_of("dispatch")) == (dispatch and name != "gpt_oss")
    excess = [t for t in report.table.terms if t.name.startswith("gradient storage beyond")]
    assert bool(excess) == (name == "gpt_oss"), [t.name for t in report.table.terms]


@pytest.mark.torchtitan
@pytest.mark.parametrize("sco", [False, True])
def test_checkpointed_blocks_with_and_without_sco(torchtitan_models, sco):
    build_debug_moe, torchtitan_loss = torchtitan_models
    from torchtitan.distributed.activation_checkpoint import FullAC
    torch._dynamo.reset()
    vocab, seq = 4096, 128
    model = build_debug_moe("deepseek_v3", vocab_size=vocab, seq_len=seq)
    for key in list(model.layers)[3:]:
        del model.layers[key]
    FullAC(FullAC.Config()).apply(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = boundpass.compile(model, budget="8GiB", loss_fn=torchtitan_loss(), optimizer=opt, sco_enable=sco,
                             host_budget="8GiB")
    _, _, report = _check(step, model, opt, lm_batches(vocab, 2, seq, with_count=True))
    assert report.sco.offloaded == (3 if sco else 0)


@pytest.mark.torchtitan
def test_demo_model_smallest_accepted_budget_holds_the_measured_step(torchtitan_models):
    """Regression: on the demo's model the old check accepted 591 MiB for a step that peaks at 1,329 MiB."""
    build_debug_moe, torchtitan_loss = torchtitan_models
    torch._dynamo.reset()
    vocab, seq = 65_536, 512
    model = build_debug_moe("deepseek_v3", vocab_size=vocab, seq_len=seq)
    batches = lm_batches(vocab, 2, seq, n=2, with_count=True)  # a compiling step, one measured: the shapes are fixed
    probe = boundpass.compile(model, budget="64GiB", loss_fn=torchtitan_loss(), vocab_block=128, dispatch_cap=1,
                              optimizer=torch.optim.AdamW(model.parameters()), optimizer_offload=True,
                              optimizer_bucket=1)
    probe(*batches[0])
    narrowest = boundpass.explain(probe).table.total  # every knob at its narrowest: the least compile accepts
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with pytest.raises(InfeasibleBudgetError):
        boundpass.compile(model, budget=narrowest - (1 << 20), loss_fn=torchtitan_loss(),
                          optimizer=torch.optim.AdamW(model.parameters()), optimizer_offload=True)(*batches[0])
    torch._dynamo.reset()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = boundpass.compile(model, budget=narrowest, loss_fn=torchtitan_loss(), optimizer=opt,
                             optimizer_offload=True)
    measured = measured_step_peak(step, model, step.optimizer, batches)
    assert measured <= boundpass.explain(step).table.total <= narrowest
    assert boundpass.explain(step).table.total <= TIGHT * measured


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_certified_peak_holds_against_process_rss(inner):
    """RSS growth of one step in a fresh process (Inductor's kernels allocate where no tracker sees) against the
    certified peak less the state resident before the step, plus RSS_NON_TENSOR: within 1.10 both ways. Inductor's
    is certified on the schedule it emits (after fusion), the eager one on the partitioned graphs."""
    from boundpass.testing.whole_step import certified_and_rss
    certified, grown = certified_and_rss(inner)
    assert grown <= certified + RSS_NON_TENSOR <= TIGHT * grown, (grown, certified)


def test_inductor_certifies_the_schedule_it_emits_and_checks_it_before_compute():
    """Inductor: the certificate is read from its final schedule (after fusion) of both graphs, lowered before any
    compute. A budget between that peak and the pre-fusion one is accepted; one below it (even at the narrowest
    strip) is refused before the step runs, naming the scheduler's kernel at the peak."""
    torch._dynamo.reset()
    model = DenseLM(vocab=8192, hidden=64, inter=8192)
    step = boundpass.compile(model, budget="16GiB", loss_fn=ce, inner="inductor")
    batch = lm_batches(8192, 2, 256)[0]
    step(*batch).backward()
    cert = boundpass.explain(step).certificate
    assert cert.source == "Inductor's final schedule", cert.source
    assert cert.graph_bytes < cert.before_fusion  # fusion removed intermediates the FX walk counted
    assert cert.point.node.startswith("op")  # a scheduler node (op<i>), not an FX node
    narrowest = cert.total_at(vocab_block=128)
    before_fusion = cert.planner.total(cert.before_fusion)
    assert narrowest < before_fusion

    torch._dynamo.reset()
    fresh = DenseLM(vocab=8192, hidden=64, inter=8192)
    between = (cert.table.total + before_fusion) // 2
    accepted = boundpass.compile(fresh, budget=between, loss_fn=ce, inner="inductor")
    accepted(*batch).backward()
    assert boundpass.explain(accepted).table.total <= between < before_fusion

    torch._dynamo.reset()
    fresh = DenseLM(vocab=8192, hidden=64, inter=8192)
    refused = boundpass.compile(fresh, budget=narrowest - (256 << 10), loss_fn=ce, inner="inductor")
    with pytest.raises(InfeasibleBudgetError) as err:
        refused(*batch)
    assert "peak at backward node op" in str(err.value) and "to fix" in str(err.value)
    assert all(p.grad is None for p in fresh.parameters())


def test_the_allocator_measures_what_the_tracker_measures():
    """The allocator-level measurement (torch.profiler's memory events) that Inductor steps are measured by agrees
    with the live-storage tracker on an eager step, to the byte."""
    from boundpass.testing.whole_step import allocator_step_peak
    torch._dynamo.reset()
    model = DenseLM()
    opt = torch.optim.AdamW(model.parameters())
    step = boundpass.compile(model, budget="1GiB", loss_fn=ce, optimizer=opt)
    batches = lm_batches(4096, 2, 256)
    assert allocator_step_peak(step, model, opt, batches) == measured_step_peak(step, model, opt, batches[1:],
                                                                              warmup=0)


@pytest.mark.parametrize("name", ["dense", pytest.param("deepseek_v3", marks=pytest.mark.torchtitan)])
def test_inductor_whole_step_at_the_allocator(name):
    """Inductor (its fused kernels, its scheduler's order): every allocation of the step as torch's allocator saw
    it, against the certificate read from Inductor's schedule: measured <= certified <= 1.10 x measured."""
    from boundpass.testing.whole_step import allocator_step_peak
    torch._dynamo.reset()
    torch.manual_seed(0)
    if name == "dense":
        model, loss_fn = DenseLM(vocab=8192, hidden=128, inter=4096), ce
        batches = lm_batches(8192, 4, 512)
    else:
        pytest.importorskip("torchtitan")
        from boundpass.recipes.models import build_debug_moe, torchtitan_loss
        model = _trimmed(build_debug_moe("deepseek_v3", vocab_size=8192, seq_len=256), "deepseek_v3")
        loss_fn = torchtitan_loss()
        batches = lm_batches(8192, 2, 256, with_count=True)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    step = boundpass.compile(model, budget="16GiB", loss_fn=loss_fn, optimizer=opt, inner="inductor")
    measured = allocator_step_peak(step, model, opt, batches)
    report = boundpass.explain(step)
    assert report.certificate.source == "Inductor's final schedule"
    assert measured <= report.table.total <= TIGHT * measured, (measured, report.table.render())


def test_gradient_accumulation_is_certified_and_checked_before_the_step():
    """A step that starts with the previous micro-batch's gradients holds them through forward and backward: the
    certificate's accumulation total bounds it (measured), and a budget that only fits the plain step refuses it
    before running, naming the held gradients."""
    from boundpass.measure.memtrack import LiveStorageTracker
    from boundpass.testing.whole_step import optimizer_state_tensors
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DenseLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = boundpass.compile(model, budget="4GiB", loss_fn=ce, optimizer=opt)
    first, second = lm_batches(4096, 2, 256, n=2)
    for _ in range(2):  # compile, then AdamW's state exists
        step(*first).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step(*first).backward()  # micro-batch 1: its gradients stay
    with LiveStorageTracker() as tracker:
        tracker.track_existing(list(model.parameters()), list(model.buffers()), optimizer_state_tensors(opt),
                               [p.grad for p in model.parameters()], second)
        step(*second).backward()  # micro-batch 2 accumulates
        opt.step()
    cert = boundpass.explain(step).certificate
    assert tracker.peak_bytes() <= cert.accumulation_total <= TIGHT * tracker.peak_bytes()
    opt.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    tight = boundpass.compile(model, budget=cert.table.total, loss_fn=ce, optimizer=opt)
    tight(*first).backward()
    with pytest.raises(InfeasibleBudgetError, match="accumulation"):
        tight(*second)
