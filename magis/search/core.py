"""The core of MAGIS Alg. 3 that every strategy shares: the queue, the best state, the records.

A search is one `SearchCore` and one strategy (`magis.search.strategy`). The core owns what
must be recorded identically however children are built: the priority queue of M-States
(`pop`, `push`), the best state and its improvements (`record`), the re-analysis of a popped
best state (Alg. 3's Analyze), the budget, and the end (`finish`: the final re-ordering). A
strategy owns only how a popped state's children are built and recorded through that
interface: here, in this process (`SerialStrategy`, which calls `expand`); by worker processes
or Ray actors in the serial order (`magis.search.parallel.ParallelStrategy`); or with each
worker expanding states of its own (`magis.search.concurrent.ConcurrentStrategy`).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from magis.cost import CostModel
from magis.ir import Graph
from magis.rules import Rule, rules_in_search_order
from magis.search import fission_moves
from magis.search.budget import Budget, FissionCost, PolishCost
from magis.search.decisions import warm_start_decision
from magis.search.evaluator import FISSION_MOVE_PREFIX, Evaluator, Move, SearchStats
from magis.search.hashing import wl_hash
from magis.search.initial import SearchStart, search_start
from magis.search.options import SearchOptions
from magis.search.queue import WARM_START_PREFIX, QueueOrder, SearchQueue
from magis.search.state import MState, Objective

if TYPE_CHECKING:  # a worker's child: the figures of a state a worker holds
    from magis.search.messages import Summary


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


@dataclass(frozen=True)
class ReorderedBest:
    """The final re-ordering of a state that was the best, made where that state lives (a
    worker, while the search went on): the better of the state and its re-ordering, whether
    the re-ordering won, and whether that state is still the search's best."""

    state: MState
    won: bool
    still_best: bool


class StateSource(Protocol):
    """What `SearchCore.finish` needs of a strategy whose states may live elsewhere."""

    def whole(self, core: SearchCore, state: MState | Summary) -> MState:
        """The state itself (a worker's child fetched from that worker)."""
        ...

    def reordered_best(self, core: SearchCore) -> ReorderedBest | None:
        """The re-ordering of the best made elsewhere, if one was, waited for."""
        ...


Moves = Iterator[Move]

# Children with one pair of figures (peak, latency) queued at most: moves that touch neither
# (a recomputation or a swap away from the peak, at no time) make a plateau of distinct
# graphs with one pair of figures, and the queue ranked all of it ahead of every line above
# that peak (a user's BLOOM under memory 0.3 popped states at 55,652,356 B and 1.221x for 5 s
# of a 20 s search, one peak step each, so no tie-break by the peak's width helps). With at
# most 4, 60 s corpus searches explore 1.2-2.6x the states and lose nothing measured (README
# "Memory 0.25 on the corpus"); BLOOM's plateaus of one peak at many latencies remain. A twin
# is discarded like a state not worth pushing (its hash stays seen).
TWIN_LIMIT = 4


