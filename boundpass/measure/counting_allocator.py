"""A measure at the allocator that sees every free, on every thread: c10's CPU allocator wrapped by one that counts.

The profiler's memory events (``boundpass.testing.whole_step.allocator_peak_of``) record a free only on a thread the
profiler follows; gloo's worker threads drop the last reference to a finished collective's buffers, so those frees
are missing and the profiler's measure keeps such a block live until its address is allocated again: an upper bound
of the peak, not the peak. This allocator counts the bytes of every block it handed out and that is not yet freed,
whatever thread frees it, and their peak: exact for every CPU tensor allocated after ``install()``.

It is C++ (c10's ``Allocator`` interface has no Python hook on CPU), compiled once per torch build into a cache
(``BOUNDPASS_CACHE_DIR``, default ``~/.cache/boundpass``) with the C++ compiler Inductor uses. ``install()`` must run
before the tensors to be counted exist (a block allocated before it is freed by c10's own deleter, unseen); it stays
installed for the life of the process.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shlex
import subprocess

import torch

from boundpass.measure.memtrack import MeasurementError

__all__ = ["install", "installed", "live_bytes", "peak_bytes", "reset_peak", "exclude", "block_bytes"]

_SOURCE = pathlib.Path(__file__).with_name("counting_allocator.cpp")
_lib: ctypes.CDLL | None = None


def _cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("BOUNDPASS_CACHE_DIR", pathlib.Path.home() / ".cache" / "boundpass"))


def _build() -> pathlib.Path:
    from torch.utils import cpp_extension
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + torch.__version__.encode() + torch.__file__.encode()).hexdigest()[:16]
    out = _cache_dir() / f"counting_allocator_{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # each process builds into a name of its own: ranks starting at once on a fresh cache each build, then each
    # renames a whole file into place (a shared temporary name let one rank's rename take another's file away)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    lib_dirs = cpp_extension.library_paths()
    # CXX as make reads it: a compiler with its own leading arguments ("ccache g++") is split like a shell word list
    cmd = [*shlex.split(os.environ.get("CXX", "c++")), "-O2", "-std=c++17", "-shared", "-fPIC", str(_SOURCE),
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *[f"-I{d}" for d in cpp_extension.include_paths()], *[f"-L{d}" for d in lib_dirs],
           *[f"-Wl,-rpath,{d}" for d in lib_dirs], "-lc10", "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise MeasurementError(f"boundpass: building the counting CPU allocator failed ({' '.join(cmd[:3])} ...):\n"
                               f"{done.stderr[-4000:]}")
    os.replace(tmp, out)  # atomic: a rank loading it sees a whole file
    return out


def install() -> None:
    """Put the counting allocator in front of c10's CPU allocator for the rest of the process (idempotent)."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(_build()))
        for name in ("bp_live", "bp_peak", "bp_exclude", "bp_size"):
            getattr(lib, name).restype = ctypes.c_int64
        lib.bp_exclude.argtypes = lib.bp_size.argtypes = [ctypes.c_void_p]
        _lib = lib
    code = _lib.bp_install()
    if code != 0:
        _lib = None
        raise MeasurementError("boundpass: c10's CPU allocator could not be wrapped "
                               + ("(it has no raw deleter)" if code == 1 else "(another allocator has priority)"))


def installed() -> bool:
    return _lib is not None


def _need() -> ctypes.CDLL:
    if _lib is None:
        raise MeasurementError("boundpass: the counting CPU allocator is not installed (counting_allocator.install())")
    return _lib


def live_bytes() -> int:
    """Bytes of the CPU blocks live now that the allocator handed out since install(), less those set aside."""
    return _need().bp_live()


def peak_bytes() -> int:
    """The highest ``live_bytes()`` reached since install() or the last ``reset_peak()``."""
    return _need().bp_peak()


def reset_peak() -> None:
    _need().bp_reset_peak()


def exclude(t: torch.Tensor) -> int:
    """Set aside the storage of ``t`` from the count until it is freed (a host buffer on a CPU-only run); its bytes,
    0 when it was already set aside or was allocated before install()."""
    return _need().bp_exclude(t.untyped_storage().data_ptr())


def block_bytes(t: torch.Tensor) -> int:
    """Bytes the allocator holds for the storage of ``t`` (0: allocated before install())."""
    return _need().bp_size(t.untyped_storage().data_ptr())
