"""Limits as users write them (MAGIS §6.2's two modes): a memory limit as a ratio of the
unoptimized peak or a size, a latency limit as a ratio of the unoptimized latency or a time."""

from __future__ import annotations

import re

from magis.errors import LimitError
from magis.search import MemoryFigure

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory_limit(text: str | float | int, unoptimized_peak: int) -> int:
    """'0.4' (a ratio of the unoptimized peak), '12GiB', '500MB' or a byte count -> bytes."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise LimitError(
                f"cannot read memory limit {text!r}: give a ratio such as 0.4 or a size such as 12GiB"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "" and value <= 1.0:
        return int(value * unoptimized_peak)
    if unit == "" and value <= 1024:  # a ratio above 1 means nothing; so few bytes neither
        raise LimitError(
            f"memory limit {text!r} is ambiguous: write a ratio <= 1 or a size with a unit"
        )
    return int(value * _UNITS[unit])


def parse_latency_limit(text: str | float, unoptimized_latency: float) -> float:
    """'1.10' (a ratio of the unoptimized latency), '250ms' or '0.3s' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", str(text))
    if not m:
        raise LimitError(
            f"cannot read latency limit {text!r}: give a ratio such as 1.10 or a time such as 250ms"
        )
    value, unit = float(m.group(1)), m.group(2)
    if unit is None:
        return value * unoptimized_latency
    return value / 1e3 if unit == "ms" else value


def parse_memory_figure(name: str | MemoryFigure) -> MemoryFigure:
    """'theoretical' (the simulated peak) or 'arena' (resident bytes + the LLFB layout's arena)."""
    if isinstance(name, MemoryFigure):
        return name
    try:
        return MemoryFigure(name)
    except ValueError:
        choices = ", ".join(f.value for f in MemoryFigure)
        raise LimitError(f"unknown memory figure {name!r}; choose one of {choices}") from None


def check_one_limit(mem_limit: object, lat_limit: object) -> None:
    """A search has exactly one of the two limits (MAGIS §6.2)."""
    if (mem_limit is None) == (lat_limit is None):
        raise LimitError(
            "give exactly one of mem_limit (e.g. 0.4 or 12GiB) and lat_limit (e.g. 1.10)"
        )
