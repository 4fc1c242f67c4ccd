"""Adversarial routing for torchtitan MoE models (tests and benchmarks)."""
from __future__ import annotations


def route_all_to(model, experts) -> None:
    """Make every token of every MoE block pick ``experts`` (in place): the router's selection bias (deepseek-style
    ``expert_bias_E``, used for selection only) is set to 1e4 on them, so the scores stay the router's own.
    Experts 0..k-1 all live on EP rank 0: the worst case of standard EP's dispatch."""
    for layer in model.layers.values():
        moe = getattr(layer, "moe", None)
        if moe is not None and getattr(moe, "expert_bias_E", None) is not None:
            moe.expert_bias_E.zero_()
            moe.expert_bias_E[list(experts)] = 1e4
