"""Honest memory measurement on CPU: a live-storage peak tracker (real or fake tensors) and subprocess RSS.

Why it is built this way (custom ops' inner allocations, the fake wait_tensor trap, RSS in a fresh process):
docs/design.md §4.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from boundpass.core.errors import BoundpassError

__all__ = ["LiveStorageTracker", "measure_peak", "rss_peak_in_subprocess", "rss_run_in_subprocess", "MeasurementError"]


class MeasurementError(BoundpassError, RuntimeError):
    """A measurement subprocess failed or timed out; the message carries its stderr."""


# The real wait_tensor returns its input (same memory) but the FakeTensor impl returns a fresh storage and the
# schema has no alias annotation, so a naive tracker counts every collective output twice.
_WAIT_OPS = {torch.ops._c10d_functional.wait_tensor.default}
# Frees (or grows) its argument's storage in place and returns nothing: FSDP2 and runtime/seq_to_head free buffers
# with it, so the tracker re-reads that storage's size after it.
_RESIZE_OPS = {torch.ops.inductor.resize_storage_bytes_.default}
if hasattr(torch.ops, "c10d_functional") and hasattr(torch.ops.c10d_functional, "wait_tensor"):
    _WAIT_OPS.add(torch.ops.c10d_functional.wait_tensor.default)


def _leaf_tensors(tree: Any) -> list[torch.Tensor]:
    """Plain (or fake) tensors in a pytree, looking inside wrapper subclasses such as AsyncCollectiveTensor/DTensor."""
    out: list[torch.Tensor] = []
    stack = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    while stack:
        t = stack.pop()
        if is_traceable_wrapper_subclass(t):
            # A wrapper's own storage is a placeholder; the memory lives in its inner tensors.
            attrs, _ = t.__tensor_flatten__()
            # (DTensor in torch 2.13 also lists its DeviceMesh among the attributes: keep tensors only)
            stack.extend(x for a in attrs if isinstance(x := getattr(t, a), torch.Tensor))
        else:
            out.append(t)
    return out


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's untyped storage, or None for layouts without one (sparse, nested)."""
    if t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _nbytes(st: torch.UntypedStorage) -> int:
    """Storage size in bytes; under symbolic shapes use the size hint so measuring adds no guards."""
    n = st.nbytes()
    if isinstance(n, torch.SymInt):
        hint = getattr(n.node, "hint", None)
        return int(hint) if hint is not None else int(n)
    return int(n)


def _ptr(st: torch.UntypedStorage) -> int:
    """Real data pointer of a storage, 0 for fake/meta storages (their pointers are all 0 and warn)."""
    return 0 if st.device.type == "meta" else st.data_ptr()


class _Alloc:
    """One allocation: bytes on a device, alive while any of the storages mapped to it is alive."""
    __slots__ = ("nbytes", "device", "keys", "ptr")

    def __init__(self, nbytes: int, device: str, ptr: int):
        self.nbytes, self.device, self.keys, self.ptr = nbytes, device, set(), ptr


