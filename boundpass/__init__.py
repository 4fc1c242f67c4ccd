"""boundpass: bounded-memory rewrites for long-context MoE training, with sympy bounds and fail-fast budgets."""
from boundpass.errors import BoundpassError, BoundpassInputError, InfeasibleBudgetError  # noqa: F401
from boundpass.units import format_bytes, parse_bytes  # noqa: F401
from boundpass.compiler import BoundedModule, compile, explain  # noqa: F401,E402
