"""The tile C_s of the attention sublayer in query blocks against its time: the curve the time model's blocks
constants are fitted to (boundpass/bound/cost_model.py, BLOCKS_*), and the knee the model gives beside the measured one.

One forward + backward of boundpass::attention_blocks (runtime/attention_blocks.py) at torchtitan's deepseek_v3
MLA shape: hidden 256, 16 heads, q / k head dim 192, v head dim 128, bf16, one sequence, a kv program (k and v made
per key tile), k, v and the backward's q, dO, dq on the host; one thread. Per (L, C_s): the least of ``--repeats`` runs
(time on a noisy 2-core machine: the least is the op's, the rest is the neighbours'). Writes
docs/results/attention_knee.json and .md.

    python bench/attention_knee.py [--lengths 2048,4096,8192] [--chunks 64,128,256,512,1024]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from bench.common import fmt_seconds, markdown_table, publish, run_metadata
from boundpass.bound import cost_model
from boundpass.runtime import attention_blocks as ab

HIDDEN, HEADS, D, D_V = 256, 16, 192, 128


class Query(torch.nn.Module):
    def forward(self, n, x, w):
        return F.linear(x, w).view(1, n, HEADS, D).transpose(1, 2)


class KV(torch.nn.Module):
    def forward(self, n, x, wk, wv):
        k = F.linear(x, wk).view(1, n, HEADS, D)
        return k.transpose(1, 2), F.linear(x, wv).view(1, n, HEADS, D_V).transpose(1, 2)


class Out(torch.nn.Module):
    def forward(self, n, o, w):
        return F.linear(o.transpose(1, 2).reshape(1, n, -1), w)


def one_step(length: int, chunk: int) -> float:
    g = torch.Generator().manual_seed(length)
    t = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).bfloat16().requires_grad_()  # noqa: E731
    x, wq, wk, wv, wo = t(1, length, HIDDEN), t(HEADS * D, HIDDEN), t(HEADS * D, HIDDEN), t(HEADS * D_V, HIDDEN), \
        t(HIDDEN, HEADS * D_V)
    start = time.perf_counter()
    y = ab.sublayer(Query(), Out(), [x], [wq, wk, wv, wo], row_dims=(1,), query_params=1, kv=KV(), kv_params=2,
                    chunk=chunk, offload=True)
    torch.autograd.grad(y, [x, wq, wk, wv, wo], torch.randn_like(y))
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--chunks", default="64,128,256,512,1024")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--reuse", action="store_true",
                   help="re-render docs/results/attention_knee.json's measured points against the model as it is now")
    args = p.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)
    rows = []
    if args.reuse:
        from bench.common import RESULTS_DIR
        import json
        old = json.loads((RESULTS_DIR / "attention_knee.json").read_text())
        rows = [dict(r, model_seconds=cost_model.chunked_attention_seconds(r["C_s"], B=1, L=r["L"], A_q=HEADS, D=D,
                                                                          D_v=D_V, blocks=True)) for r in old["rows"]]
        args.lengths, meta = "", old["meta"]
    for length in (int(s) for s in args.lengths.split(",") if s):
        for chunk in (int(s) for s in args.chunks.split(",")):
            if chunk > length or (length >= 8192 and chunk < 128):   # hours of tiny tiles
                continue
            seconds = min(one_step(length, chunk) for _ in range(args.repeats))
            model = cost_model.chunked_attention_seconds(chunk, B=1, L=length, A_q=HEADS, D=D, D_v=D_V, blocks=True)
            rows.append(dict(L=length, C_s=chunk, seconds=seconds, model_seconds=model))
            print(f"attention_knee: L={length} C_s={chunk}: {seconds:.3f} s (model {model:.3f} s)", flush=True)
    knees = []
    for length in sorted({r["L"] for r in rows}):
        curve = {r["C_s"]: r["seconds"] for r in rows if r["L"] == length}
        lo, hi = min(curve), max(curve)
        knees.append(dict(L=length, measured=cost_model.knee(curve),
                          model=cost_model.chunked_attention_knee(lo=lo, hi=hi, B=1, L=length, A_q=HEADS, D=D,
                                                                  D_v=D_V, blocks=True)))
    publish("attention_knee", dict(meta=meta if args.reuse else run_metadata(), rows=rows, knees=knees), render,
            started)


def render(data: dict) -> str:
    meta = data["meta"]
    lines = ["# The attention sublayer's tile C_s against its time (the time model's blocks constants)", "",
             f"bench/attention_knee.py, {meta['date_utc']}, torch {meta['torch']}, one thread. One forward + "
             "backward of boundpass::attention_blocks at torchtitan's deepseek_v3 MLA shape (hidden 256, 16 heads, "
             "D 192, D_v 128, bf16, a kv program, k / v / q / dO on the host), the least of the repeats; beside it the "
             "time model (boundpass/bound/cost_model.py, blocks=True). The knee: the narrowest C_s within "
             f"{cost_model.KNEE_TOLERANCE:.0%} of the curve's best.", "",
             markdown_table(["L", "C_s", "measured", "model", "model / measured"],
                            [[f"{r['L']:,}", str(r["C_s"]), fmt_seconds(r["seconds"]), fmt_seconds(r["model_seconds"]),
                              f"{r['model_seconds'] / r['seconds']:.2f}"] for r in data["rows"]]), "",
             markdown_table(["L", "knee measured", "knee of the model"],
                            [[f"{k['L']:,}", str(k["measured"]), str(k["model"])] for k in data["knees"]])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
