"""The CPU as users name it: core lists (``0-3,8``) and instruction-set flags, without torch:
the CLI parses core lists before any worker starts."""

from __future__ import annotations

import functools
from pathlib import Path


class CoreSpecError(ValueError):
    """A core list the user typed that cannot be used."""


def parse_core_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; refuses malformed or empty lists."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise CoreSpecError(f"empty entry in core list {text!r}; use e.g. 0-3,8")
        low_text, dash, high_text = part.partition("-")
        try:
            low = int(low_text)
            high = int(high_text) if dash else low
        except ValueError:
            raise CoreSpecError(f"{part!r} in core list {text!r} is not a core number or a range like 0-3") from None
        if low < 0 or high < low:
            raise CoreSpecError(f"bad range {part!r} in core list {text!r}")
        cores.update(range(low, high + 1))
    return sorted(cores)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(flag for line in text.splitlines() if line.startswith("flags") for flag in line.split()[2:])
