"""FSDP2's gradient reduce-scatter on gloo with no buffer outliving the call: a deterministic peak.

Why: ProcessGroupGloo's ``reduce_scatter_tensor`` clones its whole input, all-reduces the clone and copies this
rank's chunk out (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, ``reduce_scatter_tensor_coalesced``). The
clone is referenced by the all-reduce's work, which a gloo worker thread (two by default) drops only when it next
gets the lock, so one or two earlier clones can still be alive during a later reduce-scatter, depending on
thread timing (measured on 2 and 4 ranks: the per-block budget had to count two such copies, and the measured
steady step varied by up to 30 MiB on the deepseek_v3 debug model at 4 ranks).

``ReleasingReduceScatter`` computes the same values with the memory under our control: the all-reduce runs in
place on FSDP2's own reduce-scatter input (FSDP2 never reads it again: it only keeps it alive for stream ordering,
which a CPU run does not have), this rank's chunk is copied into FSDP2's output, and the input's bytes are freed
at once. Same all-reduce on the same data, so the gradients are bitwise the stock path's; no clone, and the late
reference a worker thread keeps is to an empty storage. Installed by the recipe on gloo groups only (NCCL makes
no copy); ``boundpass.block_compile`` counts one reduce-scatter input instead of two plus gloo's held copies.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

__all__ = ["ReleasingReduceScatter", "fsdp_param_groups", "install_releasing_reduce_scatter",
           "uses_releasing_reduce_scatter"]


class ReleasingReduceScatter(ReduceScatter):
    """FSDP2 ``ReduceScatter`` comm: in-place all-reduce of the input, this rank's chunk out, the input freed."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        if async_op:  # FSDP2 2.13 calls it synchronously; an async caller would read a buffer freed below
            raise NotImplementedError("ReleasingReduceScatter runs synchronously (FSDP2 calls it with async_op=False)")
        world, rank = group.size(), group.rank()
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(world, -1)[rank].view_as(output_tensor))
        torch.ops.inductor.resize_storage_bytes_(input_tensor, 0)
        return None


def fsdp_param_groups(model: nn.Module):
    """(name, FSDP2 parameter group) for every FSDP2 module of ``model``, in module order: ``path``, or
    ``path[i]`` when a module has several groups (parameters on different meshes: torchtitan's EP experts). A group
    shared by several modules (torchtitan's ``fully_shard([norm, lm_head])``) comes once per module."""
    from torch.distributed.fsdp import FSDPModule
    for path, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        groups = [g for g in (list(groups) if groups is not None else [state._fsdp_param_group]) if g is not None]
        for i, group in enumerate(groups):
            yield (f"{path}[{i}]" if len(groups) > 1 else path), group


def install_releasing_reduce_scatter(model: nn.Module) -> int:
    """Give every FSDP2 parameter group of ``model`` whose shard group runs on gloo a ``ReleasingReduceScatter``;
    returns how many. Set per group: ``FSDPModule.set_custom_reduce_scatter`` refuses modules with several groups
    (torchtitan's EP experts), because a mesh-specific comm would be ambiguous; this one uses the group it is
    called with, so it is right for each."""
    done = set()
    for _, group in fsdp_param_groups(model):
        if id(group) in done or dist.get_backend(group.mesh_info.shard_process_group) != "gloo":
            continue
        group._reduce_scatter_comm = ReleasingReduceScatter()
        done.add(id(group))
    return len(done)


def uses_releasing_reduce_scatter(param_group) -> bool:
    """True when this FSDP2 parameter group reduce-scatters through ``ReleasingReduceScatter``."""
    return isinstance(getattr(param_group, "_reduce_scatter_comm", None), ReleasingReduceScatter)
