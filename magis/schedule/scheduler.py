"""The schedulers, chosen by name, and what they return (MAGIS §5.2 re-ordering, §6.1).

`schedule(graph, Scheduler.DP)` re-orders a graph for the least peak memory without changing what
runs, so its latency is the program order's (without Store/Load, the sum of operator times), nor
what it computes: ops that draw from the random generator keep their program order.
Every returned order is a topological order of the graph; with ``check=True`` that is asserted,
and so is the claimed peak against `magis.sim.memory_timeline` (tests turn it on; a search, which
schedules thousands of states, leaves it off).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from magis.errors import MagisError
from magis.ir import Graph
from magis.schedule.dp import DEFAULT_BUDGET, lower_bounds
from magis.schedule.problem import problem_of
from magis.schedule.segment import segment_problems
from magis.schedule.solve import Options, SegmentInfo, solve


class Scheduler(enum.Enum):
    # The order PyTorch ran, as captured: the baseline. For a rewritten graph, whose new nodes
    # come last in insertion order, the topological order closest to it (ties by insertion).
    PROGRAM = "program"
    DP = "dp"  # narrow-waist partition + Serenity DP per segment (MAGIS §6.1)

    @staticmethod
    def parse(name: str | Scheduler) -> Scheduler:
        if isinstance(name, Scheduler):
            return name
        try:
            return Scheduler(name.strip().lower())
        except ValueError:
            choices = ", ".join(s.value for s in Scheduler)
            raise UnknownSchedulerError(
                f"unknown scheduler '{name}'; choose one of {choices}"
            ) from None


class UnknownSchedulerError(MagisError):
    """A scheduler name that is not in `Scheduler`."""


@dataclass(frozen=True)
class ScheduleResult:
    """An order of every node of the graph and what the scheduler knows of it."""

    scheduler: Scheduler
    order: tuple[int, ...]  # node ids, a topological order of the graph
    peak_bytes: int  # simulated peak (MAGIS §2.1), resident bytes included
    # In run order; empty for the program order, and when the DP scheduler's partition and
    # heuristics could not beat it (then the program order is returned: never worse).
    segments: tuple[SegmentInfo, ...]
    seconds: float  # wall time of the scheduler

    @property
    def exact_segments(self) -> int:
        return sum(1 for s in self.segments if s.exact)


def schedule(
    graph: Graph,
    scheduler: Scheduler | str = Scheduler.DP,
    budget: int = DEFAULT_BUDGET,
    check: bool = False,
) -> ScheduleResult:
    """Schedule `graph`; `budget` caps the DP's state expansions per segment; `check` asserts
    the result (`verify_schedule`)."""
    kind = Scheduler.parse(scheduler)
    start = time.perf_counter()
    problem = problem_of(graph)
    if kind is Scheduler.PROGRAM:
        order = tuple(graph.topological_order())
        segments: tuple[SegmentInfo, ...] = ()
        peak = None
    else:
        sol = solve(problem, range(problem.n), Options(budget=budget))
        order = tuple(problem.full_order(sol.units))
        segments = sol.segments
        peak = sol.peak_bytes
        program = graph.topological_order()
        baseline = simulated_peak(graph, program)
        if baseline < peak:  # partition and heuristics lost to the captured order: keep that
            order, segments, peak = tuple(program), (), baseline
    seconds = time.perf_counter() - start
    if peak is None:
        peak = simulated_peak(graph, order)
    result = ScheduleResult(kind, order, peak, segments, seconds)
    if check:
        verify_schedule(graph, result)
    return result


def peak_lower_bound(graph: Graph) -> int:
    """Bytes live at some step in every order: no schedule's peak is below this (the DP's
    static bound on the whole graph: at each unit's step, its inputs and outputs and whatever
    its ancestors made for its descendants). Equal to a schedule's peak, it proves it optimal."""
    problem = problem_of(graph)
    if not problem.n:
        return problem.resident
    (seg,) = segment_problems(problem, [range(problem.n)])
    return problem.resident + max(lower_bounds(seg))


def simulated_peak(graph: Graph, order) -> int:
    """The peak of `order` by the simulator's memory model (MAGIS §2.1)."""
    from magis.sim import memory_timeline

    timeline, _, _ = memory_timeline(graph, order)
    resident = problem_of(graph).resident
    return int(timeline.max()) if len(timeline) else resident


def verify_schedule(graph: Graph, result: ScheduleResult) -> None:
    """Assert that `result` is a topological order whose peak is what the scheduler claims."""
    if not graph.is_valid_schedule(list(result.order)):
        raise AssertionError(f"{result.scheduler.value}: the order violates a dependency")
    peak = simulated_peak(graph, result.order)
    if peak != result.peak_bytes:
        raise AssertionError(
            f"{result.scheduler.value}: claimed peak {result.peak_bytes} B, simulated {peak} B"
        )
