"""Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021) as a baseline.

DTR runs the program as written under a memory budget. When an allocation does not fit, it
evicts the resident tensor with the smallest

    h_DTR(t) = (c(t) + sum of c over e*(t)) / (m(t) * s(t))            (DTR §4, Eq. 1)

where c is the compute time of the op that made t, m its size, s its staleness (time since it was
last read or made), and e*(t) its evicted neighbourhood: the evicted tensors that would have to
be recomputed with t, or could no longer be. We use DTR's own cheap approximation of e*, h_DTR^eq
(§4, "equivalence classes"): evicted tensors that touch form a class in a union-find with the sum
of its members' costs; evicting t merges the classes of its evicted neighbours (producers'
inputs and consumers' outputs); recomputing t subtracts its cost from its class, which is never
split. Time is the simulated clock of the cost model; the "tensors" are storages (a view is free
and goes with its base). A tensor needed again after eviction is recomputed on demand,
recursively (`magis.baselines.budget`).

The candidate with the least h is found exactly: h >= c(t) / (m(t) s(t)), computed for all
candidates at once, bounds the search, which evaluates the neighbourhood term for candidates in
increasing order of that bound until the bound exceeds the best h seen (at most
`DTROptions.max_exact` of them; the DTR prototype samples candidates instead).

Each point is the program the run executed (recomputations as clone nodes), simulated: its peak
is within the budget by construction. Budgets are fractions of the program-order peak; one DTR
cannot meet (everything an op needs at once does not fit, or recomputation exceeds 50 ops per op
of the program) is a `Failure`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from magis.baselines.base import Baseline, Outcome
from magis.baselines.budget import (
    DEFAULT_RATIOS,
    MAX_RECOMPUTE_FACTOR,
    BudgetRun,
    BudgetTables,
    budget_sweep,
)
from magis.cost import CostModel
from magis.ir import Graph

_EPS_S = 1e-12  # staleness floor: a tensor made this instant is not infinitely fresh


@dataclass(frozen=True)
class DTROptions:
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    max_recompute_factor: int = MAX_RECOMPUTE_FACTOR
    max_exact: int = 64  # candidates whose neighbourhood term is evaluated per eviction


class DTRPolicy:
    """h_DTR^eq over the storages of one run (union-find of evicted storages)."""

    def __init__(self, tables: BudgetTables, max_exact: int) -> None:
        n = len(tables.storages)
        self.t = tables
        self.max_exact = max_exact
        self.evicted = np.zeros(n, dtype=bool)
        self.parent = np.full(n, -1, dtype=np.int64)  # union-find; -1: never evicted
        self.class_cost = np.zeros(n, dtype=np.float64)

    def choose(self, run: BudgetRun) -> int | None:
        cand = run.candidates()
        if not len(cand):
            return None
        t = self.t
        scale = t.nbytes[cand] * (run.now - run.last_access[cand] + _EPS_S)
        bound = t.cost[cand] / scale
        best, best_h = None, np.inf
        for i in np.argsort(bound, kind="stable")[: self.max_exact]:
            if bound[i] >= best_h:
                break
            s = int(cand[i])
            h = (t.cost[s] + self._neighbourhood_cost(s)) / scale[i]
            if h < best_h:
                best, best_h = s, h
        return best

    def _neighbourhood_cost(self, s: int) -> float:
        roots = {
            self._find(n) for n in (*self.t.parents[s], *self.t.children[s]) if self.evicted[n]
        }
        return float(sum(self.class_cost[r] for r in roots))

    def on_evict(self, run: BudgetRun, s: int) -> None:
        self.evicted[s] = True
        if self.parent[s] < 0:
            self.parent[s] = s
        root = self._find(s)
        self.class_cost[root] += self.t.cost[s]
        for n in (*self.t.parents[s], *self.t.children[s]):
            if self.evicted[n]:
                root = self._union(root, self._find(n))

    def on_materialize(self, run: BudgetRun, s: int, recompute: bool) -> None:
        if self.evicted[s]:
            self.evicted[s] = False
            self.class_cost[self._find(s)] -= self.t.cost[s]

    def _find(self, s: int) -> int:
        parent = self.parent
        root = s
        while parent[root] != root:
            root = int(parent[root])
        while parent[s] != root:  # path compression
            parent[s], s = root, int(parent[s])
        return root

    def _union(self, a: int, b: int) -> int:
        if a == b:
            return a
        self.parent[b] = a
        self.class_cost[a] += self.class_cost[b]
        return a


def dtr_points(
    graph: Graph,
    cost: CostModel,
    options: DTROptions = DTROptions(),
    deadline: float | None = None,
) -> Iterator[Outcome]:
    """DTR at every budget of `options.ratios` (fractions of the program-order peak), until
    `deadline` (`time.perf_counter()`, None: none)."""
    make = partial(DTRPolicy, max_exact=options.max_exact)
    yield from budget_sweep(
        "dtr", graph, cost, make, options.ratios, options.max_recompute_factor, deadline
    )


def dtr_at(graph: Graph, cost: CostModel, ratios: Sequence[float]) -> list[Outcome]:
    """DTR at the given budgets only."""
    return list(dtr_points(graph, cost, DTROptions(ratios=tuple(ratios))))


DTR = Baseline(
    "dtr",
    "Dynamic Tensor Rematerialization: evict by h_DTR^eq, recompute on demand (Kirisame+ 2021)",
    dtr_points,
    stops_within_points=True,
)
