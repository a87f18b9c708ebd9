"""The search of MAGIS Alg. 3: coordinated graph transformation and scheduling.

A priority queue of M-States; each popped state is rewritten by every rule (lazily: a candidate
graph is built only when evaluated, a few at a time), de-duplicated by an incremental
Weisfeiler-Lehman hash, rescheduled incrementally (Alg. 2, then Store/Load timing), simulated,
and pushed back if it is not worse than the best by more than a factor delta (1.1); the queue is
ordered by BetterThan (in memory-limit mode, under a rising latency cap until the limit is met:
see queue.py). The best state is re-analysed when popped (Analyze of Alg. 3: a new F-Tree on
its graph and schedule, `fission_moves.Reanalysis`). (A queue order weighing memory saved
against latency spent was tried and did worse: resnet50 missed a 0.4 memory limit in 60 s that
the greedy order meets, and unet under a 1.10 latency limit ended higher.) A time budget or
Ctrl-C ends the search; the best state so far is always returned, and every improvement is
recorded (time, memory, latency) for plots.

Where each part lives: the queue, the best state and the records in `core.py` (`SearchCore`),
how popped states are expanded (here, by worker processes in the serial order, or by workers
each on states of its own) in `strategy.py`, `parallel.py` and `concurrent.py`; the knobs in
`options.py`, the deadline in `budget.py`, turning a move into a child state in `evaluator.py`,
the child's schedule in `reschedule.py`, the queue order in `queue.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from magis.cost import CostModel
from magis.ir import Graph
from magis.search.collector import search_pace
from magis.search.core import (
    Improvement,
    SearchCore,
    SearchResult,
    WarmStart,
    default_rules,
    search_rules,
)
from magis.search.options import SearchOptions
from magis.search.parallel import start_workers
from magis.search.state import Objective
from magis.search.strategy import strategy_for
from magis.search.transport import SearchWorkers

__all__ = [
    "Improvement",
    "SearchResult",
    "WarmStart",
    "default_rules",
    "optimize_graph",
    "search_rules",
    "start_search_workers",
]


def start_search_workers(
    cost: CostModel, options: SearchOptions, objective: Objective, graph: Graph | None = None
) -> SearchWorkers:
    """The `options.workers` worker processes (or Ray actors) of a search with these options
    (`magis.search.parallel`), booting from now on; hand them to `optimize_graph`. They
    order each state's moves by what `objective` needs, as the serial search does. With
    `graph` (the step that search will run on), the first of them builds the initial state
    meanwhile (`magis.search.initial`)."""
    return start_workers((cost, options, search_rules(options), objective), options, graph)


def optimize_graph(
    graph: Graph,
    cost: CostModel,
    objective: Objective,
    options: SearchOptions | None = None,
    on_improvement: Callable[[Improvement], None] | None = None,
    before_polish: Callable[[SearchResult], None] | None = None,
    warm_starts: Sequence[WarmStart] = (),
    workers: SearchWorkers | None = None,
) -> SearchResult:
    """Alg. 3 on `graph` under `objective`, within `options.time_budget` seconds (or
    `options.max_states` states). Ctrl-C ends it early with the best state so far.

    `warm_starts` (other methods' programs of the same step) join the queue beside the
    initial state; the best of them is the best state to beat from the start.

    `before_polish` is handed the result as it stands before the final re-ordering (which a
    second Ctrl-C may interrupt): a caller saves it there so that nothing is lost.

    `workers`: the worker processes of `options.workers` > 1, when the caller started them
    early (`start_search_workers`, so that they boot while it does other work); else they
    are started here."""
    clock_start = time.perf_counter()
    options = options if options is not None else SearchOptions()
    if workers is None and options.workers > 1:
        workers = start_search_workers(cost, options, objective, graph)
    strategy = strategy_for(options, workers)
    try:
        with search_pace() as settle:
            begun = strategy.initial_start(cost)  # built by a worker while the peers ran
            core = SearchCore.start(
                graph, cost, objective, options, on_improvement, begun, settle, clock_start
            )
            for warm in warm_starts:
                core.add_warm_start(warm)
            interrupted = False
            try:
                strategy.run(core)
            except KeyboardInterrupt:
                interrupted = True
            return core.finish(interrupted, strategy, before_polish)
    finally:
        strategy.close()
