"""SCO: selective checkpoint offload of activation-checkpoint boundaries to host memory under a host budget in bytes.

A checkpointed block (torchtitan's ``CheckpointWrapper``, ``torch.utils.checkpoint(use_reentrant=False)``) keeps
one long-lived tensor per layer: its input, saved for the recomputation in backward. In torch ≥ 2.13 the
non-reentrant checkpoint saves its inputs with ``_CheckpointFrame.save_inputs`` *before* entering its own
``saved_tensors_hooks``, so an outer ``saved_tensors_hooks`` scoped to the block's call sees exactly those
saved inputs (everything saved inside the block goes to the checkpoint's own, innermost, hooks). SCO installs
such hooks around each block:

    pack    (block entry, forward)   the block's first positional tensor is its boundary: if it fits the host
            budget (layers walked in forward order, stopping at the first that does not fit, so the offloaded
            layers are a prefix) copy it into a pooled host buffer and return a handle; the device tensor is
            then held by nobody but the caller and dies when the next layer's output replaces it
    unpack  (recomputation of layer l, backward)   return layer l's boundary (waiting for its prefetch) and
            start the prefetch of layer l-1's boundary, so ≤ 2 restored boundaries are live at once

Prefetch runs on a side CUDA stream ordered by events on CUDA, and on a one-thread worker on CPU (there the
"device" and the host are the same memory: the schedule and the bytes are real, the saving is not). Host
buffers form a per-layer pool reused across steps: pool bytes never exceed the host budget. Gradients are
bit-identical to no offload: the recomputation reads a bitwise copy of the same input. See docs/sco.md.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError

__all__ = ["apply_sco", "SCOHandle", "SCOEvent", "planned_offloaded_layers", "sco_device_bound", "sco_host_bound",
           "bound_values"]

# aten copy_: Tensor.copy_'s Python binding opens a device guard that fake "cuda" tensors cannot (CPU build).
_copy = torch.ops.aten.copy_.default


@dataclass(frozen=True)
class SCOEvent:
    """One step of the schedule; the two totals are sampled right after it (measured from live storages)."""
    kind: str                   # keep | offload | prefetch | restore | free
    layer: int                  # block index in forward order
    nbytes: int                 # bytes of this boundary
    device_boundary_bytes: int  # bytes of boundary storages alive on the device after the event
    restored_live: int          # restored (prefetched or restored) boundaries alive after the event


def planned_offloaded_layers(boundary_bytes: list[int], host_budget: int) -> int:
    """Boundaries offloaded by the greedy forward-order walk: the longest prefix whose bytes fit ``host_budget``."""
    used = 0
    for count, nbytes in enumerate(boundary_bytes):
        if used + nbytes > host_budget:
            return count
        used += nbytes
    return len(boundary_bytes)


class _Resident:
    """A boundary kept on the device; its unpack marks the start of its layer's recomputation."""
    __slots__ = ("owner", "layer", "tensor")

    def __init__(self, owner: "SCOHandle", layer: int, tensor: Tensor):
        self.owner, self.layer, self.tensor = owner, layer, tensor

    def unpack(self) -> Tensor:
        self.owner._prefetch(self.layer - 1)
        return self.tensor


class _Offloaded:
    """A boundary whose bytes live in host buffer ``layer`` of the pool; restored on unpack."""
    __slots__ = ("owner", "layer", "like", "nbytes", "pending", "__weakref__")

    def __init__(self, owner: "SCOHandle", layer: int, like: Tensor):
        self.owner, self.layer, self.nbytes = owner, layer, _nbytes(like)
        self.like = (like.shape, like.stride(), like.dtype, like.device)
        self.pending = None  # (device tensor, completion) of a started prefetch

    def unpack(self) -> Tensor:
        restored = self.owner._restore(self)
        self.owner._prefetch(self.layer - 1)
        return restored