class LiveStorageTracker(TorchDispatchMode):
    """Peak/live bytes of storages created by ops under this mode (real or FakeTensorMode tensors), per device type.

    Works in either nesting order with FakeTensorMode (an infra mode, always dispatched below this one).
    Storages are keyed by StorageImpl identity (``UntypedStorage._cdata``; fake data pointers are all 0);
    a ``weakref.finalize`` on the storage subtracts them when the last tensor using them dies. Allocations
    made inside a boundpass custom op are counted (its Python implementation runs under the mode); other custom
    ops' kernels are invisible (the mode is popped there): only their outputs count. Under torch.compile the mode
    is off while compiling and on while the compiled artifacts run (``ignore_compile_internals``).
    """

    # Higher-order operators reach __torch_dispatch__ (torch refuses them under a mode that does not say it takes
    # them). Only the ones that wrap a single op are taken: AOTAutograd's RNG functionalization of a compiled
    # activation-checkpointed block (run_and_save_rng_state / run_with_rng_state run one random op and save or restore
    # the generator state); their outputs are counted like any op's. A HOP with a body of many ops (its intermediates
    # would go unseen) is refused by name.
    supports_higher_order_operators = True
    _SINGLE_OP_HOPS = frozenset({"run_and_save_rng_state", "run_with_rng_state"})

    def __init__(self, record: bool = False) -> None:
        """record=True: append the all-device live bytes to ``self.samples`` after every op that allocates (or
        grows a storage), and once per ``track_existing`` call: the measured memory timeline of what ran."""
        super().__init__()
        self.record = record
        self.samples: list[int] = []
        self._by_key: dict[int, _Alloc] = {}  # StorageImpl address -> allocation
        self._by_ptr: dict[int, _Alloc] = {}  # real data pointer -> allocation (catches new StorageImpls on old memory)
        self._live: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._live_total = 0
        self._peak_total = 0

    # ---- accounting -------------------------------------------------------------------------------------
    def _add(self, device: str, delta: int) -> None:
        self._live[device] = self._live.get(device, 0) + delta
        self._peak[device] = max(self._peak.get(device, 0), self._live[device])
        self._live_total += delta
        self._peak_total = max(self._peak_total, self._live_total)

    def _attach(self, st: torch.UntypedStorage, alloc: _Alloc) -> None:
        key = st._cdata
        alloc.keys.add(key)
        self._by_key[key] = alloc
        fin = weakref.finalize(st, self._on_free, key, alloc)
        fin.atexit = False  # nothing to account for at interpreter exit

    def _on_free(self, key: int, alloc: _Alloc) -> None:
        alloc.keys.discard(key)
        if self._by_key.get(key) is alloc:
            del self._by_key[key]
        if not alloc.keys:
            self._add(alloc.device, -alloc.nbytes)
            if alloc.ptr and self._by_ptr.get(alloc.ptr) is alloc:
                del self._by_ptr[alloc.ptr]

    def _new(self, st: torch.UntypedStorage, device: str) -> None:
        alloc = _Alloc(_nbytes(st), device, _ptr(st))
        self._attach(st, alloc)
        if alloc.ptr:
            self._by_ptr[alloc.ptr] = alloc
        self._add(device, alloc.nbytes)

    def _run(self, func, args, kwargs):
        """Run an op; a boundpass custom op runs its Python implementation under this mode, so its workspace
        (strips, chunks, receive buffers) is measured too, not only its outputs."""
        opdef = _opdef(func)
        if opdef is None or any(isinstance(t, torch._subclasses.FakeTensor) for t in _leaf_tensors((args, kwargs))):
            return func(*args, **kwargs)
        with self:
            return opdef._init_fn(*args, **kwargs)

    def _resized(self, st: torch.UntypedStorage, alloc: _Alloc) -> None:
        # resize_ and out= can grow a storage in place; keep its bytes current.
        n = _nbytes(st)
        if n != alloc.nbytes:
            self._add(alloc.device, n - alloc.nbytes)
            alloc.nbytes = n
            if alloc.ptr and self._by_ptr.get(alloc.ptr) is alloc:
                del self._by_ptr[alloc.ptr]
            alloc.ptr = _ptr(st)
            if alloc.ptr:
                self._by_ptr[alloc.ptr] = alloc

    # ---- public API -------------------------------------------------------------------------------------
    def track_existing(self, *tensors: Any) -> "LiveStorageTracker":
        """Count already-allocated tensors (e.g. op inputs, weights) as live bytes until they are freed."""
        for t in _leaf_tensors(tensors):
            st = _storage(t)
            if st is None:
                continue
            alloc = self._by_key.get(st._cdata) or (self._by_ptr.get(_ptr(st)) if _ptr(st) else None)
            if alloc is None:
                self._new(st, t.device.type)
            elif st._cdata not in alloc.keys:
                self._attach(st, alloc)
        if self.record:
            self.samples.append(self._live_total)
        return self

    def live_bytes(self, device: str | None = None) -> int:
        """Bytes currently live on `device` ("cpu", "cuda", ...; indices ignored), or on all devices if None."""
        return self._live_total if device is None else self._live.get(torch.device(device).type, 0)

    def peak_bytes(self, device: str | None = None) -> int:
        """High-water mark of live bytes on `device`, or of the all-device sum if None, since the last reset."""
        return self._peak_total if device is None else self._peak.get(torch.device(device).type, 0)

    def reset_peak(self) -> None:
        """Set every peak (bytes) to the current live bytes."""
        self._peak = dict(self._live)
        self._peak_total = self._live_total

    # ---- dispatch -------------------------------------------------------------------------------------
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Off while torch.compile traces and compiles, on while the compiled artifacts run: a compiled step is
        # measured by the ops it executes (aot_eager: every aten op; Inductor kernels allocate outside it).
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator) and func.name() not in self._SINGLE_OP_HOPS:
            raise NotImplementedError(f"LiveStorageTracker does not measure the higher-order operator {func.name()!r}: "
                                      "the ops inside its body would not be seen")
        out = self._run(func, args, kwargs)
        if func in _RESIZE_OPS and (st := _storage(args[0])) is not None \
                and (alloc := self._by_key.get(st._cdata)) is not None:
            self._resized(st, alloc)
        inputs = [(t, st) for t in _leaf_tensors((args, kwargs)) if (st := _storage(t)) is not None]
        in_keys = {st._cdata for _, st in inputs}
        in_ptrs = {p for _, st in inputs if (p := _ptr(st))}
        before = self._live_total
        for t in _leaf_tensors(out):
            st = _storage(t)
            if st is None:
                continue
            key = st._cdata
            alloc = self._by_key.get(key)
            if alloc is not None:  # in-place op, view or repeated output of something we track
                self._resized(st, alloc)
                continue
            if key in in_keys:  # alias of an untracked input (view/detach/in-place): not new memory
                continue
            ptr = _ptr(st)
            if ptr and ptr in in_ptrs:
                continue
            if ptr and ptr in self._by_ptr:  # a new StorageImpl over memory we already count
                self._attach(st, self._by_ptr[ptr])
                continue
            if func in _WAIT_OPS:
                # Transfer, not add: the output is the input's memory. Untracked input -> untracked output.
                src = self._by_key.get(next(iter(in_keys), -1))
                if src is not None:
                    self._attach(st, src)
                continue
            self._new(st, t.device.type)
        if self.record and self._live_total > before:
            self.samples.append(self._live_total)
        return out


