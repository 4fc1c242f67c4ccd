"""The narrow interface through which `boundpass.plan` gets its models (nothing here imports torch).

The planner (boundpass/plan.py, boundpass/block_trace.py) knows how to read a torchtitan-style decoder (an
embedding, ``layers`` of blocks with ``attention`` and ``moe`` / ``feed_forward``, a final norm, an lm_head),
not where such a decoder comes from. A *model source* says that:

  resolve(model) -> str          the canonical family name, or BoundpassInputError naming the known ones;
                                 cheap: no torch, no model package imported (the CLI's < 1 s refusal)
  flavors(model) -> tuple | None every flavor the family's registry has, read without importing it (None: not
                                 knowable before import; the flavor is then checked by config())
  config(model, flavor, *, seq_len=None)
                                 the family's decoder config of that flavor, its attention swapped for a
                                 CPU-traceable causal kernel, buildable on meta; BoundpassInputError with the reason
                                 when the flavor cannot be planned (its package needs a kernel package that is
                                 missing, it has no MoE block, a token mixer the composed budget does not model)
  notes(model, flavor) -> list   what the plan report should say about this model (parts not modelled)
  loss()                         the training loss as the family's trainer runs it: loss(logits, labels, tokens)

The torchtitan source is `boundpass.recipes.families.SOURCE` (recipes/families.py): the one place that knows
torchtitan's package layout and registries. The core names it only as the default below, by import path, and
imports it on first use; any other object with these methods can be passed as ``source=`` to `boundpass.plan`.
"""
from __future__ import annotations

import importlib
from typing import Any, Protocol

DEFAULT_SOURCE = "boundpass.recipes.families:SOURCE"


class ModelSource(Protocol):
    def resolve(self, model: str) -> str: ...

    def flavors(self, model: str) -> tuple[str, ...] | None: ...

    def config(self, model: str, flavor: str, *, seq_len: int | None = None) -> Any: ...

    def notes(self, model: str, flavor: str) -> list[str]: ...

    def loss(self) -> Any: ...


_default: ModelSource | None = None


def default_source() -> ModelSource:
    """The torchtitan source (imported on first use; it imports nothing heavy until asked for a config)."""
    global _default
    if _default is None:
        module, _, name = DEFAULT_SOURCE.partition(":")
        _default = getattr(importlib.import_module(module), name)
    return _default
