"""The search of MAGIS Alg. 3: coordinated graph transformation and scheduling.

A priority queue of M-States; each popped state is rewritten by every rule (lazily: a candidate
graph is built only when evaluated, a few at a time), de-duplicated by an incremental
Weisfeiler-Lehman hash, rescheduled incrementally (Alg. 2, then Store/Load timing), simulated,
and pushed back if it is not worse than the best by more than a factor delta (1.1); the queue is
ordered by BetterThan (in memory-limit mode, under a rising latency cap until the limit is met:
see queue.py). The best state is re-analysed when popped (Analyze of Alg. 3: a new F-Tree on
its graph and schedule, `fission_moves.Reanalysis`). (A queue order weighing memory saved
against latency spent was tried and did worse: resnet50 missed a 0.4 memory limit in 60 s that the greedy order meets, and
unet under a 1.10 latency limit ended higher.) A time budget or Ctrl-C ends the search; the
best state so far is always returned, and every improvement is recorded (time, memory,
latency) for plots.
"""

from __future__ import annotations

import enum
import itertools
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from magis.cost import CostModel
from magis.errors import MagisError
from magis.ir import Graph
from magis.rules.base import Rewrite, Rewritten, Rule, RuleContext
from magis.rules.compact import COMPACT, DECOMPACT
from magis.rules.remat import DEREMAT, REMAT
from magis.rules.swap import DESWAP, SWAP
from magis.rules.taso import TASO_RULES
from magis.schedule import incremental_schedule, schedule
from magis.schedule.swaps import time_swaps
from magis.search import fission_moves
from magis.search.hashing import wl_hash, wl_hash_incremental
from magis.search.queue import QueueOrder, SearchQueue
from magis.search.state import MState, Objective
from magis.sim import SimResult, simulate

DELTA = 1.1  # Alg. 3's relaxation coefficient
EXPANSION_WIDTH = 8  # children evaluated per pop before the state goes back (partial expansion)


class MemoryFigure(enum.Enum):
    """What a state's memory is: the simulator's theoretical peak (MAGIS), or the arena a
    long-lived-first best-fit layout needs for it (ROAM §IV-B: what an allocator can reach)."""

    THEORETICAL = "theoretical"
    ARENA = "arena"


def measure_state(
    graph: Graph, order, cost: CostModel, figure: MemoryFigure, detail: bool = True
) -> SimResult:
    sim = simulate(graph, order, cost, detail)
    if figure is MemoryFigure.ARENA:
        from magis.layout import plan_layout

        arena = plan_layout(graph, list(order), "llfb").arena_bytes
        sim = replace(sim, peak_bytes=sim.resident_bytes + arena)
    return sim


