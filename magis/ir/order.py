"""Schedules of a graph's nodes: a schedule is a sequence of node ids, each run once."""

from __future__ import annotations

from collections.abc import Sequence


def positions(order: Sequence[int]) -> dict[int, int]:
    """Each node of a schedule -> its index in it."""
    return dict(zip(order, range(len(order)), strict=True))
