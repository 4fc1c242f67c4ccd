"""torchtitan's model families for boundpass.plan, found from torchtitan's own registries: the torchtitan model
source (the interface is boundpass/core/model_source.py; this module is its only torchtitan implementation).

Discovery rule (torchtitan 0.3.0's layout; nothing is imported to find a name):
- a family is a package ``torchtitan.models.<name>`` whose ``__init__.py`` defines ``model_registry(flavor, ...)``
  (the function torchtitan's trainer calls to get a ``ModelSpec``); the packages are listed on disk, found
  through ``importlib.util.find_spec("torchtitan")``, which does not import torchtitan;
- a family's flavors are the keys of the module-level dict that ``model_registry`` indexes with its flavor
  argument (``deepseekv3_configs[flavor]``, ``kimi_k2_5_configs[flavor]``, ...), read from the package's source
  with ``ast``;
- a flavor *plans* when, imported and its config built (``model_registry(flavor).model``): the package imports
  (any kernel package it needs is installed: torchtitan 0.3.0's qwen3_5 needs ``fla``), the config is a decoder
  (``layers``, ``tok_embeddings``, ``lm_head``, ``norm``), at least one block has a MoE (``layer.moe``), and every
  block's token mixer is softmax attention with one of the inner kernels the composed budget models (Flex,
  varlen or SDPA causal attention; swapped for SDPA's causal kernel, which is CPU-traceable, as torchtitan's own
  graph_trainer tests do). Otherwise ``config`` raises BoundpassInputError with that reason.

Names are torchtitan's package names; the recipes' ``qwen3_moe`` (their name for qwen3's MoE flavors) is an alias
of ``qwen3``. This module imports no torch at import time: the CLI resolves a name with it in milliseconds.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
from pathlib import Path

from boundpass.core.errors import BoundpassInputError

# The recipes' debug trainer configs (a torchtitan config_registry function each), by the name the recipes and
# their trainer configs use (recipes/config_registry.py: qwen3_moe_debug_mop, ...): recipe name -> (package, fn).
RECIPE_CONFIGS = {
    "deepseek_v3": ("deepseek_v3", "deepseek_v3_debugmodel"),
    "qwen3_moe": ("qwen3", "qwen3_moe_debug"),
    "gpt_oss": ("gpt_oss", "gpt_oss_debugmodel"),
}
ALIASES = {name: package for name, (package, _) in RECIPE_CONFIGS.items() if name != package}

# inner attention kernels (torchtitan.models.common.attention) whose memory the composed budget models: causal
# softmax attention run by a fused O(N) kernel; a sliding window (gpt_oss's even layers) only attends to fewer keys
SOFTMAX_KERNELS = ("FlexAttention", "VarlenAttention", "ScaledDotProductAttention")


def _models_dir() -> Path | None:
    spec = importlib.util.find_spec("torchtitan")  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


@functools.lru_cache(maxsize=None)
def families() -> tuple[str, ...]:
    """Every torchtitan.models package with a model registry (MoE or not: that needs the config), sorted."""
    root = _models_dir()
    if root is None or not root.is_dir():
        return ()
    return tuple(sorted(p.name for p in root.iterdir()
                        if (p / "__init__.py").is_file() and "def model_registry(" in (p / "__init__.py").read_text()))


def resolve(model: str) -> str:
    """The package name of ``model`` (an alias resolved), or BoundpassInputError listing the known ones."""
    name = ALIASES.get(model, model)
    known = families()
    if name not in known:
        if not known:
            raise BoundpassInputError(f"unknown model {model!r}: torchtitan is not installed (pip install "
                                      f"'boundpass[torchtitan]'), so no model family can be found")
        raise BoundpassInputError(f"unknown model {model!r}; torchtitan {_version()} ships these model packages "
                                  f"(each with a model_registry): {', '.join(known)}"
                                  + (f" (and the alias {', '.join(f'{a} = {p}' for a, p in ALIASES.items())})"
                                     if ALIASES else ""))
    return name


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("torchtitan")
    except Exception:  # noqa: BLE001 (a source tree without metadata)
        return "(unknown version)"


@functools.lru_cache(maxsize=None)
def flavors(model: str) -> tuple[str, ...] | None:
    """The keys of the dict ``model_registry`` indexes with its flavor, read from the source (None: not found)."""
    family = resolve(model)
    try:
        tree = ast.parse((_models_dir() / family / "__init__.py").read_text())
    except (OSError, SyntaxError):
        return None
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "model_registry"), None)
    if fn is None or not fn.args.args:
        return None
    arg = fn.args.args[0].arg
    tables = {n.value.id for n in ast.walk(fn) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
              and isinstance(n.slice, ast.Name) and n.slice.id == arg}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if isinstance(getattr(node, "value", None), ast.Dict) and any(
                isinstance(t, ast.Name) and t.id in tables for t in targets):
            keys = tuple(k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
            return keys or None
    return None


def _package(family: str):
    from boundpass.recipes.cpu_support import apply_cpu_device_fix
    apply_cpu_device_fix()
    try:
        with _inductor_config_not_read():
            return importlib.import_module(f"torchtitan.models.{family}")
    except ModuleNotFoundError as err:
        raise BoundpassInputError(
            f"{family}: torchtitan.models.{family} cannot be imported here: it needs the package {err.name!r}, "
            f"which is not installed (torchtitan does not install its models' optional dependencies)") from err
    except Exception as err:  # noqa: BLE001 (ImportError, or a package that fails while it imports)
        raise BoundpassInputError(f"{family}: torchtitan.models.{family} cannot be imported here: "
                                  f"{type(err).__name__}: {err}") from err


@contextlib.contextmanager
def _inductor_config_not_read():
    """Import torchtitan's model packages without Inductor's compiler (~0.7 s of a plan's imports: Inductor's
    compile_fx, lowerings, kernel templates and code generators; nothing plan runs needs them).

    torchtitan.models.common.attention compiles FlexAttention in its class body (``torch.compile(flex_attention,
    ...)``); torch.compile then asks the Inductor backend for its config (``get_compiler_config``), which imports
    ``torch._inductor.compile_fx``. That config is only what the compiled function's ``get_compiler_config()``
    accessor returns (torch stores None for a backend without the method, as here while the package imports);
    compiling, which imports compile_fx when it happens, is unchanged. plan swaps every block's attention for
    SDPA, so the compiled FlexAttention never runs in it. Once compile_fx is imported there is nothing to save."""
    import sys
    import torch
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    method = None if wrapper is None else wrapper.__dict__.get("get_compiler_config")
    if method is None or "torch._inductor.compile_fx" in sys.modules:
        yield
        return
    del wrapper.get_compiler_config
    try:
        yield
    finally:
        wrapper.get_compiler_config = method


_NOTES: dict = {}


def config(model: str, flavor: str, *, seq_len: int | None = None):
    """torchtitan's decoder config of (model, flavor), causal SDPA attention in every block (the CPU-traceable
    kernel), RoPE at ``seq_len`` positions if given; BoundpassInputError when it cannot be planned, and why."""
    import dataclasses
    family = resolve(model)
    package = _package(family)
    table = next((getattr(package, n) for n in package.model_registry.__code__.co_names
                  if isinstance(getattr(package, n, None), dict)), None)
    if table is not None and flavor not in table:
        raise BoundpassInputError(f"unknown flavor {flavor!r} of {family}; known: {', '.join(table)}")
    cfg = package.model_registry(flavor).model
    layers = getattr(cfg, "layers", None)
    if not layers or not all(hasattr(cfg, a) for a in ("tok_embeddings", "lm_head", "norm")):
        raise BoundpassInputError(f"{family} {flavor} is not a decoder LM (no layers / tok_embeddings / lm_head / "
                                  f"norm in {type(cfg).__qualname__}): boundpass plan composes decoder MoE training")
    if not any(getattr(layer, "moe", None) is not None for layer in layers):
        raise BoundpassInputError(f"{family} {flavor} has no MoE block (a dense model): boundpass plan composes "
                                  f"MoE training" + _moe_hint(family))
    for i, layer in enumerate(layers):
        inner = getattr(getattr(layer, "attention", None), "inner_attention", None)
        kind = type(inner).__qualname__.split(".")[0]
        if inner is None or kind not in SOFTMAX_KERNELS:
            raise BoundpassInputError(
                f"{family} {flavor}: block {i}'s token mixer ({type(layer).__qualname__.split('.')[0]}, inner "
                f"{kind}) is not an attention kind the composed budget models (causal softmax attention under a "
                f"fused kernel: {', '.join(SOFTMAX_KERNELS)})")
    from torchtitan.models.common.attention import ScaledDotProductAttention
    notes = []
    windows = sum(1 for layer in layers if tuple(getattr(layer.attention.inner_attention, "window_size", (-1, 0)))
                  [0] >= 0)
    if windows:
        notes.append(f"{family} {flavor}: {windows} of {len(layers)} blocks use sliding-window attention; they are "
                     f"counted as full causal attention (an upper bound: the window only drops keys)")
    if getattr(cfg, "vision_encoder", None) is not None:
        notes.append(f"{family} {flavor} carries a vision encoder: its weights are counted (parameters, gradients, "
                     f"optimizer state: an upper bound, a text-only step gives them no gradient), its image-token "
                     f"activations are not (the step planned is text-only)")
    if getattr(cfg, "mtp_layers", None):
        notes.append(f"{family} {flavor}: its multi-token-prediction layers are counted as parameters only")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if seq_len is not None:
            layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
    _NOTES[(family, flavor)] = notes
    return cfg


def _moe_hint(family: str) -> str:
    try:
        moe = moe_flavors(family)
    except BoundpassInputError:
        return ""
    return f"; its MoE flavors: {', '.join(moe)}" if moe else f"; {family} has no MoE flavor"


def notes(model: str, flavor: str) -> list[str]:
    return list(_NOTES.get((resolve(model), flavor), ()))


def loss():
    """torchtitan's own CrossEntropyLoss (sum over tokens / global valid tokens, ignore_index=-100)."""
    from torchtitan.components.loss import CrossEntropyLoss
    return CrossEntropyLoss.Config().build()


