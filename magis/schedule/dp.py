"""The dynamic program over sets of scheduled units (Serenity, MAGIS ref. [3]; DpSchedule, Alg. 2).

A state is the set S of units already run (a bitmask over the segment). Its memory after S,
live(S), depends on S alone, so the least peak over the orders reaching S,

    f(S ∪ {v}) = min over ready v of max(f(S), live(S) + alloc(v)),

is a dynamic program over sets. We run it best-first, as a bottleneck shortest path: states come
off a heap by max(f(S), h(S)), where h(S) is the largest static lower bound of a unit not yet run
(what must be live at its step in every order: its inputs, its outputs, storages made by its
ancestors and read by its descendants). The priority never decreases along a path, so the first
full set popped is optimal; memoization keeps one entry per set.

Three things keep the search small:

* **Branch and bound.** A state whose peak already reaches the best known schedule's (the list
  scheduler's, `heuristic`) is dropped; if nothing beats it, that schedule was optimal.
* **Free moves.** A ready unit whose step stays within max(f(S), h(S)) and that frees at least
  what it keeps (views' units, in-place updates, a ReLU over a dead input) runs at once: moving it
  first in any optimal completion raises no step, since every later live set only shrinks.
* **Budget.** After `budget` expansions the search stops and the list schedule stands, marked
  inexact (Serenity's soft budget; MAGIS falls back the same way on segments it cannot finish).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from magis.schedule.segment import SegmentProblem

DEFAULT_BUDGET = 20_000  # state expansions per segment


@dataclass(frozen=True)
class DpResult:
    order: tuple[int, ...]  # local indices
    peak: int  # segment peak, resident bytes excluded
    exact: bool  # proven optimal for the segment
    expanded: int  # states expanded


def lower_bounds(seg: SegmentProblem) -> list[int]:
    """For each unit, bytes live at its step in every order of the segment."""
    m = seg.m
    anc = [0] * m
    for i in range(m):
        a = seg.pred_mask[i]
        bits = a
        while bits:
            low = bits & -bits
            a |= anc[low.bit_length() - 1]
            bits ^= low
        anc[i] = a
    des = [0] * m
    for i in range(m - 1, -1, -1):
        d = 0
        for j in seg.succ[i]:
            d |= des[j] | (1 << j)
        des[i] = d
    lb = [seg.fixed] * m
    for nbytes, prod, readers, escapes in seg.storages:
        upto = 0  # units at whose step some reader is still to come
        bits = readers
        while bits:
            low = bits & -bits
            upto |= anc[low.bit_length() - 1] | low
            bits ^= low
        if prod < 0:
            live = 0 if escapes else upto  # an escaping live-in is in `fixed`
        else:
            after = des[prod] | (1 << prod)
            live = after if escapes else after & (upto | (1 << prod))
        while live:
            low = live & -live
            lb[low.bit_length() - 1] += nbytes
            live ^= low
    return lb


def dp_schedule(
    seg: SegmentProblem,
    upper: tuple[tuple[int, ...], int] | None = None,
    budget: int = DEFAULT_BUDGET,
) -> DpResult:
    """Least-peak order of a segment; `upper` = (order, peak) of a known schedule to beat."""
    m = seg.m
    if m == 0:
        return DpResult((), seg.live_in, True, 0)
    lb = lower_bounds(seg)
    by_lb = sorted(range(m), key=lambda i: -lb[i])
    floor = max(seg.live_in, lb[by_lb[0]])
    if upper is not None and upper[1] <= floor:
        return DpResult(tuple(upper[0]), upper[1], True, 0)
    bound = upper[1] if upper is not None else None
    found = _search(seg, lb, by_lb, bound, budget)
    if found is None:  # nothing beats `upper`: it is optimal
        assert upper is not None
        return DpResult(tuple(upper[0]), upper[1], True, 0)
    order, peak, expanded, exact = found
    if not exact:
        if upper is not None:
            return DpResult(tuple(upper[0]), upper[1], False, expanded)
        return DpResult((), -1, False, expanded)
    return DpResult(order, peak, True, expanded)


def _search(seg: SegmentProblem, lb, by_lb, bound, budget):
    """Best-first search; (order, peak, expanded, exact) or None when `bound` cannot be beaten."""
    full = (1 << seg.m) - 1
    alloc, kept, succ, pred_mask = seg.alloc, seg.kept, seg.succ, seg.pred_mask

    def h(done: int) -> int:
        for i in by_lb:
            if not done >> i & 1:
                return lb[i]
        return 0

    best = {0: seg.live_in}
    info = {0: (seg.live_in, seg.ready0(), -1, -1)}  # live, ready, parent, unit
    heap = [(max(seg.live_in, h(0)), 0, 0)]
    closed: set[int] = set()
    expanded = 0
    while heap:
        prio, negdepth, done = heapq.heappop(heap)
        if done == full:
            return _trace(info, done), best[done], expanded, True
        if done in closed:
            continue
        closed.add(done)
        expanded += 1
        if expanded > budget:
            return (), -1, expanded, False
        f = best[done]
        live, ready = info[done][0], info[done][1]
        moves = _moves(seg, done, live, ready, max(f, prio))
        for i, freed in moves:
            nf = max(f, live + alloc[i])
            if bound is not None and nf >= bound:
                continue
            nxt = done | (1 << i)
            if nxt in closed:
                continue
            old = best.get(nxt)
            if old is not None and old <= nf:
                continue
            nready = ready & ~(1 << i)
            for j in succ[i]:
                if not pred_mask[j] & ~nxt:
                    nready |= 1 << j
            best[nxt] = nf
            info[nxt] = (live + kept[i] - freed, nready, done, i)
            heapq.heappush(heap, (max(nf, h(nxt)), negdepth - 1, nxt))
    return None


def _moves(seg: SegmentProblem, done: int, live: int, ready: int, level: int):
    """Ready units with what each frees; a single free move when one exists."""
    moves = []
    bits = ready
    while bits:
        low = bits & -bits
        i = low.bit_length() - 1
        bits ^= low
        freed = seg.freed(i, done)
        if seg.kept[i] <= freed and live + seg.alloc[i] <= level:
            return [(i, freed)]
        moves.append((i, freed))
    return moves


def _trace(info, done: int) -> tuple[int, ...]:
    order = []
    while done:
        _, _, parent, unit = info[done]
        order.append(unit)
        done = parent
    return tuple(reversed(order))
