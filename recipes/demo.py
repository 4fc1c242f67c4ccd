"""The README's main demo: boundpass on torchtitan's deepseek_v3 debug MoE model (vocab enlarged) on CPU.

    python -m boundpass.recipes.demo                          # one process, Ring-DTP at P = 1
    torchrun --nproc-per-node 2 -m boundpass.recipes.demo     # two gloo ranks, Ring-DTP at P = 2

It compiles model + torchtitan's loss (and the AdamW optimizer) with boundpass, prints the explain report, trains a
few steps beside the uncompiled model with torch AdamW (same weights, same batches) and prints both losses, measures the peak RSS of
one training step with and without the rewrite (fresh subprocesses), and shows the fail-fast error of an
infeasible budget.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import textwrap

import torch
import torch.distributed as dist

import boundpass
from boundpass.measure.memtrack import rss_peak_in_subprocess
from boundpass.core.quiet import filter_upstream_warnings
from boundpass.recipes.models import build_debug_moe, torchtitan_loss
from boundpass.core.units import format_bytes

_STEP_RSS_SNIPPET = """
import torch, boundpass
from boundpass.recipes.models import build_debug_moe, torchtitan_loss
def setup():
    torch.manual_seed(0)
    model = build_debug_moe("deepseek_v3", vocab_size={vocab}, seq_len={seq})
    loss_fn = torchtitan_loss()
    step = boundpass.compile(model, budget="{budget}", loss_fn=loss_fn) if {rewrite} else (
        lambda t, y, n: loss_fn(model(t), y, n))
    tokens = torch.randint(0, {vocab}, ({batch}, {seq})); labels = torch.randint(0, {vocab}, ({batch}, {seq}))
    valid = (labels != -100).sum()
    step(tokens, labels, valid)[0].backward()  # warm-up: compile and first-touch allocations are excluded
    model.zero_grad(set_to_none=True)  # a step without gradient accumulation (what the budget certifies)
    return step, tokens, labels, valid
def measured(state):
    step, tokens, labels, valid = state
    step(tokens, labels, valid)[0].backward()
