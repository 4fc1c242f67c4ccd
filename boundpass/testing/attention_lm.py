"""A small LM whose blocks are attention only (no MLP): GQA with an MLA-style value head dim unequal to the
query/key head dim by default, causal SDPA, an optional mask tensor (the causal one built in the graph, which the
attention pass proves causal; a sliding window or one read from the activations, which it must skip) or dropout (skipped
too), or a query read from the previous position (what it must not walk in query blocks).
Unequal head dims keep torch's SDPA on its math path on a CPU ([B, A_q, L, L] scores); ``dv=16`` takes the fused
kernel. Used by tests/passes/test_attention_pass.py and bench/attention.py."""
import torch
import torch.nn as nn
import torch.nn.functional as F

V, H = 256, 64


class Attention(nn.Module):
    """GQA with an MLA-style value head dim (24) unequal to the query/key head dim (16)."""

    def __init__(self, heads=4, kv_heads=2, d=16, dv=24, mask=None, dropout=0.0, shifted_query=False):
        super().__init__()
        self.heads, self.kv_heads, self.d, self.dv, self.mask, self.dropout = heads, kv_heads, d, dv, mask, dropout
        self.shifted_query = shifted_query   # each query from the previous position: not position-wise
        self.q = nn.Linear(H, heads * d, bias=False)
        self.k = nn.Linear(H, kv_heads * d, bias=False)
        self.v = nn.Linear(H, kv_heads * dv, bias=False)
        self.o = nn.Linear(heads * dv, H, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(torch.roll(x, 1, dims=1) if self.shifted_query else x).view(b, n, self.heads, self.d).transpose(1, 2)
        k = self.k(x).view(b, n, self.kv_heads, self.d).transpose(1, 2)
        v = self.v(x).view(b, n, self.kv_heads, self.dv).transpose(1, 2)
        if self.mask is not None:
            keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()   # "tensor": causal, built in-graph
            if self.mask == "window":      # a sliding window of 8 positions: not the causal mask
                keep = keep & ~torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-8)
            if self.mask == "input":       # read from the activations (as padding masks are): not a constant
                keep = keep & (x[:, None, :, :1] > -1e9)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout, enable_gqa=True)
        return self.o(o.transpose(1, 2).reshape(b, n, -1))


class LM(nn.Module):
    def __init__(self, layers=2, **attention):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, H)
        self.norms = nn.ModuleList(nn.RMSNorm(H) for _ in range(layers))
        self.attn = nn.ModuleList(Attention(**attention) for _ in range(layers))
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for norm, attn in zip(self.norms, self.attn):
            h = h + attn(norm(h))
        return self.head(h)
