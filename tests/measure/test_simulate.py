"""Tests for boundpass.measure.simulate.simulated_rank (fake process group + FakeTensorMode, one process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import FakeTensor

from boundpass.measure.simulate import SimulatedRank, simulated_rank

H = 7168
N_BIG = 200_000  # [200000, 7168] fp32 = 5.34 GiB per tensor


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(autouse=True)
def _no_process_group():
    if dist.is_initialized():  # left over by another test module: not ours to destroy
        pytest.skip("a process group is already initialised in this process")
    yield
    assert not dist.is_initialized()


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_huge_fake_tensors_allocate_nothing(device):
    rss0 = _rss_bytes()
    with simulated_rank(3, 8, device=device) as sim:
        x = torch.empty(N_BIG, H, device=sim.device)
        w = torch.empty(H, H, device=sim.device)
        y = (x @ w).float().softmax(-1)  # another 5.3 GiB if it were real
        ys = [y + i for i in range(4)]  # and 4 more
        assert isinstance(x, FakeTensor) and isinstance(y, FakeTensor)
        assert x.shape == (N_BIG, H) and y.dtype == torch.float32
        assert x.device == sim.device and y.device == sim.device
        assert x.untyped_storage().nbytes() == N_BIG * H * 4  # reports the size it would have...
        grown = _rss_bytes() - rss0
        del ys
    # ...but ~32 GiB of "tensors" did not move RSS (the machine has 23 GiB in total)
    assert grown < 256 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"


def test_reports_rank_world_device_and_group():
    with simulated_rank(5, 16) as sim:
        assert isinstance(sim, SimulatedRank)
        assert (sim.rank, sim.world_size) == (5, 16)
        assert dist.is_initialized()
        assert dist.get_backend() == "fake"
        assert (dist.get_rank(), dist.get_world_size()) == (5, 16)
        assert sim.group is dist.group.WORLD
        assert (dist.get_rank(sim.group), dist.get_world_size(sim.group)) == (5, 16)
        assert sim.device == torch.device("cuda", 0)  # normalised like fake tensors report it
        assert torch.empty(1, device="cuda").device == sim.device
        assert torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is sim.fake_mode
        # no CUDA in this torch build -> autograd on fake cuda would abort the process
        assert sim.autograd_ok == torch.backends.cuda.is_built()
    with simulated_rank(0, 2, device="cpu") as sim:
        assert sim.device == torch.device("cpu") and sim.autograd_ok


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_ring_exchange_batch_isend_irecv(device):
    W = 8
    with simulated_rank(2, W, device=device) as sim:
        send = torch.empty(N_BIG, H, device=sim.device)
        recv = torch.empty_like(send)
        for _ in range(W - 1):  # Ring-DTP style: W-1 rounds, swap buffers each round
            ops = [
                dist.P2POp(dist.isend, send, (sim.rank + 1) % W),
                dist.P2POp(dist.irecv, recv, (sim.rank - 1) % W),
            ]
            works = dist.batch_isend_irecv(ops)
            assert len(works) == 2
            for wk in works:
                wk.wait()
            send, recv = recv, send
        assert recv.shape == (N_BIG, H) and isinstance(recv, FakeTensor)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_documented_collectives(device):
    W = 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor deprecation
        with simulated_rank(1, W, device=device) as sim:
            a = torch.ones(8, 4, device=sim.device)
            dist.all_reduce(a)
            dist.all_reduce(a, async_op=True).wait()
            out = torch.empty(8 * W, 4, device=sim.device)
            dist.all_gather_into_tensor(out, a)
            assert out.shape == (8 * W, 4)
            o = torch.empty(8, 4, device=sim.device)
            dist.all_to_all_single(o, a)
            o2 = torch.empty(10, 4, device=sim.device)
            dist.all_to_all_single(o2, a, [3, 1, 2, 4], [2, 2, 2, 2])
            dist.all_to_all_single(o, a, async_op=True).wait()
            y = funcol.all_to_all_single(a, [3, 1, 2, 4], [2, 2, 2, 2], sim.group)
            # under FakeTensorMode funcol returns a plain, already-waited FakeTensor (no .wait())
            assert type(y) is FakeTensor and y.shape == (10, 4)
            assert funcol.wait_tensor(y).shape == (10, 4)
            assert funcol.broadcast(a, 0, sim.group).shape == (8, 4)
            if device == "cuda" and not torch.backends.cuda.is_built():
                with pytest.raises(AssertionError, match="not compiled with CUDA"):
                    dist.broadcast(a, 0)
            else:
                dist.broadcast(a, 0)


def test_compiled_funcol_all_to_all_under_simulation():
    with simulated_rank(1, 4) as sim:
        def f(x):
            return funcol.all_to_all_single(x * 2, [3, 1, 2, 4], [2, 2, 2, 2], sim.group).sum(0)

        torch._dynamo.reset()
        out = torch.compile(f, backend="eager", fullgraph=True)(torch.ones(8, 4, device=sim.device))
        assert out.shape == (4,) and out.device == sim.device
    torch._dynamo.reset()


def test_group_destroyed_and_fake_mode_exited_after_exit():
    with simulated_rank(0, 4):
        pass
    assert not dist.is_initialized()
    assert torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None
    t = torch.zeros(2)
    assert not isinstance(t, FakeTensor) and t.sum().item() == 0

    with pytest.raises(ValueError, match="inside"):
        with simulated_rank(1, 4):
            raise ValueError("inside")
    assert not dist.is_initialized()
    assert torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None

    # usable again afterwards
    with simulated_rank(2, 4) as sim:
        assert sim.rank == 2


def test_refuses_when_a_real_group_is_initialised():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already initialised"):
            with simulated_rank(0, 2):
                pass
        assert dist.get_backend() == "gloo"  # untouched
    finally:
        dist.destroy_process_group()


def test_bad_rank_rejected():
    with pytest.raises(ValueError):
        with simulated_rank(4, 4):
            pass


def test_fake_cuda_autograd_aborts_on_cpu_only_build():
    """Documents the hazard behind ``sim.autograd_ok``: it kills the process, so probe in a subprocess."""
    if torch.backends.cuda.is_built():
        pytest.skip("only a hazard on torch builds without CUDA")
    code = textwrap.dedent(
        """
        import torch
        from boundpass.measure.simulate import simulated_rank
        with simulated_rank(0, 2, device="cpu") as sim:   # fake cpu: autograd fine
            x = torch.ones(4, 4, device=sim.device, requires_grad=True)
            (x * 2).sum().backward()
            assert x.grad.shape == (4, 4)
        print("cpu-ok", flush=True)
        with simulated_rank(0, 2) as sim:                 # fake cuda: aborts
            x = torch.ones(4, 4, device=sim.device, requires_grad=True)
            y = x * 2
        print("cuda-survived", flush=True)
        """
    )
    import os

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert "cpu-ok" in p.stdout, p.stderr
    assert "cuda-survived" not in p.stdout
    assert p.returncode != 0
    assert "not linked with support for cuda" in p.stderr
