"""A Mixtral-style MoE LM in plain PyTorch (not torchtitan's): router -> top-k -> a loop over experts that
gathers each expert's tokens with ``torch.where`` and adds their weighted outputs back with ``index_add_``.

The dispatch pass finds it by what it computes and rewrites it to PipelinedLLEP (bias-free SwiGLU experts);
the variants it cannot compute (``expert_bias=True``, ``activation="gelu"``, ``weighting="input"``) are reported
SKIPPED, and the step analysis then bounds their data-dependent expert batches at their upper bound, whatever
the router draws.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


class SwiGLUExpert(nn.Module):
    """act(x w1) * (x w3) -> w2; SwiGLU with the defaults (Mixtral's), GeGLU with activation="gelu"."""

    def __init__(self, hidden: int, inter: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=bias)
        self.w3 = nn.Linear(hidden, inter, bias=bias)
        self.w2 = nn.Linear(inter, hidden, bias=bias)
        self.act = _ACTIVATIONS[activation]

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class StackedExperts(nn.Module):
    """The same SwiGLU experts held as one [E, out, in] parameter per projection (nn.Linear's layout per expert),
    indexed per expert in the loop: the grouped-weights spelling."""

    def __init__(self, hidden: int, inter: int, experts: int):
        super().__init__()
        per = [SwiGLUExpert(hidden, inter) for _ in range(experts)]
        for name in ("w1", "w2", "w3"):
            setattr(self, name, nn.Parameter(torch.stack([getattr(ex, name).weight.detach() for ex in per])))

    def __len__(self):
        return self.w1.shape[0]

    def expert(self, e: int, x):
        return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])


class MixtralMoE(nn.Module):
    """grouping="one_hot": Mixtral's where on a one_hot mask; "eq": where(ids == e), the same routes spelled another
    way. weighting="output": each expert's output times its route's score (Mixtral's); "input": the score applied
    to the expert's input rows instead (another model: the pass must not rewrite it). stacked=True: the experts'
    weights as one [E, out, in] parameter per projection (``StackedExperts``)."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, expert_bias: bool = False,
                 activation: str = "silu", grouping: str = "one_hot", weighting: str = "output",
                 stacked: bool = False):
        super().__init__()
        self.grouping, self.weighting = grouping, weighting
        self.gate = nn.Linear(hidden, experts, bias=False)
        if stacked:
            self.experts = StackedExperts(hidden, inter, experts)
        else:
            self.experts = nn.ModuleList(SwiGLUExpert(hidden, inter, expert_bias, activation) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):
        b, t, h = x.shape
        x = x.view(-1, h)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, len(self.experts)).permute(2, 1, 0)  # [E, k, T]
        for e in range(len(self.experts)):
            expert = self.experts[e] if isinstance(self.experts, nn.ModuleList) else \
                functools.partial(self.experts.expert, e)
            if self.grouping == "one_hot":
                slot, token = torch.where(mask[e])
            else:
                token, slot = torch.where(ids == e)
            if self.weighting == "output":
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
            else:
                out.index_add_(0, token, expert(x[token] * weights[token, slot, None]))
        return out.view(b, t, h)


class MixtralLM(nn.Module):
    """Embedding -> RMSNorm -> MoE (residual) -> RMSNorm -> head; returns [B, S, V] logits."""

    def __init__(self, vocab: int = 2048, hidden: int = 64, inter: int = 256, experts: int = 4, top_k: int = 2,
                 expert_bias: bool = False, activation: str = "silu", grouping: str = "one_hot",
                 weighting: str = "output", stacked: bool = False, checkpointed: bool = False):
        super().__init__()
        self.checkpointed = checkpointed  # the norm + MoE in torch.utils.checkpoint (a HOP body in the graph)
        self.emb = nn.Embedding(vocab, hidden)
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.moe = MixtralMoE(hidden, inter, experts, top_k, expert_bias, activation, grouping, weighting, stacked)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        if self.checkpointed:
            h = h + checkpoint(self._block, h, use_reentrant=False)
        else:
            h = h + self._block(h)
        return self.head(self.norm2(h))

    def _block(self, h):
        return self.moe(self.norm1(h))

    def route_all_tokens_to_the_first_experts(self) -> None:
        """Adversarial routing: a zero gate ties every score, so top-k picks experts 0..k-1 for every token (each
        of them gets all T tokens, the others none)."""
        with torch.no_grad():
            self.moe.gate.weight.zero_()
