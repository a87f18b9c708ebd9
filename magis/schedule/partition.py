"""GraphPartition (MAGIS §6.1, Alg. 2 line 11), one level at a time.

`split` cuts a scope (a set of units) at its narrow waists, nw <= 1. A scope with none is cut
again after peeling floaters off: a threshold starts at half the scope's size and halves until
the core falls apart at some waist (down to `min_window`; below that the scope stays whole).
Every unit that is not a cut is placed between the cuts by the floater rule (`placement`).
`solve` splits only segments the DP cannot finish, so as many decisions as possible stay inside
the exact DP: a floater's segment is a heuristic, the DP's order within a segment is not.

Every edge goes from a segment to the same or a later one: cuts are placed by reachability over
the whole unit set, and floaters are placed between their latest ancestor's and earliest
descendant's segments, so concatenating segment orders gives a topological order.
"""

from __future__ import annotations

from collections.abc import Container

from magis.schedule.narrow_waist import Closure, bits, cut_segments, window_above
from magis.schedule.placement import place_floaters
from magis.schedule.problem import Problem

MIN_WINDOW = 8  # the smallest nw window peeled off as a floater


def split(
    problem: Problem,
    clo: Closure,
    scope: int,
    before: Container[int] = frozenset(),
    min_window: int = MIN_WINDOW,
) -> list[int]:
    """One level of partition of `scope` (a mask over `clo.units`): its narrow-waist cuts, or,
    when it has none, the cuts that appear once floaters wider than a halving threshold are
    peeled off. A single mask when nothing splits it."""
    parts = _cut(problem, clo, scope, scope, before)  # plain GraphPartition first
    tau = scope.bit_count() // 2
    while len(parts) == 1 and tau >= min_window:
        core = scope
        while True:  # peel at this threshold until the core is stable
            drop = window_above(clo, core, tau)
            if not drop:
                break
            core &= ~drop
        parts = _cut(problem, clo, scope, core, before)
        tau //= 2
    return parts


def _cut(
    problem: Problem, clo: Closure, scope: int, core: int, before: Container[int]
) -> list[int]:
    """Cut `core` at nw <= 1; every other unit of `scope` is placed between the cuts by the
    floater rule (`placement`), core or not: between two cuts a unit may still run in the
    segment before or after, and a weight concatenation with no inputs would otherwise run
    before the first cut and be held to its far user. Segment masks in order."""
    _, cuts = cut_segments(clo, core)
    if not cuts:  # one segment holds every unit: nothing to place (split tries many cores)
        return [scope] if scope else []
    fixed = {c: k + 1 for k, c in enumerate(cuts)}  # a cut starts its segment
    nsegs = len(cuts) + 1
    floaters = [u for u in (clo.units[i] for i in bits(scope)) if u not in fixed]
    placed = place_floaters(problem, clo, fixed, floaters, nsegs, before)
    core_seg = fixed
    masks = [0] * nsegs
    index = clo.index
    for u, k in (*core_seg.items(), *placed.items()):
        masks[k] |= 1 << index[u]
    return [m for m in masks if m]
