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


# A first fission child, in units of the start's analysis per node: on the 99,900-node Mamba
# step the analysis took 12.9 s and the first child 77 s (a whole-step split).
FISSION_PRIOR = 6.0


@dataclass
class FissionCost:
    """What one fission child costs (materializing the mutated F-Tree, then checking, hashing
    and simulating the split graph), in seconds per node of the graph it splits: the latest
    child's, measured; before the first, FISSION_PRIOR times the start's analysis (the F-Tree
    that offers the moves). On the 99,900-node Mamba step the first child, a whole-step split,
    took 77 s: a 60 s search ran 117 s for that one state, where its re-materializations and
    swaps alone reach 0.15 of the peak in the same 60 s. A move whose child is expected to
    outlast the budget is not built. On graphs of a few thousand nodes a child is a second or
    two and this never binds."""

    per_node: float

    @staticmethod
    def before_any(analysis_seconds: float, nodes: int) -> FissionCost:
        return FissionCost(FISSION_PRIOR * analysis_seconds / max(nodes, 1))

    def expected(self, nodes: int) -> float:
        return self.per_node * nodes

    def affordable(self, nodes: int, left: float) -> bool:
        return self.expected(nodes) <= left

    def observe(self, seconds: float, nodes: int) -> None:
        self.per_node = seconds / max(nodes, 1)