@dataclass
class SearchCore:
    """One search's mutable state: the queue, the best state, the improvements so far."""

    objective: Objective
    options: SearchOptions
    rules: tuple[Rule, ...]
    evaluator: Evaluator
    budget: Budget
    ranking: QueueOrder
    queue: SearchQueue
    initial: MState
    best: MState | Summary
    reanalysis: fission_moves.Reanalysis
    on_improvement: Callable[[Improvement], None] | None
    improvements: list[Improvement] = field(default_factory=list)
    settle: Callable[[], None] = lambda: None  # after each child built here (`search_pace`)
    fission_cost: FissionCost = field(default_factory=lambda: FissionCost(0.0))
    # a state neither queued nor parked nor the best (a worker then drops its copy)
    discard: Callable[[MState | Summary], None] = lambda state: None
    # children recorded per (peak bytes, latency): `TWIN_LIMIT`
    figures_seen: Counter[tuple[int, float]] = field(default_factory=Counter)
    # Under a memory limit, the latest state that lowered the queue's frontier (the least
    # memory within its cap), offered a re-analysis when popped as the best is
    # (`offers_reanalysis`, `QueueOrder.leads`).
    leader: MState | Summary | None = None

    @staticmethod
    def start(
        graph: Graph,
        cost: CostModel,
        objective: Objective,
        options: SearchOptions,
        on_improvement: Callable[[Improvement], None] | None = None,
        begun: SearchStart | None = None,
        settle: Callable[[], None] = lambda: None,
        clock_start: float | None = None,
    ) -> SearchCore:
        """The search of `graph` from its initial state (`begun`, when a worker built it).
        Its budget counts from `clock_start` (`time.perf_counter()`, default now): the caller's
        wait for a worker's initial state is the search's time too (on a 100,000-node step,
        25 s that a 60 s search otherwise spent past its budget)."""
        began = time.perf_counter() if clock_start is None else clock_start
        budget = Budget(options.time_budget, options.max_states, start=began)
        if begun is None:
            begun = search_start(graph, cost, options)
        init = begun.state
        budget.polish = PolishCost(begun.dp_seconds, len(graph), options.time_budget)
        evaluator = Evaluator(cost, options.memory_figure, seen={init.hash.value})
        ranking = QueueOrder(objective, init.latency, options.delta)
        ranking.observe(init, 0.0)
        queue = SearchQueue(ranking)
        # The search's own start is expanded first, whatever the order: its F-Tree's macro
        # moves are where the large reductions are (§7.2), and a peer's plan queued beside it
        # (a warm start) with less memory, and that plan's children, kept it waiting; corpus:
        # opt under 1.10 then never split the model (0.650 of the peak instead of 0.235).
        queue.push_first(init)
        scale = fission_moves.analysis_scale(begun.seconds, len(graph))
        return SearchCore(
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
            settle,
            FissionCost.before_any(begun.seconds, len(graph)),
        )

    @property
    def stats(self) -> SearchStats:
        return self.evaluator.stats

    # --- the queue ---------------------------------------------------------------------------

    def pop(self) -> tuple[MState | Summary, object | None]:
        """The next state to expand, with the moves it has left (None: not expanded yet)."""
        return self.queue.pop()

    def push(self, state: MState | Summary, moves: object | None = None) -> None:
        """Queue a state; with `moves`, a state put back with the moves it has left."""
        self.queue.push(state, moves)

    def out_of_budget(self) -> bool:
        return self.budget.exhausted(self.stats.states_explored, self.best.nodes)

    def add_warm_start(self, warm: WarmStart) -> None:
        """Queue another method's program as a state (its rules' moves apply to it as to any
        state; re-analysis gives it an F-Tree when it is the best one popped)."""
        order = tuple(warm.order)
        sim = self.evaluator.simulate(warm.graph, order)
        start = warm_start_decision(
            warm.name, self.initial.sim, sim, self.initial.graph, warm.graph
        )  # what `magis explain` shows of it
        name = f"{WARM_START_PREFIX}{warm.name}"
        state = MState(warm.graph, order, sim, wl_hash(warm.graph), (name,), decisions=(start,))
        if not self.evaluator.is_new(state.hash.value):
            return
        self.ranking.observe(state, 0.0)
        self.queue.push(state)
        if self.objective.better(state, self.best):
            self.best = state
            self._improvement(name)

    # --- expanding a state in this process -----------------------------------------------------

    def expand(self, state: MState, moves: Moves | None) -> None:
        """Evaluate a few of a popped state's children (partial expansion), then put it back
        with the rest of its moves. A child better than the best is popped next, so the search
        follows an improving line at once instead of first evaluating every sibling; no move
        is dropped (Alg. 3 still sees them all in time)."""
        if moves is None:
            state = self.reanalysed(state)
            ctx = self.evaluator.context(state, self.options.hotspots_only, self.objective)
            wants = self.objective.wants_memory(state)
            moves = self.evaluator.moves(state, self.rules, ctx, wants, self.objective)
        evaluated = 0
        for name, make_child in moves:
            if self.out_of_budget():
                return
            fission = name.startswith(FISSION_MOVE_PREFIX)
            if fission and not self.fission_affordable(state.nodes):
                self.stats.unaffordable += 1
                continue
            began = time.perf_counter()
            child = make_child()
            if fission and child is not None:
                self.observe_fission(time.perf_counter() - began, state.nodes)
            self.settle()
            if child is None:
                continue
            evaluated += 1
            improved = self.record(name, child)
            if improved or evaluated >= self.options.expansion_width:
                self.queue.push(state, moves)
                return

    def fission_affordable(self, nodes: int) -> bool:
        """Whether a fission child of a state of `nodes` nodes is expected to finish within
        the budget (`FissionCost`); always, when the budget is counted in states
        (reproducible). Workers are told it with each task (`Task.fission`)."""
        _, left = self.budget.analysis_window()
        return self.fission_cost.affordable(nodes, left)

    def observe_fission(self, seconds: float, nodes: int) -> None:
        """A fission child of a `nodes`-node state was materialized in `seconds` (here or in a
        worker). Moves that end before it (an F-Tree seen before, a split that cannot be
        made) are not observed: on the 99,900-node Mamba step such a move took 0.9 s, priced
        the next one, a whole-step split, at 0.9 s too, and that split took 49 s."""
        self.fission_cost.observe(seconds, nodes)

    def reanalysed(self, state: MState) -> MState:
        """The best state or the leader, when popped without a lineage, starts a new one on a
        fresh F-Tree (Alg. 3's Analyze), if its hot-spots are new and the analysis is
        affordable."""
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
        return self._took_over(state, replace(state, fission=lineage))

    def offers_reanalysis(self, state: MState | Summary) -> bool:
        """Whether a popped state is offered a re-analysis: the best or the leader, without a
        lineage (an `MState`, or a worker's `Summary` of one).

        Alg. 3 analyses the best. Under a memory limit, once a plan meets it at a high latency
        that plan is the best, and the states that lower the peak within the cap (the line
        that could meet it cheaply) were never analysed: a user's BLOOM under 0.3 met it at
        4.2x in 1 s and its frontier stood at 0.351 of the peak for the rest of the search,
        where the latency-limit search, whose best is its frontier, splits on to 0.252 at
        1.10x. So the leader is offered one too."""
        if not self.options.reanalyse or state.in_lineage:
            return False
        return state is self.best or state is self.leader

    def reanalysed_elsewhere(self, state: Summary) -> Summary:
        """The best state or the leader, re-analysed by the worker that holds it: it starts
        a lineage."""
        return self._took_over(state, replace(state, in_lineage=True))

    def _took_over(self, state: MState | Summary, analysed: MState | Summary) -> MState | Summary:
        """`analysed` (`state` with a lineage) in the place of `state` as the best or the
        leader."""
        if state is self.best:
            self.best = analysed
        if state is self.leader:
            self.leader = analysed
        return analysed

    # --- records -----------------------------------------------------------------------------

    def record(self, name: str, child: MState | Summary) -> bool:
        """Count the child, keep it as the best if it is, and queue it if it is worth it;
        True when it improved on the best."""
        self.stats.states_explored += 1
        self.stats.rules_applied[name] += 1
        improved = self.objective.better(child, self.best)
        if improved:
            self.best = child
            self._improvement(name)
        fresh = self._count_twins(child) < TWIN_LIMIT
        if self.ranking.leads(child):
            self.leader = child
        if fresh and self.ranking.worth_pushing(child, self.best):
            self.queue.push(child)
        elif not (fresh and self.ranking.parks(child) and self.queue.park(child)) and not improved:
            self.discard(child)
        if self.ranking.observe(child, self.budget.progress(self.stats.states_explored)):
            self.queue.rekey()
            self._unpark()
        return improved

    def _count_twins(self, child: MState | Summary) -> int:
        """How many children recorded before `child` had its exact figures (`TWIN_LIMIT`)."""
        figures = (child.memory, child.latency)
        twins = self.figures_seen[figures]
        self.figures_seen[figures] = twins + 1
        return twins

    def _unpark(self) -> None:
        """Parked states the raised cap now reaches are judged as if they had just arrived."""
        for state in self.queue.unpark(self.ranking.reach):
            if self.ranking.worth_pushing(state, self.best):
                self.queue.push(state)
            elif state is not self.best:
                self.discard(state)

    def _improvement(self, rule: str) -> None:
        imp = Improvement(self.budget.elapsed(), self.best.memory, self.best.latency, rule)
        self.improvements.append(imp)
        if self.on_improvement is not None:
            self.on_improvement(imp)

    # --- the end -------------------------------------------------------------------------------

    def finish(
        self,
        interrupted: bool,
        source: StateSource,
        before_polish: Callable[[SearchResult], None] | None = None,
    ) -> SearchResult:
        """The best state after one full re-ordering (kept if better, and if affordable), with
        the detailed simulation reports read (the peak's breakdown by category). Where a
        worker has re-ordered the best (`ConcurrentStrategy`), that re-ordering competes with
        any state found best since."""
        done = source.reordered_best(self)
        if done is not None:
            final, won = self._against_later_best(done, source)
        else:
            best = self.best = source.whole(self, self.best)
            if before_polish is not None:
                before_polish(self._result(best, interrupted))
            affordable = self.budget.polish.affordable(best.nodes)
            final, won = self.evaluator.reordered(best, self.objective, affordable)
        self.best = final
        if won:
            imp = Improvement(self.budget.elapsed(), final.memory, final.latency, "reschedule")
            self.improvements.append(imp)
        return self._result(final, interrupted)

    def _against_later_best(self, done: ReorderedBest, source: StateSource) -> tuple[MState, bool]:
        """A worker's re-ordering of a state that was the best, against the best now: the
        search went on while it ran, and may have found a better state."""
        if done.still_best:
            return done.state, done.won
        later = source.whole(self, self.best)
        later, _ = self.evaluator.reordered(later, self.objective, False)
        if self.objective.better(done.state, later):
            return done.state, done.won
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
