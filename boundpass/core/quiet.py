"""Upstream warnings a boundpass user cannot act on, filtered one by one at boundpass's entry points.

`python -m boundpass` (the plan CLI), the demo (`python -m boundpass.recipes.demo`) and the torchtitan recipe
(`boundpass.recipes.train`, warnings only) call `filter_upstream_warnings()` before any work; `--verbose` (plan,
demo) skips it. Library calls
(`boundpass.compile`, `boundpass.plan.plan`) filter nothing: a program that imports boundpass keeps its own warning
policy. Each entry matches one exact message (a regex anchored at its start, as `warnings.filterwarnings` does)
and one category, never a whole module or category, so a new upstream warning still shows.

Not filtered: "Casting complex values to real discards the imaginary part", which the demo printed. It was
boundpass's own bug (recipes/models.py cast the model with Module.to(dtype), turning deepseek_v3's complex RoPE
cache into its real part: RoPE scaled instead of rotating), fixed there; if it shows again, something casts a
complex tensor and should not.
"""
from __future__ import annotations

import logging
import warnings

# (message regex, category, why a boundpass user cannot act on it)
UPSTREAM_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r"In CPU autocast, but the target dtype is not supported\. Disabling autocast\.", UserWarning,
     # torch/amp/autocast_mode.py, raised from torchtitan/models/common/moe.py (TokenChoiceTopKRouter): the router
     # computes its gate under torch.autocast(device_type=x.device.type, dtype=torch.float32); CPU autocast takes
     # only bf16 / fp16, so torch disables it for that block and warns at every router call (every MoE layer of
     # every forward, and every block plan traces). fp32 models (the demo) compute the same gate either way; on
     # a GPU the autocast applies. It is torchtitan's code, not the user's.
     "torchtitan's MoE router asks CPU autocast for fp32, which CPU autocast does not support"),
)


# (exact message of a WARNING record torchtitan logs on its logger, the root logger; why it cannot be acted on)
UPSTREAM_LOG_RECORDS: tuple[tuple[str, str], ...] = (
    ("initial_load_model_only=True has no effect without an initial_load_path.",
     # torchtitan/components/checkpointer/base.py logs it when a Trainer.Config is built: the debug model's config
     # (recipes/models.py: debug_moe_config, used by the demo and the tests) keeps the checkpoint defaults, and
     # nothing there loads a checkpoint. The recipe does not filter it: there the checkpoint config is the user's.
     "the debug model's torchtitan config keeps checkpoint defaults; the demo loads no checkpoint"),
)


class _UpstreamLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(record.getMessage() == message for message, _ in UPSTREAM_LOG_RECORDS)


LOG_FILTER = _UpstreamLogFilter()  # on torchtitan's logger (the root logger); removeFilter(LOG_FILTER) undoes it


def filter_upstream_warnings(*, log_records: bool = True) -> None:
    """Ignore exactly the warnings in UPSTREAM_WARNINGS (message and category) for the rest of this process, and
    (log_records) the torchtitan log records in UPSTREAM_LOG_RECORDS."""
    for message, category, _ in UPSTREAM_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    if log_records:
        logging.getLogger().addFilter(LOG_FILTER)  # a set: adding it twice keeps one
