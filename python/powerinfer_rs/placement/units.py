"""Byte counts as people write them: `parse_bytes` reads '8GiB', '8000MB', '1.5G' (binary) or a
plain number; `format_bytes` writes '1.50 GiB'. VRAM budgets (`Engine.load(vram_budget=...)`,
`powerinfer-rs place`) go through here.

It knows nothing of models or placement and imports nothing from the package.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}


def parse_bytes(value: str | int | float) -> int:
    """'8GiB', '8000MB', '1.5G' (binary), '123456' or a number of bytes -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"a size must be a finite number of bytes >= 0, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read the size {value!r}: give bytes or a number with a unit, e.g. '8GiB', '8000MB', '512MiB'"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError
