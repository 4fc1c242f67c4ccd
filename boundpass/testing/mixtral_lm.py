"""A Mixtral-style MoE LM in plain PyTorch (not torchtitan's): router -> top-k -> a loop over experts that
gathers each expert's tokens with ``torch.where`` and adds their weighted outputs back with ``index_add_``.

The dispatch pass does not rewrite it (it is not torchtitan's RoutedExperts) and must say so; the step analysis
bounds its data-dependent expert batches at their upper bound, whatever the router draws.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLUExpert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtralMoE(nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUExpert(hidden, inter) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):
        b, t, h = x.shape
        x = x.view(-1, h)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, len(self.experts)).permute(2, 1, 0)  # [E, k, T]
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.view(b, t, h)


class MixtralLM(nn.Module):
    """Embedding -> RMSNorm -> MoE (residual) -> RMSNorm -> head; returns [B, S, V] logits."""

    def __init__(self, vocab: int = 2048, hidden: int = 64, inter: int = 256, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.moe = MixtralMoE(hidden, inter, experts, top_k)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.moe(self.norm1(h))
        return self.head(self.norm2(h))

    def route_all_tokens_to_the_first_experts(self) -> None:
        """Adversarial routing: a zero gate ties every score, so top-k picks experts 0..k-1 for every token (each
        of them gets all T tokens, the others none)."""
        with torch.no_grad():
            self.moe.gate.weight.zero_()
