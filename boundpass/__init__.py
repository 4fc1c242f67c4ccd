"""boundpass: bounded-memory rewrites for long-context MoE training, with sympy bounds and fail-fast budgets."""
import os as _os

# runtime/ and recipes/ live at the top of the repository and install as boundpass.runtime / .recipes.
# Run from a source tree (PYTHONPATH=., as on the GPU machine), they are found through the repository root.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "runtime")) and \
        _os.path.isfile(_os.path.join(_root, "runtime", "__init__.py")):
    __path__.append(_root)  # noqa: F821 (a package's __path__)
from boundpass.errors import BoundpassError, BoundpassInputError, InfeasibleBudgetError  # noqa: F401
from boundpass.units import format_bytes, parse_bytes  # noqa: F401
from boundpass.compiler import BoundedModule, compile, explain  # noqa: F401,E402
from boundpass.plan import plan  # noqa: F401,E402
