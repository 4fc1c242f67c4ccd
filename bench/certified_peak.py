"""What binds a whole step's certificate, at any length: torchtitan's trainer on the deepseek_v3 debug recipe (1 rank,
batch 1, FullAC, per-block compile, bf16), boundpass with the attention and feed-forward passes, run certify-only
(`--boundpass.certify_only`: every graph compiled and checked, no block computing, so a 128K-token step costs its
compile), then each block graph's certified peak: the program point and its largest live storages (module path,
shape, dtype, bytes; the op's own workspace first). What the next region to bound is, read off the certificate.

    python bench/certified_peak.py 32768 [--budget 2GiB] [--top 30] [-- more --boundpass options]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from boundpass.testing.distributed import run_on_ranks

PASSES = ("--boundpass.attention.enable", "--boundpass.feed_forward.enable", "--boundpass.rope_to_seq_len")


def certified_points(rank, world, assets: str, seq: int, budget: str, top: int, extra: tuple) -> str:
    from bench.e2e import reach_args, trainer_rank_setup
    trainer_rank_setup(assets)
    from boundpass.measure.step_peak import render_point
    from boundpass.recipes.train import config_manager_class
    dump = tempfile.TemporaryDirectory(prefix="bp_certified_peak_")
    args = reach_args("boundpass", seq, budget, "aot_eager", 128, "64GiB", 2, dump.name,
                       (*PASSES, "--boundpass.certify_only", *extra))
    trainer = config_manager_class()().parse_args(args).build()
    data = trainer.batch_generator(trainer.dataloader)
    trainer.step = 1
    try:
        trainer.train_step(data)
    except trainer.CertifiedOnly:
        pass
    lines = [f"L = {seq}: certified {trainer.certified_peak()} B (budget {budget})"]
    for i, cert in enumerate(trainer.blocks.certificates):
        lines.append(f"--- block graph certificate {i}: {cert.table.total} B")
        lines += render_point(cert.peak, cert.point, cert.values, top=top)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("seq", type=int)
    p.add_argument("--budget", default="2GiB")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("extra", nargs="*", help="more trainer options (after --)")
    args = p.parse_args(argv)
    from boundpass.recipes.assets import ensure_assets
    assets = str(Path(tempfile.gettempdir()) / "bp_assets")
    ensure_assets(assets)
    print(run_on_ranks(certified_points, 1, assets, args.seq, args.budget, args.top, tuple(args.extra),
                       timeout_s=3600)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
