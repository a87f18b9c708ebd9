"""Incremental scheduling (MAGIS §6.1, Alg. 2).

After a rewrite only a stretch of the old schedule needs new decisions. `reschedule_interval`
finds it (GetRescheduleInterval): the positions of the units the rewrite touched, widened on each
side by ExtendBound, which walks outward while the narrow-waist value keeps falling — at most 20
steps, stopping early once it has seen a waist of at most 10 and the next one is not below 4
(the paper's empirical constants). Narrow waists are where a schedule can be cut with little
loss (§6.1: the peak of independently optimal halves is within the weight of the nw nodes of
the optimum), so that is where the old prefix and suffix are kept.

`incremental_schedule` then keeps the old prefix and suffix, partitions everything else of the
new graph (the interval plus the nodes the rewrite created) with the narrow-waist partition,
solves its segments with the DP, and merges (Alg. 2 lines 9-12); the merged order is then
polished at its peak like any other (`solve.polish`), since a rewrite can lower what is
achievable around a peak the interval does not reach. Prefix and suffix are kept as
units of the new graph, by their head; if the rewrite made a kept unit depend on the middle
(or the middle on a kept unit of the suffix) that unit joins the middle, so the result is always
a valid order.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from magis.ir import DerivedKey, Graph
from magis.schedule.memo import DpMemo
from magis.schedule.narrow_waist import nw_values
from magis.schedule.problem import Problem, problem_of
from magis.schedule.scheduler import simulated_peak
from magis.schedule.solve import Options, SegmentInfo, polish, solve, step_memory

# ExtendBound's constants (Alg. 2 line 4)
MAX_STEPS = 20
GOOD_WAIST = 10
TIGHT_WAIST = 4


@dataclass(frozen=True)
class IncrementalResult:
    order: tuple[int, ...]  # node ids of the new graph
    peak_bytes: int
    interval: tuple[int, int]  # first and last rescheduled position of the old unit schedule
    rescheduled: int  # units of the new graph that were scheduled again
    segments: tuple[SegmentInfo, ...]
    seconds: float

    @property
    def exact_segments(self) -> int:
        return sum(1 for s in self.segments if s.exact)


def unit_schedule(problem: Problem, order: Iterable[int]) -> list[int]:
    """The unit order a node order runs (each unit at its head's place)."""
    units = []
    for nid in order:
        u = problem.unit_of.get(nid)
        if u is not None and problem.members[u][0] == nid:
            units.append(u)
    return units


_UNIT_NW: DerivedKey[dict[int, int]] = DerivedKey("schedule.nw")


def unit_nw(graph: Graph) -> dict[int, int]:
    """nw of every unit of the graph, placeholders excluded (cached per graph version)."""
    problem = problem_of(graph)
    return graph.derived(_UNIT_NW, lambda: nw_values(problem, range(problem.n)))


def extend_bound(psi: Sequence[int], nw: dict[int, int], i: int, d: int) -> int:
    """ExtendBound(i, d) of Alg. 2: walk from position i in direction d while nw falls."""
    best = None  # n-hat; None is infinity
    steps = 0
    while (
        steps < MAX_STEPS
        and (best is None or best > GOOD_WAIST or nw[psi[i]] < TIGHT_WAIST)
        and (best is None or nw[psi[i]] < best)
    ):
        best = nw[psi[i]]
        if not 0 <= i + d < len(psi):
            break
        i += d
        steps += 1
    return i


def reschedule_interval(
    graph: Graph, order: Sequence[int], changed: Iterable[int]
) -> tuple[int, int]:
    """GetRescheduleInterval (Alg. 2 lines 1-8) on the unit schedule of `order`: (beg, end),
    inclusive positions. `changed` are node ids of `graph` the rewrite touched."""
    problem = problem_of(graph)
    return _interval(graph, problem, unit_schedule(problem, order), changed)


def _interval(graph: Graph, problem: Problem, psi: list[int], changed) -> tuple[int, int]:
    pos = {u: i for i, u in enumerate(psi)}
    touched = _touched_units(graph, problem, changed)
    if not psi:
        return 0, -1
    if not touched:
        return 0, len(psi) - 1
    nw = unit_nw(graph)
    first = min(pos[u] for u in touched)
    last = max(pos[u] for u in touched)
    return extend_bound(psi, nw, first, -1), extend_bound(psi, nw, last, 1)


def _touched_units(graph: Graph, problem: Problem, changed: Iterable[int]) -> set[int]:
    """Units holding a changed node; a changed prologue node touches the units that read it."""
    units: set[int] = set()
    frontier = [n for n in changed if n in graph]
    seen = set(frontier)
    while frontier:
        nid = frontier.pop()
        u = problem.unit_of.get(nid)
        if u is not None:
            units.add(u)
            continue
        for s in graph.successors(nid):
            if s not in seen:
                seen.add(s)
                frontier.append(s)
    return units


def incremental_schedule(
    old_graph: Graph,
    old_order: Sequence[int],
    new_graph: Graph,
    changed: Iterable[int],
    options: Options | None = None,
    check: bool = False,
    memo: DpMemo | None = None,
) -> IncrementalResult:
    """Alg. 2: reschedule the interval around the old nodes `changed`, keep the rest. A `memo`
    passed from one call to the next answers the DP on segments that did not change."""
    start = time.perf_counter()
    options = options if options is not None else Options()
    old = problem_of(old_graph)
    psi = unit_schedule(old, old_order)
    beg, end = _interval(old_graph, old, psi, changed)
    prefix_nodes = [n for u in psi[: max(beg, 0)] for n in old.members[u]]
    suffix_nodes = [n for u in psi[end + 1 :] for n in old.members[u]]
    new = problem_of(new_graph)
    prefix, middle, suffix = _split(new, prefix_nodes, suffix_nodes)
    sol = solve(new, middle, options, before=prefix, memo=memo, polished=False)
    units, _ = polish(new, [*prefix, *sol.units, *suffix], (), options, sol.expanded, memo)
    order = tuple(new.full_order(units))
    peak = new.resident + max(step_memory(new, units), default=0)
    if check:
        assert new_graph.is_valid_schedule(list(order)), "incremental order violates a dependency"
        assert peak == simulated_peak(new_graph, order), "incremental peak is not the simulated one"
    return IncrementalResult(
        order, peak, (beg, end), len(middle), sol.segments, time.perf_counter() - start
    )


def _split(
    new: Problem, prefix_nodes: list[int], suffix_nodes: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """New-graph units kept before, rescheduled, and kept after (see the module docstring)."""
    rank = {n: i for i, n in enumerate(prefix_nodes)}
    rank_after = {n: i for i, n in enumerate(suffix_nodes)}
    heads = [m[0] for m in new.members]
    prefix = sorted((u for u in range(new.n) if heads[u] in rank), key=lambda u: rank[heads[u]])
    suffix = sorted(
        (u for u in range(new.n) if heads[u] in rank_after), key=lambda u: rank_after[heads[u]]
    )
    kept_before: set[int] = set()
    for u in prefix:  # a kept unit whose inputs are no longer all kept before it moves
        if all(p in kept_before for p in new.preds[u]):
            kept_before.add(u)
    kept_after: set[int] = set()
    for u in reversed(suffix):
        if all(s in kept_after for s in new.succs[u]):
            kept_after.add(u)
    prefix = [u for u in prefix if u in kept_before]
    suffix = [u for u in suffix if u in kept_after]
    middle = [u for u in range(new.n) if u not in kept_before and u not in kept_after]
    return prefix, middle, suffix
