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

from collections.abc import Callable
from dataclasses import dataclass

from magis.schedule.segment import SegmentProblem

# (growth = kept - freed, step = live + alloc, index) -> sort key
Key = Callable[[int, int, int], tuple]
KEYS: tuple[Key, ...] = (
    lambda growth, step, i: (growth, step, i),
    lambda growth, step, i: (step, growth, i),
)


@dataclass(frozen=True)
class ListResult:
    order: tuple[int, ...]  # local indices
    peak: int  # resident bytes excluded


def greedy(seg: SegmentProblem, key: Key) -> ListResult:
    """One greedy pass with `key` (see the module docstring)."""
    done, live, peak = 0, seg.live_in, seg.live_in
    ready = seg.ready0()
    order = []
    while ready:
        choice = None
        best = None
        bits = ready
        while bits:
            low = bits & -bits
            i = low.bit_length() - 1
            bits ^= low
            freed = seg.freed(i, done)
            growth = seg.kept[i] - freed
            step = live + seg.alloc[i]
            if growth <= 0 and step <= peak:
                choice = (i, freed)
                break
            k = key(growth, step, i)
            if best is None or k < best:
                best, choice = k, (i, freed)
        i, freed = choice
        peak = max(peak, live + seg.alloc[i])
        live += seg.kept[i] - freed
        done |= 1 << i
        order.append(i)
        ready &= ~(1 << i)
        for j in seg.succ[i]:
            if not seg.pred_mask[j] & ~done:
                ready |= 1 << j
    return ListResult(tuple(order), peak)


def list_schedule(seg: SegmentProblem) -> ListResult:
    """The best of the greedy passes over `KEYS` and the topological (program-like) order, so
    that a segment never gets worse than the order it came in."""
    identity = tuple(range(seg.m))
    candidates = [ListResult(identity, seg.peak_of(identity))]
    candidates.extend(greedy(seg, key) for key in KEYS)
    return min(candidates, key=lambda r: r.peak)
