"""Concurrent expansions: each worker expands a popped state of its own (a search under a time
budget with `SearchOptions.workers` > 1; MAGIS Alg. 3 with its loop run by several workers).

`magis.search.parallel` keeps the serial order: the children of one popped state are built by
several workers, and recorded as the serial search would record them. That is what a search
bounded by `max_states` needs (the same plan as one worker), but it leaves workers idle: the
first child of a pop often improves, and then the serial search stops the pop there and pops
that child, so most of a search is a line of single children. On vit-base, 2 workers ran both
at once for 3 of 26 s, and the search was slower than serial.

A search bounded by time is not reproducible anyway (the queue's order reads the clock), so here
each idle worker pops the next state and expands it, move by move, as `_Search.expand` does
(partial expansion: up to `expansion_width` children, stopping at an improvement), and outcomes
are recorded as they arrive. The line of improvements goes on at the serial speed in the worker
that holds it (a popped state goes to a worker that holds it when one is idle), while the other
workers expand the states next in the queue. De-duplication, the best state, the queue and the
re-analysis are the main process's, as in the serial order.
"""

from __future__ import annotations

from dataclasses import dataclass

from magis.search.parallel import (
    ParallelChildren,
    PendingMoves,
    pool_of,
    reanalysed,
    record_child,
)
from magis.search.state import MState
from magis.search.workers import Outcome, Summary

LOOKAHEAD = 8  # queue entries a worker looks through for a state it holds


@dataclass
class _Job:
    """A popped state a worker is expanding, and how many children it has recorded."""

    state: MState | Summary
    moves: PendingMoves
    evaluated: int = 0


def run(search) -> None:
    """Pop and expand until the budget is spent or nothing is left to expand."""
    pool = pool_of(search)
    jobs: dict[int, _Job] = {}
    while not search.out_of_budget():
        _start_jobs(search, pool, jobs)
        if not jobs:
            return
        wid, out = _next_outcome(pool, jobs)
        if _advance(search, pool, jobs[wid], out):
            del jobs[wid]
        elif wid not in pool.busy:
            _submit_next(pool, wid, jobs[wid].moves)


def _start_jobs(search, pool: ParallelChildren, jobs: dict[int, _Job]) -> None:
    """Give every idle worker a popped state, one it holds if the queue's next few have one."""
    while search.queue:
        idle = [w for w in range(pool.n) if w not in jobs and w not in pool.busy]
        if not idle:
            return
        wid = idle[0]
        state, moves = _pop_for(search, pool, wid)
        if moves is None:
            state = reanalysed(search, pool, state)  # waits on the state's worker if busy
            moves = PendingMoves(pool.sid_for(state), state.nodes)
        jobs[wid] = _Job(state, moves)
        _submit_next(pool, wid, moves)


def _pop_for(search, pool: ParallelChildren, wid: int):
    """The first of the queue's next `LOOKAHEAD` entries that worker `wid` holds, or that no
    worker holds (the main process pickles those without waiting on anyone); else the first.
    Moving a state another worker holds stalls both workers: it must finish its move, then
    pickle the state (0.1-0.4 s on vit-base), and the search's line of improvements mostly
    lives in one worker, whose children fill the top of the queue."""
    popped = []
    chosen = None
    while search.queue and len(popped) < LOOKAHEAD:
        state, moves = search.queue.pop()
        holders = pool.holders(pool.sid_for(state)) if isinstance(state, Summary) else set()
        if not holders or wid in holders:
            chosen = (state, moves)
            break
        popped.append((state, moves))
    if chosen is None:
        chosen = popped.pop(0)
    for state, moves in popped:
        search.queue.push(state, moves)
    return chosen


def _submit_next(pool: ParallelChildren, wid: int, moves: PendingMoves) -> None:
    pool.submit(wid, moves, moves.next_index)
    moves.next_index += 1


def _next_outcome(pool: ParallelChildren, jobs: dict[int, _Job]) -> tuple[int, Outcome]:
    """The next move evaluated, of any job: one a synchronous call already collected, or the
    next reply."""
    while True:
        for wid, job in jobs.items():
            if job.moves.cursor in job.moves.outcomes:
                return wid, job.moves.outcomes.pop(job.moves.cursor)
        pool.collect()


def _advance(search, pool: ParallelChildren, job: _Job, out: Outcome) -> bool:
    """Record one outcome of a job, as `_Search.expand` records a child; True when the job is
    over (no more moves, an improvement, or `expansion_width` children)."""
    moves = job.moves
    moves.cursor += 1
    if out.name is None:  # no more moves: the state is done with
        pool.release(moves.sid)
        return True
    child = pool.replay(search.evaluator, out)
    if child is None:
        return False
    job.evaluated += 1
    improved = record_child(search, pool, out.name, child)
    if improved or job.evaluated >= search.options.expansion_width:
        search.queue.push(job.state, moves)
        return True
    return False
