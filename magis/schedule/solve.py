"""Schedule a set of units: partition, solve each segment, merge (MAGIS §6.1, Alg. 2 line 11).

The unit set (the whole graph, or the reschedule interval of Alg. 2) is cut by GraphPartition
(`partition.split`; a set of at most `whole_limit` units goes to the DP whole) and the segments
are worked off as a queue, left to right:

* a segment of at most `dp_limit` units gets the list schedule as its upper bound, then the DP
  within `budget` expansions; if the DP finishes, its order is optimal for the segment and is
  emitted;
* a segment too large, or one the DP could not finish, is split one level (`partition.split`:
  its narrow-waist cuts, peeling floaters if it has none) and its parts go to the front of the
  queue;
* a segment that cannot be split is emitted with the best order known (list schedule, or what
  the DP beat it with).

So the DP sees segments as large as it can finish — a floater's placement between segments is a
heuristic, the DP's order within one is not — and the partition goes only as deep as needed.

Then `polish` re-solves a window of units around the peak step with the DP, which may cross
segment boundaries, for as long as that lowers the peak (the partition may have kept a cell's
blocks from interleaving with the next cell's).

`total_budget` caps the expansions of a whole solve: past it, segments get the list schedule.
Every count is of DP expansions, never of seconds, so results do not depend on the machine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from magis.schedule.dp import DEFAULT_BUDGET
from magis.schedule.heuristic import list_schedule
from magis.schedule.memo import DpMemo, run_dp
from magis.schedule.narrow_waist import bits, closure
from magis.schedule.partition import split
from magis.schedule.problem import Problem
from magis.schedule.segment import SegmentProblem, Sweep

DP_LIMIT = 64  # units: larger segments are split before the DP is tried
TOTAL_BUDGET = 2_000_000  # DP expansions per solve
WHOLE_LIMIT = 24  # units: smaller sets skip the partition
WINDOW = 40  # units around the peak re-solved after merging
POLISH_ROUNDS = 8
POLISH_BUDGET = 20_000


@dataclass(frozen=True)
class Options:
    """Knobs of the DP scheduler; budgets count DP state expansions (deterministic)."""

    budget: int = DEFAULT_BUDGET  # per segment
    total_budget: int = TOTAL_BUDGET  # per solve
    dp_limit: int = DP_LIMIT
    use_dp: bool = True
    whole_limit: int = WHOLE_LIMIT  # sets this small go to the DP before any partition
    window: int = WINDOW  # units re-solved around the peak after merging
    polish_rounds: int = POLISH_ROUNDS
    polish_budget: int = POLISH_BUDGET  # per window


@dataclass(frozen=True)
class SegmentInfo:
    units: int
    nodes: int
    exact: bool  # the DP proved this segment's order optimal
    peak_bytes: int  # the segment's peak step, resident bytes included


@dataclass(frozen=True)
class Solution:
    units: tuple[int, ...]  # unit order
    segments: tuple[SegmentInfo, ...]  # as partitioned and solved, before polishing
    expanded: int  # DP states expanded in all
    peak_bytes: int  # of the whole order (`before`, then `units`), resident included


def solve(
    problem: Problem,
    units: Sequence[int],
    options: Options | None = None,
    before: Iterable[int] = (),
    memo: DpMemo | None = None,
    polished: bool = True,
) -> Solution:
    """An order of `units`, a dependency-closed middle part: `before` runs first, the rest last.
    `memo` answers DP calls on segments seen before (`memo.DpMemo`); `polished=False` leaves the
    polish to a caller that polishes a larger order anyway (incremental scheduling)."""
    options = options if options is not None else Options()
    before = sorted(before)
    clo = closure(problem, sorted(units))
    if not clo.units:
        return Solution((), (), 0, problem.resident + Sweep(problem, before).live)
    sweep = Sweep(problem, before)
    whole = (1 << len(clo.units)) - 1
    # GraphPartition first (Alg. 2 line 11), unless the set is small enough for the DP whole
    queue = deque(
        [whole] if len(clo.units) <= options.whole_limit else split(problem, clo, whole, sweep.done)
    )
    order: list[int] = []
    infos: list[SegmentInfo] = []
    spent = 0
    while queue:
        mask = queue.popleft()
        m = mask.bit_count()  # a segment's problem is built only for the DP or the heuristic
        tries_dp = options.use_dp and m <= options.dp_limit and spent < options.total_budget
        seg = sweep.segment(clo.units[i] for i in bits(mask)) if tries_dp else None
        if tries_dp:
            local, peak, exact, expanded = _dp(problem, seg, options, memo)
            spent += expanded
            if exact:
                _emit(problem, sweep, seg, local, peak, True, order, infos)
                continue
        parts = split(problem, clo, mask, sweep.done)
        if len(parts) > 1:
            queue.extendleft(reversed(parts))
            continue
        if not tries_dp:
            seg = sweep.segment(clo.units[i] for i in bits(mask))
            heur = list_schedule(seg)
            local, peak = heur.order, heur.peak
        _emit(problem, sweep, seg, local, peak, False, order, infos)
    if polished:
        order, spent = polish(problem, order, before, options, spent, memo)
    peak = problem.resident + max(step_memory(problem, order, before))
    return Solution(tuple(order), tuple(infos), spent, peak)


def step_memory(problem: Problem, units: Sequence[int], before: Iterable[int] = ()) -> list[int]:
    """Bytes live at each unit's step (resident excluded) when `before`, then `units`, run."""
    sweep = Sweep(problem, before)
    steps = []
    for u in units:
        steps.append(sweep.live + problem.alloc[u])
        sweep.advance((u,))
    return steps