"""


def _say(rank, text=""):
    if rank == 0:
        print(text, flush=True)


def _batch(vocab, batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[:, :4] = -100  # torchtitan masks some positions (ignore_index): exercised from step 1
    return tokens, labels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=65_536, help="enlarged vocabulary (rows of lm_head)")
    parser.add_argument("--seq", type=int, default=512, help="sequence length")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=3, help="training steps to compare")
    parser.add_argument("--budget", default="1GiB", help="per-rank device budget")
    parser.add_argument("--infeasible-budget", default="900MiB", help="a budget to show the fail-fast error")
    parser.add_argument("--skip-rss", action="store_true", help="skip the peak-RSS measurement subprocesses")
    parser.add_argument("--verbose", action="store_true",
                        help="also show the upstream warnings boundpass filters (boundpass/core/quiet.py)")
    args = parser.parse_args(argv)
    if not args.verbose:
        filter_upstream_warnings()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    group = dist.group.WORLD if distributed else None
    tokens_per_rank = args.batch * args.seq
    _say(rank, f"== boundpass demo: torchtitan deepseek_v3 debugmodel, V={args.vocab}, {args.batch}x{args.seq} "
               f"tokens per rank, {world} rank(s) (Ring-DTP P={world}), budget {args.budget}")

    model = build_debug_moe("deepseek_v3", vocab_size=args.vocab, seq_len=args.seq)
    reference = copy.deepcopy(model)
    loss_fn = torchtitan_loss()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-4, foreach=False) for m in (model, reference)]
    # the optimizer is budgeted too: its moments do not fit beside parameters and gradients, so boundpass
    # swaps in OffloadStreamAdamW (state on the host, bit-identical updates); step compiled.optimizer
    compiled = boundpass.compile(model, budget=args.budget, loss_fn=loss_fn, ring_group=group,
                                 optimizer=optimizers[0])
    optimizers[0] = compiled.optimizer

    _say(rank, f"\n== training {args.steps} steps: boundpass-compiled vs the uncompiled model (same weights, batches)")
    worst = 0.0
    for step in range(1, args.steps + 1):
        tokens, labels = _batch(args.vocab, args.batch, args.seq, seed=1000 * step + rank)
        valid = (labels != -100).sum()
        if distributed:  # torchtitan normalises by the valid tokens of the whole data-parallel batch
            dist.all_reduce(valid)
        losses = []
        for run, module, opt in ((compiled, model, optimizers[0]),
                                 (lambda t, y, n: loss_fn(reference(t), y, n), reference, optimizers[1])):
            opt.zero_grad()
            loss, _ = run(tokens, labels, valid)
            loss.backward()
            if distributed:  # data-parallel gradient sum (what FSDP/DDP do); Ring-DTP's dW relies on it
                for p in module.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
            opt.step()
            losses.append(loss.detach())
        if distributed:
            for loss in losses:
                dist.all_reduce(loss)
        worst = max(worst, abs(losses[0].item() - losses[1].item()) / abs(losses[1].item()))
        _say(rank, f"  step {step}: loss boundpass {losses[0].item():.6f}   uncompiled {losses[1].item():.6f}")
        if step == 1:
            _say(rank, "\n" + boundpass.explain(compiled).text(graph="excerpt") + "\n")
    _say(rank, f"  largest relative loss difference: {worst:.2e} (fp32; MoE experts run their matmuls in bf16)")

    # the promise itself: the whole step, measured with real tensors, against the peak compile certified
    from boundpass.testing.whole_step import measured_step_peak
    batch = _batch(args.vocab, args.batch, args.seq, seed=rank)
    valid = (batch[1] != -100).sum()
    if distributed:
        dist.all_reduce(valid)
    measured = measured_step_peak(compiled, model, optimizers[0], [(*batch, valid)] * 2)
    certified = boundpass.explain(compiled).table.total
    _say(rank, "\n== the whole step vs the budget (parameters, buffers, gradients, optimizer state, every activation;"
               " live-storage tracker, real tensors)")
    _say(rank, f"  budget {format_bytes(compiled.budget)}  >=  certified peak {format_bytes(certified)}  >=  "
               f"measured peak {format_bytes(measured)}  ({certified / measured:.3f}x measured)")
    if not measured <= certified <= compiled.budget:
        _say(rank, "  THE CERTIFIED PEAK DOES NOT HOLD: this is a bug, please report it")
        return 1

    if not args.skip_rss and not distributed:
        _say(rank, "\n== peak RSS growth of one training step (fresh subprocess each, after a warm-up step)")
        fields = dict(vocab=args.vocab, seq=args.seq, batch=args.batch, budget=args.budget)
        eager = rss_peak_in_subprocess(_STEP_RSS_SNIPPET.format(rewrite=False, **fields))
        bounded = rss_peak_in_subprocess(_STEP_RSS_SNIPPET.format(rewrite=True, **fields))
        logits = tokens_per_rank * args.vocab * 4
        _say(rank, f"  uncompiled torchtitan step : {format_bytes(eager)}   ([N, V] fp32 logits alone: "
                   f"{format_bytes(logits)})")
        _say(rank, f"  boundpass-compiled step    : {format_bytes(bounded)}   ({bounded / eager:.2f}x)")

    _say(rank, f"\n== fail fast: the same model at budget {args.infeasible_budget}")
    torch._dynamo.reset()
    tight = boundpass.compile(copy.deepcopy(reference), budget=args.infeasible_budget, loss_fn=loss_fn,
                              ring_group=group)
    tokens, labels = _batch(args.vocab, args.batch, args.seq, seed=rank)
    try:
        tight(tokens, labels, (labels != -100).sum())
        _say(rank, "  unexpectedly fit: raise --vocab or lower --infeasible-budget")
        return 1
    except boundpass.InfeasibleBudgetError as err:
        _say(rank, textwrap.indent(str(err).split("\nbounds table:")[0], "  "))
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
