"""List scheduling for segments too large for the DP, and the DP's first upper bound.

A greedy pass runs, at each step, one ready unit:

1. a free move if there is one (it frees at least what it keeps and its step stays within the
   peak so far — the DP's dominance rule, so never a mistake);
2. otherwise the unit chosen by a key. `KEYS` holds two: least growth of live memory, then least
   step memory (the memory-aware greedy of Serenity's baseline and of ROAM's list order), and the
   reverse priority, which wins when one big step is unavoidable and should come when little else
   is live. Both run and the lower peak is kept.

The segment's topological order (program order where the graph came from a capture) competes
too. Ties fall to the lower local index — topological, i.e. closest to program order — so the result
is deterministic.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from magis.schedule.segment import SegmentProblem

# (growth = kept - freed, step = live + alloc, index) -> sort key
Key = Callable[[int, int, int], tuple]
KEYS: tuple[Key, ...] = (
    lambda growth, step, i: (growth, step, i),
    lambda growth, step, i: (step, growth, i),
)


# (storages each unit reads that the segment may free, readers left of each, bytes of each)
Freeable = tuple[list[list[int]], list[int], list[int]]


@dataclass(frozen=True)
class ListResult:
    order: tuple[int, ...]  # local indices
    peak: int  # resident bytes excluded


def greedy(seg: SegmentProblem, key: Key, freeable: Freeable | None = None) -> ListResult:
    """One greedy pass with `key` (see the module docstring).

    Its state is counts, not the DP's bitmasks: a storage is freed by its last reader to run
    (`remaining` readers down to one), and a unit is ready when its last local predecessor ran.
    On a segment of 23,000 units (a split decoder's backward, too large for the DP) every mask
    operation cost a pass over 360 words."""
    reads, remaining, nbytes = freeable if freeable is not None else freeable_reads(seg)
    remaining = list(remaining)
    waiting = [0] * seg.m
    for succ in seg.succ:
        for j in succ:
            waiting[j] += 1
    ready = [i for i in range(seg.m) if not waiting[i]]  # ascending: ties to the lower index
    live = peak = seg.live_in
    order = []
    while ready:
        choice = None
        best = None
        for at, i in enumerate(ready):
            freed = sum(nbytes[k] for k in reads[i] if remaining[k] == 1)
            growth = seg.kept[i] - freed
            step = live + seg.alloc[i]
            if growth <= 0 and step <= peak:
                choice = (at, freed)
                break
            k = key(growth, step, i)
            if best is None or k < best:
                best, choice = k, (at, freed)
        at, freed = choice
        i = ready.pop(at)
        peak = max(peak, live + seg.alloc[i])
        live += seg.kept[i] - freed
        order.append(i)
        for k in reads[i]:
            remaining[k] -= 1
        for j in seg.succ[i]:
            waiting[j] -= 1
            if not waiting[j]:
                bisect.insort(ready, j)
    return ListResult(tuple(order), peak)


def freeable_reads(seg: SegmentProblem) -> Freeable:
    """(storages each unit reads that the segment may free, readers left of each, bytes of
    each): the storages of `seg.frees`, indexed once."""
    reads: list[list[int]] = [[] for _ in range(seg.m)]
    remaining: list[int] = []
    nbytes: list[int] = []
    for size, _, readers, escapes in seg.storages:
        if escapes or not readers:
            continue
        k = len(nbytes)
        nbytes.append(size)
        remaining.append(readers.bit_count())
        left = readers
        while left:
            low = left & -left
            reads[low.bit_length() - 1].append(k)
            left ^= low
    return reads, remaining, nbytes


def list_schedule(seg: SegmentProblem) -> ListResult:
    """The best of the greedy passes over `KEYS` and the topological (program-like) order, so
    that a segment never gets worse than the order it came in."""
    identity = tuple(range(seg.m))
    candidates = [ListResult(identity, seg.peak_of(identity))]
    freeable = freeable_reads(seg)
    candidates.extend(greedy(seg, key, freeable) for key in KEYS)
    return min(candidates, key=lambda r: r.peak)
