"""The time a search may spend (MAGIS §6.2: a search under a time budget), and its progress.

A budget is seconds, or states when `max_states` is given: then everything that would read the
clock to decide (progress, whether a re-analysis is affordable) reads the state count instead,
so a search with a seed and `max_states` is reproducible.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

POLISH_SHARE = 0.25  # at most this share of the budget goes to the final full re-ordering


@dataclass(frozen=True)
class PolishCost:
    """What the final full re-ordering of the best graph is expected to cost: the initial
    graph's DP scheduling time, scaled by the square of the growth in nodes (measured on
    gpt-neo-1.3b: 0.19 s for 5,040 nodes, 6.2 s for 32,179 after a 8-way split, 20.6 s for
    63,187 after a 16-way one). A search reserves that time at the end of its budget; beyond
    POLISH_SHARE of the budget, the best keeps the search's own schedule (before this, a
    180 s search of gpt-neo-1.3b ran for 297 s)."""

    initial_seconds: float
    initial_nodes: int
    budget: float

    def estimate(self, nodes: int) -> float:
        return self.initial_seconds * (nodes / max(self.initial_nodes, 1)) ** 2

    def affordable(self, nodes: int) -> bool:
        return self.estimate(nodes) <= POLISH_SHARE * self.budget

    def reserve(self, nodes: int) -> float:
        return self.estimate(nodes) if self.affordable(nodes) else 0.0


@dataclass
class Budget:
    """Deadline, the reserve for the final re-ordering, and progress in [0, 1]."""

    seconds: float
    max_states: int | None = None
    polish: PolishCost | None = None
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def exhausted(self, states: int, best_nodes: int) -> bool:
        if self.max_states is not None:
            return states >= self.max_states or self.elapsed() >= self.seconds
        # the final re-ordering of the best runs within the budget, not after it
        reserve = self.polish.reserve(best_nodes) if self.polish is not None else 0.0
        return self.elapsed() >= self.seconds - reserve

    def over(self) -> bool:
        """Whether the whole budget is spent, the final re-ordering's reserve included: a
        search whose best a worker re-orders meanwhile explores until then."""
        return self.elapsed() >= self.seconds

    def progress(self, states: int) -> float:
        """Share of the budget used: by states when bounded by them (reproducible)."""
        if self.max_states is not None:
            return states / self.max_states
        return self.elapsed() / self.seconds

    def analysis_window(self) -> tuple[float, float]:
        """(seconds elapsed, seconds left) for deciding whether a re-analysis is affordable;
        unbounded when the budget is counted in states, so that decision never reads the clock."""
        if self.max_states is not None:
            return math.inf, math.inf
        elapsed = self.elapsed()
        return elapsed, self.seconds - elapsed
