"""What every baseline hands back, and how a constraint picks among its points (MAGIS §7.1).

A baseline is a method a user would pick instead of magis: checkpointing, PyTorch's min-cut
partitioner, DTR, XLA's greedy re-materialization, offloading, micro-batching. Each one turns the
same captured step into one or more *points*: a graph and an order that our simulator costs and our
executor runs, so that every method is judged by one simulator and one cost model (DESIGN
principle 2). A method with a knob (a memory budget, a number of segments) yields one point per
knob setting: that set is its Pareto curve. A method that cannot meet a constraint is a `Failure`,
never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from magis.cost import CostModel
from magis.ir import Graph
from magis.sim import SimResult, simulate


@dataclass(frozen=True)
class BaselinePoint:
    """One setting of one method: the program it runs and what the simulator says of it.

    `repeats` > 1 means the graph runs that many times per training step (micro-batching): its
    latency is multiplied, its peak is not. `params` records the knob (budget, segments, ...).
    """

    method: str
    graph: Graph = field(repr=False)
    order: tuple[int, ...] = field(repr=False)
    sim: SimResult = field(repr=False)
    params: dict[str, Any] = field(default_factory=dict)
    repeats: int = 1
    extra_latency_s: float = 0.0  # time outside the graph (micro-batching's final update)
    extra_bytes: int = 0  # bytes outside the graph (micro-batching's gradient accumulators)

    @property
    def memory(self) -> int:
        return self.sim.peak_bytes + self.extra_bytes

    @property
    def latency(self) -> float:
        return self.sim.latency_s * self.repeats + self.extra_latency_s


@dataclass(frozen=True)
class Failure:
    """A method that produced no program for a setting or constraint, and why."""

    method: str
    reason: str
    params: dict[str, Any] = field(default_factory=dict)


Outcome = BaselinePoint | Failure


@dataclass(frozen=True)
class Target:
    """One constraint a method can solve for directly: least latency within `memory_bytes`, or
    least memory within `latency_s` (exactly one is set)."""

    memory_bytes: int | None = None
    latency_s: float | None = None

    def __post_init__(self) -> None:
        if (self.memory_bytes is None) == (self.latency_s is None):
            raise ValueError("a Target sets exactly one of memory_bytes and latency_s")


@dataclass(frozen=True)
class Baseline:
    """A method by name: `points(graph, cost)` yields its Pareto candidates (lazily, since some
    are expensive), each a `BaselinePoint` or a `Failure`. A method that solves for one
    constraint (an exact model) also has `solve(graph, cost, target, seconds)`, which the
    search's warm starts call with the search's own constraint and the seconds they can spare
    (None: no clock; the method must then give the same plan on every run).

    A method whose one point may take minutes on a large graph (the budget walks of XLA and
    DTR: a minute a budget at 100,000 nodes) takes a `deadline` in `points` and stops within
    a point (`stops_within_points`); `sweep` passes it where it is taken."""

    name: str
    description: str
    points: Callable[..., Iterable[Outcome]]
    solve: Callable[[Graph, CostModel, Target, float | None], Outcome] | None = None
    stops_within_points: bool = False

    def sweep(
        self, graph: Graph, cost: CostModel, deadline: float | None = None
    ) -> Iterable[Outcome]:
        """`points`, told `deadline` (`time.perf_counter()`) where the method stops within a
        point; the caller stops between points (`magis.commands.warm_start.best_point`)."""
        if self.stops_within_points:
            return self.points(graph, cost, deadline=deadline)
        return self.points(graph, cost)


def point(
    method: str, graph: Graph, order: Sequence[int], cost: CostModel, **params
) -> BaselinePoint:
    """A `BaselinePoint` of `graph` run in `order`, simulated under `cost`."""
    order = tuple(order)
    return BaselinePoint(method, graph, order, simulate(graph, order, cost), dict(params))


def best_under_memory(outcomes: Iterable[Outcome], limit_bytes: int, method: str) -> Outcome:
    """The fastest point whose peak fits `limit_bytes` (ties: less memory), else a Failure
    naming the least memory the method reached."""
    pts = [o for o in outcomes if isinstance(o, BaselinePoint)]
    fits = [p for p in pts if p.memory <= limit_bytes]
    if fits:
        return min(fits, key=lambda p: (p.latency, p.memory))
    least = min((p.memory for p in pts), default=None)
    why = "no point" if least is None else f"least memory reached {size_text(least)}"
    return Failure(method, f"no setting fits {size_text(limit_bytes)} ({why})")


def size_text(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the figure at 1 or more (tiny workloads
    have kilobyte peaks)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3f} {unit}"
    return f"{int(nbytes)} B"


def best_under_latency(outcomes: Iterable[Outcome], limit_s: float, method: str) -> Outcome:
    """The least-memory point whose latency fits `limit_s` (ties: faster), else a Failure."""
    pts = [o for o in outcomes if isinstance(o, BaselinePoint)]
    fits = [p for p in pts if p.latency <= limit_s]
    if fits:
        return min(fits, key=lambda p: (p.memory, p.latency))
    fastest = min((p.latency for p in pts), default=None)
    why = "no point" if fastest is None else f"fastest is {fastest * 1e3:.2f} ms"
    return Failure(method, f"no setting fits {limit_s * 1e3:.2f} ms ({why})")


def pareto_front(points: Iterable[BaselinePoint]) -> list[BaselinePoint]:
    """The points no other point beats in both memory and latency, by increasing memory."""
    front: list[BaselinePoint] = []
    for p in sorted(points, key=lambda p: (p.memory, p.latency)):
        if not front or p.latency < front[-1].latency:
            front.append(p)
    return front
