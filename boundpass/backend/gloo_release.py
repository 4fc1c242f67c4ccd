"""FSDP2's collectives on gloo with no buffer outliving its use: a deterministic peak.

Why: a gloo worker thread (two per process group by default) keeps its reference to a finished collective's work,
and with it the work's tensors, until it next takes the group's lock (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp,
``runLoop``). On a busy CPU that can be a whole block's compute later, so buffers FSDP2 is done with stay allocated
for as long as the thread is not scheduled:
- the reduce-scatter: ProcessGroupGloo's ``reduce_scatter_tensor`` clones its whole input, all-reduces the clone
  and copies this rank's chunk out (``reduce_scatter_tensor_coalesced``); one or two earlier clones could still be
  alive during a later reduce-scatter (measured on 2 and 4 ranks: the per-block budget had to count two such copies,
  and the measured steady step varied by up to 30 MiB on the deepseek_v3 debug model at 4 ranks);
- the all-gather: FSDP2 drops a unit's all-gather output right after copying it out into the unsharded
  parameters, but the work's reference keeps it (measured under the MoP layout on 4 ranks with the CPU busy:
  block 2's 15.1 MiB all-gather output still allocated during block 1's backward: 1.013-1.080x the composed
  budget in 12 of 96 steps; freed on the worker thread, where the profiler does not see the free).

``ReleasingReduceScatter`` computes the same values with the memory under our control: the all-reduce runs in
place on FSDP2's own reduce-scatter input (FSDP2 never reads it again: it only keeps it alive for stream ordering,
which a CPU run does not have), this rank's chunk is copied into FSDP2's output, and the input's bytes are freed
at once. Same all-reduce on the same data, so the gradients are bitwise the stock path's; no clone, and the late
reference a worker thread keeps is to an empty storage. ``release_all_gather_outputs`` frees the bytes of each
all-gather output right after its copy-out into the unsharded parameters: nothing reads it again, so the parameters
are the same, and again the late reference is to an empty storage.

``install_releasing_collectives`` puts both on every FSDP2 group whose shard group runs on gloo (NCCL makes no
copy, and its buffers follow the caching allocator's stream rules instead); the recipe and the MoP layout install
them; ``boundpass.backend.block_compile`` and the composed budget count one reduce-scatter input, no clone, and each
all-gather output until its copy-out.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

__all__ = ["ReleasingReduceScatter", "fsdp_param_groups", "install_releasing_collectives",
           "release_all_gather_outputs", "releases_all_gather_outputs", "uses_releasing_reduce_scatter"]


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


def release_all_gather_outputs(param_group) -> None:
    """Free each all-gather output of this FSDP2 parameter group once it has been copied out, whoever else still
    holds a reference (gloo's worker thread). FSDP2 (torch 2.13, ``_fsdp_param_group.py``) is done with a unit's
    output after the copy-out in its ``wait_for_unshard``: it drops it there, except in forward after a synchronous
    all-gather, where it keeps it in ``comm_ctx.all_gather_state`` only so that a GPU's all-gather streams do not
    reuse the memory while the copy-out may still run (``_wait_all_gather_streams_on_event``), until the next unit's
    copy-out or the root's post-forward drops it. On CPU there are no streams: the output is released right after its
    copy-out either way (the kept state then holds an empty storage). CPU outputs only; a one-rank group's "output"
    is a buffer FSDP2 keeps and is never released."""
    if releases_all_gather_outputs(param_group):
        return
    original = param_group.wait_for_unshard

    def wait_for_unshard():
        result = param_group._all_gather_result
        original()
        if result is None:
            return
        out = result.all_gather_output
        if out is not param_group._all_gather_output and out.device.type == "cpu":
            torch.ops.inductor.resize_storage_bytes_(out, 0)

    wait_for_unshard.releases_all_gather_outputs = True
    param_group.wait_for_unshard = wait_for_unshard  # the instance's: FSDP2's hooks call group.wait_for_unshard()


def releases_all_gather_outputs(param_group) -> bool:
    """True when this FSDP2 parameter group frees each all-gather output right after its copy-out."""
    return getattr(vars(param_group).get("wait_for_unshard"), "releases_all_gather_outputs", False)


def install_releasing_collectives(model: nn.Module) -> int:
    """Give every FSDP2 parameter group of ``model`` whose shard group runs on gloo a ``ReleasingReduceScatter``
    and, where that group has more than one rank, ``release_all_gather_outputs``; returns how many groups. Set per
    group: ``FSDPModule.set_custom_reduce_scatter`` refuses modules with several groups (torchtitan's EP experts),
    because a mesh-specific comm would be ambiguous; this one uses the group it is called with, so it is right for
    each."""
    done = set()
    for _, group in fsdp_param_groups(model):
        shard_group = group.mesh_info.shard_process_group
        if id(group) in done or dist.get_backend(shard_group) != "gloo":
            continue
        group._reduce_scatter_comm = ReleasingReduceScatter()
        if shard_group.size() > 1:
            release_all_gather_outputs(group)
        done.add(id(group))
    return len(done)


def uses_releasing_reduce_scatter(param_group) -> bool:
    """True when this FSDP2 parameter group reduce-scatters through ``ReleasingReduceScatter``."""
    return isinstance(getattr(param_group, "_reduce_scatter_comm", None), ReleasingReduceScatter)
