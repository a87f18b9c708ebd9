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
    order, peak, expanded, exact = _search(seg, lb, by_lb, bound, budget)
    if exact and not order and seg.m:  # nothing beats `upper`: it is optimal
        assert upper is not None
        return DpResult(tuple(upper[0]), upper[1], True, expanded)
    if not exact:
        if upper is not None:
            return DpResult(tuple(upper[0]), upper[1], False, expanded)
        return DpResult((), -1, False, expanded)
    return DpResult(order, peak, True, expanded)


def _search(seg: SegmentProblem, lb, by_lb, bound, budget):
    """Best-first search: (order, peak, expanded, exact); an empty exact order when nothing
    beats `bound`.

    The hot loop of the scheduler: state data sit in one dict (peak f, live bytes, ready mask,
    parent, unit) and the free-move test is inlined.
    """
    full = (1 << seg.m) - 1
    alloc, kept, succ, pred_mask, frees = seg.alloc, seg.kept, seg.succ, seg.pred_mask, seg.frees
    limit = bound if bound is not None else float("inf")

    def h(done: int) -> int:
        for i in by_lb:
            if not done >> i & 1:
                return lb[i]
        return 0

    states = {0: (seg.live_in, seg.live_in, seg.ready0(), -1, -1)}  # f, live, ready, parent, unit
    heap = [(max(seg.live_in, h(0)), 0, 0)]
    closed: set[int] = set()
    expanded = 0
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        prio, negdepth, done = pop(heap)
        if done == full:
            return _trace(states, done), states[done][0], expanded, True
        if done in closed:
            continue
        closed.add(done)
        expanded += 1
        if expanded > budget:
            return (), -1, expanded, False
        f, live, ready, _, _ = states[done]
        level = prio if prio > f else f
        moves = []
        bits = ready
        while bits:
            low = bits & -bits
            i = low.bit_length() - 1
            bits ^= low
            freed = 0
            for mask, nbytes in frees[i]:
                if mask & done == mask:
                    freed += nbytes
            if kept[i] <= freed and live + alloc[i] <= level:
                moves = [(i, freed)]  # a free move: no other branch needed
                break
            moves.append((i, freed))
        for i, freed in moves:
            step = live + alloc[i]
            nf = step if step > f else f
            if nf >= limit:
                continue
            nxt = done | (1 << i)
            if nxt in closed:
                continue
            old = states.get(nxt)
            if old is not None and old[0] <= nf:
                continue
            nready = ready & ~(1 << i)
            for j in succ[i]:
                if pred_mask[j] & nxt == pred_mask[j]:
                    nready |= 1 << j
            states[nxt] = (nf, live + kept[i] - freed, nready, done, i)
            hn = h(nxt)
            push(heap, (nf if nf > hn else hn, negdepth - 1, nxt))
    return (), -1, expanded, True  # exhausted below the bound: nothing beats it


def _trace(states, done: int) -> tuple[int, ...]:
    order = []
    while done:
        _, _, _, parent, unit = states[done]
        order.append(unit)
        done = parent
    return tuple(reversed(order))
