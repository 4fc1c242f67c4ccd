"""What every rank of a group must agree on, checked on the data an op already exchanges.

A ring or EP op whose ranks disagree on a setting (the vocabulary size, a dtype, the chunk cap, ...) does not
fail by itself: the ranks post collectives of different sizes or counts and then hang, abort inside gloo, or
return a wrong result. ``agree`` packs the settings (as int64) beside the small per-rank payload the op already
all-gathers (its token or route counts), so one collective of a fixed length both delivers the counts and lets
every rank see every other rank's settings. A mismatch raises the same ``BoundpassInputError`` on every rank,
naming each field that differs and each rank's value, before any large allocation and before any collective
whose size depends on those settings. A rank whose own input was refused locally (a bad shape, a meta tensor)
flags that in the same exchange, so its peers raise too instead of waiting for it in the next collective.

``global_max_tokens`` is the one small all-reduce a compiler needs to choose a knob from a global fact (the
Ring-DTP branch from the ring's largest N, the PipelinedLLEP cap from the EP group's largest token count).
"""
from __future__ import annotations

import struct
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from boundpass.core.errors import BoundpassInputError

# dtype <-> small int: a fixed table (the same on every rank because it is the same code)
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
           getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
UNKNOWN = -(1 << 62)  # a field this rank could not read (its input was refused locally)


def _encode(kind: str, value) -> int:
    if value is None:
        return UNKNOWN
    if kind == "dtype":
        return _DTYPES.index(value) if value in _DTYPES else len(_DTYPES) + sum(str(value).encode())  # deterministic across processes
    if kind == "float":  # exact: the float's bits
        return struct.unpack("<q", struct.pack("<d", float(value)))[0]
    if kind == "bool":
        return int(bool(value))
    if isinstance(kind, tuple):  # one of a fixed set of choices (str)
        return kind.index(value) if value in kind else len(kind)
    return int(value)


def _decode(kind, code: int) -> str:
    if code == UNKNOWN:
        return "<refused locally>"
    if kind == "dtype":
        return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) and _DTYPES[code] is not None else f"<dtype #{code}>"
    if kind == "float":
        return repr(struct.unpack("<d", struct.pack("<q", code))[0])
    if kind == "bool":
        return str(bool(code))
    if isinstance(kind, tuple):
        return repr(kind[code]) if 0 <= code < len(kind) else "<invalid>"
    return str(code)


def check_devices(op: str, tensors: dict[str, Tensor], *, allow_meta: bool = False) -> torch.device:
    """Refuse meta tensors (no data: the result would be uninitialised memory) and inputs on different devices."""
    named = {name: t for name, t in tensors.items() if isinstance(t, Tensor)}
    devices = {name: t.device for name, t in named.items()}
    if not allow_meta:
        meta = [name for name, d in devices.items() if d.type == "meta"]
        if meta:
            raise BoundpassInputError(
                f"{op} needs real tensors, got meta tensors for {', '.join(meta)} (a meta tensor holds no data, so "
                f"the result would be uninitialised memory): materialise them first (e.g. model.to_empty(device=...) "
                f"and load or initialise the weights)")
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {d}" for name, d in devices.items())
        raise BoundpassInputError(f"{op} needs every input on one device, got {listed}: move them to one device")
    return next(iter(devices.values())) if devices else torch.device("cpu")


def mixed_real_call(op: str, tensors: dict[str, Tensor]) -> bool:
    """For a custom op's fake kernel: True when real inputs on different devices reached it.

    The dispatcher sends a call whose inputs mix ``meta`` and real tensors to the Meta kernel, i.e. the fake
    kernel, which would return uninitialised (real) memory as if it were the result. The fake kernel then runs
    the real kernel instead, which refuses the input on every rank of its group (through the agreement
    exchange, so no peer waits). Under FakeTensorMode, inputs on different (fake) devices are refused here.
    All-meta inputs (shape propagation) and one-device calls pass (False).
    """
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, Tensor)}
    if len(set(devices.values())) <= 1:
        return False
    if any(isinstance(t, torch._subclasses.FakeTensor) for t in tensors.values()):
        listed = ", ".join(f"{name} on {d}" for name, d in devices.items())
        raise BoundpassInputError(f"{op} needs every input on one device, got {listed}: move them to one device")
    return True


