"""The search of MAGIS Alg. 3: coordinated graph transformation and scheduling.

A priority queue of M-States ordered by BetterThan; each popped state is rewritten by every rule
(lazily: a candidate graph is built only when evaluated), de-duplicated by an incremental
Weisfeiler-Lehman hash, rescheduled incrementally (Alg. 2, then Store/Load timing), simulated,
and pushed back if it is not worse than the best by more than a factor delta (1.1). A time
budget or Ctrl-C ends the search; the best state so far is always returned, and every
improvement is recorded (time, memory, latency) for plots.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from magis.cost import CostModel
from magis.errors import MagisError
from magis.ir import Graph
from magis.rules.base import Rewrite, Rewritten, Rule, RuleContext, candidates
from magis.rules.remat import DEREMAT, REMAT
from magis.rules.swap import DESWAP, SWAP
from magis.rules.taso import TASO_RULES
from magis.schedule import incremental_schedule, schedule
from magis.schedule.swaps import time_swaps
from magis.search import fission_moves
from magis.search.hashing import wl_hash, wl_hash_incremental
from magis.search.state import MState, Objective
from magis.sim import SimResult, simulate

DELTA = 1.1  # Alg. 3's relaxation coefficient


class MemoryFigure(enum.Enum):
    """What a state's memory is: the simulator's theoretical peak (MAGIS), or the arena a
    long-lived-first best-fit layout needs for it (ROAM §IV-B: what an allocator can reach)."""

    THEORETICAL = "theoretical"
    ARENA = "arena"


def measure_state(graph: Graph, order, cost: CostModel, figure: MemoryFigure) -> SimResult:
    sim = simulate(graph, order, cost)
    if figure is MemoryFigure.ARENA:
        from magis.layout import plan_layout

        arena = plan_layout(graph, list(order), "llfb").arena_bytes
        sim = replace(sim, peak_bytes=sim.resident_bytes + arena)
    return sim


def default_rules() -> tuple[Rule, ...]:
    """TASO rules first (cheap latency wins that buy slack), then the schedule-based rules."""
    return (*TASO_RULES, REMAT, DEREMAT, SWAP, DESWAP)


@dataclass(frozen=True)
class Improvement:
    seconds: float
    memory: int
    latency: float
    rule: str


@dataclass
class SearchStats:
    states_explored: int = 0
    duplicates: int = 0
    rules_applied: Counter = field(default_factory=Counter)
    breakdown: dict[str, float] = field(
        default_factory=lambda: {"transform": 0.0, "schedule": 0.0, "simulate": 0.0, "hash": 0.0}
    )


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


class _Timer:
    def __init__(self, stats: SearchStats, figure: MemoryFigure) -> None:
        self.stats = stats
        self.figure = figure  # carried here so every evaluation measures memory the same way

    def run(self, part: str, fn: Callable, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.stats.breakdown[part] += time.perf_counter() - start


def initial_state(
    graph: Graph,
    cost: CostModel,
    fission: bool = True,
    figure: MemoryFigure = MemoryFigure.THEORETICAL,
    max_level: int = 4,
    naive_fission_seed: int | None = None,
) -> MState:
    """The graph scheduled by the DP scheduler (re-ordering costs no time: MAGIS §5.2), with
    its F-Tree (Analyze, Alg. 1) when `fission` is on."""
    order = schedule(graph, "dp").order
    state = MState(graph, order, measure_state(graph, order, cost, figure), wl_hash(graph))
    analysis = (
        fission_moves.analyze(graph, list(order), max_level, naive_fission_seed)
        if fission
        else None
    )
    if analysis is None:
        return state
    base, base_order, tree = analysis
    return replace(state, ftree=tree, fission_base=base, fission_base_order=base_order)


def optimize_graph(
    graph: Graph,
    cost: CostModel,
    objective: Objective,
    time_budget: float = 180.0,
    rules: Sequence[Rule] | None = None,
    delta: float = DELTA,
    hotspots_only: bool = True,
    on_improvement: Callable[[Improvement], None] | None = None,
    max_states: int | None = None,
    fission: bool = True,
    memory_figure: MemoryFigure = MemoryFigure.THEORETICAL,
    max_level: int = 4,
    naive_fission_seed: int | None = None,
) -> SearchResult:
    """Alg. 3 on `graph` under `objective`, for at most `time_budget` seconds.

    `max_level` is the F-Tree's L (heuristic H3); `hotspots_only` is H2; `naive_fission_seed`
    turns H1 off (the §7.2.5 ablation's naive-fission)."""
    rules = tuple(rules) if rules is not None else default_rules()
    start = time.perf_counter()
    stats = SearchStats()
    timer = _Timer(stats, memory_figure)
    init = initial_state(graph, cost, fission, memory_figure, max_level, naive_fission_seed)
    best = init
    improvements = [Improvement(0.0, init.memory, init.latency, "initial")]
    tie = itertools.count()
    queue = [(objective.key(init), next(tie), init)]
    seen = {init.hash.value}
    interrupted = False
    try:
        while queue and time.perf_counter() - start < time_budget:
            if max_states is not None and stats.states_explored >= max_states:
                break
            _, _, state = heapq.heappop(queue)
            ctx = RuleContext(state.graph, state.order, state.sim, state.frozen, hotspots_only)
            for name, make_child in _moves(state, rules, ctx, cost, seen, timer):
                if time.perf_counter() - start >= time_budget:
                    break
                child = make_child()
                if child is None:
                    continue
                stats.states_explored += 1
                stats.rules_applied[name] += 1
                if objective.better(child, best):
                    best = child
                    imp = Improvement(
                        time.perf_counter() - start, child.memory, child.latency, name
                    )
                    improvements.append(imp)
                    if on_improvement is not None:
                        on_improvement(imp)
                if objective.worth_pushing(child, best, delta):
                    heapq.heappush(queue, (objective.key(child), next(tie), child))
    except KeyboardInterrupt:
        interrupted = True
    return SearchResult(
        init, best, objective, stats, tuple(improvements), time.perf_counter() - start, interrupted
    )


def _moves(state: MState, rules, ctx: RuleContext, cost: CostModel, seen: set[int], timer: _Timer):
    """(rule name, lazy child) pairs: F-Tree mutations first while the lineage allows them."""
    if state.ftree is not None:
        for description, build_tree in fission_moves.moves(state.ftree):
            name = "fission:" + description.split()[0]
            yield (
                name,
                lambda b=build_tree, n=name: _evaluate_fission(state, b, n, cost, seen, timer),
            )
    for rewrite in candidates(rules, ctx):
        yield rewrite.rule, lambda r=rewrite: _evaluate(state, r, cost, seen, timer)


def _evaluate_fission(
    state: MState, build_tree, name: str, cost: CostModel, seen: set[int], timer: _Timer
):
    """Materialize the mutated F-Tree on the lineage's base graph: its program order is the
    hierarchical schedule (each enabled region's parts one after the other)."""
    tree = timer.run("transform", build_tree)
    try:
        done = timer.run(
            "transform", fission_moves.apply, state.fission_base, state.fission_base_order, tree
        )
    except MagisError:
        return None
    h = timer.run("hash", wl_hash, done.graph)
    if h.value in seen:
        timer.stats.duplicates += 1
        return None
    seen.add(h.value)
    sim = timer.run("simulate", measure_state, done.graph, done.order, cost, timer.figure)
    return replace(
        state,
        graph=done.graph,
        order=tuple(done.order),
        sim=sim,
        hash=h,
        history=(*state.history, name),
        frozen=done.frozen,
        ftree=tree,
    )


def _evaluate(
    state: MState, rewrite: Rewrite, cost: CostModel, seen: set[int], timer: _Timer
) -> MState | None:
    result: Rewritten = timer.run("transform", rewrite.build)
    h = timer.run(
        "hash",
        wl_hash_incremental,
        state.hash,
        state.graph,
        result.graph,
        result.touched,
        result.removed,
    )
    if h.value in seen:
        timer.stats.duplicates += 1
        return None
    seen.add(h.value)
    order = timer.run("schedule", _reschedule, state, result, cost)
    sim = timer.run("simulate", measure_state, result.graph, order, cost, timer.figure)
    # Any rule other than an F-Tree mutation ends the lineage's fission moves (module docstring).
    return MState(result.graph, tuple(order), sim, h, (*state.history, rewrite.rule), state.frozen)


def _reschedule(state: MState, result: Rewritten, cost: CostModel) -> list[int]:
    """Alg. 2 around the old nodes the rewrite touched, then Store/Load timing."""
    old = state.graph
    touched_old = set(result.changed) | set(result.removed)
    for n in result.added:
        touched_old.update(p for p in result.graph.predecessors(n) if p in old)
        touched_old.update(s for s in result.graph.successors(n) if s in old)
    touched_old = {n for n in touched_old if n in old}
    order = list(incremental_schedule(old, state.order, result.graph, touched_old).order)
    if any(result.graph.info(n).copy_stream for n in result.graph.ops()):
        order = time_swaps(result.graph, order, cost)
    return order
