"""Run a function on N real ``torch.distributed`` ranks (CPU processes) with a hard timeout.

Usage (also from pytest: ``fn`` may live in a test module)::

    from boundpass.testing.distributed import run_on_ranks

    def _sum_ranks(rank, world_size, scale):          # top level => picklable by name
        import torch, torch.distributed as dist
        t = torch.tensor([float(rank) * scale])
        dist.all_reduce(t)
        return t

    outs = run_on_ranks(_sum_ranks, 4, 2.0, timeout_s=30)   # -> [tensor([12.]), ...] in rank order

What it does

* Starts ``world_size`` processes with the ``forkserver`` start method. The fork server is started once per
  parent process, with ``OMP_NUM_THREADS=1`` in its environment, and imports ``PRELOAD`` (torch, Dynamo,
  Inductor, boundpass's compiler and recipes, the packages a torchtitan trainer imports) once; every rank is a
  fork of it, so a launch no longer pays ~5-7 CPU-seconds of imports per rank (measured: a 2-rank launch that imports
  torchtitan took 6.9 s with ``spawn``, 0.06 s after the first with the preloaded fork server). The server
  runs no torch op and starts no OpenMP pool (its one extra thread is jemalloc's, see ``PRELOAD``), so
  forking it is safe; Python's ``random`` reseeds in each
  fork (``os.register_at_fork``), torch's generator starts at its import-time default seed as it did under
  spawn. Each child also calls ``torch.set_num_threads(1)``, sets
  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, and gets the parent's ``sys.path``, so
  modules importable in the parent (``tests/`` modules under pytest, the repo root) import in the child.
* Each child calls ``dist.init_process_group(backend, init_method="file://<tmp>/store", rank, world_size)``
  (a FileStore in a fresh temp dir: no port races; gloo's own timeout is set to ``timeout_s + 60`` so a
  hang surfaces as this harness's ``TimeoutError``), runs ``fn(rank, world_size, *args, **kwargs)`` and
  sends the return value back (plain ``pickle``; tensors are copied by value). A rank that has returned
  keeps its process group up until *every* rank has returned, then destroys it and exits: so a peer
  still blocked in a collective keeps hanging (and is named by the ``TimeoutError``) instead of failing
  with a gloo "connection closed" error caused by the early finisher.
* ``fn``/``args``/``kwargs`` are pickled in the parent first, so a lambda or local function fails
  immediately with a clear error instead of inside a child.
* If any rank raises: it reports its traceback and stays up (sockets open, so its peers do not fail
  with secondary "connection closed" errors), the parent kills every rank at once and raises a
  ``RuntimeError`` carrying the failed rank's full traceback text (``RankError``, a ``RuntimeError`` subclass; ``.rank`` and ``.tracebacks``).
  A rank that dies without a Python exception (signal, ``os._exit``, C++ abort) also raises
  ``RankError`` with its exit code.
* If not every rank has returned ``timeout_s`` seconds after the start (spawn/import time included),
  every child is killed (SIGKILL, its whole process group: each child makes itself a group leader) and
  ``TimeoutError`` names the ranks that did not finish.
* When ``fn`` is defined in the launching script, each child imports that script as ``__mp_main__`` (as spawn
  did), so a *script* that calls
  ``run_on_ranks`` must guard its top-level code with ``if __name__ == "__main__":`` (pytest and
  ``python -m`` are fine). Code fed on stdin / ``python -c`` cannot host ``fn``.
* Children are started with ``PR_SET_PDEATHSIG=SIGKILL`` on Linux: they die with the fork server, which exits
  when the parent does (multiprocessing closes its pipe), so they die if the parent is killed.

Nothing here imports torch or torchtitan at module level (the fork server's environment is set first); the first
launch in a process starts the fork server (~10 s of imports on a 2-core machine), later ones take well under a
second to start their ranks.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

__all__ = ["run_on_ranks", "RankError"]

_ENV_LOCK = threading.Lock()
# Start-up environment of every child. Set in the parent's environment only around ``Process.start()``: the
# first start launches the fork server, a fresh interpreter that inherits it, so it is in place before the
# server imports torch (torch sizes its OpenMP pool from it).
_CHILD_ENV = {"OMP_NUM_THREADS": "1"}
# Imported once by the fork server, through ``boundpass.testing.fork_server_preload`` (the one module multiprocessing
# is asked to preload; it calls ``preload``, which skips a module that fails to import instead of letting the error
# kill the server and every launch). Besides the import-time modules: the third-party packages a torchtitan trainer
# rank imports lazily on its first build (in a rank of test_block_compile's per-block run: 1,286 new modules, pandas,
# datasets, tensorboard, huggingface_hub, pyarrow among them). Not torchtitan's own trainer modules: they bind
# torchtitan's device type ("cuda" on a machine without one) at import, before recipes/cpu_support.py's shims run in
# the rank. Importing pyarrow (through datasets) starts jemalloc's background thread in the server; jemalloc's own
# fork handlers make forking it safe. Not "__main__": Python 3.11's fork server never receives the main script's
# path (it asks spawn's preparation data for a 'main_path' key that spawn names 'init_main_from_path'), so a
# script's own functions are resolved in each child instead (``_main_of``), as spawn did.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.utils.tensorboard",
    "pytest",  # test modules hold the ranks' functions
    "datasets",
    "tokenizers",
    "boundpass.backend.compiler",
    "boundpass.backend.block_compile",
    "boundpass.testing.whole_step",
    "boundpass.recipes.train",
    "boundpass.recipes.mop",
]
_START_METHOD = "forkserver"


def preload(names) -> dict:
    """Import each of ``names`` (in the fork server); returns the ones that failed with their exception. A missing
    module is skipped silently (a CPU-only bench on a machine without torchtitan); one that raises anything else is
    skipped with a line on stderr (multiprocessing's own preload catches only ImportError). Either way the server
    keeps running, and a rank that needs the module imports it itself, where its error surfaces as that rank's
    traceback."""
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            failed[name] = e
        except Exception as e:  # noqa: BLE001 - an import-time error must not take the fork server down
            failed[name] = e
            sys.stderr.write(f"[run_on_ranks] the fork server could not preload {name} ({e!r}); "
                             f"ranks that need it import it themselves\n")
    return failed


class RankError(RuntimeError):
    """A rank raised (or died). ``str()`` contains the full traceback text of every failed rank."""

    def __init__(self, message: str, rank: int, tracebacks: dict[int, str]):
        super().__init__(message)
        self.rank = rank
        self.tracebacks = tracebacks


def _set_pdeathsig() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:  # best effort only
        pass


def _main_of(fn) -> dict:
    """How a child imports the launcher's ``__main__`` (a script, or ``python -m`` module) when ``fn`` lives there:
    spawn's own preparation data, the entries that name the main module; empty when ``fn`` lives elsewhere."""
    if getattr(fn, "__module__", None) != "__main__":
        return {}
    from multiprocessing import spawn
    data = spawn.get_preparation_data("run_on_ranks")
    return {k: v for k, v in data.items() if k in ("init_main_from_name", "init_main_from_path")}


def _child_main(rank, world_size, payload, init_method, backend, pg_timeout_s, sys_path, env, conn, parent_pid,
                main=None):
    # Runs in the forked child. Order matters: process group + env + sys.path before torch/fn imports.
    try:
        os.setpgid(0, 0)  # own process group, so the parent can kill grandchildren too
    except OSError:
        pass
    _set_pdeathsig()
    try:  # parent already gone (our parent process is the fork server, so ask about the launcher itself)
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        os._exit(1)
    except PermissionError:
        pass
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = list(sys_path)
    code = 1
    try:
        import torch
        import torch.distributed as dist
        from datetime import timedelta

        torch.set_num_threads(1)
        if main:  # the script's top-level code runs as __mp_main__ (its main guard keeps it from running again)
            from multiprocessing import spawn
            spawn.prepare(main)
        fn, args, kwargs = pickle.loads(payload)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args, **kwargs)
        try:
            data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(f"rank {rank}: the return value of {fn!r} is not picklable: {e!r}") from e
        conn.send(("ok", rank, data))
        # Keep the process group (and its sockets) up until every rank has reported: a rank that finished
        # early must not make a peer that is still inside a collective fail with "connection closed" --
        # that peer is the one that hangs, and the parent's TimeoutError should name it.
        try:
            conn.recv()
        except (EOFError, OSError):
            pass
        code = 0
        dist.destroy_process_group()
    except BaseException:
        if code != 0:
            tb = traceback.format_exc()
            try:
                conn.send(("err", rank, tb))
            except Exception:
                sys.stderr.write(f"[run_on_ranks] rank {rank} failed and could not report:\n{tb}")
            else:
                # Stay alive (sockets open) until the parent, which now has the root cause, kills every
                # rank: exiting here would make peers blocked in a collective fail with "connection
                # closed" errors that could race this report.
                try:
                    conn.recv()
                except BaseException:
                    pass
    try:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        # Skip interpreter teardown (gloo threads, atexit hooks): the parent already has what it needs.
        os._exit(code)


