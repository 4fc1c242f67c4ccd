"""The narrow interface through which `boundpass.plan` gets its models (nothing here imports torch).

The planner (boundpass/planning/full_scale.py, boundpass/planning/block_trace.py) knows how to read a torchtitan-style decoder (an
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
torchtitan's package layout and registries. A Hugging Face transformers config (``"hf:<config.json path>"``,
``"hf:<config class>"``, or a config object) is planned through `boundpass.recipes.hf.SOURCE` (recipes/hf.py).
The core names both only here, by import path, and imports them on first use (`source_for`); any other object
with these methods can be passed as ``source=`` to `boundpass.plan`.
"""
from __future__ import annotations

import importlib
from typing import Any, Protocol

DEFAULT_SOURCE = "boundpass.recipes.families:SOURCE"
HF_SOURCE = "boundpass.recipes.hf:SOURCE"
HF_PREFIX = "hf:"


class ModelSource(Protocol):
    def resolve(self, model: str) -> str: ...

    def flavors(self, model: str) -> tuple[str, ...] | None: ...

    def config(self, model: str, flavor: str, *, seq_len: int | None = None) -> Any: ...

    def notes(self, model: str, flavor: str) -> list[str]: ...

    def loss(self) -> Any: ...


_loaded: dict[str, ModelSource] = {}


def _load(path: str) -> ModelSource:
    if path not in _loaded:
        module, _, name = path.partition(":")
        _loaded[path] = getattr(importlib.import_module(module), name)
    return _loaded[path]


def default_source() -> ModelSource:
    """The torchtitan source (imported on first use; it imports nothing heavy until asked for a config)."""
    return _load(DEFAULT_SOURCE)


def is_transformers_config(model: Any) -> bool:
    """A transformers config object or class (read from its module's name: transformers is not imported)."""
    cls = model if isinstance(model, type) else type(model)
    return any(c.__module__.startswith("transformers.") and c.__name__ in ("PreTrainedConfig", "PretrainedConfig")
               for c in cls.__mro__)


def source_for(model: Any) -> tuple[ModelSource, str]:
    """(the source that plans ``model``, its name there): "hf:..." names and transformers config objects the
    transformers source (a config object registered under a name), anything else torchtitan's."""
    if is_transformers_config(model):
        source = _load(HF_SOURCE)
        return source, source.register(model)
    if isinstance(model, str) and model.startswith(HF_PREFIX):
        return _load(HF_SOURCE), model
    return default_source(), model
