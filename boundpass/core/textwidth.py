"""Report text for a terminal: every report boundpass prints by default fits ``WIDTH`` columns.

Names of terms are long on purpose (they say what is counted); a table cell drops their trailing
parenthetical remarks first and then clips, while the full names stay in ``--json`` and in the formulas view.
Imports nothing heavy: the plan CLI uses it before torch is imported.
"""
from __future__ import annotations

import textwrap

WIDTH = 120


def fit(text: str, n: int) -> str:
    """``text`` in at most ``n`` characters: trailing "(...)" remarks dropped first, then what follows the first
    ": " (a name's explanation), then clipped with "..."."""
    if len(text) <= n:
        return text
    short = text
    while short.endswith(")") and len(short) > n:
        cut = _open_of_last_group(short)
        if cut <= 0:
            break
        short = short[:cut].rstrip()
    if len(short) > n and ": " in short and short.index(": ") <= n:
        short = short[:short.index(": ")]
    if len(short) <= n:
        return short
    return short[: max(n - 3, 0)] + "..." if n > 3 else short[:n]


def _open_of_last_group(text: str) -> int:
    """Index of the "(" that closes with the last character of ``text`` (-1 when unbalanced)."""
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        if text[i] == ")":
            depth += 1
        elif text[i] == "(":
            depth -= 1
            if depth == 0:
                return i
    return -1


def wrap(text: str, *, width: int = WIDTH, first: str = "", rest: str = "  ") -> list[str]:
    """``text`` wrapped to ``width`` columns, ``first`` before its first line and ``rest`` before the others;
    words longer than a line (a formula without spaces) are broken rather than overflow."""
    return textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=rest,
                         break_long_words=True, break_on_hyphens=False) or [first.rstrip()]


def table(rows: list[tuple[str, ...]], *, width: int = WIDTH, shrink: int = 0) -> list[str]:
    """Left-aligned columns two spaces apart; column ``shrink`` (the names) is cut with ``fit`` so that every
    line fits ``width``; the other columns (bytes, shares, verdicts) are short and kept whole."""
    if not rows:
        return []
    cols = len(rows[0])
    widths = [max(len(r[i]) for r in rows) for i in range(cols)]
    others = sum(w for i, w in enumerate(widths) if i != shrink) + 2 * (cols - 1)
    widths[shrink] = max(8, min(widths[shrink], width - others))
    cells = [[fit(c, widths[i]) if i == shrink else c for i, c in enumerate(r)] for r in rows]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def flat(text: str) -> str:
    """The words of ``text`` in order, whitespace collapsed: what a report says, however its lines wrapped (for
    checking a phrase in a report)."""
    return " ".join(text.split())
