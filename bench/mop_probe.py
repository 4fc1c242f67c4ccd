"""Where one MoP step's peak is, segment by segment: a diagnostic for tightening the certificate (not a bench).

Runs the MoP layout on 4 gloo ranks at one length with the attention in tiles (bench/reach.py's trainer settings),
and during step 2 reads the counting CPU allocator (boundpass/measure/counting_allocator.py; the host buffers set
aside as the benches do) at the entry and exit of each tiles op (put, attend, attend_bwd, take): the live bytes
there and the peak since the last read. The segment from one block's `take` to the next `put` is that block's
tail (its input projections' backward) and the start of the next block's recompute. On rank 0 it also lists every
live CPU tensor (shape, dtype, the allocator's bytes) at each `take`'s exit, from the garbage collector's view:
what the certificate's terms stand for, tensor by tensor. Beside it, the certificate's total and binding term.

This is how docs/plan.md's boundaries-and-gradients position law and the wide trace's own gradients were found
(2026-12-08: at L = 8,192, 292.6 MiB measured against 321.7 MiB certified before, 298.6 after).

    python bench/mop_probe.py --seq 8192 --budget 384MiB --tiles 256 [--list 40]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.reach as reach
from bench.common import fmt_bytes
from bench.e2e import host_storages_tensors, trainer_rank_setup

TILES_OPS = ("tiles_put", "tiles_attend", "tiles_attend_backward", "tiles_take")


def _live_tensors(host: set) -> list:
    """(allocator bytes, shape, dtype, type) of every live CPU storage a Python tensor names, host buffers out."""
    import gc

    import torch

    from boundpass.measure import counting_allocator
    seen = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            t = getattr(obj, "_local_tensor", obj)
            if t.is_meta or t.device.type != "cpu":
                continue
            ptr = t.untyped_storage().data_ptr()
        except (ReferenceError, RuntimeError):  # a dead weak proxy; a fake / functional tensor a trace left
            continue
        if ptr and ptr not in seen and ptr not in host:
            seen[ptr] = (counting_allocator.block_bytes(t), list(t.shape), str(t.dtype), type(obj).__name__)
    return sorted(seen.values(), key=lambda item: -item[0])


def _job(rank, world, assets, args, vocab):
    trainer_rank_setup(assets)
    from boundpass.measure import counting_allocator
    from boundpass.runtime import seq_to_head_tiles
    reach.pad_v_attention()
    import tempfile
    dump = tempfile.TemporaryDirectory(prefix="bp_probe_")
    trainer = reach.configure([*args[:-1], "--dump_folder", dump.name, args[-1]], vocab).build()
    marks, lists, host, recording = [], [], set(), [False]

    def read(name, where):
        marks.append((name, where, counting_allocator.live_bytes(), counting_allocator.peak_bytes()))
        counting_allocator.reset_peak()

    def wrapped(name, fn):
        def op(*a, **k):
            if recording[0]:
                read(name, "enter")
            out = fn(*a, **k)
            if recording[0]:
                if name == "tiles_take" and rank == 0:
                    lists.append(_live_tensors(host))
                read(name, "exit")
            return out
        return op
    # the custom ops call these module functions by name: wrapped for this process only
    for name in TILES_OPS:
        setattr(seq_to_head_tiles, name, wrapped(name, getattr(seq_to_head_tiles, name)))
    try:
        data = trainer.batch_generator(trainer.dataloader)
        trainer.step = 1
        trainer.train_step(data)
        table = max(trainer._tables(), key=lambda t: t.total)
        out = dict(certified=trainer.certified_peak(), binding=table.binding().name)
        trainer.step = 2
        trainer.optimizers.zero_grad(set_to_none=True)
        for t in host_storages_tensors(trainer):
            counting_allocator.exclude(t)
            host.add(t.untyped_storage().data_ptr())
        counting_allocator.reset_peak()
        out["start"] = counting_allocator.live_bytes()
        recording[0] = True
        trainer.train_step(data)
        recording[0] = False
        read("step", "end")
        out.update(marks=marks, lists=lists)
        return out
    finally:
        trainer.close()
        dump.cleanup()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deepseek_v3", choices=sorted(reach.CONFIGS))
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--budget", default="384MiB")
    p.add_argument("--tiles", type=int, default=256, help="C_s of the attention in tiles")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--list", type=int, default=30, help="how many of the largest live tensors to print per take")
    p.add_argument("--out", help="a JSON file for everything read")
    args = p.parse_args(argv)
    from boundpass.recipes.assets import ensure_assets
    from boundpass.testing.distributed import run_on_ranks
    reach.MOP_ATTENTION_TILES[0] = True
    trainer_args = reach.trainer_args("mop", args.model, args.seq, ep=reach.MOP_EP, ac="full", chunk_tokens=256,
                               budget=args.budget, host_budget="16GiB", steps=2)
    trainer_args = [*trainer_args[:-1], "--boundpass.attention.chunk", str(args.tiles), trainer_args[-1]]
    assets = str(Path(ensure_assets()["tokenizer"]).parent)
    ranks = run_on_ranks(_job, reach.WORLD, assets, trainer_args, args.vocab, timeout_s=3600)
    if args.out:
        Path(args.out).write_text(json.dumps(ranks))
    first = ranks[0]
    peak = max(m[3] for r in ranks for m in r["marks"])
    print(f"L = {args.seq}, tiles of {args.tiles}: certified {fmt_bytes(first['certified'])}, measured "
          f"{fmt_bytes(peak)} ({first['certified'] / peak:.3f}x); binding: {first['binding']}")
    print(f"rank 0, live at the step's start {fmt_bytes(first['start'])}; per read: live, peak since the last read")
    for name, where, live, since in first["marks"]:
        print(f"  {name:<22} {where:<5} {fmt_bytes(live):>11} {fmt_bytes(since):>11}")
    for i, items in enumerate(first["lists"]):
        print(f"live tensors at take {i + 1} (block {len(first['lists']) - i - 1}'s attention backward), largest "
              f"{args.list} of {len(items)}, {fmt_bytes(sum(x[0] for x in items))} in all:")
        for nbytes, shape, dtype, kind in items[:args.list]:
            print(f"  {fmt_bytes(nbytes):>11} {shape} {dtype} {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
