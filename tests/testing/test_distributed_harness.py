"""Tests for boundpass.testing.distributed.run_on_ranks (real gloo ranks, CPU processes forked from a fork server)."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

from boundpass.testing.distributed import RankError, run_on_ranks

pytestmark = pytest.mark.distributed


# ---- rank functions: top level so that a rank can import them by module name ----------------------------

def _all_reduce_rank(rank, world_size, scale, *, offset=0.0):
    import torch.distributed as dist

    t = torch.tensor([float(rank) * scale + offset, 1.0])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "sum": t,
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "env_rank": os.environ.get("RANK"),
    }


def _raise_on_rank1(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        _helper_that_raises(rank)
    dist.all_reduce(torch.ones(1))  # rank 0 (and others) block here until killed
    return rank


def _helper_that_raises(rank):
    raise ValueError(f"boom from rank {rank}")


def _rank1_skips_collective(rank, world_size):
    import torch.distributed as dist

    if rank != 1:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: everybody else hangs
    return rank


def _die_hard(rank, world_size):
    os._exit(7)  # no Python exception, no report


# ---- helpers ------------------------------------------------------------------------------------------

def _child_pids() -> set[int]:
    """Live (non-zombie) descendants of this process, other than multiprocessing's resource tracker and the fork
    server (both started once per parent and kept; the ranks are children of the fork server)."""
    parent, helper = {}, set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        # field 4 (ppid) comes after the parenthesised comm, which may contain spaces
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z":
            continue
        parent[int(d)] = int(fields[1])
        if b"resource_tracker" in cmdline or b"forkserver" in cmdline:
            helper.add(int(d))
    me, out = os.getpid(), set()
    for pid in parent:
        p = pid
        while p in parent and p != me:
            p = parent[p]
        if p == me and pid not in helper:
            out.add(pid)
    return out


# ---- tests --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_returns_in_rank_order(world_size):
    before = _child_pids()
    outs = run_on_ranks(_all_reduce_rank, world_size, 2.0, offset=1.0, timeout_s=60)
    assert [o["rank"] for o in outs] == list(range(world_size))
    expected = sum(2.0 * r + 1.0 for r in range(world_size))
    for o in outs:
        assert o["world"] == world_size
        assert o["backend"] == "gloo"
        assert torch.equal(o["sum"], torch.tensor([expected, float(world_size)]))
        assert o["omp"] == "1" and o["threads"] == 1
    assert [o["env_rank"] for o in outs] == [str(r) for r in range(world_size)]
    assert _child_pids() - before == set()


def test_raising_rank_surfaces_traceback_promptly():
    before = _child_pids()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as ei:
        run_on_ranks(_raise_on_rank1, 2, timeout_s=60)
    elapsed = time.monotonic() - t0
    msg = str(ei.value)
    assert isinstance(ei.value, RankError) and ei.value.rank == 1
    # the failing rank stays up until the parent kills everyone, so its peer (blocked in all_reduce)
    # never sees a "connection closed" error of its own: exactly one report, the root cause
    assert set(ei.value.tracebacks) == {1}
    assert "rank 1" in msg
    assert "ValueError: boom from rank 1" in msg
    assert "Traceback (most recent call last)" in msg
    assert "_helper_that_raises" in msg  # the full traceback, not just the last line
    assert elapsed < 30, f"should not wait for the 60 s timeout (took {elapsed:.1f}s)"
    assert _child_pids() - before == set()


def test_hanging_rank_times_out_and_leaves_no_children():
    before = _child_pids()
    timeout_s = 6
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as ei:
        run_on_ranks(_rank1_skips_collective, 2, timeout_s=timeout_s)
    elapsed = time.monotonic() - t0
    msg = str(ei.value)
    # rank 1 finished (it skipped the collective); rank 0 is the one stuck in all_reduce
    m = re.search(r"ranks \[([\d, ]*)\] did not finish", msg)
    assert m, msg
    missing = [int(x) for x in m.group(1).split(",")]
    assert 0 in missing, msg  # (rank 1 is normally listed as finished; on a loaded machine start-up
    assert "finished: [1]" in msg or missing == [0, 1], msg  # may eat the whole budget)
    assert timeout_s - 0.5 <= elapsed < timeout_s + 5, elapsed
    assert _child_pids() - before == set()


def test_rank_dying_without_exception_is_reported():
    with pytest.raises(RankError, match=r"rank 0 exited with code 7"):
        run_on_ranks(_die_hard, 1, timeout_s=30)


def test_unpicklable_fn_fails_fast():
    with pytest.raises(TypeError, match="picklable"):
        run_on_ranks(lambda rank, ws: rank, 2, timeout_s=5)


_SCRIPT = '''
import torch.distributed as dist
from boundpass.testing.distributed import run_on_ranks

def _script_rank(rank, world_size):
    return f"{__name__}:{rank}/{dist.get_world_size()}"

if __name__ == "__main__":
    print(run_on_ranks(_script_rank, 2, timeout_s=120))
'''


def test_a_scripts_own_function_runs_on_the_ranks(tmp_path):
    """A script run as ``python script.py`` hands run_on_ranks a function of its own ``__main__``: each rank imports
    the script as ``__mp_main__`` (its main guard keeps it from launching again) and finds the function there. The
    fork server cannot do it for them (Python 3.11 never passes it the script's path)."""
    import subprocess
    import sys
    script = tmp_path / "launch_from_a_script.py"
    script.write_text(_SCRIPT)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['__mp_main__:0/2', '__mp_main__:1/2']", out.stdout


def _env_of(rank, world_size, name):
    return os.environ.get(name)


def test_ranks_see_the_launchers_environment_at_launch(monkeypatch):
    """The fork server keeps the environment it started with; each launch hands the ranks the launcher's current
    one, as a freshly spawned process would see it."""
    run_on_ranks(_env_of, 1, "BOUNDPASS_HARNESS_PROBE", timeout_s=60)  # the fork server is up from here on
    monkeypatch.setenv("BOUNDPASS_HARNESS_PROBE", "set after the server started")
    assert run_on_ranks(_env_of, 2, "BOUNDPASS_HARNESS_PROBE", timeout_s=60) == ["set after the server started"] * 2
    monkeypatch.delenv("BOUNDPASS_HARNESS_PROBE")
    assert run_on_ranks(_env_of, 1, "BOUNDPASS_HARNESS_PROBE", timeout_s=60) == [None]


def test_a_module_that_fails_to_import_does_not_stop_the_preload(tmp_path, monkeypatch, capsys):
    """The fork server's preload skips a missing module quietly and one that raises while importing with a line on
    stderr, and imports the rest (multiprocessing's own preload lets anything but ImportError kill the server)."""
    import sys
    from boundpass.testing.distributed import preload
    (tmp_path / "bp_preload_raises.py").write_text("raise AttributeError('an incompatible dependency')\n")
    (tmp_path / "bp_preload_fine.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    failed = preload(["bp_preload_missing", "bp_preload_raises", "bp_preload_fine"])
    assert set(failed) == {"bp_preload_missing", "bp_preload_raises"}
    assert "bp_preload_fine" in sys.modules
    err = capsys.readouterr().err
    assert "could not preload bp_preload_raises" in err and "bp_preload_missing" not in err
