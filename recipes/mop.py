"""The MoP rank layout on torchtitan's MoE models: FSDP2 dense weights, sequence-to-head attention, EP experts.

One rank set of W ranks, overlapping sub-groups (SPEC.md section 5, docs/mop.md):
- every rank holds N/W consecutive tokens of every sequence (rank r: global positions [r*N/W, (r+1)*N/W)),
  fed to the model with those global positions, so RoPE is the unsharded one;
- attention: torchtitan's inner attention module is wrapped, before ``parallelize`` (as torchtitan's own
  context parallelism does), with the sequence-to-head all-to-all over all W ranks
  (boundpass.runtime.seq_to_head): A_q/W heads of the whole sequence per rank inside attention;
- dense weights: FSDP2 (``fully_shard`` per block over the W-rank "fsdp" mesh), experts: torchtitan's expert
  parallelism over the "ep" sub-mesh (E_p ranks) and FSDP over "efsdp" (W/E_p); all built by torchtitan's
  own ``parallelize_fn`` of the model (``parallelize_deepseekv3``, ...) from ParallelDims.
- gradients are summed, not averaged, over the W ranks (the loss is already divided by the global token
  count, torchtitan's convention); gloo has no PREMUL_SUM, so FSDP reduces with a plain sum.

Data-parallel replicas (whole sequences on disjoint rank sets) are left out: the W ranks hold one set of
sequences, split along the sequence.
"""
from __future__ import annotations

import torch

from boundpass.errors import BoundpassInputError
from boundpass.recipes.models import MODELS, apply_cpu_device_fix, debug_moe_config
from boundpass.runtime.seq_to_head import SeqToHeadAttention, check_head_counts, shard_positions, shard_sequence

# torchtitan reads its device type once, at import: fix it before anything imports torchtitan (no-op on GPUs)
apply_cpu_device_fix()

__all__ = ["mop_config", "apply_seq_to_head", "parallelize_mop", "shard_batch", "attention_heads"]


def mop_config(name: str = "deepseek_v3", *, world: int, ep: int, seq_len: int, vocab_size: int | None = None,
               param_dtype: str = "float32"):
    """torchtitan Trainer.Config of a debug MoE model laid out over ``world`` ranks with EP degree ``ep``."""
    if name not in MODELS:
        raise BoundpassInputError(f"unknown model {name!r}; the MoP layout supports {sorted(MODELS)}")
    if world % ep:
        raise BoundpassInputError(f"the EP degree ({ep}) must divide the {world} ranks of the MoP layout")
    shard_sequence(seq_len, 0, world)  # refuses a ragged last shard before anything is built
    cfg = debug_moe_config(name, vocab_size=vocab_size, seq_len=seq_len)
    par = cfg.parallelism
    par.data_parallel_shard_degree = world
    par.expert_parallel_degree = ep
    # spmd_types cannot run on gloo (uneven list all_to_all, fully_shard on plain tensors): notes/torchtitan_cpu.md
    par.spmd_backend = "partial_dtensor"
    cfg.training.mixed_precision_param = param_dtype
    cfg.model_spec.model.update_from_config(config=cfg)  # EP sharding config now that ep is set
    A_q, A_kv = attention_heads(cfg)
    check_head_counts(A_q, A_kv, world)
    return cfg


def attention_heads(cfg) -> tuple[int, int]:
    """(query heads, kv heads) of the model's attention as the inner attention sees them (MLA: k per head)."""
    att = cfg.model_spec.model.layers[0].attention
    A_q = att.n_heads
    A_kv = getattr(att, "n_kv_heads", None) or A_q
    return A_q, A_kv


def apply_seq_to_head(model: torch.nn.Module, group) -> None:
    """Wrap every block's inner attention with the sequence-to-head all-to-all over ``group`` (in place).

    Call before ``parallelize`` so the wrapper runs on local tensors inside torchtitan's wrapping, like its
    context-parallel ``apply_cp_to_forward``. Parameter names do not change (the inner module has none).
    """
    for block in model.layers.values():
        inner = block.attention.inner_attention
        if isinstance(inner, SeqToHeadAttention):
            raise BoundpassInputError("apply_seq_to_head: attention is already sequence-to-head")
        block.attention.inner_attention = SeqToHeadAttention(inner, group)


def parallelize_mop(model: torch.nn.Module, cfg, *, world: int, ac_config=None, sequence_to_head: bool = True):
    """Apply the MoP layout to a materialised model (same values on every rank); returns (model, parallel_dims).

    torchtitan's own parallelize function does EP + FSDP2; this adds sequence-to-head attention and the
    sum-reduction of gradients. ``ac_config``: torchtitan's activation checkpointing config (e.g.
    ``FullAC.Config()``), applied by the same parallelize function; None: off. Compile stays off.
    """
    import torch.distributed as dist
    from torchtitan.distributed import ParallelDims

    if not dist.is_initialized() or dist.get_world_size() != world:
        raise BoundpassInputError(f"parallelize_mop needs an initialised process group of {world} ranks")
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils as tt_utils

    if tt_utils.device_type == "cuda" and not torch.cuda.is_available():
        raise BoundpassInputError("torchtitan was imported before boundpass.recipes.mop on a machine without CUDA, "
                                  "so its device type is 'cuda'; import boundpass.recipes.mop (or call "
                                  "boundpass.recipes.models.apply_cpu_device_fix()) before importing torchtitan")

    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)  # what torchtitan's Trainer does first
    dims = ParallelDims.from_config(cfg.parallelism, world)
    dims.build_mesh()
    if sequence_to_head:
        apply_seq_to_head(model, dims.get_mesh("fsdp").get_group())
    cfg.model_spec.parallelize_fn(model, parallel_dims=dims, training=cfg.training, parallelism=cfg.parallelism,
                                  compile_config=cfg.compile, ac_config=ac_config, dump_folder=cfg.dump_folder)
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)           # the loss is already / global tokens
            module.set_force_sum_reduction_for_comms(True)   # gloo: no PREMUL_SUM
    return model, dims


def shard_batch(tokens: torch.Tensor, labels: torch.Tensor, rank: int, world: int):
    """This rank's (tokens, labels, positions) of a [B, L] batch: L/W consecutive tokens at global positions."""
    s = shard_sequence(tokens.shape[1], rank, world)
    return tokens[:, s].contiguous(), labels[:, s].contiguous(), shard_positions(tokens.shape[1], rank, world)

