"""The counting CPU allocator (boundpass.measure.counting_allocator) sees every free, whatever thread makes it.

Each case runs in a fresh interpreter: the allocator stays installed for the life of a process, and a pytest worker
should keep c10's own.
"""
import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_free_on_another_thread_is_counted_where_the_profiler_misses_it():
    out = _run("""
        import threading, torch
        from torch.profiler import ProfilerActivity, profile
        from boundpass.measure import counting_allocator as ca
        ca.install()
        base = ca.live_bytes()
        box = {"t": torch.empty(1 << 18)}
        assert ca.live_bytes() - base == 1 << 20 and ca.block_bytes(box["t"]) == 1 << 20
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            scratch = torch.empty(1 << 16)
            worker = threading.Thread(target=box.clear)   # the last reference dropped on another thread
            worker.start(); worker.join()
            del scratch
        frees = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage < 0]
        print(ca.live_bytes() - base, frees)
    """)
    live, frees = out.split(maxsplit=1)
    assert int(live) == 0                     # both blocks gone from the count
    assert frees.strip() == "[-262144]"       # the profiler saw only the main thread's free


def test_peak_of_an_eager_step_equals_the_profiler_measure():
    """On one thread both measures see the same allocations and frees: the peak of a training step agrees to the
    byte (the profiler measure is the one the trainer benches used before; boundpass.testing.whole_step)."""
    out = _run("""
        import torch
        from boundpass.measure import counting_allocator as ca
        ca.install()
        from boundpass.testing.dense_lm import DenseLM, ce, lm_batches
        from boundpass.testing.whole_step import allocator_peak_of
        torch.manual_seed(0)
        model = DenseLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches = lm_batches(4096, 2, 64)
        def step(batch):
            loss = ce(model(batch[0]), batch[1]); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        step(batches[0])
        before = ca.live_bytes()
        state = [*model.parameters(), *model.buffers(),
                 *[t for s in opt.state.values() for t in s.values()], *batches[1]]
        ca.reset_peak()
        _, profiled = allocator_peak_of(lambda: step(batches[1]), state)
        del state
        # what else is live in the process (the first batch, torch's own small tensors) is the same before and after
        print(ca.peak_bytes() - before, profiled - sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for t in [*model.parameters(), *model.buffers(), *[t for s in opt.state.values() for t in s.values()],
                        *batches[1]]}.values()))
    """)
    counted, profiled = map(int, out.split())
    assert counted == profiled > 0


def test_ranks_building_the_allocator_at_once_on_an_empty_cache_each_get_a_whole_library(tmp_path):
    """Four processes (the ranks of a bench on a fresh machine) build at once: each into a temporary name of its own,
    each renamed into place. A compiler stand-in (CXX) that takes a while makes their builds overlap."""
    import os
    compiler = tmp_path / "fake_cxx.py"
    compiler.write_text(textwrap.dedent("""
        import sys, time
        time.sleep(4)
        out = sys.argv[sys.argv.index("-o") + 1]
        with open(out, "w") as f:
            f.write("whole")
    """))
    env = {**os.environ, "BOUNDPASS_CACHE_DIR": str(tmp_path / "cache"), "CXX": f"{sys.executable} {compiler}"}
    code = "from boundpass.measure.counting_allocator import _build; print(_build())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    assert all(rc == 0 for _, _, rc in results), [err[-2000:] for _, err, rc in results if rc]
    built = {out.strip() for out, _, _ in results}
    assert len(built) == 1 and open(built.pop()).read() == "whole"
    assert not list((tmp_path / "cache").glob("*.tmp"))  # no rank's temporary left behind