# ------------------------------------------------------------------------------------------- for benches and tests
@functools.lru_cache(maxsize=None)
def moe_flavors(model: str) -> tuple[str, ...]:
    """The flavors of ``model`` whose config has a MoE block (imports the package; BoundpassInputError if it
    cannot be imported)."""
    family = resolve(model)
    package = _package(family)
    out = []
    for flavor in flavors(family) or ():
        layers = getattr(package.model_registry(flavor).model, "layers", None) or ()
        if any(getattr(layer, "moe", None) is not None for layer in layers):
            out.append(flavor)
    return tuple(out)


def survey() -> dict:
    """{family: {"moe_flavors": (...), "refused": reason or None}} for every torchtitan family (imports each)."""
    out = {}
    for family in families():
        try:
            moe = moe_flavors(family)
        except BoundpassInputError as err:
            out[family] = {"moe_flavors": (), "refused": str(err)}
            continue
        if not moe:
            out[family] = {"moe_flavors": (), "refused": f"{family} has no MoE flavor (dense models only)"}
            continue
        try:
            config(family, moe[0])
            out[family] = {"moe_flavors": moe, "refused": None}
        except BoundpassInputError as err:
            out[family] = {"moe_flavors": moe, "refused": str(err)}
    return out


@functools.lru_cache(maxsize=None)
def largest_moe_flavor(model: str) -> str:
    """The MoE flavor with the most parameters (each built on meta: seconds at 1T parameters)."""
    import torch
    family = resolve(model)
    sizes = {}
    for flavor in moe_flavors(family):
        with torch.device("meta"):
            net = config(family, flavor).build()
        sizes[flavor] = sum(p.numel() for p in net.parameters())
        del net
    return max(sizes, key=sizes.get)


def debug_moe_flavor(model: str) -> str:
    """The family's debug MoE flavor: the first MoE flavor named debug*, else its first MoE flavor."""
    moe = moe_flavors(model)
    return next((f for f in moe if f.startswith("debug")), moe[0])


class _Source:
    """boundpass.core.model_source.ModelSource over torchtitan's registries (this module's functions)."""
    name = "torchtitan"
    resolve = staticmethod(resolve)
    flavors = staticmethod(flavors)
    config = staticmethod(config)
    notes = staticmethod(notes)
    loss = staticmethod(loss)


SOURCE = _Source()
