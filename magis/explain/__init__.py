"""A plan's decisions, one row each, with the bytes each took off the peak and the time it
added (`magis explain`, issue #17)."""

from magis.explain.explain import (
    PREDATES_DECISIONS,
    SORTS,
    Bottleneck,
    Explanation,
    Row,
    bottleneck,
    explain,
)

__all__ = [
    "PREDATES_DECISIONS",
    "SORTS",
    "Bottleneck",
    "Explanation",
    "Row",
    "bottleneck",
    "explain",
]