def polish(
    problem: Problem,
    units: list[int],
    before: Iterable[int],
    options: Options,
    spent: int = 0,
    memo: DpMemo | None = None,
) -> tuple[list[int], int]:
    """Re-solve a window of `options.window` units around the peak step with the DP while that
    lowers the peak: a segment boundary chosen by the partition may have kept two parts from
    interleaving (a NASNet cell's blocks with the next cell's), and a window spans it. The
    window is tried centred on the peak, then with the peak near its end and near its start."""
    before = list(before)
    for _ in range(options.polish_rounds):
        if not options.use_dp or len(units) <= 1 or spent >= options.total_budget:
            break
        steps = step_memory(problem, units, before)
        k = max(range(len(steps)), key=steps.__getitem__)
        for offset in (options.window // 2, options.window * 3 // 4, options.window // 4):
            lo = max(0, min(k - offset, len(units) - options.window))
            sweep = Sweep.at(problem, {*before, *units[:lo]}, steps[lo] - problem.alloc[units[lo]])
            better, spent = _polish_window(problem, units, lo, sweep, options, memo, spent)
            if better is not None:
                units = better
                break
        else:
            break
    return units, spent


def _polish_window(problem, units, lo, sweep, options, memo, spent):
    """(improved order or None, expansions spent) for the window of units from position lo."""
    window = units[lo : lo + options.window]
    seg = sweep.segment(window)
    local = {u: i for i, u in enumerate(seg.units)}
    current = tuple(local[u] for u in window)
    peak = seg.peak_of(current)
    res = run_dp(seg, (current, peak), options.polish_budget, memo)
    spent += res.expanded
    if res.peak >= peak:
        return None, spent
    return [*units[:lo], *(seg.units[i] for i in res.order), *units[lo + len(window) :]], spent


def _dp(
    problem: Problem, seg: SegmentProblem, options: Options, memo: DpMemo | None
) -> tuple[tuple[int, ...], int, bool, int]:
    """The list schedule, then the DP seeded with it as the bound to beat."""
    heur = list_schedule(seg)
    res = run_dp(seg, (heur.order, heur.peak), options.budget, memo)
    return res.order, res.peak, res.exact, res.expanded


def _emit(problem, sweep, seg, local, peak, exact, order, infos) -> None:
    units = [seg.units[i] for i in local]
    order.extend(units)
    sweep.advance(units)
    nodes = sum(len(problem.members[u]) for u in units)
    infos.append(SegmentInfo(seg.m, nodes, exact, problem.resident + peak))
