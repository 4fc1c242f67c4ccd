"""Whole-sequence attention tensors kept on the host, written in row blocks and read back tile by tile, the next
tile's copy started before the current one is used (FPDT's double buffer).

A ``HostRows`` is a [B, A, L, D] tensor whose bytes live in a pooled host buffer: ``write(s, e, rows)`` copies rows
[s, e) out of the device; ``fetch((x, y, ...), ranges)`` yields, per range, device copies of those rows of every
store, the copy of range i + 1 started before range i is handed over, so at most two tiles of each store are on the
device at once. The kernels (runtime/chunked_attention.py) read a store where they read a whole tensor otherwise.

Pool: one flat buffer per role ("k", "v", "q", "dO", "dq"), kept across calls and steps and grown only when a call needs
more: a rank runs one attention op at a time, so the host holds the largest call's stores. Pinned on CUDA.
Prefetch: a side CUDA stream ordered by events on CUDA; on CPU a one-thread worker (there the "device" and the host
are the same memory: the schedule and the bytes are real, the saving is the device bound's, as SCO's). The device
tile is allocated on the calling thread, so every allocation is seen where torch's profiler looks; the worker only
copies into it.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

__all__ = ["HostRows", "fetch", "pool_tensors", "pool_bytes", "clear_pool"]

_POOL: dict[str, Tensor] = {}
_WORKER: ThreadPoolExecutor | None = None
_STREAMS: dict = {}


def _buffer(role: str, nbytes: int, device: torch.device) -> Tensor:
    held = _POOL.get(role)
    if held is None or held.numel() < nbytes:
        _POOL.pop(role, None)
        del held   # the old buffer goes before the larger one is made
        _POOL[role] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    return _POOL[role]


def pool_tensors() -> list[Tensor]:
    """The host buffers the pool holds now (host memory by design: a device measurement sets them aside)."""
    return list(_POOL.values())


def pool_bytes() -> int:
    return sum(t.numel() for t in _POOL.values())


def clear_pool() -> None:
    _POOL.clear()


class HostRows:
    """A [B, A, L, D] tensor of ``dtype`` on the host (role's pooled buffer); its tiles go to ``device``."""

    def __init__(self, role: str, shape, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device(device)
        nbytes = self.shape.numel() * dtype.itemsize
        self.host = _buffer(role, nbytes, self.device)[:nbytes].view(dtype).view(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def write(self, s: int, e: int, rows: Tensor) -> None:
        """Rows [s, e) (dim 2) from the device; returns once they are on the host."""
        self.host[:, :, s:e].copy_(rows)


def _worker() -> ThreadPoolExecutor:
    global _WORKER
    if _WORKER is None:
        _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attention-prefetch")
    return _WORKER


def _start(stores, s: int, e: int):
    """Allocate the tiles here, start their copies: (tiles, what to wait on)."""
    device = stores[0].device
    tiles = [torch.empty((*x.shape[:2], e - s, x.shape[3]), dtype=x.dtype, device=device) for x in stores]
    if device.type == "cuda":
        stream = _STREAMS.setdefault(device, torch.cuda.Stream(device))
        stream.wait_stream(torch.cuda.current_stream(device))   # the tiles' memory is free for the copy
        with torch.cuda.stream(stream):
            for t, x in zip(tiles, stores):
                t.copy_(x.host[:, :, s:e], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        for t in tiles:
            t.record_stream(torch.cuda.current_stream(device))
        return tiles, done

    def copy():
        for t, x in zip(tiles, stores):
            t.copy_(x.host[:, :, s:e])
    return tiles, _worker().submit(copy)


def _wait(pending) -> list[Tensor]:
    tiles, done = pending
    if isinstance(done, torch.cuda.Event):
        torch.cuda.current_stream(tiles[0].device).wait_event(done)
    else:
        done.result()
    return tiles


def fetch(stores, ranges):
    """Per (s, e) of ``ranges``: ((s, e), [rows [s, e) of each store on the device]); the next range's copy is
    started before this one is handed over (two tiles of each store live at most: this one and the next)."""
    ranges = list(ranges)
    pending = _start(stores, *ranges[0]) if ranges else None
    for i, (s, e) in enumerate(ranges):
        current = pending
        pending = _start(stores, *ranges[i + 1]) if i + 1 < len(ranges) else None
        tiles = _wait(current)
        del current
        yield (s, e), tiles
        del tiles
