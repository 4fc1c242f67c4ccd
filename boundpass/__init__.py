"""boundpass: bounded-memory rewrites for long-context MoE training, with sympy bounds and fail-fast budgets."""
import importlib as _importlib
import os as _os
import sys as _sys
import types as _types

# runtime/ and recipes/ live at the top of the repository and install as boundpass.runtime / .recipes.
# Run from a source tree (PYTHONPATH=., as on the GPU machine), they are found through the repository root.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "runtime")) and \
        _os.path.isfile(_os.path.join(_root, "runtime", "__init__.py")):
    __path__.append(_root)  # noqa: F821 (a package's __path__)
from boundpass.errors import (BoundpassError, BoundpassInputError, InfeasibleBudgetError,  # noqa: F401,E402
                              NotCertifiedError, PeerRefusedError)
from boundpass.units import format_bytes, parse_bytes  # noqa: F401,E402
from boundpass.config import Config  # noqa: F401,E402  (every knob, one name each: imports no torch)

# The entry points that need torch are imported on first use, so that `python -m boundpass plan` refuses a bad
# argument before torch and torchtitan are imported (boundpass/plan_input.py). Two of them share their name with
# a submodule (boundpass.plan, boundpass.explain): importing that submodule binds it on the package, which would
# hide the function; these names are data descriptors on the package's class, so the function always wins (as
# with an eager `from boundpass.plan import plan`) and the submodules stay reachable through the import system.
_ENTRY_POINTS = {"compile": "boundpass.compiler", "explain": "boundpass.compiler",
                 "BoundedModule": "boundpass.compiler", "plan": "boundpass.plan"}


def _entry_point(name: str, module: str) -> property:
    def get(package):
        if name in package._assigned:  # set by a program (e.g. a test's monkeypatch): theirs
            return package._assigned[name]
        return getattr(_importlib.import_module(module), name)

    def put(package, value):
        if isinstance(value, _types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            return  # the import system binding the same-named submodule
        package._assigned[name] = value

    def remove(package):
        package._assigned.pop(name, None)

    return property(get, put, remove)


class _Package(_types.ModuleType):
    def __getattr__(self, name):
        # a submodule not imported yet (boundpass.composed, boundpass.runtime, ...): as when every one was
        # imported with the package
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_ENTRY_POINTS))


for _name, _module in _ENTRY_POINTS.items():
    setattr(_Package, _name, _entry_point(_name, _module))
_assigned: dict = {}
_sys.modules[__name__].__class__ = _Package
