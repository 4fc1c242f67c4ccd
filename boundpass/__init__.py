"""boundpass: bounded-memory rewrites for long-context MoE training, with sympy bounds and fail-fast budgets.

The public surface: ``compile``, ``explain``, ``plan``, ``Config``, ``BoundedModule``, the errors, ``format_bytes`` /
``parse_bytes``, and ``boundpass.runtime`` (the bounded operators). The layers below it, lowest first
(docs/architecture.md; each imports only the ones under it, checked in CI by import-linter):

    core      errors, units, symbols, Config, plan's inputs, report text     (no torch)
    runtime   the bounded operators and their memory contracts            (boundpass.runtime, runtime/)
    measure   live-storage tracking, the step's peak from graphs / Inductor schedules, simulated ranks
    bound     bound terms, the step law, Knob, time models, the composed budget of a launch
    passes    graph passes behind one protocol (vocab, dispatch), SCO, the optimizer swap
    planning  the planner (knobs against the peak, the fail-fast error), explain, plan at full scale
    backend   boundpass.compile's module and Dynamo backends, the one lowering, the per-block and MoP backends
    recipes   torchtitan and Hugging Face integration                      (boundpass.recipes, recipes/)
"""
import importlib as _importlib
import os as _os

# runtime/ and recipes/ live at the top of the repository and install as boundpass.runtime / .recipes.
# Run from a source tree (PYTHONPATH=., as on the GPU machine), they are found through the repository root.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "runtime")) and \
        _os.path.isfile(_os.path.join(_root, "runtime", "__init__.py")):
    __path__.append(_root)  # noqa: F821 (a package's __path__)
from boundpass.core.errors import (BoundpassError, BoundpassInputError, InfeasibleBudgetError,  # noqa: F401,E402
                                   NotCertifiedError, PeerRefusedError)
from boundpass.core.units import format_bytes, parse_bytes  # noqa: F401,E402
from boundpass.core.config import Config  # noqa: F401,E402  (every knob, one name each: imports no torch)

# The entry points that need torch are imported on first use, so that `python -m boundpass plan` refuses a bad
# argument before torch and torchtitan are imported (boundpass/core/plan_input.py).
_ENTRY_POINTS = {"compile": "boundpass.backend.compiler", "explain": "boundpass.backend.compiler",
                 "BoundedModule": "boundpass.backend.compiler", "plan": "boundpass.planning.full_scale"}


def __getattr__(name: str):
    if name in _ENTRY_POINTS:
        return getattr(_importlib.import_module(_ENTRY_POINTS[name]), name)
    if name in ("runtime", "recipes", "testing"):  # the packages that install under boundpass's namespace
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_ENTRY_POINTS))
