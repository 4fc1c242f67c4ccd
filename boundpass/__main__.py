"""`python -m boundpass plan ...`: the composed per-rank budget of a torchtitan MoE model, before launch.

Arguments are parsed and validated (boundpass/core/plan_input.py) before torch or torchtitan is imported, so a bad one
is refused at once; while the plan runs, a progress line per model build and traced block goes to stderr.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

from boundpass.core.config import OPTIMIZER_SLOTS, OPTIMIZER_STAGING_BYTES, PLAN_BUDGET, PLAN_DISPATCH_CAP, PLAN_VOCAB_BLOCK
from boundpass.core.errors import BoundpassError
from boundpass.core.plan_input import LAYOUTS, OPERATORS, CostModel, locate, make_input


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m boundpass")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="does this model fit per-rank memory at this launch (and what does)")
    p.add_argument("model", help="torchtitan model package with a model_registry (recipes/families.py): "
                                 "deepseek_v3, qwen3, gpt_oss, kimi_k2_7, ...; or a Hugging Face transformers "
                                 "config: hf:path/to/config.json, hf:MixtralConfig (recipes/hf.py)")
    p.add_argument("flavor", nargs="?", default=None,
                   help="a MoE flavor of its registry, e.g. 671B, 235B-A22B, 120b, Kimi-K2.5, debugmodel "
                        "(none for a transformers config)")
    p.add_argument("--ranks", "-W", type=int, required=True, help="ranks W")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree E_p (divides W and E)")
    p.add_argument("--ring", "-P", type=int, default=None, help="Ring-DTP ring degree P (default W)")
    tokens = p.add_mutually_exclusive_group(required=True)
    tokens.add_argument("--tokens-per-rank", "-N", type=int, help="per-rank token ceiling N")
    tokens.add_argument("--context", type=int, help="tokens per sequence (N = context x global batch / W)")
    p.add_argument("--global-batch", type=int, default=1, help="sequences per step (with --context)")
    p.add_argument("--budget", default=PLAN_BUDGET, help=f"device bytes per rank (default {PLAN_BUDGET})")
    p.add_argument("--host-budget", default=None, help="host bytes per rank, e.g. 256GiB (default: unlimited)")
    p.add_argument("--operators", default=",".join(OPERATORS),
                   help=f"comma-separated subset of {','.join(OPERATORS)}; 'none' = the baseline")
    p.add_argument("--dtype", default="bf16", help="bf16 (default) or fp32")
    # boundpass.Config's knobs, --<section>-<field> (docs/config.md); default None: the value boundpass/core/config.py
    # defines for a knob no planner chooses (composed.Launch.resolved)
    p.add_argument("--dispatch-cap", type=int, default=None,
                   help=f"PipelinedLLEP chunk cap c (tokens per source per chunk; default {PLAN_DISPATCH_CAP})")
    p.add_argument("--dispatch-borrowed-slots", type=int, default=None,
                   help="PipelinedLLEP borrowed-expert slots s_b per EP rank (default E / E_p; 0: no relocation)")
    p.add_argument("--vocab-block", type=int, default=None, help=f"Ring-DTP strip width C (default {PLAN_VOCAB_BLOCK})")
    p.add_argument("--optimizer-bucket", type=int, default=None,
                   help=f"OffloadStreamAdamW bucket β (parameters; default: {OPTIMIZER_STAGING_BYTES >> 20} MiB of "
                        f"staging over {OPTIMIZER_SLOTS} slots)")
    p.add_argument("--optimizer-slots", type=int, default=None,
                   help=f"OffloadStreamAdamW staging slots S (default {OPTIMIZER_SLOTS})")
    p.add_argument("--sco-max-layers", type=int, default=None,
                   help="SCO offloads at most this many checkpoint boundaries (default: all the host budget holds)")
    p.add_argument("--routing", default="worst", choices=("worst", "balanced"),
                   help="standard EP's received rows: worst case (E_p N k) or balanced (N k)")
    p.add_argument("--layout", default="mop", choices=LAYOUTS,
                   help="mop: one sequence split over the ranks (boundpass's layout); dp: FSDP2's data parallelism, "
                        "whole sequences per rank (stock torchtitan), for a baseline with --operators none")
    p.add_argument("--loss-chunks", type=int, default=1,
                   help="torchtitan's chunked loss (--loss.num_chunks) without ring_dtp (default 1: full logits)")
    p.add_argument("--attention-tiles", type=int, default=0, metavar="C_s",
                   help="the MoP layout's attention in tiles of C_s rows, the whole sequence's tensors on the host "
                        "(the trainer's --boundpass.attention.enable under --boundpass.layout mop; default 0: the "
                        "whole-tensor exchange)")
    p.add_argument("--no-trace", action="store_true", help="skip tracing torchtitan's blocks (bounds only)")
    p.add_argument("--solve", action="store_true", help="also the largest context (or N) that fits")
    p.add_argument("--search", action="store_true",
                   help="choose E_p, P, c, beta, S and the SCO subset at the least predicted step time")
    p.add_argument("--flops", type=float, default=400e12, help="--search: sustained FLOP/s per rank")
    p.add_argument("--link-intra", type=float, default=400e9, help="--search: bytes/s per rank inside a node")
    p.add_argument("--link-inter", type=float, default=50e9, help="--search: bytes/s per rank across nodes")
    p.add_argument("--host-link", type=float, default=50e9, help="--search: bytes/s per rank host <-> device")
    p.add_argument("--gpus-per-node", type=int, default=8, help="--search: ranks per node")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table (formulas included)")
    p.add_argument("--formulas", action="store_true", help="also each term's sympy formula (under its row)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")
    p.add_argument("--verbose", action="store_true",
                   help="also show the upstream warnings boundpass filters (boundpass/core/quiet.py)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    ops = () if args.operators.strip().lower() in ("", "none") else tuple(
        o.strip() for o in args.operators.split(",") if o.strip())
    launch = dict(ranks=args.ranks, ep=args.ep, ring=args.ring, tokens_per_rank=args.tokens_per_rank,
                  context=args.context, global_batch=args.global_batch, budget=args.budget,
                  host_budget=args.host_budget, operators=ops, dtype=args.dtype, dispatch_cap=args.dispatch_cap,
                  dispatch_borrowed_slots=args.dispatch_borrowed_slots, vocab_block=args.vocab_block,
                  optimizer_bucket=args.optimizer_bucket,
                  optimizer_slots=args.optimizer_slots, sco_max_layers=args.sco_max_layers, routing=args.routing,
                  layout=args.layout, loss_chunks=args.loss_chunks, attention_tiles=args.attention_tiles)
    try:  # everything that needs no model, before torch is imported
        source, model, flavor = locate(args.model, args.flavor)
        make_input(model, flavor, **launch, source=source)
        cost = CostModel(flops=args.flops, link_intra=args.link_intra, link_inter=args.link_inter,
                         host_link=args.host_link, gpus_per_node=args.gpus_per_node)  # validated even without --search
    except BoundpassError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()

    def progress(message: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - start:5.1f}s] {message}", file=sys.stderr, flush=True)

    progress(f"importing torch and the model's library ({model} {flavor})")
    # The CLI's process (restored after the plan, for a caller of main()): most of what it builds lives until it
    # exits (modules, the model on meta, the graphs), so no automatic full collections, which walked all of that ~7
    # times a 671B plan (~0.8 s of CPU; young garbage is still collected, peak RSS measured the same); and the two
    # block kinds' graphs may be captured side by side (block_trace.FORK_CAPTURES: a forked second process).
    thresholds = gc.get_threshold()
    gc.set_threshold(*thresholds[:2], 1 << 30)
    try:
        if not args.verbose:
            from boundpass.core.quiet import filter_upstream_warnings
            filter_upstream_warnings()
        from boundpass.planning import block_trace
        from boundpass.planning.full_scale import as_json, plan
        block_trace.FORK_CAPTURES = True
        try:
            result = plan(model, flavor, **launch, source=source, do_trace=not args.no_trace, solve=args.solve,
                          search=cost if args.search else None, progress=progress)
        finally:
            block_trace.FORK_CAPTURES = False
    except BoundpassError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        gc.set_threshold(*thresholds)
    progress(f"done in {result.seconds:.1f} s")
    print(as_json(result) if args.json else result.render(formulas=args.formulas))
    return 0 if result.fits else 1


if __name__ == "__main__":
    code = main()
    # exiting: the interpreter's last full collections then skip all the plan built (~1 s of a 671B plan's wall time
    # went into walking it there); exit handlers and module teardown run as usual
    gc.freeze()
    # os._exit skips the interpreter's teardown, where triton's nanobind extension (imported through torch's Inductor)
    # prints "nanobind: leaked N instances / types / functions" (~27 lines a user cannot act on) to stderr
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
