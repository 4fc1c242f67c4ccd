"""A probe of the next step of issue 36 (not an operator, wired into no pass): the attention sublayer of a
recomputed block walked in query blocks, so that only k, v and their gradients are O(L).

Schedule (torchtitan's deepseek_v3 MLA attention, one rank, eager): k and v are projected over the whole sequence as
the model does (their graph is autograd's); the query projection, the attention and the output projection run one
query block of B_q rows at a time through boundpass's chunked-attention kernels at the block's offset
(runtime/chunked_attention.py, ``q_offset``), the forward keeping nothing of a block. The backward walks the blocks
again: it recomputes the block's q and its output, takes the output projection's backward, then the kernels'
backward, which adds the block's key / value gradients into one pair of accumulators (``into``), then the query
projection's backward. What the block holds at O(L) is then x, k, v, their gradients and the output; where the model
as it runs holds q, k, v padded, the output, its gradient, dq, dk and dv (eight [L, 16, 192] fp32 tensors).

Measured: the MoE block (attention + MoE FFN) forward + backward under a non-reentrant checkpoint (as torchtitan's
FullAC runs it), at the live-storage tracker (every tensor storage, the block's parameters and buffers and the
input / output gradient counted from the start), the model's attention on torch's fused CPU kernel with v zero-padded
(what the MoP layout runs). Exactness: the loss and every gradient of the block's parameters and input against the
block as it runs, built from the same seed.

Writes docs/results/attention_sublayer.json and .md.

    python bench/attention_sublayer.py [--lengths 1024,2048,4096] [--blocks 128,256,512]
"""
from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils.checkpoint import checkpoint

from bench.common import fmt_bytes, markdown_table, publish, run_metadata
from boundpass.measure.memtrack import LiveStorageTracker
from boundpass.runtime import chunked_attention as ca


def _moe_block(length: int):
    from boundpass.recipes.models import build_debug_moe
    from boundpass.runtime.seq_to_head import SeqToHeadAttention
    net = build_debug_moe("deepseek_v3", vocab_size=4096, seq_len=length)
    block = next(b for b in net.layers.values() if getattr(b, "moe", None) is not None)  # the first MoE block
    block.attention.inner_attention = SeqToHeadAttention(block.attention.inner_attention, None)  # fused, v padded
    return block


def _query(attn, x_i: torch.Tensor, start: int) -> torch.Tensor:
    """The block's queries of rows [start, start + n): [B, A, n, D] (projection, RoPE at their positions)."""
    b, n, _ = x_i.shape
    q = attn.wq(x_i) if attn.q_lora_rank == 0 else attn.wq_b(attn.q_norm(attn.wq_a(x_i)))
    q_nope, q_pe = torch.split(q.view(b, n, -1, attn.qk_head_dim), [attn.qk_nope_head_dim, attn.qk_rope_head_dim],
                               dim=-1)
    q_pe, _ = attn.rope(q_pe, q_pe[:, :, :1].detach(), torch.arange(start, start + n).unsqueeze(0))
    return torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)


