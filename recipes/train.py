"""Entry point: torchtitan's own `torchtitan.train.main`, with the boundpass section and (only without a GPU) CPU shims.

    torchrun --nproc-per-node 2 -m boundpass.recipes.train --module boundpass.recipes \
        --config deepseek_v3_debug_ep2 --boundpass.budget 2GiB

`--module/--config` may also name any stock torchtitan config (`--module deepseek_v3 --config
deepseek_v3_debugmodel`): its Trainer.Config is upgraded to BoundpassTrainer.Config with boundpass off, so the
same command without `--boundpass.budget` trains exactly as torchtitan does. Configs that read torchtitan's
test assets (`c4_test` + `./tests/assets/tokenizer`) are pointed at locally generated ones (recipes/assets.py).
"""
from __future__ import annotations

import os

from boundpass.core.quiet import filter_upstream_warnings
from boundpass.recipes import cpu_support


def config_manager_class():
    from torchtitan.config import ConfigManager
    from boundpass.recipes.assets import point_config_at_assets
    from boundpass.recipes.trainer import upgrade_config

    class BoundpassConfigManager(ConfigManager):
        """ConfigManager that adds the boundpass section, local assets and CPU adaptations before tyro parses."""

        def _load_config(self, args):
            loaded, rest = super()._load_config(args)
            loaded = upgrade_config(loaded)
            if loaded.hf_assets_path == "./tests/assets/tokenizer" and not os.path.isdir(loaded.hf_assets_path):
                point_config_at_assets(loaded)
            cpu_support.adapt_config(loaded)
            return loaded, rest

    return BoundpassConfigManager


def build_in_process(argv: list[str]):
    """Parse `argv` exactly as the command line would be and build the trainer (model built, parallelized and
    initialised, optimizer, dataloader); nothing is trained. The caller closes it. See `train_in_process`."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    cpu_support.apply_runtime_shims()
    filter_upstream_warnings(log_records=False)  # each one with its reason: boundpass/core/quiet.py
    import torch
    from torchtitan.tools.logging import init_logger

    init_logger()
    torch._dynamo.reset()  # a previous trainer's graphs must not be reused (they hold its modules)
    # torchtitan's init_distributed does this, but skips it when the process group already exists
    torch.autograd.set_multithreading_enabled(False)
    config = config_manager_class()().parse_args(list(argv))
    return config.build()


def train_in_process(argv: list[str]):
    """Parse `argv` exactly as the command line would be, build the trainer, train (or, with
    `--checkpoint.create_seed_checkpoint`, save the initial weights as torchtitan's main does), close; returns
    the trainer.

    For tests and benchmarks that run several trainings in one process (imports paid once). If
    torch.distributed is already initialised (e.g. by boundpass.testing.distributed.run_on_ranks), torchtitan
    reuses that process group.
    """
    trainer = build_in_process(argv)
    config = trainer.config
    try:
        if config.checkpoint.create_seed_checkpoint:  # torchtitan.train.main's branch: save the initial weights
            if int(os.environ.get("WORLD_SIZE", "1")) != 1 or not config.checkpoint.enable:
                raise ValueError("--checkpoint.create_seed_checkpoint needs one rank and --checkpoint.enable "
                                 "(torchtitan's own rule: the seed is saved unsharded)")
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    finally:
        trainer.close()
    return trainer


def main() -> None:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the datasets are local files: never reach the network
    shims = cpu_support.apply_runtime_shims()
    filter_upstream_warnings(log_records=False)  # each one with its reason: boundpass/core/quiet.py
    import torchtitan.train as tt_train
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    if shims:
        logger.info(f"[boundpass] no GPU: CPU shims applied: {', '.join(shims)}")
    tt_train.ConfigManager = config_manager_class()
    tt_train.main()


if __name__ == "__main__":
    main()
