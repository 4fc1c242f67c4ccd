"""boundpass.planning.block_trace: a block's forward + backward peak from its AOTAutograd graphs, in symbolic tokens,
against the same block's fwd + bwd measured with real tensors (LiveStorageTracker: live tensor storages).

Traced once with the token dimension a SymInt (one sympy expression in N), evaluated at several N; measured at
each N. Both leave the block's input (a checkpoint boundary, counted by its own term) out and count the weights'
gradients (backward allocates them); the output and its incoming gradient are live through backward in both.
"""
from __future__ import annotations

import pytest
import sympy
import torch

from boundpass.core import symbols as sym
from boundpass.planning.block_trace import block_peak, block_phases
from boundpass.measure.memtrack import LiveStorageTracker


class PlainBlock(torch.nn.Module):
    """Pre-norm transformer-style block: RMSNorm, causal SDPA attention, RMSNorm, SwiGLU MLP, residuals."""

    def __init__(self, hidden=64, heads=4, mlp=176):
        super().__init__()
        self.heads = heads
        self.attention_norm = torch.nn.RMSNorm(hidden)
        self.attention = torch.nn.ModuleDict({"wqkv": torch.nn.Linear(hidden, 3 * hidden, bias=False),
                                              "wo": torch.nn.Linear(hidden, hidden, bias=False)})
        self.ffn_norm = torch.nn.RMSNorm(hidden)
        self.feed_forward = torch.nn.ModuleDict({"w1": torch.nn.Linear(hidden, mlp, bias=False),
                                                 "w3": torch.nn.Linear(hidden, mlp, bias=False),
                                                 "w2": torch.nn.Linear(mlp, hidden, bias=False)})

    def forward(self, x):
        B, T, H = x.shape
        q, k, v = self.attention["wqkv"](self.attention_norm(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(B, T, self.heads, H // self.heads).transpose(1, 2) for t in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.attention["wo"](a.transpose(1, 2).reshape(B, T, H))
        f = self.feed_forward
        n = self.ffn_norm(h)
        return h + f["w2"](torch.nn.functional.silu(f["w1"](n)) * f["w3"](n))


def _measured(block, tokens, dtype):
    torch.manual_seed(0)
    x = torch.randn(1, tokens, 64, dtype=dtype, requires_grad=True)
    block.zero_grad(set_to_none=True)
    with LiveStorageTracker() as tracker:  # x exists before: not counted (a boundary)
        y = block(x)
        dy = torch.randn_like(y)
        y.backward(dy)
    return tracker.peak_bytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_traced_peak_of_a_plain_block_matches_its_measured_fwd_bwd_at_every_n(dtype):
    block = PlainBlock().to(dtype)
    x = torch.empty(1, 256, 64, dtype=dtype, device="meta", requires_grad=True)
    peak, token = block_peak(block, (x,), weight_grads=True)
    assert token is sym.N
    expr = peak.peak_expr()
    assert expr.free_symbols == {sym.N}
    for tokens in (64, 256, 1000, 2048):
        traced = int(sympy.ceiling(expr.subs(sym.N, tokens)))
        measured = _measured(block, tokens, dtype)
        print(f"{dtype} N={tokens}: traced {traced} B, measured {measured} B, ratio {traced / measured:.4f}")
        assert measured <= traced <= 1.10 * measured, (tokens, traced, measured)


def test_concrete_tokens_and_weight_gradients_left_out():
    block = PlainBlock()
    x = torch.empty(1, 512, 64, device="meta", requires_grad=True)
    concrete, token = block_peak(block, (x,), symbolic_tokens=False, weight_grads=True)
    symbolic, _ = block_peak(block, (x,), weight_grads=True)
    assert token is None and concrete.peak_expr().is_number
    assert int(concrete.peak_expr()) == int(symbolic.peak_expr().subs(sym.N, 512))
    without, _ = block_peak(block, (x,))
    grads = sum(p.numel() * 4 for p in block.parameters())
    at = int(without.peak_expr().subs(sym.N, 512))
    assert int(symbolic.peak_expr().subs(sym.N, 512)) - grads <= at < int(symbolic.peak_expr().subs(sym.N, 512))


def test_phases_split_backward_at_the_attention_and_cover_the_peak():
    block = PlainBlock()
    x = torch.empty(1, 128, 64, device="meta", requires_grad=True)
    # PlainBlock calls its FFN's linears, not the ModuleDict: tag its norm and linears
    tags = {"attention": "attention", "attention.wo": "wo", "ffn_norm": "ffn", "feed_forward.w1": "ffn",
            "feed_forward.w3": "ffn", "feed_forward.w2": "ffn"}
    trace = block_phases(block, (x,), tags=tags)
    # no tagged kernel module here: the attention's backward is everything from its output projection on
    values = {name: int(sympy.ceiling(e.subs(sym.N, 128))) for name, e in trace.phases.items()}
    assert set(values) == {"forward", "ffn_backward", "attention_backward", "tail_backward", "forward_attention",
                           "forward_ffn"}
    assert max(values.values()) == int(sympy.ceiling(trace.peak_expr().subs(sym.N, 128)))
    # the forward split at the FFN's first node (the composed budget's W > 1 terms): its parts make the forward
    assert max(values["forward_attention"], values["forward_ffn"]) == values["forward"]
    assert values["forward_attention"] > 0 and values["forward_ffn"] > 0
    assert values["ffn_backward"] > 0 and values["attention_backward"] > 0


@pytest.mark.parametrize("layer", [0, 1], ids=["dense", "moe"])
def test_traced_torchtitan_deepseek_block_matches_its_measured_fwd_bwd(layer):
    """torchtitan's real deepseek_v3 debug blocks (MLA through SeqToHeadAttention on one rank: the fused kernel;
    the MoE block with its router, EP = 1 token dispatch and grouped experts: at EP = 1 the dispatch's shapes
    do not depend on the routing), traced once on meta-built weights, measured with real ones."""
    pytest.importorskip("torchtitan")
    from boundpass.planning.full_scale import fuse_unequal_head_dims, model_config
    cfg = model_config("deepseek_v3", "debugmodel", seq_len=1024)
    torch.manual_seed(0)
    block = cfg.layers[layer].build()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    fuse_unequal_head_dims(block, cfg.layers[layer].attention)
    x = torch.empty(1, 8, cfg.dim, device="meta", requires_grad=True)
    peak, _ = block_peak(block, (x, None, None), weight_grads=True)
    expr = peak.peak_expr()  # one symbolic peak, evaluated at each N
    for tokens in (256, 1024):
        xr = torch.randn(1, tokens, cfg.dim, requires_grad=True)
        block.zero_grad(set_to_none=True)
        with LiveStorageTracker() as tracker:
            y = block(xr, None, None)
            y.backward(torch.randn_like(y))
        traced = int(sympy.ceiling(expr.subs(sym.N, tokens)))
        measured = tracker.peak_bytes()
        print(f"deepseek_v3 layer {layer} N={tokens}: traced {traced} B, measured {measured} B, "
              f"ratio {traced / measured:.4f}")
        assert measured <= traced <= 1.10 * measured


_FORKED_CHILD = """
import json, time
import torch
from boundpass.planning import block_trace
from boundpass.planning.full_scale import model_config
cfg = model_config("deepseek_v3", "debugmodel")
with torch.device("meta"):
    net = cfg.build()
block_trace.FORK_CAPTURES = True
assert block_trace.can_fork(), "a fresh process on this machine cannot fork its captures"
lines = []
forked = block_trace.trace_torchtitan_blocks(net, cfg.layers[-1].attention, one_rank=False, progress=lines.append)
checks = [block_trace.forked(lambda: ("terms", 2))(), block_trace.forked(lambda: 1 / 0)()]
block_trace.FORK_TIMEOUT_S = 0.5
checks.append(block_trace.forked(lambda: time.sleep(30))())
print(json.dumps({"terms": [str(t) for t in forked], "lines": lines, "checks": checks}))
"""


def test_forked_block_capture_gives_the_serial_terms():
    """FORK_CAPTURES (the plan CLI): the MoE block of a model with both kinds is captured in a forked second
    process; the terms are the serial ones, in the same order. A child that raises, or runs past FORK_TIMEOUT_S,
    returns None (the caller then traces that block itself). The forking runs in a fresh single-threaded process, as
    the CLI is (a pytest-xdist worker has other threads, and block_trace does not fork there)."""
    pytest.importorskip("torchtitan")
    import json
    import subprocess
    import sys

    from boundpass.planning import block_trace
    from boundpass.planning.full_scale import model_config
    cfg = model_config("deepseek_v3", "debugmodel")
    with torch.device("meta"):
        net = cfg.build()
    serial = block_trace.trace_torchtitan_blocks(net, cfg.layers[-1].attention, one_rank=False)
    assert [k for k, _, _ in serial] and {k for k, _, _ in serial} == {"dense_wide", "moe_wide"}
    child = subprocess.run([sys.executable, "-c", _FORKED_CHILD], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["terms"] == [str(t) for t in serial]
    assert any(line.startswith("tracing the first moe block") and "(in a second process)" in line
               for line in out["lines"]), out["lines"]
    assert out["checks"] == [["terms", 2], None, None]


@pytest.mark.parametrize("head", ["full_logits", "ring_dtp"])
def test_traced_torchtitan_head_matches_its_measured_fwd_bwd(head):
    """torchtitan's loss head (final norm + lm_head + CrossEntropyLoss, or the Ring-DTP op on one rank with its
    declared workspace), traced once at symbolic N on meta weights, against the same head run with real tensors:
    the head's input, its labels and its weight gradients counted in both."""
    pytest.importorskip("torchtitan")
    from boundpass.planning.block_trace import _Head, trace_torchtitan_head
    from boundpass.planning.full_scale import model_config
    cfg = model_config("deepseek_v3", "debugmodel")
    with torch.device("meta"):
        meta_net = cfg.build()
    traced = {which: expr for _, which, expr in trace_torchtitan_head(meta_net)}
    torch.manual_seed(0)
    norm, lm_head = cfg.norm.build(), cfg.lm_head.build()
    for m in (norm, lm_head):
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02)
    module = _Head(norm, lm_head, head == "ring_dtp")
    for tokens in (256, 1024):
        module.zero_grad(set_to_none=True)
        with LiveStorageTracker() as tracker:
            h = torch.randn(1, tokens, cfg.dim, requires_grad=True)
            module(h).backward()
        # the strip width C of the op's declared workspace at the op's default (0: the whole vocabulary)
        value = traced[head].subs({sym.N: tokens, sym.C: lm_head.weight.shape[0]})
        traced_bytes, measured = int(sympy.ceiling(value)), tracker.peak_bytes()
        print(f"head {head} N={tokens}: traced {traced_bytes} B, measured {measured} B, "
              f"ratio {traced_bytes / measured:.4f}")
        assert measured <= traced_bytes <= 1.10 * measured
