"""Words and sizes as the planner says them to people: one unit ("GB") and one
way of listing things, so every refusal reads alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_GB = 1024**3


_MB = 1024**2


_KB = 1024


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def format_bytes(n: int) -> str:
    """A size for people: "1.5 GB", "512 MB", "3 KB", "12 B"."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= _GB:
        return f"{sign}{n / _GB:.1f} GB"
    if n >= _MB:
        return f"{sign}{n / _MB:.0f} MB"
    if n >= _KB:
        return f"{sign}{n / _KB:.0f} KB"
    return f"{sign}{n} B"


def gb(n: int) -> str:
    """Refusals always speak GB so the numbers in one sentence compare at a glance;
    below 1 GB with two significant digits, so small nodes' figures still differ."""
    x = n / _GB
    if x == 0 or abs(x) >= 1:
        return f"{x:.1f} GB"
    decimals = 1 - math.floor(math.log10(abs(x)))
    return f"{x:.{decimals}f}".rstrip("0").rstrip(".") + " GB"


def _joined(parts: Sequence[str], word: str) -> str:
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + f" {word} " + parts[-1]
