"""The overlap checker: tensors alive at the same time never share a byte of the arena.

Two storages conflict when their lifetimes intersect (inclusive steps) and their address ranges
[offset, offset + size) intersect. Checking all pairs is O(n^2); a sweep over time is
O(n log n): storages enter the active set at their start and leave after their end, and the
active set, kept sorted by offset, is pairwise disjoint as long as no conflict has been found —
so a newcomer [o, o + s) conflicts with some active storage iff the active storage with the
largest offset below o + s ends after o (disjoint and sorted by offset means sorted by end too).
Zero-byte storages occupy nothing and never conflict.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from magis.errors import MagisError

if TYPE_CHECKING:
    from magis.layout import Layout


class LayoutOverlapError(MagisError):
    """A layout that puts two tensors alive at the same time on the same bytes."""


@dataclass(frozen=True)
class Overlap:
    """The first conflict found: positions of the two storages in the lifetimes."""

    first: int
    second: int


def find_overlap(offsets, sizes, start, end) -> Overlap | None:
    """The first pair (in sweep order) alive together whose address ranges intersect, or None.

    `offsets`, `sizes`, `start`, `end` are equal-length integer arrays; lifetimes are inclusive.
    """
    offsets, sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
    start, end = np.asarray(start, np.int64), np.asarray(end, np.int64)
    keep = np.flatnonzero(sizes > 0)
    by_start = keep[np.lexsort((keep, start[keep]))]
    by_end = keep[np.lexsort((keep, end[keep]))]
    active: list[tuple[int, int]] = []  # (offset, index), sorted
    active_end: list[int] = []  # offset + size of the same entries
    leave = 0
    for i in by_start.tolist():
        t = int(start[i])
        while leave < len(by_end) and end[by_end[leave]] < t:
            j = int(by_end[leave])
            leave += 1
            pos = bisect.bisect_left(active, (int(offsets[j]), j))
            if pos < len(active) and active[pos][1] == j:
                del active[pos], active_end[pos]
        lo, hi = int(offsets[i]), int(offsets[i] + sizes[i])
        below = bisect.bisect_left(active, (hi, -1)) - 1
        if below >= 0 and active_end[below] > lo:
            return Overlap(active[below][1], i)
        pos = bisect.bisect_left(active, (lo, i))
        active.insert(pos, (lo, i))
        active_end.insert(pos, hi)
    return None


def overlapping_pairs_bruteforce(offsets, sizes, start, end) -> list[tuple[int, int]]:
    """Every conflicting pair, by comparing all pairs (O(n^2)): the tests' reference."""
    o, s = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
    a, b = np.asarray(start, np.int64), np.asarray(end, np.int64)
    time = (a[:, None] <= b[None, :]) & (a[None, :] <= b[:, None])
    space = (o[:, None] < (o + s)[None, :]) & (o[None, :] < (o + s)[:, None])
    both = time & space & (s[:, None] > 0) & (s[None, :] > 0)
    i, j = np.nonzero(np.triu(both, k=1))
    return list(zip(i.tolist(), j.tolist(), strict=True))


def check_layout(layout: Layout) -> None:
    """Raise LayoutOverlapError naming two storages of `layout` that overlap, if any do."""
    lt = layout.lifetimes
    hit = find_overlap(layout.offsets, lt.size, lt.start, lt.end)
    if hit is not None:
        a, b = hit.first, hit.second
        raise LayoutOverlapError(
            f"storages {lt.storages[a]} (steps {lt.start[a]}-{lt.end[a]}, bytes "
            f"{layout.offsets[a]}+{lt.size[a]}) and {lt.storages[b]} (steps "
            f"{lt.start[b]}-{lt.end[b]}, bytes {layout.offsets[b]}+{lt.size[b]}) overlap"
        )
    top = layout.offsets + lt.size
    if len(top) and int(layout.offsets.min()) < 0:
        worst = int(np.argmin(layout.offsets))
        raise LayoutOverlapError(f"storage {lt.storages[worst]} has a negative offset")
    if len(top) and int(top.max()) > layout.arena_bytes:
        worst = int(np.argmax(top))
        raise LayoutOverlapError(
            f"storage {lt.storages[worst]} ends at byte {int(top[worst])}, past the arena "
            f"of {layout.arena_bytes} bytes"
        )
