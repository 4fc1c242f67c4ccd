"""Ready configs: torchtitan's MoE debug models with a larger vocabulary and longer sequences, EP = 1 and EP = 2.

    torchrun --nproc-per-node 2 -m boundpass.recipes.train --module boundpass.recipes \
        --config deepseek_v3_debug_ep2 --boundpass.budget 2GiB

Each function starts from torchtitan's own config function (same model, optimizer, LR schedule, AC), then sets
the vocabulary (default 32,768 rows instead of 2,048: the [tokens, V] logits then dominate the step's peak),
the sequence length (1,024), the batch (2 sequences per rank), 20 steps, the generated local assets, and
`expert_parallel_degree` (1 or 2). CPU adaptations (SDPA attention, no CUDA graphs, partial_dtensor) are
applied by `boundpass.recipes.train` only when no GPU is present. Everything stays overridable from the
command line (`--training.seq_len 4096`, ...). boundpass itself stays off until `--boundpass.budget` is given.

The `*_mop` configs select the MoP rank layout (`--boundpass.layout mop`, recipes/mop.py, docs/recipe.md): W = the
launch's ranks split one batch of 2 sequences along the sequence, E_p = 2, every block checkpointed (FullAC: what
the composed budget assumes), causal SDPA attention, PipelinedLLEP dispatch (not for gpt_oss, whose experts have
biases) and the Ring-DTP head. Launch on W ranks, W dividing the heads and the sequence:

    torchrun --nproc-per-node 2 -m boundpass.recipes.train --module boundpass.recipes --config deepseek_v3_debug_mop
"""
from __future__ import annotations

import importlib

from boundpass.recipes.trainer import BoundpassTrainer, upgrade_config

VOCAB = 32_768
SEQ_LEN = 1024
BATCH = 2
STEPS = 20

_SOURCES = {  # recipe name: (torchtitan package, its config function)
    "deepseek_v3": ("deepseek_v3", "deepseek_v3_debugmodel"),
    "qwen3_moe": ("qwen3", "qwen3_moe_debug"),
    "gpt_oss": ("gpt_oss", "gpt_oss_debugmodel"),
}


def set_vocab(config, vocab: int) -> None:
    """Resize the model's vocabulary (embedding rows, lm_head rows) and the loss's global vocab size."""
    model = config.model_spec.model
    model.vocab_size = vocab
    model.tok_embeddings.num_embeddings = vocab
    model.lm_head.out_features = vocab
    loss = config.loss
    for cfg in (loss, getattr(loss, "loss_fn", None)):
        if cfg is not None and hasattr(cfg, "global_vocab_size"):
            cfg.global_vocab_size = vocab


def recipe_config(name: str, *, ep: int = 1, vocab: int = VOCAB, seq_len: int = SEQ_LEN, batch: int = BATCH,
                  steps: int = STEPS, blocks: int | None = None) -> BoundpassTrainer.Config:
    """torchtitan's config of `name` with the settings above; `blocks`: keep only its first blocks (None: all)."""
    package, fn = _SOURCES[name]
    registry = importlib.import_module(f"torchtitan.models.{package}.config_registry")
    config = upgrade_config(getattr(registry, fn)())
    if blocks is not None:
        config.model_spec.model.layers = config.model_spec.model.layers[:blocks]
    set_vocab(config, vocab)
    config.training.seq_len = seq_len
    config.training.local_batch_size = batch
    config.training.steps = steps
    config.parallelism.expert_parallel_degree = ep
    config.metrics.log_freq = 1
    config.debug.seed = 0  # same initial weights in every run: stock and boundpass runs are compared step by step
    config.checkpoint.interval = steps  # save once at the end unless told otherwise
    if name == "gpt_oss":
        config.validator.enable = False  # the validator's c4_validation set would be downloaded
    return config


def deepseek_v3_debug() -> BoundpassTrainer.Config:
    return recipe_config("deepseek_v3", ep=1)


def deepseek_v3_debug_ep2() -> BoundpassTrainer.Config:
    return recipe_config("deepseek_v3", ep=2)


def qwen3_moe_debug() -> BoundpassTrainer.Config:
    return recipe_config("qwen3_moe", ep=1)


def qwen3_moe_debug_ep2() -> BoundpassTrainer.Config:
    return recipe_config("qwen3_moe", ep=2)


def qwen3_moe_debug_ep2_3blocks() -> BoundpassTrainer.Config:
    """qwen3_moe_debug_ep2 cut to its first 3 blocks: 64 experts per block make the 8-block model 331 M parameters,
    most of a quick 2-rank check's time (tests/backend/test_block_compile.py's SCO run)."""
    return recipe_config("qwen3_moe", ep=2, blocks=3)


def gpt_oss_debug() -> BoundpassTrainer.Config:
    return recipe_config("gpt_oss", ep=1)


def gpt_oss_debug_ep2() -> BoundpassTrainer.Config:
    return recipe_config("gpt_oss", ep=2)


def mop_recipe_config(name: str, *, ep: int = 2, pipelined_llep: bool = True, ring_dtp: bool = True,
                      **kwargs) -> BoundpassTrainer.Config:
    """`recipe_config(name)` under the MoP layout: the W ranks of the launch share each batch (`local_batch_size`
    is the whole batch), E_p = `ep`, FullAC, causal SDPA, validation off (it reads whole sequences per rank)."""
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = recipe_config(name, ep=ep, **kwargs)
    for layer in config.model_spec.model.layers:  # flex/varlen document masks are not sharded by the exchange
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.activation_checkpoint = FullAC.Config()
    config.parallelism.spmd_backend = "partial_dtensor"  # what the layout is built on (recipes/mop.py)
    config.validator.enable = False
    bp = config.boundpass
    bp.layout, bp.mop_pipelined_llep, bp.mop_ring_dtp = "mop", pipelined_llep, ring_dtp
    return config


def deepseek_v3_debug_mop() -> BoundpassTrainer.Config:
    return mop_recipe_config("deepseek_v3")


def qwen3_moe_debug_mop() -> BoundpassTrainer.Config:
    return mop_recipe_config("qwen3_moe")


def gpt_oss_debug_mop() -> BoundpassTrainer.Config:
    # gpt_oss's experts carry biases, which PipelinedLLEP (bias-free SwiGLU) refuses: torchtitan's EP dispatcher
    return mop_recipe_config("gpt_oss", pipelined_llep=False)
