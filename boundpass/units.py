"""Byte sizes for budgets: parse "60GiB" / "1.5 TB" / 1_000_000 and print them back for people."""
from __future__ import annotations

import math
import re

from boundpass.errors import BoundpassInputError

# Decimal (SI) and binary (IEC) units; bare "K/M/G/T" are read as binary, as memory is sized in powers of 2.
_UNITS = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([+-]?(?:\d[\d_]*)?(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(size: int | float | str, *, what: str = "budget") -> int:
    """Parse a positive byte size (int, float or string with a unit) into an int number of bytes."""
    if isinstance(size, bool):
        raise BoundpassInputError(f"{what}: expected a byte size such as '60GiB' or 2**30, got {size!r}")
    if isinstance(size, (int, float)):
        value, unit = float(size), ""
        if isinstance(size, int):
            if size <= 0:
                raise BoundpassInputError(f"{what} must be a positive number of bytes, got {size}")
            return size
    elif isinstance(size, str):
        match = _PATTERN.match(size)
        if not match or not match.group(1) or match.group(1) in "+-.":
            raise BoundpassInputError(
                f"{what}: cannot read {size!r} as a byte size; write e.g. '60GiB', '1.5 TB' or '64 GiB'")
        value = float(match.group(1).replace("_", ""))
        unit = match.group(2).lower()
        if unit not in _UNITS:
            known = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (K/M/G/T mean KiB/MiB/GiB/TiB)"
            raise BoundpassInputError(f"{what}: unknown unit {match.group(2)!r} in {size!r}; known units: {known}")
    else:
        raise BoundpassInputError(f"{what}: expected a byte size such as '60GiB' or 2**30, got {type(size).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise BoundpassInputError(f"{what} must be a positive, finite byte size, got {size!r}")
    nbytes = int(value * _UNITS[unit])
    if nbytes <= 0:
        raise BoundpassInputError(f"{what} {size!r} is less than one byte")
    return nbytes


def format_bytes(nbytes: int | float) -> str:
    """Human-readable binary size ('1.50 GiB'); exact bytes below 1 KiB."""
    n = float(nbytes)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
