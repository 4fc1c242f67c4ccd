"""How the runtime's custom ops name a process group: torch.library schemas take a string, not a group object."""
from __future__ import annotations


def release_storage(t) -> None:
    """Free a finished exchange buffer's bytes now. Why: ProcessGroupGloo's worker threads (two by default) drop
    their reference to a finished collective asynchronously, so each could keep one earlier exchange's send and
    receive buffers alive into a later one (measured: one or two such pairs, timing dependent). The collective
    has completed (it waited), so nothing reads the bytes any more; the backend's late reference then holds an
    empty storage, and the op's peak no longer depends on thread timing."""
    import torch
    torch.ops.inductor.resize_storage_bytes_(t, 0)


def group_of(name: str):
    """The process group a custom op's ``group`` string names (None for '': one rank, no exchange)."""
    import torch.distributed as dist
    return dist.distributed_c10d._resolve_process_group(name) if name else None


def group_name_of(group) -> str:
    """The name a custom op resolves its process group by ('' = no group: one rank, no exchange)."""
    return "" if group is None else group.group_name