class _QueryBlocks(torch.autograd.Function):
    """y = wo(attention(q(x), k, v)) walked in query blocks; the parameters the blocks read passed explicitly."""

    @staticmethod
    def forward(ctx, attn, rows, x, k, v, *params):
        length, ys = x.shape[1], []
        with torch.no_grad():
            for s in range(0, length, rows):
                e = min(s + rows, length)
                out, _ = ca.chunked_attention_forward(_query(attn, x[:, s:e], s), k, v, True, attn.softmax_scale,
                                                      rows, q_offset=s)
                ys.append(attn.wo(out.transpose(1, 2).reshape(x.shape[0], e - s, -1)))
        ctx.attn, ctx.rows = attn, rows
        ctx.save_for_backward(x, k, v, *params)
        return torch.cat(ys, 1)

    @staticmethod
    def backward(ctx, grad_y):
        x, k, v, *params = ctx.saved_tensors
        attn, rows = ctx.attn, ctx.rows
        dx = torch.empty_like(x)
        acc = torch.promote_types(k.dtype, torch.float32)  # the kernels' accumulation dtype
        dk, dv = torch.zeros(k.shape, dtype=acc), torch.zeros(v.shape, dtype=acc)
        dparams = [torch.zeros_like(p) for p in params]
        for s in range(0, x.shape[1], rows):
            e = min(s + rows, x.shape[1])
            with torch.enable_grad():
                x_i = x[:, s:e].detach().requires_grad_()
                q_i = _query(attn, x_i, s)
                with torch.no_grad():  # k and v require grad: the kernel's tiles must not join a graph
                    out, lse = ca.chunked_attention_forward(q_i.detach(), k, v, True, attn.softmax_scale, rows,
                                                            q_offset=s)
                out.requires_grad_()
                y = attn.wo(out.transpose(1, 2).reshape(x.shape[0], e - s, -1))
                grad_out, *from_wo = torch.autograd.grad(y, [out, *params], grad_y[:, s:e], allow_unused=True)
            dq, _, _ = ca.chunked_attention_backward(grad_out, q_i.detach(), k, v, out.detach(), lse, True,
                                                     attn.softmax_scale, rows, q_offset=s, into=(dk, dv))
            dx_i, *from_q = torch.autograd.grad(q_i, [x_i, *params], dq, allow_unused=True)
            dx[:, s:e] = dx_i
            for acc_p, a, b in zip(dparams, from_wo, from_q):
                for g in (a, b):
                    if g is not None:
                        acc_p.add_(g)
            del x_i, q_i, out, lse, y, grad_out, dq, dx_i
        return (None, None, dx, dk.to(k.dtype), dv.to(v.dtype), *dparams)


def _walked_forward(self, x, attention_masks, positions=None, *, rows: int):
    """deepseek_v3's Attention.forward with the query side walked in blocks (k / v as the model computes them)."""
    bsz, seqlen, _ = x.size()
    kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    k_pe, _ = self.rope(k_pe.unsqueeze(2), k_pe.unsqueeze(2).detach(), positions)
    kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
    k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.size(2), -1)], dim=-1)
    params = [p for n, p in self.named_parameters() if n.split(".")[0] in ("wq", "wq_a", "wq_b", "q_norm", "wo")]
    return _QueryBlocks.apply(self, rows, x, k.transpose(1, 2), v.transpose(1, 2), *params)


def measure(length: int, rows: int | None) -> dict:
    """One forward + backward of the MoE block at ``length`` (rows None: as it runs)."""
    block = _moe_block(length)
    if rows:
        attn = block.attention
        attn.forward = types.MethodType(lambda self, *a, **kw: _walked_forward(self, *a, **kw, rows=rows), attn)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, length, block.attention.wo.out_features, generator=g).requires_grad_()
    grad = torch.randn(x.shape, generator=g)
    tracker = LiveStorageTracker().track_existing(x, grad, *block.parameters(), *block.buffers())
    start = time.perf_counter()
    with tracker:
        out = checkpoint(block, x, None, use_reentrant=False)
        out.backward(grad)
        loss = float((out.detach().double() * grad.double()).sum())
        del out
    seconds = time.perf_counter() - start
    grads = {"x": x.grad, **{n: p.grad for n, p in block.named_parameters() if p.grad is not None}}
    return dict(length=length, rows=rows, peak=tracker.peak_bytes(), seconds=seconds, loss=loss, grads=grads)


