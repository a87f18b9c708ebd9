"""The order of Alg. 3's priority queue, and the latency the memory-limit search allows itself.

Alg. 3 orders the queue by BetterThan: in memory-limit mode, a state over the limit ranks by
its memory alone. With re-materialization and swapping that is a trap. Every recompute lowers
the peak a little at a latency cost, so the greedy line of them is always popped first. It
reaches the limit at a high latency (resnet50 under 0.4: the limit met at 1.98x in 4 s, and
1.42x after 180 s of de-re-materialization). Meanwhile the latency-limit search at 1.10 finds
0.39 of the peak at 1.096x with the same rules. Once a state meets the limit, every state
that meets it ranks first, so the cheap lines were never expanded again.

So in memory-limit mode, until a state meets the limit, the search works as the latency-limit
search does, under a latency cap. States within the cap rank by memory, before every state
above it. The cap starts just above the initial latency and rises a step whenever the lowest
memory reached within it ("the frontier") is not falling fast enough to reach the limit in the
time that is left (at its pace over the last tenth of the budget). It is a sweep of latency limits, paced by the search's own progress.
Progress is the fraction of the time budget, or of `max_states` when that is given, so that a
search bounded by states stays deterministic.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from magis.search.state import Mode, MState, Objective

CAP_STEP = 0.025  # of the initial latency, per raise
CAP_WINDOW = 0.1  # of the progress: how far back the frontier's pace is measured
CAP_LOOKAHEAD = 2  # steps above the cap whose states are still kept (a later raise expands them)


@dataclass
class QueueOrder:
    """Sort keys and the relaxed push test of Alg. 3's queue (smaller keys pop first)."""

    objective: Objective
    initial_latency: float
    delta: float
    cap: float = field(init=False)
    _met: bool = field(default=False, init=False)
    _last_raise: float = field(default=0.0, init=False)
    _frontier: float = field(default=float("inf"), init=False)
    _pace: list[tuple[float, float]] = field(
        default_factory=list, init=False
    )  # (progress, frontier)
    _seen: list[tuple[float, int]] = field(default_factory=list, init=False)  # (latency, memory)

    def __post_init__(self) -> None:
        self.cap = self.initial_latency * (1 + CAP_STEP)

    @property
    def capped(self) -> bool:
        """Whether the latency cap orders the queue (memory-limit mode, limit not met yet)."""
        return self.objective.mode is Mode.MEMORY_LIMIT and not self._met

    def key(self, s: MState) -> tuple:
        if not self.capped or self.objective.satisfied(s):
            return self.objective.key(s)
        return (1, s.latency > self.cap, s.memory, s.latency)

    def worth_pushing(self, s: MState, best: MState) -> bool:
        if not self.capped or self.objective.satisfied(s):
            return self.objective.worth_pushing(s, best, self.delta)
        if s.latency > self.cap + CAP_LOOKAHEAD * CAP_STEP * self.initial_latency:
            return False
        return s.memory <= self.delta * self._frontier

    def observe(self, s: MState, progress: float) -> bool:
        """Record an evaluated state; True when the cap rose (the queue must be re-keyed)."""
        if not self.capped:
            return False
        if self.objective.satisfied(s):
            self._met = True
            return True  # from now on the objective's own order
        bisect.insort(self._seen, (s.latency, s.memory))
        if s.latency <= self.cap and s.memory < self._frontier:
            self._frontier = s.memory
            self._pace.append((progress, s.memory))
        if not self._falling_too_slowly(progress):
            return False
        self._raise(progress)
        return True

    def rekey(self, queue: list) -> None:
        queue[:] = [(self.key(s), t, s, m) for _, t, s, m in queue]
        heapq.heapify(queue)

    def _falling_too_slowly(self, progress: float) -> bool:
        if progress - self._last_raise < CAP_WINDOW:
            return False
        if self._frontier == float("inf"):  # nothing within the cap yet
            return True
        then = self._frontier_at(progress - CAP_WINDOW)
        pace = (then - self._frontier) / CAP_WINDOW  # bytes per unit of progress
        needed = self._frontier - self.objective.limit
        return pace * (1 - progress) < needed

    def _frontier_at(self, progress: float) -> float:
        value = float("inf")
        for p, memory in self._pace:
            if p > progress:
                break
            value = memory
        return value

    def _raise(self, progress: float) -> None:
        self.cap += CAP_STEP * self.initial_latency
        self._last_raise = progress
        reachable = self._seen[: bisect.bisect_right(self._seen, (self.cap, float("inf")))]
        self._frontier = min((m for _, m in reachable), default=float("inf"))
        self._pace.append((progress, self._frontier))
