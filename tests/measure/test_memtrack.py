"""boundpass.measure.memtrack: live-storage tracker on real and fake tensors, fake-PG wait_tensor fix, subprocess RSS."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from boundpass.measure import memtrack
from boundpass.measure.memtrack import (LiveStorageTracker, MeasurementError, measure_peak, rss_peak_in_subprocess,
                                rss_run_in_subprocess)

F32 = 4


# ---- real tensors -----------------------------------------------------------------------------------------
def test_matmul_peak_is_exact():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with LiveStorageTracker() as tr:
        c = (a @ b).relu()  # mm output and relu output are alive together for a moment
        assert tr.live_bytes() == 64 * 16 * F32  # mm's temporary is gone
    assert tr.peak_bytes() == 2 * 64 * 16 * F32
    assert tr.peak_bytes("cpu") == tr.peak_bytes() and tr.peak_bytes("cuda") == 0
    del c


def test_track_existing_counts_inputs_until_freed():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    out, peak = measure_peak(torch.mm, a, b, track=(a, b))
    assert peak == (64 * 32 + 32 * 16 + 64 * 16) * F32
    tr = LiveStorageTracker().track_existing(a, a.t(), b)  # a view of a tracked tensor is not a second copy
    assert tr.live_bytes() == (64 * 32 + 32 * 16) * F32
    del a
    gc.collect()
    assert tr.live_bytes() == 32 * 16 * F32


def test_aliases_do_not_count():
    x = torch.randn(128, 64)
    pre = torch.empty(128, 64)
    with LiveStorageTracker() as tr:
        views = [x.t(), x.transpose(0, 1), x.view(-1), x.reshape(64, 128), x.detach(), x.narrow(0, 0, 8),
                 x[::2], x.unsqueeze(0).expand(3, 128, 64), x.permute(1, 0), x.as_strided((4,), (1,))]
        x.add_(1)
        x.mul_(2)
        torch.add(x, x, out=pre)  # out= into an existing buffer of the right size
        assert tr.live_bytes() == 0 and tr.peak_bytes() == 0
        y = x.clone()
        ys = [y.t(), y.detach(), y.view(-1), y.add_(1)]
        assert tr.live_bytes() == tr.peak_bytes() == 128 * 64 * F32
    del views, ys


def test_freeing_decreases_live_and_keeps_peak():
    with LiveStorageTracker() as tr:
        a = torch.ones(1000)
        b = torch.ones(2000)
        v = a.view(10, 100)
        assert tr.live_bytes() == 3000 * F32
        del a
        gc.collect()
        assert tr.live_bytes() == 3000 * F32  # a view keeps the storage alive
        del v
        assert tr.live_bytes() == 2000 * F32  # storage finalizers fire without needing gc
        del b
        assert tr.live_bytes() == 0
        assert tr.peak_bytes() == 3000 * F32
        tr.reset_peak()
        assert tr.peak_bytes() == 0
        c = torch.ones(10)
    assert tr.peak_bytes() == 10 * F32
    del c


def test_resize_and_out_resize_are_tracked():
    a = torch.randn(256)
    with LiveStorageTracker() as tr:
        o = torch.empty(0)
        torch.add(a, a, out=o)  # out= grows o's storage in place
        assert tr.live_bytes() == 256 * F32
        o.resize_(1024)
        assert tr.live_bytes() == 1024 * F32
    del o
    assert tr.live_bytes() == 0


def test_storage_freed_in_place_is_tracked():
    """resize_storage_bytes_(t, 0) frees a storage that other references keep (a collective's late reference,
    FSDP2's buffers): the tracker counts the bytes gone at once, not when the last reference dies."""
    with LiveStorageTracker() as tr:
        buf = torch.empty(1024)
        keep = buf.view(32, 32)  # another reference, as a gloo work's would be
        assert tr.live_bytes() == 1024 * F32
        torch.ops.inductor.resize_storage_bytes_(buf, 0)
        assert tr.live_bytes() == 0 and tr.peak_bytes() == 1024 * F32
        torch.ops.inductor.resize_storage_bytes_(buf, 64 * F32)  # and grown again
        assert tr.live_bytes() == 64 * F32
    del buf, keep
    assert tr.live_bytes() == 0


# ---- fake tensors ---------------------------------------------------------------------------------------
def test_fake_storage_identity_and_finalizer():
    with FakeTensorMode():
        with LiveStorageTracker() as tr:
            a = torch.empty(1000, 1000, device="cuda")
            v = a.t()
            assert tr.live_bytes("cuda") == 4_000_000
            del a
            gc.collect()
            assert tr.live_bytes("cuda") == 4_000_000  # still alive through the view
            del v
            gc.collect()
            assert tr.live_bytes() == 0 and tr.peak_bytes("cuda") == 4_000_000


def test_either_nesting_order_with_fake_mode():
    for tracker_outside in (True, False):
        tr = LiveStorageTracker()
        with (tr if tracker_outside else FakeTensorMode()):
            with (FakeTensorMode() if tracker_outside else tr):
                a = torch.empty(100, 100)
                b = torch.mm(a, a.t())
        assert tr.peak_bytes("cpu") == 2 * 100 * 100 * F32
        del a, b
        assert tr.live_bytes() == 0


def test_cross_entropy_at_paper_shape_under_fake_mode():
    n, h, v = 16384, 7168, 200000
    u = n * v * F32  # one fp32 logits-sized buffer: 12.2 GiB
    with FakeTensorMode():
        hid = torch.randn(n, h, requires_grad=True)  # autograd on fake "cuda" aborts on a CPU build: use cpu
        w = torch.randn(v, h, requires_grad=True)
        y = torch.randint(0, v, (n,))
        base = (n * h + v * h) * F32 + n * 8  # h, W, int64 targets
        with LiveStorageTracker() as tr:
            tr.track_existing(hid, w, y)
            loss = F.cross_entropy(hid @ w.T, y)
            # fwd: logits + log_softmax alive together; + 4 B loss + 4 B nll total_weight
            assert tr.peak_bytes() == 2 * u + base + 8
            assert tr.live_bytes() == u + base + 8  # logits are not saved for backward
            loss.backward()
            # bwd: log_softmax (saved) + nll_loss_backward + _log_softmax_backward_data
            assert tr.peak_bytes() == 3 * u + base + 8
            assert tr.live_bytes("cpu") == 2 * base - n * 8 + F32  # grads of h, W + the loss


def test_fake_cuda_accounted_under_cuda():
    with FakeTensorMode():
        with LiveStorageTracker() as tr:
            x = torch.randn(1 << 20, 1024, device="cuda")  # 4 GiB, never allocated
            m = torch.randn(256, 256)
            z = F.log_softmax(x, dim=-1)
            host = z.narrow(0, 0, 4).to("cpu")  # z[:4] needs a CUDA device guard; narrow does not
        assert tr.peak_bytes("cuda") == tr.peak_bytes("cuda:0") == 2 * (1 << 30) * F32
        assert tr.live_bytes("cpu") == (256 * 256 + 4 * 1024) * F32
        assert tr.peak_bytes() == tr.peak_bytes("cuda") + tr.peak_bytes("cpu")
        del x, m, z, host


# ---- fake process group: wait_tensor is a transfer --------------------------------------------------------
@pytest.fixture
def fake_pg():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _a2a_peak(group) -> tuple[int, int, int]:
    import torch.distributed._functional_collectives as funcol

    with FakeTensorMode():
        x = torch.empty(4096, 1024, device="cuda")
        with LiveStorageTracker() as tr:
            y = funcol.all_to_all_single(x, None, None, group=group)  # under a mode this waits at once
            z = funcol.wait_tensor(y)
            live = tr.live_bytes("cuda")
        del y, z
        gc.collect()
        return tr.peak_bytes("cuda"), live, tr.live_bytes()


def test_fake_wait_tensor_counted_once(fake_pg, monkeypatch):
    nbytes = 4096 * 1024 * F32
    assert _a2a_peak(fake_pg) == (nbytes, nbytes, 0)
    # The trap is real: without the transfer rule the collective output is counted twice.
    monkeypatch.setattr(memtrack, "_WAIT_OPS", set())
    assert _a2a_peak(fake_pg)[0] == 2 * nbytes


def test_real_funcol_async_tensor_not_double_counted(fake_pg):
    import torch.distributed._functional_collectives as funcol

    x = torch.randn(64, 32)
    with LiveStorageTracker() as tr:
        y = funcol.all_to_all_single(x, None, None, group=fake_pg)  # AsyncCollectiveTensor wrapper
        z = y.wait()
    assert tr.peak_bytes() == tr.live_bytes() == x.nbytes
    del y, z


def test_compiled_checkpointed_random_op_is_measured():
    """A compiled activation-checkpointed region that draws random numbers runs AOTAutograd's RNG HOPs
    (run_and_save_rng_state in forward, run_with_rng_state in the recompute): torch refuses a HOP under a mode that
    does not take them, which is how the MoP layout's compiled FullAC blocks first failed under the tracker
    (tests/recipes/test_mop.py). The tracker takes those two (one op each, outputs counted) and refuses a HOP with a body."""
    def f(x):
        return torch.utils.checkpoint.checkpoint(lambda y: torch.nn.functional.dropout(y, 0.5).sin(), x,
                                                 use_reentrant=False)
    x = torch.randn(1 << 16, requires_grad=True)
    torch.manual_seed(0)
    ref = f(x)
    ref.sum().backward()
    ref_grad, x.grad = x.grad, None
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.manual_seed(0)
    with LiveStorageTracker() as tr:
        out = compiled(x)
        out.sum().backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, ref_grad)  # same draws in forward and recompute
    # live at the peak, measured 4.25 x: the output, the gradient and the recompute's dropout output and mask
    assert 3 * x.nbytes <= tr.peak_bytes() <= 6 * x.nbytes, tr.peak_bytes()
    with pytest.raises(NotImplementedError, match="higher-order operator 'cond'"):
        tr.__torch_dispatch__(torch.ops.higher_order.cond, [], (torch.tensor(True), lambda: x, lambda: x, ()))