def default_rules() -> tuple[Rule, ...]:
    """TASO rules first (cheap latency wins that buy slack), then the schedule-based rules."""
    return (*TASO_RULES, REMAT, DEREMAT, SWAP, DESWAP, COMPACT, DECOMPACT)


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
    order: Sequence[int] | None = None,
) -> MState:
    """The graph scheduled by the DP scheduler (re-ordering costs no time: MAGIS §5.2), or in
    `order` when given, with its F-Tree (Analyze, Alg. 1) when `fission` is on."""
    order = tuple(schedule(graph, "dp").order if order is None else order)
    state = MState(graph, order, measure_state(graph, order, cost, figure), wl_hash(graph))
    analysis = (
        fission_moves.analyze(graph, list(order), max_level, naive_fission_seed)
        if fission
        else None
    )
    if analysis is None:
        return state
    base, base_order, tree = analysis
    return replace(state, fission=fission_moves.Lineage(base, base_order, tree, epoch=0))


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
    seed: int | None = None,
) -> SearchResult:
    """Alg. 3 on `graph` under `objective`, for at most `time_budget` seconds.

    `max_level` is the F-Tree's L (heuristic H3); `hotspots_only` is H2; `naive_fission_seed`
    turns H1 off (the §7.2.5 ablation's naive-fission). `seed` shuffles the order in which the
    rules are tried: the search is deterministic for one seed, and different seeds explore
    different plans (tests verify plans from several)."""
    rules = tuple(rules) if rules is not None else default_rules()
    if seed is not None:
        rules = tuple(random.Random(seed).sample(rules, len(rules)))
    start = time.perf_counter()
    stats = SearchStats()
    timer = _Timer(stats, memory_figure)
    dp_start = time.perf_counter()
    dp_order = schedule(graph, "dp").order
    polish = PolishCost(time.perf_counter() - dp_start, len(graph), time_budget)
    init_start = time.perf_counter()
    init = initial_state(
        graph, cost, fission, memory_figure, max_level, naive_fission_seed, dp_order
    )
    init_seconds = time.perf_counter() - init_start  # mostly the initial analysis
    best = init
    improvements = [Improvement(0.0, init.memory, init.latency, "initial")]
    ranking = QueueOrder(objective, init.latency, delta)
    ranking.observe(init, 0.0)
    queue = SearchQueue(ranking)
    queue.push(init)
    seen = {init.hash.value}
    seen_trees: set = set()
    reanalysis = fission_moves.Reanalysis(max_level, init_seconds / max(len(graph), 1) ** 2)
    reanalyse = fission and naive_fission_seed is None
    interrupted = False

    def out_of_time() -> bool:
        if max_states is not None:
            return stats.states_explored >= max_states or time.perf_counter() - start >= time_budget
        # the final re-ordering of the best runs within the budget, not after it
        return time.perf_counter() - start >= time_budget - polish.reserve(best.graph)

    def progress() -> float:  # by states when bounded by them: a reproducible search
        if max_states is not None:
            return stats.states_explored / max_states
        return (time.perf_counter() - start) / time_budget

    try:
        while queue and not out_of_time():
            state, moves = queue.pop()
            if moves is None and reanalyse and state is best and state.fission is None:
                lineage = timer.run(
                    "transform",
                    reanalysis.lineage,
                    state.graph,
                    state.order,
                    state.sim.hotspots,
                    state.frozen,
                    time.perf_counter() - start,
                    time_budget - (time.perf_counter() - start),
                )
                state = state if lineage is None else replace(state, fission=lineage)
                best = state if lineage is not None else best
            if moves is None:
                ctx = RuleContext(state.graph, state.order, state.sim, state.frozen, hotspots_only)
                moves = _moves(state, rules, ctx, cost, seen, seen_trees, timer)
            # Partial expansion: a few children at a time, and the state goes back into the
            # queue with the rest of its moves. A child better than the best is popped next, so
            # the search follows an improving line at once instead of first evaluating every
            # sibling; no move is dropped (Alg. 3 still sees them all in time).
            improved, evaluated = False, 0
            for name, make_child in moves:
                if out_of_time():
                    break
                child = make_child()
                if child is None:
                    continue
                evaluated += 1
                stats.states_explored += 1
                stats.rules_applied[name] += 1
                if objective.better(child, best):
                    best = child
                    improved = True
                    imp = Improvement(
                        time.perf_counter() - start, child.memory, child.latency, name
                    )
                    improvements.append(imp)
                    if on_improvement is not None:
                        on_improvement(imp)
                if ranking.worth_pushing(child, best):
                    queue.push(child)
                if ranking.observe(child, progress()):
                    queue.rekey()
                if improved or evaluated >= EXPANSION_WIDTH:
                    queue.push(state, moves)
                    break
    except KeyboardInterrupt:
        interrupted = True
    polished = _polish(best, cost, timer) if polish.affordable(best.graph) else best
    if objective.better(polished, best):
        best = polished
        improvements.append(
            Improvement(time.perf_counter() - start, best.memory, best.latency, "reschedule")
        )
    else:  # states are simulated without the report's detail (the peak's breakdown)
        best = replace(best, sim=measure_state(best.graph, best.order, cost, memory_figure))
    return SearchResult(
        init, best, objective, stats, tuple(improvements), time.perf_counter() - start, interrupted
    )


@dataclass(frozen=True)
class PolishCost:
    """What the final full re-ordering of the best graph (`_polish`) is expected to cost: the
    initial graph's DP scheduling time, scaled by the square of the growth in nodes (measured
    on gpt-neo-1.3b: 0.19 s for 5,040 nodes, 6.2 s for 32,179 after a 8-way split, 20.6 s for
    63,187 after a 16-way one). A search reserves that time at the end of its budget; beyond
    POLISH_SHARE of the budget, the best keeps the search's own schedule (before this, a
    180 s search of gpt-neo-1.3b ran for 297 s)."""

    initial_seconds: float
    initial_nodes: int
    budget: float

    def estimate(self, graph: Graph) -> float:
        return self.initial_seconds * (len(graph) / max(self.initial_nodes, 1)) ** 2

    def affordable(self, graph: Graph) -> bool:
        return self.estimate(graph) <= POLISH_SHARE * self.budget

    def reserve(self, graph: Graph) -> float:
        return self.estimate(graph) if self.affordable(graph) else 0.0