def _routed(name: str) -> bool:
    """The routed experts' weights: torchtitan runs their matmuls in bf16 whatever the model's dtype, so an input
    that differs in its last fp32 bits can round to a neighbouring bf16 value there (reported apart)."""
    return "experts" in name and "shared" not in name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--blocks", default="256", help="query rows per block (and the kernels' tile), comma-separated")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    started = time.perf_counter()
    rows = []
    for length, block in ((n, b) for n in (int(s) for s in args.lengths.split(","))
                          for b in (int(s) for s in args.blocks.split(","))):
        plain, walked = measure(length, None), measure(length, block)
        rel = {n: ((walked["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
               for n, g in plain["grads"].items()}
        routed = [n for n in rel if _routed(n)]
        rows.append(dict(length=length, block=block, peak_plain=plain["peak"], peak_walked=walked["peak"],
                         seconds_plain=plain["seconds"], seconds_walked=walked["seconds"],
                         loss_rel=abs(walked["loss"] - plain["loss"]) / abs(plain["loss"]),
                         grad_rel_max=max(v for n, v in rel.items() if n not in routed),
                         routed_rel_max=max((rel[n] for n in routed), default=0.0),
                         grads=len(rel) - len(routed), routed=len(routed)))
        print(rows[-1], flush=True)
    data = dict(rows=rows, meta=run_metadata(), command="python bench/attention_sublayer.py "
                + " ".join(argv if argv is not None else sys.argv[1:]))
    # the peak's growth per token between the two longest lengths, per block size
    lengths = sorted({r["length"] for r in rows})
    if len(lengths) > 1:
        data["slopes"] = {}
        for block in sorted({r["block"] for r in rows}):
            a, b = (next(r for r in rows if r["length"] == n and r["block"] == block) for n in lengths[-2:])
            span = b["length"] - a["length"]
            data["slopes"][block] = dict(plain=(b["peak_plain"] - a["peak_plain"]) / span,
                                         walked=(b["peak_walked"] - a["peak_walked"]) / span)
    publish("attention_sublayer", data, render, started)
    return 0


def render(data: dict) -> str:
    meta = data["meta"]
    lines = ["# The attention sublayer walked in query blocks: a probe (issue 36's next step)", "",
             f"`{data['command']}`; {meta['date_utc']}, torch {meta['torch']}, {meta['nproc']} cores. Not an operator "
             "and wired into no pass: bench/attention_sublayer.py's docstring says what it runs. torchtitan's "
             "deepseek_v3 debug MoE block (MLA: 16 heads, qk 192, v 128), one rank, fp32, forward + backward under a "
             "non-reentrant checkpoint (FullAC), peak at the live-storage tracker; the block as it runs uses torch's "
             "fused CPU kernel with v padded (the MoP layout's attention).", ""]
    table = [[f"{r['length']:,}", f"{r['block']:,}", fmt_bytes(r["peak_plain"]), fmt_bytes(r["peak_walked"]),
              f"{r['peak_walked'] / r['peak_plain']:.2f}", f"{r['seconds_plain']:.2f} s", f"{r['seconds_walked']:.2f} s",
              f"{r['loss_rel']:.1e}", f"{r['grad_rel_max']:.1e}", f"{r['routed_rel_max']:.1e}"]
             for r in data["rows"]]
    lines += [markdown_table(["L", "query block", "block as it runs", "walked", "ratio", "time as it runs",
                              "time walked", "loss rel. diff", f"max rel. diff, {data['rows'][0]['grads']} gradients "
                              "(input, attention, norms, router, shared expert)",
                              f"routed experts ({data['rows'][0]['routed']}, bf16 matmuls)"], table), ""]
    for block, sl in (data.get("slopes") or {}).items():
        lines += [f"Peak per token between the two longest lengths, query blocks of {block}: {sl['plain'] / 1024:.1f} "
                  f"KiB as it runs, {sl['walked'] / 1024:.1f} KiB walked ({sl['walked'] / sl['plain']:.2f}x)."]
    lines += [""]
    lines += ["What is left at O(L) walked: x and its gradient, k and v (and MLA's [L, 16, 256] kv up-projection they "
              "are views of), their gradients, the block's output; the next step is k / v kept on the host or "
              "recomputed per key block from MLA's latent, the FFN in blocks once the attention no longer binds, "
              "and the op, its pass and bound, through plan and the MoP layout (docs/chunked_attention.md)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