def _opdef(func):
    """The CustomOpDef of a boundpass custom op (its Python implementation), else None."""
    if getattr(func, "namespace", None) != "boundpass":
        return None
    from torch._library.custom_ops import _maybe_get_opdef
    return _maybe_get_opdef(func)


def measure_peak(fn: Callable[..., Any], *args: Any, track: tuple = (), **kwargs: Any) -> tuple[Any, int]:
    """Run fn(*args, **kwargs) under a LiveStorageTracker; return (result, peak bytes over all devices).

    Tensors in `track` (e.g. the op's inputs) are counted as live from the start.
    """
    with LiveStorageTracker() as tracker:
        tracker.track_existing(*track)
        result = fn(*args, **kwargs)
    return result, tracker.peak_bytes()


# The child runs the snippet's setup(), lets the allocator settle, records VmRSS, resets the RSS high-water mark
# (clear_refs "5" sets VmHWM := VmRSS), runs measured(state) and reports VmHWM - baseline on a marked line.
_CHILD = r"""
import gc, json, sys
def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field + " not in /proc/self/status")
_ns = {"__name__": "__main__"}  # torch.compile looks up the module of traced frames by this name
exec(compile(sys.stdin.read(), "<rss snippet>", "exec"), _ns)
if "measured" not in _ns:
    raise SystemExit("rss_peak_in_subprocess: the snippet must define measured(state)")
_state = _ns["setup"]() if "setup" in _ns else None
gc.collect()
_base = _status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
_ns["measured"](_state)
_hwm = _status_kib("VmHWM")
print("__MEMTRACK_RSS__ " + json.dumps({"base_kib": _base, "hwm_kib": _hwm}), flush=True)
"""


def rss_peak_in_subprocess(code: str, *, env: dict[str, str] | None = None, timeout: float = 300.0) -> int:
    """Peak RSS growth in bytes of `measured(state)` defined by `code`, run in a fresh interpreter (Linux only).

    `code` must define ``measured(state)`` and may define ``setup() -> state`` (imports, inputs: excluded
    from the figure). Returns VmHWM during measured minus VmRSS just before it, never below 0.
    """
    return rss_run_in_subprocess(code, env=env, timeout=timeout)[0]


def rss_run_in_subprocess(code: str, *, env: dict[str, str] | None = None,
                          timeout: float = 300.0) -> tuple[int, str]:
    """(``rss_peak_in_subprocess``'s figure, everything else the child printed to stdout): what ``setup`` reports
    about the state it built (a certified peak, say) comes back from the same run instead of a second one."""
    child_env = dict(os.environ)
    # Without this glibc raises its mmap threshold after the first large free and RSS stops dropping on free.
    child_env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    child_env.update(env or {})
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD], input=code, env=child_env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise MeasurementError(f"RSS measurement subprocess timed out after {timeout} s; stderr:\n{err}") from None
    if proc.returncode != 0:
        raise MeasurementError(f"RSS measurement subprocess exited with {proc.returncode}; stderr:\n{proc.stderr}")
    lines = proc.stdout.splitlines()
    for i in reversed(range(len(lines))):
        if lines[i].startswith("__MEMTRACK_RSS__ "):
            rec = json.loads(lines[i].split(" ", 1)[1])
            rest = "\n".join(lines[:i] + lines[i + 1:])
            return max(0, rec["hwm_kib"] - rec["base_kib"]) * 1024, rest
    raise MeasurementError(f"RSS measurement subprocess printed no result; stdout:\n{proc.stdout}\n"
                           f"stderr:\n{proc.stderr}")
