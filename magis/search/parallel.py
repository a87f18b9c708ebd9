"""A popped state's children evaluated by parallel workers, recorded in the serial order
(MAGIS Alg. 3, lines 6-12; `SearchOptions.workers`).

The serial search (`_Search.expand`) takes a popped state's moves one by one: build the child,
drop it if its hash was seen, else record it; it stops at the first improvement or after
`expansion_width` children and puts the state back with the rest of its moves. Here up to
`workers` moves of the popped state are evaluated at once, each by a worker (a local process,
or a Ray actor: `magis.search.workers`), but the main process RECORDS the outcomes in the
serial order and stops where the serial search stops; an outcome evaluated past that point is
kept with the state's remaining moves (`PendingMoves`) and recorded when the serial search
would reach it. De-duplication is replayed here in that order too. So the recorded states, the
queue and the plan are the serial search's: the same plan for a seed and `max_states`, which
count recorded states only.

What travels: a child stays in the worker that built it; the main process keeps its figures
(`Summary`, all the queue orders by), even for the best state, which it fetches once, when the
search ends. A worker receives a state's pickled bytes only when it must expand a state it
does not hold, and the re-analysis of a popped best state (a new F-Tree) runs in the worker
that holds it, the main process deciding whether it is due as the serial search does. Moving
a state costs about as much as building a child (vit-base: 1.9 MB, 0.11 s to pickle), so the
main process must never be the one that pickles or analyses: before this, 2 workers ran at
half the serial speed. The pool of workers and the states they hold: `magis.search.pool`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from magis.cost import CostModel
from magis.ir import Graph
from magis.search.initial import INITIAL_SID, SearchStart
from magis.search.pickling import dumps, loads
from magis.search.pool import ParallelChildren, PendingMoves
from magis.search.state import MState
from magis.search.workers import (
    Batch,
    RayMissingError,
    Sid,
    Summary,
    WorkerError,
    import_ray,
    start_local_workers,
    start_ray_workers,
)

__all__ = [
    "Batch",
    "ParallelChildren",
    "PendingMoves",
    "RayMissingError",
    "WorkerError",
    "expand",
    "import_ray",
    "pool_of",
    "reanalysed",
    "record_child",
    "start_workers",
    "whole",
]


def start_workers(search_setup: tuple, options, graph: Graph | None = None) -> Any:
    """The worker processes (or Ray actors) of a search, started before its initial analysis
    so that they boot meanwhile; `search_setup`: (cost model, options, rules). With `graph`,
    the first worker builds the search's initial state as soon as it boots (`magis.search.
    initial`), and keeps it."""
    setup = dumps(search_setup)
    first = None if graph is None else (0, "initial", dumps(graph))
    if options.ray is not None:
        workers = start_ray_workers(options.workers, setup, options.ray)
        if first is not None:
            workers.submit(*first)
    else:
        workers = start_local_workers(options.workers, setup, first)
    workers.initial_from = None if first is None else first[0]
    return workers


def initial_from_worker(workers: Any, cost: CostModel) -> SearchStart | None:
    """The initial state the first worker built (`start_workers` with a graph), or None."""
    wid = None if workers is None else workers.initial_from
    if wid is None:
        return None
    workers.initial_from = None
    return loads(workers.answer(wid), cost)


def pool_of(search) -> ParallelChildren:
    """The search's pool over its workers, made on its first expansion."""
    if search.pool is None:
        search.pool = ParallelChildren.start(
            search.workers, search.options.workers, search.evaluator
        )
        if search.initial_in_worker:
            search.pool.held(INITIAL_SID, search.initial, 0)
    return search.pool


def whole(search, state: MState | Summary) -> MState:
    """The state itself: a child the main process holds only the figures of is fetched from
    its worker."""
    if isinstance(state, MState):
        return state
    return pool_of(search).materialize(state)


def reordered_in_worker(search) -> tuple[MState, bool, Sid] | None:
    """The worker's re-ordering of a state that was the best (`ParallelChildren.reorder`),
    waited for if it is still running: (the better of the state and its re-ordering, whether
    the re-ordering won, the state's id), or None if no worker was asked. Ctrl-C waits until
    it is back (at most the reserve `budget.PolishCost` made for it)."""
    pool = search.pool
    if pool is None or pool.reordering is None:
        return None
    while True:
        try:
            final, won, seconds = pool.reordered()
            break
        except KeyboardInterrupt:  # the search is ending anyway: a few seconds more
            continue
    search.stats.breakdown["polish_in_worker"] = seconds
    return final, won, pool.reordering.sid


def sid_of(search, state: MState | Summary) -> Sid:
    """The state's id in the search's pool of workers."""
    return pool_of(search).sid_for(state)


def expand(search, state: MState | Summary, moves: PendingMoves | None) -> None:
    """`_Search.expand` with the children evaluated by `search.options.workers` workers:
    the same records, in the same order, stopping at the same move."""
    pool = pool_of(search)
    if moves is None:
        state = reanalysed(search, pool, state)
        moves = PendingMoves(pool.sid_for(state), state.nodes)
    evaluated = 0
    while True:
        if search.out_of_budget():
            return
        # The first child of a pop often improves (a line of improvements): then the serial
        # search stops there, and siblings built meanwhile would wait, maybe for ever. So the
        # workers fan out only once a child of this pop has not improved.
        remaining = search.options.expansion_width - evaluated
        spread = evaluated > 0 and pool.worth_spreading(moves, remaining)
        out = pool.outcome(moves, 1 if evaluated == 0 else pool.n, spread)
        moves.cursor += 1
        if out.name is None:  # no more moves: the state is done with
            pool.release(moves.sid)
            return
        child = pool.replay(search.evaluator, out)
        if child is None:
            continue
        evaluated += 1
        if (
            record_child(search, pool, out.name, child)
            or evaluated >= search.options.expansion_width
        ):
            search.queue.push(state, moves)
            return


def reanalysed(search, pool: ParallelChildren, state: MState | Summary) -> MState | Summary:
    """`_Search.reanalysed`; for a state a worker holds, the main process decides whether the
    analysis is due (its record of analyses is the serial search's) and the worker runs it."""
    if isinstance(state, MState):
        return search.reanalysed(state)
    if not search.offers_reanalysis(state):
        return state
    reanalysis, ev = search.reanalysis, search.evaluator
    elapsed, left = search.budget.analysis_window()
    if not reanalysis.affordable(state.nodes, elapsed, left):
        return state  # without asking the holder, which may be in the middle of a batch
    key = pool.call_holder(state.sid, "hotspot_key", state.sid)
    if not reanalysis.due(key, state.nodes, elapsed, left):
        return state
    found, took = pool.reanalysed_in_worker(state.sid, reanalysis.max_level, reanalysis.epochs + 1)
    reanalysis.account(found, took, state.nodes)
    ev.stats.breakdown["transform"] += took
    if not found:
        return state
    search.best = replace(state, in_lineage=True)
    return search.best


def record_child(search, pool: ParallelChildren, name: str, child: Summary) -> bool:
    """`_Search.record` on the child's figures: the best too is a `Summary`, its state stays
    in its worker (pinned there) until the search ends."""
    improved = search.objective.better(child, search.best)
    kept = improved or search.ranking.worth_pushing(child, search.best)
    search.record(name, child)
    if improved:
        pool.pin(child.sid)
    if not kept:
        pool.release(child.sid)
    return improved
