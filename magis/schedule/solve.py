"""Schedule a set of units: partition, solve each segment, merge (MAGIS §6.1, Alg. 2 line 11).

The pipeline for a unit set (the whole graph, or the reschedule interval of Alg. 2):

1. small sets (at most `whole_limit` units) go to the DP whole: exact whenever it finishes;
2. otherwise floaters are peeled off, the core is cut at nw <= 1 (`narrow_waist`), floaters are
   placed (`placement`), and each segment gets the list schedule as an upper bound, then the DP
   within `budget` expansions when it has at most `dp_limit` units;
3. the segment orders are concatenated in segment order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from magis.schedule.dp import DEFAULT_BUDGET, dp_schedule
from magis.schedule.heuristic import list_schedule
from magis.schedule.narrow_waist import closure, cut_segments, peel_floaters
from magis.schedule.placement import place_floaters
from magis.schedule.problem import Problem
from magis.schedule.segment import SegmentProblem, segment_problems

WHOLE_LIMIT = 40  # units the DP is tried on whole before partitioning
DP_LIMIT = 120  # larger segments get the list schedule only


@dataclass(frozen=True)
class Options:
    """Knobs of the DP scheduler; `budget` is DP state expansions per segment."""

    budget: int = DEFAULT_BUDGET
    whole_limit: int = WHOLE_LIMIT
    dp_limit: int = DP_LIMIT
    use_dp: bool = True


@dataclass(frozen=True)
class SegmentInfo:
    units: int
    nodes: int
    exact: bool  # the DP proved this segment's order optimal
    peak_bytes: int  # the segment's peak step, resident bytes included


@dataclass(frozen=True)
class Solution:
    units: tuple[int, ...]  # unit order
    segments: tuple[SegmentInfo, ...]


def solve(
    problem: Problem,
    units: Sequence[int],
    options: Options = Options(),
    before: frozenset[int] = frozenset(),
) -> Solution:
    """An order of `units` (a dependency-closed middle part: `before` runs first, the rest last)."""
    units = sorted(units)
    if not units:
        return Solution((), ())
    if options.use_dp and len(units) <= options.whole_limit:
        (seg,) = segment_problems(problem, [units], before)
        order, info = _solve_segment(problem, seg, options)
        if info.exact:
            return Solution(order, (info,))
    return _solve_partitioned(problem, units, options, before)


def partition(
    problem: Problem, units: Sequence[int], before: frozenset[int] = frozenset()
) -> list[list[int]]:
    """Segments of `units` in run order (narrow-waist cuts of the core, floaters placed)."""
    clo = closure(problem, sorted(units))
    core = peel_floaters(clo)
    core_seg, _cuts = cut_segments(clo, core)
    floaters = [u for i, u in enumerate(clo.units) if not core >> i & 1]
    nsegs = max(core_seg.values(), default=0) + 1
    placed = place_floaters(problem, clo, core_seg, floaters, nsegs, before)
    buckets: list[list[int]] = [[] for _ in range(nsegs)]
    for u, k in (*core_seg.items(), *placed.items()):
        buckets[k].append(u)
    return [sorted(b) for b in buckets if b]


def _solve_partitioned(
    problem: Problem, units: list[int], options: Options, before: frozenset[int]
) -> Solution:
    segments = partition(problem, units, before)
    order: list[int] = []
    infos = []
    for seg in segment_problems(problem, segments, before):
        part, info = _solve_segment(problem, seg, options)
        order.extend(part)
        infos.append(info)
    return Solution(tuple(order), tuple(infos))


def _solve_segment(
    problem: Problem, seg: SegmentProblem, options: Options
) -> tuple[tuple[int, ...], SegmentInfo]:
    """List schedule, then the DP seeded with it as the bound to beat."""
    heur = list_schedule(seg)
    order, peak, exact = heur.order, heur.peak, False
    if options.use_dp and seg.m <= options.dp_limit:
        res = dp_schedule(seg, (heur.order, heur.peak), options.budget)
        order, peak, exact = res.order, res.peak, res.exact
    nodes = sum(len(problem.members[u]) for u in seg.units)
    info = SegmentInfo(seg.m, nodes, exact, problem.resident + peak)
    return tuple(seg.units[i] for i in order), info