# ---- RSS in a fresh subprocess ------------------------------------------------------------------------
def test_rss_peak_measures_256mib():
    code = (
        "import torch\n"
        "def setup():\n"
        "    torch.ones(16).sum()  # warm up the allocator and op dispatch outside the measurement\n"
        "def measured(state):\n"
        "    x = torch.ones(64 * 2**20)  # 256 MiB, every page touched\n"
        "    del x\n"
    )
    peak, stdout = rss_run_in_subprocess(code.replace("    torch.ones(16).sum()", "    print('SET UP', flush=True)\n"
                                                      "    torch.ones(16).sum()"), timeout=120)
    assert abs(peak - 256 * 2**20) <= 0.15 * 256 * 2**20, peak
    assert stdout == "SET UP"  # what setup printed comes back; the measurement's own line does not


def test_rss_child_failure_and_timeout_raise_clearly():
    with pytest.raises(MeasurementError, match="boom-from-child"):
        rss_peak_in_subprocess("def measured(state):\n    raise ValueError('boom-from-child')\n")
    with pytest.raises(MeasurementError, match="must define measured"):
        rss_peak_in_subprocess("x = 1\n")
    with pytest.raises(MeasurementError, match="timed out"):
        rss_peak_in_subprocess("import time\ndef measured(state):\n    time.sleep(60)\n", timeout=1)


def test_allocator_peak_of_an_empty_state_counts_what_the_function_allocates():
    from boundpass.testing.whole_step import allocator_peak_of
    out, peak = allocator_peak_of(lambda: torch.ones(1 << 20), [])  # 4 MiB, nothing live before
    assert out.numel() == 1 << 20 and peak >= 4 << 20, peak