class SCOHandle:
    """SCO installed on blocks: this step's plan, the host pool (bytes ≤ host_budget), the event log; remove()."""

    def __init__(self, blocks: list[nn.Module], host_budget: int, device: torch.device):
        self.blocks = list(blocks)
        self.host_budget = int(host_budget)
        self.device = device
        self.events: list[SCOEvent] = []
        self.offloaded: list[bool] = [False] * len(self.blocks)  # this step's decision per layer
        self._pool: dict[int, Tensor] = {}       # layer -> host byte buffer, reused across steps
        self._pool_user: dict[int, weakref.ref] = {}  # layer -> the _Offloaded whose bytes are in the buffer
        self._live: dict[int, tuple[int, int, bool]] = {}  # save id -> (layer, bytes, restored)
        self._keys = itertools.count()
        self._lock = threading.RLock()          # finalizers may fire on other threads, or inside _log on this one
        self._entering: list[tuple[int, Tensor | None]] = []
        self._contexts: list[saved_tensors_hooks] = []
        self._closed_prefix = False              # a boundary did not fit: later layers stay on the device
        on_cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if on_cuda else None
        self._worker = None if on_cuda else ThreadPoolExecutor(max_workers=1, thread_name_prefix="sco-prefetch")
        self._hooks = []
        for layer, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._make_enter(layer)))
            self._hooks.append(block.register_forward_hook(self._exit, always_call=True))

    # ---- public ---------------------------------------------------------------------------------------
    @property
    def host_pool_bytes(self) -> int:
        """Bytes of host buffers currently held by the pool (≤ host_budget at all times)."""
        return sum(buf.numel() for buf in self._pool.values())

    def offloaded_bytes(self) -> int:
        """Bytes copied to the host by ``offload`` events since the log was last cleared."""
        return sum(e.nbytes for e in self.events if e.kind == "offload")

    def peak_device_boundary_bytes(self) -> int:
        """Largest device_boundary_bytes in the event log (bytes)."""
        return max((e.device_boundary_bytes for e in self.events), default=0)

    def peak_restored_live(self) -> int:
        """Most restored boundaries alive at once in the event log."""
        return max((e.restored_live for e in self.events), default=0)

    def remove(self) -> None:
        """Uninstall the hooks, stop the prefetch worker and release the host pool."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self._pool.clear()
        self._pool_user.clear()

    # ---- forward: scope the hooks to each block's call -----------------------------------------------
    def _make_enter(self, layer: int):
        def enter(module, args):
            if layer == 0:
                self._closed_prefix = False  # a new forward walks the layers again
            boundary = next((a for a in args if isinstance(a, Tensor)), None)
            self._entering.append((layer, boundary))
            ctx = saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            self._contexts.append(ctx)
        return enter

    def _exit(self, module, args, output) -> None:
        self._contexts.pop().__exit__(None, None, None)
        self._entering.pop()

    def _pack(self, t: Tensor):
        layer, boundary = self._entering[-1] if self._entering else (-1, None)
        if boundary is None or not _same_tensor(t, boundary):
            return t  # another input of the checkpoint (positions, masks): saved as usual
        self._entering[-1] = (layer, None)  # one boundary per call, even if the tensor is passed twice
        nbytes = _nbytes(t)
        offload = not self._closed_prefix and t.device == self.device and self._reserve(layer, nbytes)
        self._closed_prefix = self._closed_prefix or not offload
        self.offloaded[layer] = offload
        self._track(t, layer, restored=False)
        if not offload:
            self._log("keep", layer, nbytes)
            return _Resident(self, layer, t)
        handle = _Offloaded(self, layer, t)
        self._pool_user[layer] = weakref.ref(handle)
        self._copy_out(handle, t)
        self._log("offload", layer, nbytes)
        return handle

    def _copy_out(self, handle: "_Offloaded", t: Tensor) -> None:
        """Copy boundary ``t`` into its layer's host buffer (on the side stream on CUDA)."""
        host = self._host_view(handle)
        if self._stream is None:
            _copy(host, t)
        else:  # the D2H copy waits for t's producer; record_stream keeps t's memory until the copy ends
            self._stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self._stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self._stream)

    def _unpack(self, packed):
        return packed.unpack() if isinstance(packed, (_Resident, _Offloaded)) else packed

    def _reserve(self, layer: int, nbytes: int) -> bool:
        """Give ``layer`` a free host buffer of ≥ nbytes if the pool stays within the host budget."""
        user = self._pool_user.get(layer)
        if user is not None and user() is not None:
            raise BoundpassInputError(
                f"SCO: layer {layer}'s boundary from an earlier forward is still waiting for its backward; "
                f"run backward (or drop that graph) before the next forward")
        buf = self._pool.get(layer)
        if buf is not None and buf.numel() >= nbytes:
            return True
        held = buf.numel() if buf is not None else 0
        if self.host_pool_bytes - held + nbytes > self.host_budget:
            return False
        self._pool[layer] = torch.empty(nbytes, dtype=torch.uint8, device="cpu",
                                        pin_memory=self.device.type == "cuda")
        return True

    # ---- backward: restore layer l, prefetch layer l-1 -----------------------------------------------
    def _host_view(self, handle: _Offloaded) -> Tensor:
        shape, _, dtype, _ = handle.like
        return self._pool[handle.layer][:handle.nbytes].view(dtype).view(shape)

    def _start_copy(self, handle: _Offloaded) -> None:
        """Allocate the device tensor now (so the ledger sees it) and copy the host bytes into it asynchronously."""
        shape, stride, dtype, device = handle.like
        dst = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        src = self._host_view(handle)
        if self._stream is None and isinstance(dst, FakeTensor):
            # simulated ranks: there is no data to copy, and fake tensors must not be touched from the worker
            # while the main thread is inside a fake kernel; the restored tensor is allocated (and tracked) now
            done = Future()
            done.set_result(None)
        elif self._stream is None:
            done = self._worker.submit(_copy, dst, src)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            dst.record_stream(self._stream)
        handle.pending = (dst, done)
        self._track(dst, handle.layer, restored=True)

    def _prefetch(self, layer: int) -> None:
        if layer < 0 or not self.offloaded[layer]:
            return
        handle = self._pool_user[layer]()
        if handle is None or handle.pending is not None:
            return  # already prefetched, or its graph is gone
        self._start_copy(handle)
        self._log("prefetch", layer, _nbytes(handle.pending[0]))

    def _restore(self, handle: _Offloaded) -> Tensor:
        if handle.pending is None:  # the last offloaded layer (or a second backward): nothing prefetched it
            self._start_copy(handle)
        dst, done = handle.pending
        handle.pending = None  # the caller's references decide when the restored copy dies
        if self._stream is None:
            done.result()
        else:
            torch.cuda.current_stream(dst.device).wait_event(done)
        self._log("restore", handle.layer, _nbytes(dst))
        return dst

    # ---- ledger: bytes of boundary storages alive on the device ---------------------------------------
    def _track(self, t: Tensor, layer: int, *, restored: bool) -> None:
        storage = t.untyped_storage()
        with self._lock:
            key = next(self._keys)  # per save, not per storage: a caller may pass the same tensor every step
            self._live[key] = (layer, storage.nbytes(), restored)
        weakref.finalize(storage, self._on_free, key).atexit = False

    def _on_free(self, key: int) -> None:
        with self._lock:
            layer, nbytes, _ = self._live.pop(key)
        self._log("free", layer, nbytes)

    def _log(self, kind: str, layer: int, nbytes: int) -> None:
        with self._lock:
            entries = list(self._live.values())
            live = sum(n for _, n, _ in entries)
            restored = sum(r for _, _, r in entries)
            self.events.append(SCOEvent(kind, layer, nbytes, live, restored))


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """True when ``a`` is ``b`` or an alias with the same storage and geometry (pack may get a new wrapper)."""
    return a is b or (a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.shape == b.shape
                      and a.stride() == b.stride() and a.storage_offset() == b.storage_offset())


