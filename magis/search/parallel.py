"""A popped state's children evaluated by parallel workers, recorded in the serial order
(MAGIS Alg. 3, lines 6-12; `SearchOptions.workers`).

The serial search (`SearchCore.expand`) takes a popped state's moves one by one: build the child,
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

from dataclasses import dataclass

from magis.cost import CostModel
from magis.ir import Graph
from magis.search.core import ReorderedBest, SearchCore
from magis.search.evaluator import FISSION_MOVE_PREFIX
from magis.search.initial import INITIAL_SID, SearchStart
from magis.search.messages import BuildInitial, HotspotKey, Outcome, Summary
from magis.search.pickling import dumps
from magis.search.pool import ParallelChildren, PendingMoves
from magis.search.state import MState
from magis.search.transport import SearchWorkers, start_local_workers, start_ray_workers


def start_workers(search_setup: tuple, options, graph: Graph | None = None) -> SearchWorkers:
    """The worker processes (or Ray actors) of a search, started before its initial analysis
    so that they boot meanwhile; `search_setup`: (cost model, options, rules, objective).
    With `graph`, the first worker builds the search's initial state as soon as it boots
    (`magis.search.initial`), and keeps it."""
    setup = dumps(search_setup)
    first = None if graph is None else (0, BuildInitial(dumps(graph)))
    if options.ray is not None:
        transport = start_ray_workers(options.workers, setup, options.ray)
        if first is not None:
            transport.submit(*first)
    else:
        transport = start_local_workers(options.workers, setup, first)
    return SearchWorkers(transport, None if first is None else first[0])


@dataclass
class ParallelStrategy:
    """A popped state's children built by the workers, recorded in the serial order
    (`magis.search.strategy`)."""

    workers: SearchWorkers
    pool: ParallelChildren | None = None  # over the workers, from the first expansion
    initial_in_worker: bool = False  # the initial state was built, and is held, by worker 0

    def initial_start(self, cost: CostModel) -> SearchStart | None:
        """The initial state the first worker built while the caller ran its warm starts."""
        begun = self.workers.take_initial(cost)
        self.initial_in_worker = begun is not None
        return begun

    def pool_for(self, core: SearchCore) -> ParallelChildren:
        """The pool over the workers, made on the search's first expansion."""
        if self.pool is None:
            self.pool = ParallelChildren.start(
                self.workers.transport, core.options.workers, core.evaluator
            )
            self.pool.fission_affordable = core.fission_affordable
            if self.initial_in_worker:
                self.pool.states.held(INITIAL_SID, core.initial, 0)
            states = self.pool.states
            core.discard = lambda state: states.release(state.sid)
        return self.pool

    def run(self, core: SearchCore) -> None:
        while core.queue and not core.out_of_budget():
            self.expand(core, *core.pop())

    def whole(self, core: SearchCore, state: MState | Summary) -> MState:
        """The state itself: a child the main process holds only the figures of is fetched
        from its worker."""
        if isinstance(state, MState):
            return state
        return self.pool_for(core).materialize(state)

    def reordered_best(self, core: SearchCore) -> ReorderedBest | None:
        """The worker's re-ordering of a state that was the best (`ParallelChildren.reorder`),
        waited for if it is still running, or None if no worker was asked. Ctrl-C waits
        until it is back (at most the reserve `budget.PolishCost` made for it)."""
        pool = self.pool
        if pool is None or pool.reordering is None:
            return None
        while True:
            try:
                final, won, seconds = pool.reordered()
                break
            except KeyboardInterrupt:  # the search is ending anyway: a few seconds more
                continue
        core.stats.breakdown["polish_in_worker"] = seconds
        still_best = pool.reordering.sid == pool.states.sid_for(core.best)
        return ReorderedBest(final, won, still_best)

    def close(self) -> None:
        self.workers.close()

    def expand(self, core: SearchCore, state: MState | Summary, moves: PendingMoves | None) -> None:
        """`SearchCore.expand` with the children evaluated by the workers: the same records,
        in the same order, stopping at the same move."""
        pool = self.pool_for(core)
        if moves is None:
            state = self.reanalysed(core, pool, state)
            moves = PendingMoves(pool.states.sid_for(state), state.nodes)
        evaluated = 0
        width = core.options.expansion_width
        while True:
            if core.out_of_budget():
                return
            # The first child of a pop often improves (a line of improvements): then the
            # serial search stops there, and siblings built meanwhile would wait, maybe for
            # ever. So the workers fan out only once a child of this pop has not improved.
            spread = evaluated > 0 and pool.worth_spreading(moves, width - evaluated)
            out = pool.outcome(moves, 1 if evaluated == 0 else pool.n, spread)
            moves.cursor += 1
            if out.name is None:  # no more moves: the state is done with
                pool.states.release(moves.sid)
                return
            child = self.replayed(core, pool, moves, out)
            if child is None:
                continue
            evaluated += 1
            if self.record_child(core, pool, out.name, child) or evaluated >= width:
                core.push(state, moves)
                return

    def reanalysed(
        self, core: SearchCore, pool: ParallelChildren, state: MState | Summary
    ) -> MState | Summary:
        """`SearchCore.reanalysed`; for a state a worker holds, the main process decides
        whether the analysis is due (its record of analyses is the serial search's) and the
        worker runs it."""
        if isinstance(state, MState):
            return core.reanalysed(state)
        if not core.offers_reanalysis(state):
            return state
        reanalysis = core.reanalysis
        elapsed, left = core.budget.analysis_window()
        if not reanalysis.affordable(state.nodes, elapsed, left):
            return state  # without asking the holder, which may be in the middle of a batch
        key = pool.call_holder(state.sid, HotspotKey(state.sid))
        if not reanalysis.due(key, state.nodes, elapsed, left):
            return state
        found, took = pool.reanalysed_in_worker(
            state.sid, reanalysis.max_level, reanalysis.epochs + 1
        )
        reanalysis.account(found, took, state.nodes)
        core.stats.breakdown["transform"] += took
        if not found:
            return state
        return core.reanalysed_elsewhere(state)

    def replayed(
        self, core: SearchCore, pool: ParallelChildren, moves: PendingMoves, out: Outcome
    ) -> Summary | None:
        """`ParallelChildren.replay`, a built F-Tree move's seconds observed as
        `SearchCore.expand` observes them (`FissionCost`: the next tasks say whether splits
        are affordable)."""
        materialized = out.hash is not None  # the split was made (then maybe seen before)
        if materialized and out.name.startswith(FISSION_MOVE_PREFIX):
            core.observe_fission(out.seconds, moves.nodes)
        return pool.replay(core.evaluator, out)

    def record_child(
        self, core: SearchCore, pool: ParallelChildren, name: str, child: Summary
    ) -> bool:
        """`SearchCore.record` on the child's figures: the best too is a `Summary`, its state
        stays in its worker (pinned there) until the search ends."""
        improved = core.record(name, child)
        if improved:
            pool.states.pin(child.sid)
        return improved
