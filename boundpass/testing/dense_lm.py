"""A plain PyTorch LM that is not torchtitan's (embedding, one wide MLP block, untied head) and its losses."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class DenseLM(nn.Module):
    """Embedding -> LayerNorm -> wide GELU MLP (residual) -> head; returns [B, S, V] logits."""

    def __init__(self, vocab: int = 4096, hidden: int = 64, inter: int = 2048):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.up, self.down = nn.Linear(hidden, inter), nn.Linear(inter, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return self.head(h)


class LossLM(nn.Module):
    """A plain PyTorch LM whose forward takes the labels positionally and returns its mean cross-entropy (no
    loss_fn: boundpass.compile matches the loss in the graph)."""

    def __init__(self, vocab: int = 1000, hidden: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tok, labels):
        logits = self.lm_head(torch.tanh(self.emb(tok)))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def ce(out, labels):
    """Mean token cross-entropy in fp32 (the vocab pass rewrites it)."""
    return F.cross_entropy(out.flatten(0, 1).float(), labels.flatten())


def smoothed_ce(out, labels):
    """Label-smoothed cross-entropy: the vocab pass skips it, the [N, V] logits stay."""
    return F.cross_entropy(out.flatten(0, 1), labels.flatten(), label_smoothing=0.1)


def lm_batches(vocab: int, batch: int, seq: int, n: int = 3, with_count: bool = False) -> list[tuple]:
    """``n`` seeded (tokens, labels[, valid-token count]) batches; the first 3 labels of each row are ignored."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = torch.randint(0, vocab, (batch, seq), generator=g)
        labels[:, :3] = -100
        out.append((tokens, labels, (labels != -100).sum()) if with_count else (tokens, labels))
    return out
