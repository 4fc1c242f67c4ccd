"""Build torchtitan's real MoE debug models on CPU with the few known fixes (docs/design.md §7).

Fixes applied only when no GPU is present, each for an upstream reason:
- device type: torchtitan's `tools.utils.device_type` falls back to "cuda" when no accelerator is found;
  it must read "cpu" before torchtitan is imported.
- attention: FlexAttention has no CPU backward and varlen no CPU kernel; the causal SDPA module is the one
  torchtitan's own graph_trainer tests swap in (`build_decoder_config_for_backend`).
"""
from __future__ import annotations

import importlib

import torch

from boundpass.recipes import families
from boundpass.recipes.cpu_support import apply_cpu_device_fix  # noqa: F401  (also imported from here)
# name: (torchtitan package, config-registry function): the recipes' debug trainer configs (recipes/families.py)
from boundpass.recipes.families import RECIPE_CONFIGS as MODELS


def _recipe_name(name: str) -> str:
    """The recipes' name of a family given by its package name or the recipes' name (qwen3 -> qwen3_moe)."""
    return next((n for n, (package, _) in MODELS.items() if name in (n, package)), name)


def debug_moe_config(name: str = "deepseek_v3", *, vocab_size: int | None = None, seq_len: int = 128):
    """torchtitan Trainer.Config of a debug MoE model, SDPA attention, optional enlarged vocabulary."""
    name = _recipe_name(name)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    apply_cpu_device_fix()
    package, fn = MODELS[name]
    registry = importlib.import_module(f"torchtitan.models.{package}.config_registry")
    from torchtitan.models.common.attention import ScaledDotProductAttention
    cfg = getattr(registry, fn)()
    cfg.training.seq_len = seq_len
    model_cfg = cfg.model_spec.model
    for layer in model_cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if vocab_size is not None:
        model_cfg.vocab_size = vocab_size
        model_cfg.tok_embeddings.num_embeddings = vocab_size
        model_cfg.lm_head.out_features = vocab_size
    model_cfg.update_from_config(config=cfg)
    return cfg


def build_debug_moe(name: str = "deepseek_v3", *, vocab_size: int | None = None, seq_len: int = 128,
                    dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised torchtitan debug MoE model on CPU in training mode (same seed, same weights).

    A family without a recipe trainer config (kimi_k2_7, ...) is built from its registry's debug MoE flavor
    (recipes/families.py: debug_moe_flavor), SDPA attention, RoPE at seq_len positions."""
    if _recipe_name(name) in MODELS:
        model_cfg = debug_moe_config(name, vocab_size=vocab_size, seq_len=seq_len).model_spec.model
    else:
        model_cfg = families.config(name, families.debug_moe_flavor(name), seq_len=seq_len)
        if vocab_size is not None:
            model_cfg.vocab_size = vocab_size
            model_cfg.tok_embeddings.num_embeddings = vocab_size
            model_cfg.lm_head.out_features = vocab_size
    with torch.device("meta"):
        model = model_cfg.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights(buffer_device=None)
    # floating tensors only: Module.to(dtype) casts complex ones too, and deepseek_v3's RoPE cache is complex
    # (torchtitan ComplexRoPE: torch.polar); cast to a real dtype it keeps cos(theta) alone and RoPE no longer rotates
    return model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t).train()


torchtitan_loss = families.loss  # torchtitan's own CrossEntropyLoss (sum over tokens / global valid tokens)
