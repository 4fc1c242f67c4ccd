"""Errors boundpass raises for people: each says what is wrong and what to change."""
from __future__ import annotations


class BoundpassError(Exception):
    """Base class of every error boundpass raises on purpose."""


class BoundpassInputError(BoundpassError, ValueError):
    """Bad input (units, shapes, degrees) found before any large allocation."""


class InfeasibleBudgetError(BoundpassError):
    """A memory term (or their sum) cannot fit the per-rank budget.

    Attributes name the binding term so programs can react: ``term`` (name), ``formula`` (sympy text),
    ``value_bytes`` (at these shapes), ``budget_bytes`` and ``knob`` (what would fix it).
    """

    def __init__(self, message: str, *, term: str, formula: str, value_bytes: int,
                 budget_bytes: int, knob: str):
        super().__init__(message)
        self.term = term
        self.formula = formula
        self.value_bytes = value_bytes
        self.budget_bytes = budget_bytes
        self.knob = knob


class NotCertifiedError(BoundpassError, RuntimeError):
    """The step runs code no certificate covers (graph breaks), so no budget check of it can be honest.

    ``reasons``: Dynamo's break reasons (first line of each); ``graphs``: the certified device peak of each
    compiled graph of the step (bytes, None where a graph was not certified)."""

    def __init__(self, message: str, *, reasons: list[str], graphs: list):
        super().__init__(message)
        self.reasons = reasons
        self.graphs = graphs


class PeerRefusedError(BoundpassError, RuntimeError):
    """Another rank of a ring / EP group (or of the job) refused the step; this rank stops with it instead of
    waiting in a collective. ``ranks``: the global ranks that refused."""

    def __init__(self, message: str, *, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks
