"""Concurrent expansions: each worker expands a popped state of its own (a search under a time
budget with `SearchOptions.workers` > 1; MAGIS Alg. 3 with its loop run by several workers).

`magis.search.parallel` keeps the serial order: the children of one popped state are built by
several workers, and recorded as the serial search would record them. That is what a search
bounded by `max_states` needs (the same plan as one worker), but it leaves workers idle: the
first child of a pop often improves, and then the serial search stops the pop there and pops
that child, so most of a search is a line of single children. On vit-base, 2 workers ran both
at once for 3 of 26 s, and the search was slower than serial.

A search bounded by time is not reproducible anyway (the queue's order reads the clock), so here
each idle worker pops the next state and expands it, move by move, as `SearchCore.expand` does
(partial expansion: up to `expansion_width` children, stopping at an improvement), and outcomes
are recorded as they arrive. The line of improvements goes on at the serial speed in the worker
that holds it (a popped state goes to a worker that holds it when one is idle), while the other
workers expand the states next in the queue. De-duplication, the best state, the queue and the
re-analysis are the main process's, as in the serial order.
"""

from __future__ import annotations

from dataclasses import dataclass

from magis.search.core import SearchCore
from magis.search.messages import Batch, Outcome, Summary
from magis.search.parallel import ParallelStrategy
from magis.search.pool import ParallelChildren, PendingMoves
from magis.search.state import MState

# Queue entries a worker looks through for a state it holds. With 8, on corpus:phi under 1.10
# (49,000-node split graphs) a tenth of the workers' time went to pickling and unpickling the
# states moved between them, and more to waiting for the holder to finish its batch.
LOOKAHEAD = 32
BATCH_MOVES = 64  # moves a worker evaluates at most before it hears from the main process
BATCH_SECONDS = 1.0  # ... and seconds after which it starts no other move of the batch


@dataclass
class _Job:
    """A popped state a worker is expanding, and how many children it has recorded."""

    state: MState | Summary
    moves: PendingMoves
    evaluated: int = 0


class ConcurrentStrategy(ParallelStrategy):
    """Each worker expands a popped state of its own (`magis.search.strategy`); what is
    recorded, and how, is `ParallelStrategy`'s."""

    def run(self, core: SearchCore) -> None:
        """Pop and expand until the budget is spent or nothing is left to expand."""
        pool = self.pool_for(core)
        jobs: dict[int, _Job] = {}
        while not _over(core, pool, jobs):
            self._start_jobs(core, pool, jobs)
            if not jobs and pool.reordering_worker() is not None:  # the re-ordering's time
                pool.wait_for_reordering()
                continue
            if not jobs:
                return
            for wid, job in jobs.items():  # each job's worker at work, or its outcome ready
                if wid not in pool.busy and job.moves.cursor not in job.moves.outcomes:
                    _submit_next(core, pool, wid, job)
            wid, out = _next_outcome(pool, jobs)
            if self._advance(core, pool, jobs[wid], out):
                del jobs[wid]

    def _start_jobs(self, core: SearchCore, pool: ParallelChildren, jobs: dict[int, _Job]) -> None:
        """Give every idle worker a popped state, one it holds where the queue's next few
        have one."""
        while core.queue:
            idle = [w for w in range(pool.n) if w not in jobs and w not in pool.busy]
            if not idle:
                return
            popped = _pop_for(core, pool, idle)
            if popped is None:
                return
            wid, state, moves = popped
            if moves is None:
                state = self.reanalysed(core, pool, state)  # waits on its worker if busy
                moves = PendingMoves(pool.states.sid_for(state), state.nodes)
            jobs[wid] = _Job(state, moves)

    def _advance(self, core: SearchCore, pool: ParallelChildren, job: _Job, out: Outcome) -> bool:
        """Record one outcome of a job, as `SearchCore.expand` records a child; True when the
        job is over (no more moves, an improvement, or `expansion_width` children)."""
        moves = job.moves
        moves.cursor += 1
        if out.name is None:  # no more moves: the state is done with
            pool.states.release(moves.sid)
            return True
        child = self.replayed(core, pool, moves, out)
        if child is None:
            return False
        job.evaluated += 1
        improved = self.record_child(core, pool, out.name, child)
        if improved or job.evaluated >= core.options.expansion_width:
            core.push(job.state, moves)
            return True
        return False


def _over(core: SearchCore, pool: ParallelChildren, jobs: dict[int, _Job]) -> bool:
    """Whether the search is over. Once only the final re-ordering's reserve is left
    (`budget.PolishCost`), the worker that holds the best re-orders it while the others go
    on exploring until the budget's end: on corpus:phi's 42,000-node best, 7 s of a 60 s
    search in which both workers waited for the main process. Where no worker holds the
    best, the search ends there and re-orders it itself, as the serial search does."""
    if not core.out_of_budget():
        return False
    if pool.reordering is None and not _reorder_best(core, pool, jobs):
        return True
    return core.budget.over()


def _reorder_best(core: SearchCore, pool: ParallelChildren, jobs: dict[int, _Job]) -> bool:
    """Have the best's worker re-order it (its job, if any, goes back to the queue); False
    when no worker holds the best or its re-ordering is not affordable."""
    best = core.best
    if not isinstance(best, Summary) or not core.budget.polish.affordable(best.nodes):
        return False
    holders = pool.states.holders(best.sid)
    if not holders:
        return False
    wid = min(holders)
    job = jobs.pop(wid, None)
    if job is not None:
        core.push(job.state, job.moves)
    pool.reorder(best.sid, wid)
    return True


def _pop_for(core: SearchCore, pool: ParallelChildren, idle: list[int]):
    """(worker, state, moves): the first of the queue's next `LOOKAHEAD` entries that an idle
    worker holds (to that worker), or that no worker holds (the main process pickles those
    without waiting on anyone); else the first, to the first idle worker. Moving a state
    another worker holds stalls both: it must finish its moves, then pickle the state (0.1 to
    0.4 s on vit-base), and the search's line of improvements mostly lives in one worker,
    whose children fill the top of the queue."""
    popped = []
    chosen = None
    while core.queue and len(popped) < LOOKAHEAD:
        state, moves = core.pop()
        holders = pool.states.holders(state.sid) if isinstance(state, Summary) else set()
        takers = [w for w in idle if w in holders]
        if takers or not holders:
            chosen = (takers[0] if takers else idle[0], state, moves)
            break
        popped.append((state, moves))
    if chosen is None:
        movable = [i for i, (s, _) in enumerate(popped) if pool.reachable(s.sid)]
        if movable:
            chosen = (idle[0], *popped.pop(movable[0]))
    for state, moves in popped:
        core.push(state, moves)
    return chosen


def _submit_next(core: SearchCore, pool: ParallelChildren, wid: int, job: _Job) -> None:
    """The job's next moves, as a batch that stops where `SearchCore.expand` would (or within a
    second, so that the budget is kept)."""
    moves = job.moves
    moves.next_index = moves.cursor
    batch = Batch(
        core.objective,
        core.objective.key(core.best),
        core.options.expansion_width - job.evaluated,
        BATCH_MOVES,
        min(BATCH_SECONDS, core.budget.seconds - core.budget.elapsed()),
    )
    pool.submit(wid, moves, moves.next_index, batch)


def _next_outcome(pool: ParallelChildren, jobs: dict[int, _Job]) -> tuple[int, Outcome]:
    """The next move evaluated, of any job: one a synchronous call already collected, or the
    next reply."""
    while True:
        for wid, job in jobs.items():
            if job.moves.cursor in job.moves.outcomes:
                return wid, job.moves.outcomes.pop(job.moves.cursor)
        pool.collect()