def _nbytes(t: Tensor) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def apply_sco(blocks, host_budget: int, *, device: torch.device | str | None = None) -> SCOHandle:
    """Offload the checkpoint boundaries of ``blocks`` (forward order) to host buffers of ≤ host_budget bytes.

    ``device``: the device whose memory SCO saves (default: the device of the first block's parameters);
    boundaries on other devices stay where they are. Returns the handle; ``handle.remove()`` uninstalls.
    """
    blocks = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
        raise BoundpassInputError("SCO needs a non-empty list of modules (the checkpointed blocks in forward order)")
    if isinstance(host_budget, bool) or not isinstance(host_budget, int) or host_budget < 0:
        raise BoundpassInputError(f"SCO host_budget is a number of bytes ≥ 0, got {host_budget!r}")
    if device is None:
        first = next(blocks[0].parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    return SCOHandle(blocks, host_budget, torch.device(device))


# ----------------------------------------------------------------------------------------------- bounds
def sco_device_bound() -> sympy.Expr:
    """Peak device bytes of checkpoint boundaries: N·H·b · Max(L − L_off, 2·Min(L_off, 1)).

    Each boundary is N tokens × H × b bytes. The L − L_off resident boundaries and the two-boundary prefetch
    window (layer l restoring, l-1 prefetching) never coexist: the offloaded layers are a forward prefix, so
    backward frees every resident boundary but the last before the first prefetch, and that last one is
    itself part of the window. Their sum would overstate the peak by 2·N·H·b.
    """
    return sym.N * sym.H * sym.b * sympy.Max(sym.L - sym.L_off, 2 * sympy.Min(sym.L_off, 1))


def sco_host_bound() -> sympy.Expr:
    """Host bytes of the SCO pool: L_off·N·H·b (pinned on CUDA), ≤ the host budget by construction."""
    return sym.L_off * sym.N * sym.H * sym.b


def bound_values(*, N: int, H: int, b: int, L: int, host_budget: int) -> dict:
    """Concrete symbol values: tokens N, hidden H, bytes b, layers L; L_off from the greedy plan at host_budget."""
    return {sym.N: N, sym.H: H, sym.b: b, sym.L: L,
            sym.L_off: planned_offloaded_layers([N * H * b] * L, host_budget)}


# ------------------------------------------------------------------------------------- compiled graphs
# The compiler pass (boundpass/passes/sco_pass.py) rewrites the partitioned forward / backward graphs to
# call these ops; the schedule, pool and ledger are the same SCOHandle machinery as the eager hooks.
#
#   forward   token = sco_offload(x_l, sco_id, l, offload)   offload: copy x_l into layer l's host buffer and
#             save the 1-element token instead of x_l; keep (offload=False): x_l stays saved as usual and the
#             token only lets the ledger see x_l's storage (its lifetime is measured, not assumed)
#   backward  x_l = sco_reload(token, after, sco_id, l, shape, stride, dtype)   wait for layer l's prefetch
#             (or copy now), start layer l-1's prefetch; ``after`` = one sco_done marker per consumer of
#             layer l+1's boundary, so no legal schedule can run this reload before layer l+1's boundary is
#             dead: ≤ 2 restored boundaries (this one and the prefetched l-1) are ever live
#             d = sco_done(t)   an empty tensor that exists only once t (a consumer's output) exists

_COMPILED: "weakref.WeakValueDictionary[int, CompiledSCO]" = weakref.WeakValueDictionary()
_COMPILED_IDS = itertools.count()


class CompiledSCO(SCOHandle):
    """SCO for one compiled graph: the plan per layer (forward order), the host pool and the event log.

    Referenced from the graph by ``sco_id``; whoever owns the compiled module keeps it alive.
    """

    def __init__(self, plan: list[bool], host_budget: int, device: torch.device):
        super().__init__([], host_budget, torch.device(device))
        self.plan = list(plan)                  # True: offload this layer's boundary
        self.offloaded = list(plan)
        self._handles: dict[int, _Offloaded] = {}  # forward -> backward, one per offloaded layer
        # Inductor reuses a dead buffer's memory in-graph (``buf7 = buf0  # reuse``) without the caching
        # allocator, so record_stream cannot protect a boundary still being copied to the host: with this set,
        # the compute stream waits for the D2H copy (the host thread does not). The pass sets it for Inductor.
        self.offload_waits = False
        self.sco_id = next(_COMPILED_IDS)
        _COMPILED[self.sco_id] = self

    def offload(self, x: Tensor, layer: int, offload: bool) -> Tensor:
        nbytes = _nbytes(x)
        self._track(x, layer, restored=False)
        token = torch.full((1,), layer, dtype=torch.int64, device=x.device)
        if not offload:
            self._log("keep", layer, nbytes)
            return token
        if not self._reserve(layer, nbytes):
            raise BoundpassInputError(
                f"SCO: layer {layer}'s boundary ({nbytes} B) does not fit the host pool of {self.host_budget} B "
                f"it was planned for (did the shapes change without a recompile?)")
        handle = _Offloaded(self, layer, x)
        self._pool_user[layer] = weakref.ref(handle)
        self._handles[layer] = handle
        # a graph dropped without backward drops its tokens: release the handle so the next forward may reuse
        weakref.finalize(token.untyped_storage(), self._drop_handle, layer, weakref.ref(handle)).atexit = False
        self._copy_out(handle, x)
        if self._stream is not None and self.offload_waits:
            copied = torch.cuda.Event()
            copied.record(self._stream)
            torch.cuda.current_stream(x.device).wait_event(copied)
        self._log("offload", layer, nbytes)
        return token

    def _drop_handle(self, layer: int, ref) -> None:
        with self._lock:
            if ref() is not None and self._handles.get(layer) is ref():
                del self._handles[layer]

    def reload(self, layer: int, token: Tensor | None = None) -> Tensor:
        handle = self._handles.pop(layer, None)
        if handle is None:
            raise BoundpassInputError(f"SCO: no offloaded boundary waits for layer {layer}'s backward (a second "
                                      f"backward through the same graph needs retain_graph without SCO)")
        restored = self._restore(handle)
        self._prefetch(layer - 1)
        return restored


class BlockSCO(CompiledSCO):
    """SCO across the block graphs of a per-block compile (torchtitan's ``apply_compile``; boundpass/backend/block_compile.py).

    Each block graph's boundary is its own input (the previous block's output, which the caller drops once the block
    has run), and one graph serves every block of the same structure, so which block runs — and whether its boundary
    is offloaded — is known only at run time: the graph's ops carry layer = -1 and this runtime takes the block index
    from ``current_block()`` (the block whose forward is running) and the decision from ``plan`` (a forward-order
    prefix of ``offload_count`` blocks, set by the composition). A kept block's boundary is held here, on the device,
    until its backward reads it; an offloaded one is copied to its host buffer. The token a forward saves maps back to
    its block in backward. One runtime for all blocks is what makes the prefetch cross graphs: block l's reload starts
    block l-1's copy while block l's backward runs.
    """

    def __init__(self, num_blocks: int, host_budget: int, device: torch.device, current_block):
        super().__init__([False] * num_blocks, host_budget, device)
        self.current_block = current_block
        self._kept: dict[int, Tensor] = {}        # layer -> boundary held on the device for its backward
        self._token_layer: dict[int, int] = {}    # data_ptr of a saved token -> its layer

    @property
    def offload_count(self) -> int:
        return sum(self.plan)

    def set_offload_count(self, count: int) -> None:
        """Offload the boundaries of the first ``count`` blocks (forward order) from their next forward on."""
        self.plan = [layer < count for layer in range(len(self.plan))]

    def offload(self, x: Tensor, layer: int, offload: bool) -> Tensor:
        if layer < 0:
            layer = self.current_block()
            offload = self.plan[layer]
        self.offloaded[layer] = offload
        token = super().offload(x, layer, offload)
        if not offload:
            self._kept[layer] = x.detach()
        self._token_layer[token.untyped_storage().data_ptr()] = layer
        return token

    def reload(self, layer: int, token: Tensor | None = None) -> Tensor:
        if layer < 0:
            layer = self._token_layer.pop(token.untyped_storage().data_ptr(), None)
            if layer is None:
                raise BoundpassInputError("SCO: a block's backward reads a boundary no forward of this runtime saved "
                                          "(a second backward through the same graph needs retain_graph without SCO)")
        kept = self._kept.pop(layer, None)
        if kept is not None:
            self._prefetch(layer - 1)  # the previous block may be offloaded: its copy overlaps this backward
            return kept
        return super().reload(layer)


def _compiled(sco_id: int) -> CompiledSCO:
    runtime = _COMPILED.get(sco_id)
    if runtime is None:
        raise BoundpassInputError(f"SCO runtime {sco_id} is gone: the module boundpass compiled was freed")
    return runtime


@torch.library.custom_op("boundpass::sco_offload", mutates_args=())
def sco_offload(x: Tensor, sco_id: int, layer: int, offload: bool) -> Tensor:
    return _compiled(sco_id).offload(x, layer, offload)


@sco_offload.register_fake
def _(x, sco_id, layer, offload):
    return x.new_empty((1,), dtype=torch.int64)


@torch.library.custom_op("boundpass::sco_reload", mutates_args=())
def sco_reload(token: Tensor, after: list[Tensor], sco_id: int, layer: int, shape: list[int], stride: list[int],
               dtype: torch.dtype) -> Tensor:
    return _compiled(sco_id).reload(layer, token)


@sco_reload.register_fake
def _(token, after, sco_id, layer, shape, stride, dtype):
    return token.new_empty_strided(shape, stride, dtype=dtype)


@torch.library.custom_op("boundpass::sco_done", mutates_args=())
def sco_done(t: Tensor) -> Tensor:
    return t.new_empty((0,))


@sco_done.register_fake
def _(t):
    return t.new_empty((0,))


def sco_compiled_device_bound() -> sympy.Expr:
    """Peak device bytes of checkpoint boundaries in a graph SCO compiled: N·H·b · Max(L − L_off, Min(L_off, 2)).

    Tighter than the eager hooks' bound by the last resident boundary: each sco_reload is ordered after every
    reader of the next layer's boundary, so that boundary (resident or restored) is dead before the reload
    allocates, and the window is the restored boundary plus at most one prefetched (none when L_off = 1).
    """
    return sym.N * sym.H * sym.b * sympy.Max(sym.L - sym.L_off, sympy.Min(sym.L_off, 2))