POLISH_SHARE = 0.25


def _polish(state: MState, cost: CostModel, timer: _Timer) -> MState:
    """The best state's graph re-ordered by the DP scheduler (then Store/Load timing): during
    the search, re-materialization and swapping place their nodes where the rule says
    (`Rewritten.anchor`), and the winner gets one full re-ordering at the end."""
    try:
        order = timer.run("schedule", _full_schedule, state.graph, cost)
    except MagisError:
        return state
    sim = timer.run("simulate", measure_state, state.graph, order, cost, timer.figure)
    return replace(state, order=tuple(order), sim=sim)


def _full_schedule(graph: Graph, cost: CostModel) -> list[int]:
    order = list(schedule(graph, "dp").order)
    if graph.copy_nodes():
        order = time_swaps(graph, order, cost)
    return order


def _moves(
    state: MState, rules, ctx: RuleContext, cost: CostModel, seen, seen_trees, timer: _Timer
):
    """(rule name, lazy child) pairs: F-Tree mutations (while the lineage allows them), then
    every rule's rewrites taken in turn, so the first moves tried cover every kind."""
    streams = []
    if state.fission is not None:
        streams.append(
            (
                "fission:" + description.split()[0],
                lambda b=build_tree, d=description: _evaluate_fission(
                    state, b, "fission:" + d.split()[0], cost, seen, seen_trees, timer
                ),
            )
            for description, build_tree in fission_moves.moves(
                state.fission.tree,
                fission_moves.REANALYSIS_MOVES if state.fission.epoch else None,
            )
        )
    others = [
        ((rw.rule, lambda r=rw: _evaluate(state, r, cost, seen, timer)) for rw in rule.match(ctx))
        for rule in rules
    ]
    # F-Tree mutations go first: fission is where the large reductions are (§7.2), and any
    # other rule ends the lineage's fission moves.
    return itertools.chain(*streams, _round_robin(others))


def _round_robin(streams):
    active = [iter(s) for s in streams]
    while active:
        for it in list(active):
            item = next(it, None)
            if item is None:
                active.remove(it)
            else:
                yield item


def _evaluate_fission(
    state: MState,
    build_tree,
    name: str,
    cost: CostModel,
    seen: set[int],
    seen_trees: set,
    timer: _Timer,
):
    """Materialize the mutated F-Tree on the lineage's base graph: its program order is the
    hierarchical schedule (each enabled region's parts one after the other), with Store/Load
    re-timed. Trees already materialized (the same enabled nodes with the same n, reached by
    another path) are skipped before the expensive materialization."""
    lineage = state.fission
    tree = timer.run("transform", build_tree)
    tree_key = (lineage.epoch, *((i, x.ftrans) for i, x in enumerate(tree.nodes) if x.enabled))
    if tree_key in seen_trees:
        timer.stats.duplicates += 1
        return None
    seen_trees.add(tree_key)
    try:
        done = timer.run("transform", fission_moves.apply, lineage, tree)
    except MagisError:
        return None
    mat = done.materialized
    if mat.continued and lineage.materialized is not None:  # state.graph is what it continued
        h = timer.run(
            "hash",
            wl_hash_incremental,
            state.hash,
            state.graph,
            done.graph,
            mat.touched,
            mat.removed,
        )
    else:
        h = timer.run("hash", wl_hash, done.graph)
    if h.value in seen:
        timer.stats.duplicates += 1
        return None
    seen.add(h.value)
    order = done.order
    if done.graph.copy_nodes():
        order = timer.run("schedule", time_swaps, done.graph, order, cost)
    sim = timer.run("simulate", measure_state, done.graph, order, cost, timer.figure, False)
    return replace(
        state,
        graph=done.graph,
        order=tuple(order),
        sim=sim,
        hash=h,
        history=(*state.history, name),
        frozen=done.frozen,
        fission=replace(lineage, tree=tree, materialized=done.materialized),
    )