def _kill_all(procs) -> None:
    """SIGKILL every child and its process group, then reap. Safe to call repeatedly."""
    for p in procs:
        if p.pid is None:
            continue
        # A child that already called setpgid(0, 0) leads a group whose id is its pid. One that has not
        # yet: no group with that id exists -> ESRCH. The pid cannot be reused before join() reaps it.
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass
        try:
            if p.is_alive():
                p.kill()
        except Exception:
            pass
    for p in procs:
        if p.pid is not None:
            p.join(5)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60,
    backend: str = "gloo",
    **kwargs: Any,
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned processes, each with an
    initialised default process group of ``backend``. Returns the return values in rank order.

    Raises ``TimeoutError`` (naming the unfinished ranks) if they are not all done after ``timeout_s``,
    ``RankError`` (a ``RuntimeError`` containing the traceback text) if any rank raises or dies.
    All children are gone when this returns or raises.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    try:
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(
            f"run_on_ranks: {getattr(fn, '__qualname__', fn)!r} and its arguments must be picklable "
            f"(define fn at module top level, not as a lambda/closure): {e!r}"
        ) from e

    main = _main_of(fn)
    ctx = multiprocessing.get_context(_START_METHOD)
    ctx.set_forkserver_preload(["boundpass.testing.fork_server_preload"])  # from when this process's server starts
    tmpdir = tempfile.mkdtemp(prefix="boundpass_ranks_")
    init_method = "file://" + os.path.join(tmpdir, "store")
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    procs: list = []
    conns: dict = {}  # parent end of each child's pipe -> rank (until its report is read)
    held: list = []  # parent ends of ranks that reported; they wait for a message (or a kill) from us
    # gloo's own timeout is set past ours so that a hang surfaces as our TimeoutError, not a gloo error.
    pg_timeout_s = float(timeout_s) + 60.0
    results: dict[int, bytes] = {}
    errors: dict[int, str] = {}
    try:
        with _ENV_LOCK:
            saved = {k: os.environ.get(k) for k in _CHILD_ENV}
            os.environ.update(_CHILD_ENV)
            try:
                for rank in range(world_size):
                    # the launcher's environment as it is now (os.environ holds _CHILD_ENV here): a fork of the
                    # server would otherwise see the environment the server started with
                    env = dict(os.environ)
                    env.update(
                        RANK=str(rank),
                        WORLD_SIZE=str(world_size),
                        LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(world_size),
                    )
                    r, w = ctx.Pipe(duplex=True)
                    p = ctx.Process(
                        target=_child_main,
                        args=(rank, world_size, payload, init_method, backend, pg_timeout_s,
                              list(sys.path), env, w, os.getpid(), main),
                        name=f"run_on_ranks-rank{rank}",
                        daemon=False,  # daemonic processes may not have children (DataLoader workers etc.)
                    )
                    p.start()
                    w.close()  # only the child holds its end -> EOF here when it dies
                    procs.append(p)
                    conns[r] = rank
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v

        sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
        dead_without_report: list[int] = []  # ranks whose pipe closed with no report

        def _drain(conn) -> None:
            rank = conns.pop(conn)
            try:
                kind, _, data = conn.recv()
            except (EOFError, OSError):
                dead_without_report.append(rank)
                conn.close()
                return
            if kind == "ok":
                results[rank] = data
            else:
                errors[rank] = data
            held.append(conn)

        while len(results) < world_size and not errors:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = multiprocessing.connection.wait(list(conns) + list(sentinels), timeout=remaining)
            for obj in ready:
                if obj in conns:
                    _drain(obj)
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels.pop(obj)
                    # Any final message is already in the pipe (sent before exit): read it first.
                    for c, rk in list(conns.items()):
                        if rk == rank:
                            if c.poll(0):
                                _drain(c)
                            else:
                                conns.pop(c)
                                c.close()
                                dead_without_report.append(rank)
            if dead_without_report and not errors:
                for rank in dead_without_report:
                    procs[rank].join(1)
                    code = procs[rank].exitcode
                    errors[rank] = (
                        f"rank {rank} exited with code {code} without returning a result "
                        f"(negative: killed by that signal, e.g. -6 = C++ abort; see its stderr. A child that "
                        f"fails before running fn usually means the spawn bootstrap failed: a script that "
                        f"calls run_on_ranks must guard its top-level code with "
                        f"`if __name__ == '__main__':`)\n"
                    )
                break

        if errors:
            # Others are likely blocked in a collective with the failed rank: kill them now, then pick up
            # any error reports that were already on their way (listed after the first one).
            _kill_all(procs)
            for c in list(conns):
                try:
                    if c.poll(0):
                        kind, rk, data = c.recv()
                        if kind == "err":
                            errors.setdefault(rk, data)
                except (EOFError, OSError):
                    pass
            first = next(iter(errors))
            text = "\n".join(f"---- rank {rk} ----\n{tb}" for rk, tb in errors.items())
            raise RankError(
                f"run_on_ranks({getattr(fn, '__qualname__', fn)}, world_size={world_size}): "
                f"rank {first} failed:\n{text}",
                rank=first,
                tracebacks=dict(errors),
            )

        if len(results) < world_size:
            _kill_all(procs)
            missing = [r for r in range(world_size) if r not in results]
            raise TimeoutError(
                f"run_on_ranks({getattr(fn, '__qualname__', fn)}, world_size={world_size}): "
                f"ranks {missing} did not finish within timeout_s={timeout_s} "
                f"(finished: {sorted(results)}); all {world_size} processes were killed"
            )

        # Every rank reported: release them (they destroy their group and exit), then make sure they are gone.
        for c in held:
            try:
                c.send("exit")
            except (OSError, ValueError):
                pass
        grace = max(0.0, min(5.0, deadline - time.monotonic()))
        multiprocessing.connection.wait([p.sentinel for p in procs], timeout=grace)
        _kill_all(procs)
        return [pickle.loads(results[r]) for r in range(world_size)]
    finally:
        _kill_all(procs)
        for c in list(conns) + held:
            try:
                c.close()
            except Exception:
                pass
        shutil.rmtree(tmpdir, ignore_errors=True)
