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

Where each part lives: the knobs in `options.py`, the deadline in `budget.py`, turning a move
into a child state in `evaluator.py`, the child's schedule in `reschedule.py`, the queue order
in `queue.py`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from magis.cost import CostModel
from magis.ir import Graph
from magis.rules import Rule, rules_in_search_order
from magis.search import concurrent, fission_moves, parallel
from magis.search.budget import Budget, PolishCost
from magis.search.collector import search_pace
from magis.search.decisions import warm_start_decision
from magis.search.evaluator import Evaluator, SearchStats
from magis.search.hashing import wl_hash
from magis.search.initial import search_start
from magis.search.options import SearchOptions
from magis.search.queue import WARM_START_PREFIX, QueueOrder, SearchQueue
from magis.search.state import MState, Objective


def default_rules() -> tuple[Rule, ...]:
    """TASO rules first (cheap latency wins that buy slack), then the schedule-based rules.

    Trading a recomputation for a swap (`remat_to_swap`) and relaxation (`relax`) give time
    back at the same peak; both are tried only on states that want time
    (`Rule.only_when_wanted`: over a latency limit, or within a memory limit). The trade was
    left out of memory-limit searches while nothing undid its swaps in bulk (bart-base under
    0.4: 1.163 of the latency with it, 1.094 without, before relaxation); with relaxation, 60
    s, --workers 2, under memory 0.4: corpus:densenet121 1.155 -> 1.121, corpus:regnet 1.119
    -> 1.108, corpus:t5 1.145 -> 1.140, corpus:bart 1.145 -> 1.146.

    The rules and their order are the rule catalog's (`magis.rules.catalog.RULE_CATALOG`)."""
    return rules_in_search_order()


def search_rules(options: SearchOptions) -> tuple[Rule, ...]:
    """The rules in the order they are tried: `options.seed` shuffles them."""
    rules = tuple(options.rules) if options.rules is not None else default_rules()
    if options.seed is not None:
        rules = tuple(random.Random(options.seed).sample(rules, len(rules)))
    return rules


@dataclass(frozen=True)
class WarmStart:
    """A program another method made of the same step (a baseline's plan: a graph and its
    order), handed to the search as a starting state beside its own (issue #16: the search is
    never behind a peer, and improves from there)."""

    name: str
    graph: Graph
    order: tuple[int, ...]


@dataclass(frozen=True)
class Improvement:
    seconds: float
    memory: int
    latency: float
    rule: str


@dataclass(frozen=True)
class SearchResult:
    initial: MState
    best: MState
    objective: Objective
    stats: SearchStats
    improvements: tuple[Improvement, ...]
    seconds: float
    interrupted: bool

    @property
    def satisfied(self) -> bool:
        return self.objective.satisfied(self.best)


def start_search_workers(
    cost: CostModel, options: SearchOptions, objective: Objective, graph: Graph | None = None
) -> Any:
    """The `options.workers` worker processes (or Ray actors) of a search with these options
    (`magis.search.parallel`), booting from now on; hand them to `optimize_graph`. They
    order each state's moves by what `objective` needs, as the serial search does. With
    `graph` (the step that search will run on), the first of them builds the initial state
    meanwhile (`magis.search.initial`)."""
    return parallel.start_workers((cost, options, search_rules(options), objective), options, graph)


