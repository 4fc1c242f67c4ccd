"""Byte sizes for budgets: parse "60GiB" / "1.5 TB" / 1_000_000 and print them back for people."""
from __future__ import annotations

import math
import re

from boundpass.core.errors import BoundpassInputError

# Decimal (SI) and binary (IEC) units; bare "K/M/G/T" are read as binary, as memory is sized in powers of 2.
_UNITS = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([+-]?(?:\d[\d_]*)?(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(size: int | float | str, *, what: str = "budget", zero_ok: bool = False) -> int:
    """Parse a positive byte size (int, float or string with a unit) into an int number of bytes.

    A bare number is bytes, so it must be a whole number (``1.9`` is refused, not read as 1 byte: write "1.9GiB").
    ``zero_ok``: 0 is a valid size (a host budget of 0 says "no host memory")."""
    if isinstance(size, bool):
        raise BoundpassInputError(f"{what}: expected a byte size such as '60GiB' or 2**30, got {size!r}")
    if zero_ok and isinstance(size, (int, float)) and size == 0:
        return 0
    if isinstance(size, (int, float)):
        value, unit = float(size), ""
        if isinstance(size, int):
            if size <= 0:
                raise BoundpassInputError(f"{what} must be a positive number of bytes, got {size}")
            return size
        if math.isfinite(size) and size != int(size):
            raise BoundpassInputError(
                f"{what}: a bare number is a count of bytes, and {size!r} is not a whole number of bytes; give the "
                f"unit as a string (e.g. '{size}GiB') or an int of bytes")
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