def _exchange_device(group, device: torch.device | None) -> torch.device:
    if device is not None and device.type != "meta":
        return device
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(op: str, group, rank: int, size: int, fields: Sequence[tuple[str, object, object]], *,
          local_error: BaseException | None = None, payload: Sequence[int] = (),
          device: torch.device | None = None, what: str = "group") -> list[list[int]]:
    """One all-gather of [refused?, fields..., payload...] over ``group``; returns every rank's payload.

    ``fields``: (name, kind, value) with kind "int", "bool", "float", "dtype" or a tuple of str choices; every
    rank must pass the same names in the same order (the same code does) and the same payload length.
    Raises ``BoundpassInputError`` on every rank if any rank flagged ``local_error`` or any field differs.
    """
    row = [1 if local_error is not None else 0] + [_encode(kind, value) for _, kind, value in fields] + list(payload)
    if size == 1:
        gathered = [row]
    elif str(dist.get_backend(group)).lower() == "fake":  # simulated ranks: no peer data to compare with
        if local_error is not None:
            raise local_error
        if payload:
            raise BoundpassInputError(f"{op} on a fake process group (simulated ranks) cannot exchange its counts: "
                                      f"pass them explicitly")
        return [[] for _ in range(size)]
    else:
        dev = _exchange_device(group, device)
        mine = torch.tensor(row, dtype=torch.int64, device=dev)
        out = torch.empty(size * len(row), dtype=torch.int64, device=dev)
        dist.all_gather_single(out, mine, group=group)
        gathered = out.view(size, len(row)).tolist()
    refused = [r for r in range(size) if gathered[r][0]]
    if refused:
        if local_error is not None:
            note = "" if refused == [rank] else f" (refused on ranks {refused} of the {what})"
            raise BoundpassInputError(f"{local_error}{note}") from local_error
        raise BoundpassInputError(f"{op}: rank{'s' if len(refused) > 1 else ''} {', '.join(map(str, refused))} of "
                                  f"the {what} of {size} refused its input (see that rank's error); every rank "
                                  f"stops here instead of waiting for it in the next collective")
    differ = []
    for i, (name, kind, _) in enumerate(fields, start=1):
        codes = [gathered[r][i] for r in range(size)]
        if len(set(codes)) > 1:
            differ.append(f"{name} (" + ", ".join(f"rank {r}: {_decode(kind, c)}" for r, c in enumerate(codes)) + ")")
    if differ:
        raise BoundpassInputError(f"{op}: the ranks of the {what} of {size} must agree on "
                                  f"{'; '.join(differ)}: pass the same value on every rank")
    start = 1 + len(fields)
    return [g[start:] for g in gathered]


def global_max_tokens(tokens: int, group=None, *, device: torch.device | None = None) -> int:
    """The largest ``tokens`` over ``group`` (one all-reduce of one int64; ``group`` None or 1 rank: ``tokens``).

    Every rank must call it (it is a collective). A compiler chooses knobs that must agree across ranks from
    this value: the Ring-DTP branch from the ring's N_max, the PipelinedLLEP cap c (and so its chunk count K)
    from the EP group's largest token count.
    """
    if isinstance(group, str):
        group = dist.distributed_c10d._resolve_process_group(group) if group else None
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return int(tokens)
    t = torch.tensor([int(tokens)], dtype=torch.int64, device=_exchange_device(group, device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


_KINDS = ("fits", "InfeasibleBudgetError", "BoundpassInputError", "NotCertifiedError", "other")


def fail_together(op: str, groups: Sequence, error: BaseException | None, *, numbers: Sequence[int] = (0, 0)) -> None:
    """Every rank of ``groups`` learns whether any rank's local check failed, and every rank raises.

    One all-gather per group of [what failed (0: nothing), numbers...] (``numbers``: two ints the message shows, e.g.
    the certified peak and the budget, bytes). This rank's own ``error`` is re-raised unchanged; a rank whose own
    check passed raises ``PeerRefusedError`` naming each rank that failed, what failed and its numbers, instead of
    entering the step's collectives, where it would wait for that rank until the process group's timeout.
    Groups of one rank and fake (simulated) groups exchange nothing."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():  # AOTAutograd's partitioner runs under its fake mode: these ints are real
        _fail_together(op, groups, error, numbers)


def _fail_together(op, groups, error, numbers) -> None:
    from boundpass.core.errors import PeerRefusedError
    kind = 0 if error is None else next((i for i, name in enumerate(_KINDS) if i and any(
        c.__name__ == name for c in type(error).__mro__)), len(_KINDS) - 1)
    failed = []
    for group in groups:
        size = dist.get_world_size(group)
        if size == 1 or str(dist.get_backend(group)).lower() == "fake":
            continue
        mine = torch.tensor([kind, *map(int, numbers)], dtype=torch.int64, device=_exchange_device(group, None))
        out = torch.empty(size * mine.numel(), dtype=torch.int64, device=mine.device)
        dist.all_gather_single(out, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        failed += [(ranks[r], row) for r, row in enumerate(out.view(size, -1).tolist()) if row[0]]
    if error is not None:
        raise error
    if failed:
        from boundpass.core.units import format_bytes
        listed = "; ".join(f"rank {r}: {_KINDS[row[0]]}" + (f" (peak {format_bytes(row[1])} over its budget "
                                                            f"{format_bytes(row[2])})" if row[0] == 1 else "")
                           for r, row in dict(failed).items())
        raise PeerRefusedError(f"{op}: another rank refused this step ({listed}); every rank stops here instead of "
                               f"waiting for it in the step's collectives: see that rank's error for the fix",
                               ranks=sorted(dict(failed)))