def optimize_graph(
    graph: Graph,
    cost: CostModel,
    objective: Objective,
    options: SearchOptions | None = None,
    on_improvement: Callable[[Improvement], None] | None = None,
    before_polish: Callable[[SearchResult], None] | None = None,
    warm_starts: Sequence[WarmStart] = (),
    workers: Any = None,
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
    options = options if options is not None else SearchOptions()
    if workers is None and options.workers > 1:
        workers = start_search_workers(cost, options, objective, graph)
    with search_pace() as settle:
        search = _Search.start(graph, cost, objective, options, on_improvement, workers)
        search.settle = settle
        try:
            for warm in warm_starts:
                search.add_warm_start(warm)
            interrupted = False
            try:
                if options.workers > 1 and options.max_states is None:
                    concurrent.run(search)  # each worker expands states of its own
                else:
                    while search.queue and not search.out_of_budget():
                        search.expand(*search.queue.pop())
            except KeyboardInterrupt:
                interrupted = True
            return search.finish(interrupted, before_polish)
        finally:
            if search.workers is not None:
                search.workers.close()


@dataclass
class _Search:
    """One search's mutable state: the queue, the best state, the improvements so far."""

    objective: Objective
    options: SearchOptions
    rules: tuple[Rule, ...]
    evaluator: Evaluator
    budget: Budget
    ranking: QueueOrder
    queue: SearchQueue
    initial: MState
    best: MState
    reanalysis: fission_moves.Reanalysis
    on_improvement: Callable[[Improvement], None] | None
    improvements: list[Improvement] = field(default_factory=list)
    workers: Any = None  # `parallel.start_workers`, when options.workers > 1
    pool: Any = None  # `parallel.ParallelChildren` over them, from the first expansion
    settle: Callable[[], None] = lambda: None  # after each child built here (`search_pace`)
    initial_in_worker: bool = False  # the initial state was built, and is held, by worker 0

    @staticmethod
    def start(graph, cost, objective, options, on_improvement, workers) -> _Search:
        budget = Budget(options.time_budget, options.max_states)
        begun = parallel.initial_from_worker(workers, cost)  # built while the peers ran
        held = begun is not None
        if begun is None:
            begun = search_start(graph, cost, options)
        init = begun.state
        budget.polish = PolishCost(begun.dp_seconds, len(graph), options.time_budget)
        init_seconds = begun.seconds  # mostly the initial analysis
        evaluator = Evaluator(cost, options.memory_figure, seen={init.hash.value})
        ranking = QueueOrder(objective, init.latency, options.delta)
        ranking.observe(init, 0.0)
        queue = SearchQueue(ranking)
        # The search's own start is expanded first, whatever the order: its F-Tree's macro
        # moves are where the large reductions are (§7.2), and a peer's plan queued beside it
        # (a warm start) with less memory, and that plan's children, kept it waiting; corpus:
        # opt under 1.10 then never split the model (0.650 of the peak instead of 0.235).
        queue.push_first(init)
        scale = fission_moves.analysis_scale(init_seconds, len(graph))
        return _Search(
            objective,
            options,
            search_rules(options),
            evaluator,
            budget,
            ranking,
            queue,
            init,
            init,
            fission_moves.Reanalysis(options.max_level, scale),
            on_improvement,
            [Improvement(0.0, init.memory, init.latency, "initial")],
            workers,
            initial_in_worker=held,
        )

    @property
    def stats(self) -> SearchStats:
        return self.evaluator.stats

    def add_warm_start(self, warm: WarmStart) -> None:
        """Queue another method's program as a state (its rules' moves apply to it as to any
        state; re-analysis gives it an F-Tree when it is the best one popped)."""
        order = tuple(warm.order)
        sim = self.evaluator.simulate(warm.graph, order)
        start = warm_start_decision(
            warm.name, self.initial.sim, sim, self.initial.graph, warm.graph
        )  # what `magis explain` shows of it
        state = MState(
            warm.graph,
            order,
            sim,
            wl_hash(warm.graph),
            (f"{WARM_START_PREFIX}{warm.name}",),
            decisions=(start,),
        )
        if not self.evaluator.is_new(state.hash.value):
            return
        self.ranking.observe(state, 0.0)
        self.queue.push(state)
        if self.objective.better(state, self.best):
            self.best = state
            self._improvement(f"{WARM_START_PREFIX}{warm.name}")

    def out_of_budget(self) -> bool:
        return self.budget.exhausted(self.stats.states_explored, self.best.nodes)

    def expand(self, state: MState, moves) -> None:
        """Evaluate a few of a popped state's children (partial expansion), then put it back
        with the rest of its moves. A child better than the best is popped next, so the search
        follows an improving line at once instead of first evaluating every sibling; no move
        is dropped (Alg. 3 still sees them all in time)."""
        if self.options.workers > 1:  # the same records, children built in parallel workers
            return parallel.expand(self, state, moves)
        if moves is None:
            state = self.reanalysed(state)
            ctx = self.evaluator.context(state, self.options.hotspots_only, self.objective)
            wants = self.objective.wants_memory(state)
            moves = self.evaluator.moves(state, self.rules, ctx, wants, self.objective)
        evaluated = 0
        for name, make_child in moves:
            if self.out_of_budget():
                return
            child = make_child()
            self.settle()
            if child is None:
                continue
            evaluated += 1
            improved = self.record(name, child)
            if improved or evaluated >= self.options.expansion_width:
                self.queue.push(state, moves)
                return

    def reanalysed(self, state: MState) -> MState:
        """The best state, when popped without a lineage, starts a new one on a fresh F-Tree
        (Alg. 3's Analyze), if its hot-spots are new and the analysis is affordable."""
        if not self.offers_reanalysis(state):
            return state
        elapsed, left = self.budget.analysis_window()
        lineage = self.evaluator.timed(
            "transform",
            self.reanalysis.lineage,
            state.graph,
            state.order,
            state.sim.hotspots,
            state.frozen,
            elapsed,
            left,
        )
        if lineage is None:
            return state
        self.best = replace(state, fission=lineage)
        return self.best

    def offers_reanalysis(self, state) -> bool:
        """Whether a popped state is offered a re-analysis: the best, without a lineage (an
        `MState`, or a worker's `Summary` of one)."""
        return self.options.reanalyse and state is self.best and not state.in_lineage

    def record(self, name: str, child: MState) -> bool:
        """Count the child, keep it as the best if it is, and queue it if it is worth it;
        True when it improved on the best."""
        self.stats.states_explored += 1
        self.stats.rules_applied[name] += 1
        improved = self.objective.better(child, self.best)
        if improved:
            self.best = child
            self._improvement(name)
        if self.ranking.worth_pushing(child, self.best):
            self.queue.push(child)
        if self.ranking.observe(child, self.budget.progress(self.stats.states_explored)):
            self.queue.rekey()
        return improved

    def _improvement(self, rule: str) -> None:
        imp = Improvement(self.budget.elapsed(), self.best.memory, self.best.latency, rule)
        self.improvements.append(imp)
        if self.on_improvement is not None:
            self.on_improvement(imp)

    def finish(self, interrupted: bool, before_polish=None) -> SearchResult:
        """The best state after one full re-ordering (kept if better, and if affordable), with
        the detailed simulation reports read (the peak's breakdown by category). Where a
        worker has re-ordered the best (`concurrent.run`), that re-ordering competes with any
        state found best since."""
        done = parallel.reordered_in_worker(self)
        if done is not None:
            final, won = self._against_later_best(*done)
        else:
            best = self.best = parallel.whole(self, self.best)
            if before_polish is not None:
                before_polish(self._result(best, interrupted))
            affordable = self.budget.polish.affordable(best.nodes)
            final, won = self.evaluator.reordered(best, self.objective, affordable)
        self.best = final
        if won:
            imp = Improvement(self.budget.elapsed(), final.memory, final.latency, "reschedule")
            self.improvements.append(imp)
        return self._result(final, interrupted)

    def _against_later_best(self, reordered: MState, won: bool, sid) -> tuple[MState, bool]:
        """A worker's re-ordering of a state that was the best, against the best now: the
        search went on while it ran, and may have found a better state."""
        if sid == parallel.sid_of(self, self.best):
            return reordered, won
        later = parallel.whole(self, self.best)
        later, _ = self.evaluator.reordered(later, self.objective, False)
        if self.objective.better(reordered, later):
            return reordered, won
        return later, False

    def _result(self, best: MState, interrupted: bool) -> SearchResult:
        return SearchResult(
            self.initial,
            best,
            self.objective,
            self.stats,
            tuple(self.improvements),
            self.budget.elapsed(),
            interrupted,
        )
