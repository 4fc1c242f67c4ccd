"""Simulate one rank of a paper-scale job in this process, allocating nothing.

``simulated_rank(rank, world_size)`` initialises torch's *fake* process-group backend (no peers, no
communication; ``rank``/``world_size`` are whatever you say) and enters a ``FakeTensorMode``. Inside,
every tensor factory returns a ``FakeTensor``: shape/dtype/device/strides only, no storage. So a
``[200000, 7168]`` fp32 (5.3 GiB) "cuda" tensor costs nothing, on this CPU-only torch build too::

    from boundpass.measure.simulate import simulated_rank
    import torch, torch.distributed as dist

    with simulated_rank(3, 8) as sim:                   # device="cuda" by default
        x = torch.empty(200_000, 7168, device=sim.device)
        buf = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, (sim.rank + 1) % sim.world_size),
               dist.P2POp(dist.irecv, buf, (sim.rank - 1) % sim.world_size)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    # here: fake mode exited, process group destroyed

Use it to check shapes, dispatch paths, graph capture and memory *formulas* (e.g. with a dispatch-mode
byte tracker, or ``torch.distributed._tools.mem_tracker.MemTracker``) at real sizes.

**Fake collectives move no data.** Under FakeTensorMode there is no data at all; receive buffers and
outputs just have the right shapes. Even on real tensors (outside the mode) the fake backend exchanges
nothing between ranks: ``irecv``/``recv`` buffers and ``all_reduce`` inputs keep whatever they had;
``all_gather_into_tensor`` / ``all_to_all_single`` outputs get copies of the *local* input, not the
peers' data. So anything data-dependent (e.g. MoE splits from an exchanged counts tensor) must come from
a plan, not from a collective.

Verified on torch 2.13.0+cpu (this repository's CPU machines), world_size=4, under ``FakeTensorMode``
with fake tensors on both ``"cuda"`` and ``"cpu"`` (``tests/measure/test_simulate.py`` re-checks the ones
marked [t]):

Work (right output shapes, ``Work.wait()`` fine, nothing allocated):

* ``dist.all_reduce`` (sync and ``async_op=True``) [t]
* ``dist.all_gather_into_tensor`` (output ``[W*n, ...]``) [t]; ``dist.reduce_scatter_tensor``;
  ``dist.all_gather`` (list)
* ``dist.batch_isend_irecv([P2POp(dist.isend, x, (r+1)%W), P2POp(dist.irecv, buf, (r-1)%W)])`` -- the
  Ring-DTP ring exchange -- including at ``[200000, 7168]`` fp32 [t]; plain ``isend``/``irecv``/
  ``send``/``recv``
* ``dist.all_to_all_single(out, inp)`` with even and uneven ``output_split_sizes``/``input_split_sizes``
  (also ``async_op=True``) [t]; ``dist.all_to_all`` (lists)
* ``dist.reduce``, ``dist.gather``, ``dist.scatter``, ``dist.barrier``, ``dist.new_group``
* ``funcol.all_to_all_single(x, out_splits, in_splits, group)`` (group object or ``group.group_name``)
  [t] -- see the note below; ``funcol.all_reduce``, ``funcol.all_gather_tensor``,
  ``funcol.reduce_scatter_tensor``, ``funcol.broadcast``

Fail:

* ``dist.broadcast`` on fake **cuda** tensors of a CPU-only build: ``AssertionError: Torch not compiled
  with CUDA enabled`` (``broadcast`` calls ``torch.cuda.get_device_capability`` for cuda tensors).
  Works on fake cpu tensors; ``funcol.broadcast`` works on both. [t]
* ``init_device_mesh(...)`` *inside* the fake mode: ``DataDependentOutputException:
  aten._local_scalar_dense.default``. Build meshes before entering, or inside
  ``with torch._subclasses.fake_tensor.unset_fake_temporarily(): mesh = init_device_mesh("cuda", (2, 2))``
  (works for "cuda" and "cpu"; ``funcol`` collectives on ``mesh.get_group(dim)`` then work).
* ``torch.compile`` of code calling in-place ``dist.all_reduce(x)`` on fake **cuda** tensors:
  ``TorchRuntimeError`` (Dynamo rewrites it to funcol + ``x.copy_(...)``, and that ``copy_`` raises
  "PyTorch is not linked with support for cuda devices"). Works on fake cpu. ``torch.compile
  (fullgraph=True)`` of ``funcol.all_to_all_single`` works on both.

Note on ``funcol``: outside FakeTensorMode ``funcol.*`` returns an ``AsyncCollectiveTensor`` (has
``.wait()``). Under FakeTensorMode it counts as tracing and returns a plain, already-waited
``FakeTensor``: ``.wait()`` raises ``AttributeError: 'FakeTensor' object has no attribute 'wait'``.
Use ``funcol.wait_tensor(t)``, which works on both. (Also from the compile notes section 7(iii): the
FakeTensor impl of ``_c10d_functional.wait_tensor`` returns a *new* storage, so a byte tracker must not
count its output twice.)

**Fake "cuda" on a torch build without CUDA (this machine): forward-only.** Creating fake cuda tensors
and running forward ops (matmul, softmax, collectives, ``torch.compile(backend="eager")``) works, and
``requires_grad=True`` leaves can be created, but:

* any op that *records autograd history* on a fake cuda tensor (e.g. ``(x * 2)`` with
  ``x.requires_grad``) makes the C++ autograd engine look up the CUDA device guard and the process
  **aborts** (``terminate called ... PyTorch is not linked with support for cuda devices``; SIGABRT,
  not catchable from Python: run such code in a subprocess, or use ``device="cpu"``);
* random initialisation on cuda (``nn.Linear(..., device="cuda")``, ``uniform_``) raises
  ``RuntimeError: PyTorch is not linked with support for cuda devices``; ``torch.randn``/``normal_``
  happen to work;
* some ops ask the CUDA runtime (e.g. SDPA with non-contiguous inputs) and raise the same RuntimeError.

``sim.autograd_ok`` is False exactly in that situation. For forward+backward simulation on a CPU-only
build use ``simulated_rank(..., device="cpu")``: fake cpu tensors allocate nothing either, and autograd
works. Under ``torch.no_grad()`` / ``torch.inference_mode()`` fake cuda ops are fine.

Restrictions: one simulation at a time; refuses to start if a process group (real or fake) is already
initialised in this process (``RuntimeError``). On exit (also on exception) the fake mode is exited and
the process group destroyed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["SimulatedRank", "simulated_rank"]


@dataclass(frozen=True)
class SimulatedRank:
    """What ``simulated_rank`` yields."""

    fake_mode: FakeTensorMode
    group: dist.ProcessGroup  # the default group (== dist.group.WORLD)
    rank: int
    world_size: int
    device: torch.device  # normalised as fake tensors report it, e.g. torch.device("cuda:0")
    autograd_ok: bool  # False: recording autograd on fake tensors of `device` aborts the process


def _backend_built(device: torch.device) -> bool:
    if device.type in ("cpu", "meta"):
        return True
    if device.type == "cuda":
        return torch.backends.cuda.is_built()
    mod = getattr(torch, device.type, None)
    is_available = getattr(mod, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


@contextlib.contextmanager
def simulated_rank(
    rank: int,
    world_size: int,
    *,
    device: Union[str, torch.device] = "cuda",
    allow_non_fake_inputs: bool = True,
    fake_mode: Optional[FakeTensorMode] = None,
) -> Iterator[SimulatedRank]:
    """Be rank ``rank`` of ``world_size`` on the fake process-group backend, inside a FakeTensorMode.

    ``device``: where simulated tensors should live (``sim.device``); nothing is set as default device,
    pass ``device=sim.device`` to factories. ``allow_non_fake_inputs``: let real tensors created before
    the context (module buffers, index constants) mix with fake ones; their results are fake. Pass your
    own ``fake_mode`` (e.g. ``FakeTensorMode(shape_env=ShapeEnv())`` for symbolic shapes) to use it
    instead of a fresh one; ``allow_non_fake_inputs`` is ignored then.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if dist.is_initialized():
        raise RuntimeError(
            "simulated_rank: a process group is already initialised in this process "
            f"(backend={dist.get_backend()!r}, rank={dist.get_rank()}, world_size={dist.get_world_size()}); "
            "refusing to replace it with the fake backend. Destroy it first (dist.destroy_process_group()) "
            "or run the simulation in a separate process."
        )

    # Importing this module registers the "fake" backend (older torch) and provides the store.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mode = fake_mode if fake_mode is not None else FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)
        with mode:
            # Normalise the device the way fake tensors report it ("cuda" -> "cuda:0").
            dev = torch.empty(0, device=device).device
            sim = SimulatedRank(
                fake_mode=mode,
                group=dist.group.WORLD,
                rank=rank,
                world_size=world_size,
                device=dev,
                autograd_ok=_backend_built(dev),
            )
            yield sim
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