def _evaluate(
    state: MState, rewrite: Rewrite, cost: CostModel, seen: set[int], timer: _Timer
) -> MState | None:
    result: Rewritten = timer.run("transform", rewrite.build)
    # Storage bookkeeping from the parent's, not rebuilt: rules, scheduler and simulator read it.
    timer.run(
        "simulate",
        result.graph.storages_from,
        state.graph,
        result.added,
        result.changed,
        result.removed,
    )
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
    sim = timer.run("simulate", measure_state, result.graph, order, cost, timer.figure, False)
    # Any rule other than an F-Tree mutation ends the lineage's fission moves (module docstring).
    return MState(result.graph, tuple(order), sim, h, (*state.history, rewrite.rule), state.frozen)


def _reschedule(state: MState, result: Rewritten, cost: CostModel) -> list[int]:
    """Alg. 2 around the old nodes the rewrite touched, then Store/Load timing.

    Three kinds of rewrite need no re-solving, and Alg. 2 would cost a sub-problem rebuild per
    state for an answer already known: one that only removes nodes (the duals: a merged copy's
    readers read an earlier value, so the old order minus the removed nodes stays valid), one
    that knows where its nodes belong (re-materialization and swapping: right before the
    first late reader), and one that replaces nodes by others in their place (an op split in
    two, or two merged). The final best is re-ordered in full (`_polish`)."""
    order = _order_without_solving(state.order, result)
    if order is None:
        old = state.graph
        touched_old = set(result.changed) | set(result.removed)
        for n in result.added:
            touched_old.update(p for p in result.graph.predecessors(n) if p in old)
            touched_old.update(s for s in result.graph.successors(n) if s in old)
        touched_old = {n for n in touched_old if n in old}
        order = list(incremental_schedule(old, state.order, result.graph, touched_old).order)
    if result.graph.copy_nodes():
        order = time_swaps(result.graph, order, cost)
    return order


def _order_without_solving(old_order, result: Rewritten) -> list[int] | None:
    if result.anchor is not None:
        return _place_at_anchor(old_order, result)
    if result.in_place_of:
        return _place_in_place_of(old_order, result)
    if result.added:
        return None
    order = [n for n in old_order if n not in result.removed]
    return order if _valid_around(result.graph, order, result.changed) else None


def _valid_around(graph: Graph, order: list[int], nodes) -> bool:
    """Whether `order` runs each of `nodes` after its predecessors and before its successors
    (enough when only these nodes' edges changed)."""
    pos = {n: i for i, n in enumerate(order)}
    return all(
        all(pos[p] < pos[n] for p in graph.predecessors(n))
        and all(pos[x] > pos[n] for x in graph.successors(n))
        for n in nodes
        if n in pos
    )


def _place_in_place_of(old_order, result: Rewritten) -> list[int] | None:
    """The old order with each group of new nodes where the first of the nodes it replaces
    ran (then `_defer_writers`); None when that order is not valid (then Alg. 2 re-orders)."""
    pos = {n: i for i, n in enumerate(old_order)}
    spots = {min(olds, key=pos.__getitem__): news for olds, news in result.in_place_of}
    order = []
    for n in old_order:
        order.extend(spots.get(n, ()))
        if n not in result.removed:
            order.append(n)
    order, moved = _defer_writers(result.graph, order, result.added)
    return order if _valid_around(result.graph, order, [*result.touched, *moved]) else None


def _place_at_anchor(old_order, result: Rewritten) -> list[int] | None:
    """The old order with the added nodes right before the anchor (then `_defer_writers`);
    None when no such order is found (then Alg. 2 re-orders)."""
    order = [n for n in old_order if n not in result.removed]
    at = order.index(result.anchor)
    added = sorted(result.added)
    order[at:at] = added
    order, moved = _defer_writers(result.graph, order, added)
    return order if _valid_around(result.graph, order, [*added, *moved]) else None


def _defer_writers(graph: Graph, order: list[int], added) -> tuple[list[int], list[int]]:
    """`order` with each node that must follow an added node but runs before it moved to
    right after the last such added node, and the nodes moved. These are in-place updates: a
    recomputed op, or a convolution by a weight's slice, reads the weight, and the scheduler
    had put the weight's update right after its gradient."""
    pos = {n: i for i, n in enumerate(order)}
    after: dict[int, int] = {}
    for a in added:
        for s in graph.successors(a):
            if pos[s] < pos[a]:
                after[s] = max(after.get(s, -1), pos[a])
    if not after:
        return order, []
    follow: dict[int, list[int]] = {}
    for s in sorted(after, key=pos.__getitem__):
        follow.setdefault(order[after[s]], []).append(s)
    out = []
    for n in order:
        if n not in after:
            out.append(n)
            out.extend(follow.get(n, ()))
    return out, list(after)
