"""GraphPartition (MAGIS §6.1, Alg. 2 line 11), refined until segments are within the DP's reach.

A scope (first the whole unit set) is cut at its narrow waists, nw <= 1. A segment still larger
than `limit` units is partitioned again on its own: floaters are peeled off with a threshold
that starts at half the segment's size and halves until the core falls apart at some waist
(down to `min_window`, below which a segment is left whole to the list scheduler). Floaters join
the sub-segment their dependencies and memory effect choose (`placement`). Peeling only where a
segment is too big keeps as many decisions as possible inside the exact DP: a floater's place is
a heuristic, the DP's order within a segment is not.

Every edge goes from a segment to the same or a later one: cuts are placed by reachability over
the whole unit set, and floaters are placed between their latest ancestor's and earliest
descendant's segments, so concatenating segment orders gives a topological order.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from magis.schedule.narrow_waist import Closure, bits, closure, cut_segments, window_above
from magis.schedule.placement import place_floaters
from magis.schedule.problem import Problem

SEGMENT_LIMIT = 48  # units: segments above this are partitioned further
MIN_WINDOW = 8  # the smallest nw window peeled off as a floater


def partition(
    problem: Problem,
    units: Sequence[int],
    before: Container[int] = frozenset(),
    limit: int = SEGMENT_LIMIT,
    min_window: int = MIN_WINDOW,
) -> list[list[int]]:
    """Segments of `units` in run order (see the module docstring)."""
    clo = closure(problem, sorted(units))
    scope = (1 << len(clo.units)) - 1
    masks = _refine(problem, clo, scope, before, limit, min_window, top=True)
    return [[clo.units[i] for i in bits(m)] for m in masks]


def _refine(
    problem: Problem,
    clo: Closure,
    scope: int,
    before: Container[int],
    limit: int,
    min_window: int,
    top: bool = False,
) -> list[int]:
    """Masks of the segments of `scope`, each at most `limit` units where a waist allows."""
    if scope.bit_count() <= limit and not top:
        return [scope]
    parts = split(problem, clo, scope, before)
    if len(parts) == 1:
        return parts
    out: list[int] = []
    for part in parts:
        out.extend(_refine(problem, clo, part, before, limit, min_window))
    return out


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
