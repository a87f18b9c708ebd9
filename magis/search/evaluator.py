"""Turning a move into a child M-State (MAGIS Alg. 3, lines 8-12): build, de-duplicate by hash,
reschedule, simulate.

The `Evaluator` holds what every evaluation of one search shares: the cost model, the memory
figure states are measured by, the hashes and F-Trees already seen, and the statistics (states,
duplicates, rules applied, seconds per part).
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from magis.backend.meta_check import MetaChecker, MetaReport
from magis.cost import CostModel
from magis.errors import MagisError, MagisWarning
from magis.ir import Graph, positions
from magis.rules import (
    OrderIndex,
    Rewrite,
    Rewritten,
    Rule,
    RuleContext,
    RuleKind,
    after_local_move,
    ordered_for,
)
from magis.rules.duplicates import derive_duplicate_index
from magis.rules.relax import RELAX, relaxation_at_peak
from magis.schedule import schedule
from magis.schedule.swaps import time_swaps
from magis.search import fission_moves
from magis.search.decisions import fission_decision, reorder_decision, rewrite_decision
from magis.search.hashing import graph_hash, wl_hash_incremental
from magis.search.options import MemoryFigure
from magis.search.reschedule import reschedule
from magis.search.state import Mode, MState, Objective
from magis.search.symmetry import MoveSignatures, derive_node_names
from magis.sim import SimResult, derive_facts, simulate, tables

Move = tuple[str, Callable[[], MState | None]]  # (rule name, lazy child)


def simulate_state(
    graph: Graph, order: Sequence[int], cost: CostModel, figure: MemoryFigure, detail: bool = True
) -> SimResult:
    """The simulation of `order` with its peak counted by `figure` (the arena a long-lived-
    first best-fit layout needs, under MemoryFigure.ARENA)."""
    sim = simulate(graph, order, cost, detail)
    if figure is MemoryFigure.ARENA:
        from magis.layout import plan_layout  # the layout solver is heavy to import

        arena = plan_layout(graph, list(order), "llfb").arena_bytes
        sim = replace(sim, peak_bytes=sim.resident_bytes + arena)
    return sim


@dataclass
class SearchStats:
    states_explored: int = 0
    duplicates: int = 0
    # Moves skipped unbuilt as mirrors of a move tried on the same state (symmetry.py): the
    # duplicates they would have been.
    mirrored: int = 0
    # Children whose ops, run on fake tensors, do not make the shapes, dtypes and strides the
    # graph records (the meta check): dropped, never kept or returned.
    meta_rejected: int = 0
    # Fission moves not built because their child was expected to outlast the budget
    # (`budget.FissionCost`).
    unaffordable: int = 0
    rules_applied: Counter = field(default_factory=Counter)
    failed_children: Counter = field(default_factory=Counter)  # per rule: builds that raised
    breakdown: dict[str, float] = field(
        default_factory=lambda: {
            "transform": 0.0,
            "check": 0.0,
            "schedule": 0.0,
            "simulate": 0.0,
            "hash": 0.0,
            # The final full re-ordering of the best (`polish`, once) in the main process,
            # while the search waits: apart, so that a search's states per second are also
            # read over its exploration. ("polish_in_worker": the same, run by a worker
            # while the others explore, `ParallelChildren.reorder`.)
            "polish": 0.0,
        }
    )


POSITIONS_KEPT = 4  # parent orders whose positions an evaluator keeps
FISSION_MOVE_PREFIX = "fission:"  # the names of F-Tree mutations' moves (`fission:enable`)


@dataclass
class Evaluator:
    cost: CostModel
    figure: MemoryFigure = MemoryFigure.THEORETICAL
    stats: SearchStats = field(default_factory=SearchStats)
    seen: set[int] = field(default_factory=set)  # hashes of every graph evaluated
    seen_trees: set = field(default_factory=set)  # F-Trees already materialized
    checker: MetaChecker = field(default_factory=MetaChecker)
    # The positions of the last few parent orders rescheduled from: a state's children are
    # built one after another (a worker may interleave a few states), and indexing a
    # 42,000-step order costs 2 ms.
    _positions: list[tuple[tuple[int, ...], dict[int, int]]] = field(
        default_factory=list, repr=False
    )

    def positions(self, order: tuple[int, ...]) -> dict[int, int]:
        """`order`'s node -> index, kept for the POSITIONS_KEPT orders asked for last."""
        for k, (known, pos) in enumerate(self._positions):
            if known is order:
                if k:
                    self._positions.insert(0, self._positions.pop(k))
                return pos
        pos = positions(order)
        self._positions.insert(0, (order, pos))
        del self._positions[POSITIONS_KEPT:]
        return pos

    def timed(self, part: str, fn: Callable, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.stats.breakdown[part] += time.perf_counter() - start

    def simulate(self, graph: Graph, order: Sequence[int], detail: bool = False) -> SimResult:
        return self.timed("simulate", simulate_state, graph, order, self.cost, self.figure, detail)

    def is_new(self, hash_value: int) -> bool:
        """Records the hash; False (a duplicate, counted) when it was seen before."""
        if hash_value in self.seen:
            self.stats.duplicates += 1
            return False
        self.seen.add(hash_value)
        return True

    def derive_metas(self, graph: Graph, touched) -> MetaReport | None:
        """Derive the strides of what a rewrite touched, and of their readers, on fake tensors
        (`MetaChecker.derive`); None, counted, for a child whose ops cannot run on them or make
        other shapes or dtypes than the graph records: it is dropped."""
        report = self.timed("check", self.checker.derive, graph, touched)
        if not report.ok:
            self.stats.meta_rejected += 1
            return None
        return report

    def context(self, state: MState, hotspots_only: bool, objective: Objective) -> RuleContext:
        """What the rules see of `state`, with the ceiling `objective` puts on moves that give
        time back and the cost model they weigh it with."""
        return RuleContext(
            state.graph,
            state.order,
            state.sim,
            state.frozen,
            hotspots_only,
            ceiling=objective.memory_ceiling(state),
            cost=self.cost,
            # the rules' index of the order is the one its children's rescheduling reads
            index=OrderIndex(state.order, self.positions(state.order)),
        )

    def moves(
        self,
        state: MState,
        rules: Sequence[Rule],
        ctx: RuleContext,
        wants_memory: bool | None = None,
        objective: Objective | None = None,
    ) -> Iterator[Move]:
        """F-Tree mutations (while the lineage allows them) alternating with every rule's
        rewrites taken in turn, so the first moves tried cover every kind. Fission has every
        other turn: it is where the large reductions are (§7.2). (All F-Tree moves first, as
        before, starved the other rules on large graphs: an encoder-decoder of 5,172 nodes
        spent a 180 s search on 119 materializations, not one re-materialization or swap.)

        `wants_memory` (the objective's need, `Objective.wants_memory`) puts the rules that save
        it first; `objective` relaxes the children over its latency limit (`repaired`).
        Only TASO's substitutions stay out of enabled F-Tree regions: a re-
        materialization or swap inside one part of a split crosses no region boundary (its
        child leaves the lineage, as any rule's does), and after a whole-model split nearly
        every hot-spot lies inside one (T5-base: its 60 s plan 0.649 -> 0.587 of the peak)."""
        streams = []
        if state.fission is not None:
            limit = fission_moves.REANALYSIS_MOVES if state.fission.epoch else None
            streams.append(
                (
                    f"{FISSION_MOVE_PREFIX}{m.kind}",
                    lambda m=m: self.repaired(
                        self.fission_child(state, m.build, f"{FISSION_MOVE_PREFIX}{m.kind}"),
                        objective,
                    ),  # a materialization renumbers nodes: no parent context
                )
                for m in fission_moves.moves(state.fission.tree, limit, wants_memory, twins=True)
            )
        inside = ctx.without_frozen()
        rules = after_local_move(rules, state.history)
        if wants_memory is not None:
            rules = ordered_for(rules, wants_memory)
        mirrors = MoveSignatures(state.graph, state.hash.labels[-1])
        others = [
            (
                (rw.rule, lambda r=rw: self.repaired(self.child(state, r), objective, ctx))
                for rw in self._matches(rule, ctx if rule.kind is RuleKind.TASO else inside)
                if self._unmirrored(rw, mirrors)
            )
            for rule in rules
        ]
        return round_robin([*streams, round_robin(others)])

    def _unmirrored(self, rewrite: Rewrite, mirrors: MoveSignatures) -> bool:
        """Whether the rewrite is no mirror of one offered on its state before (counted)."""
        if mirrors.first(rewrite):
            return True
        self.stats.mirrored += 1
        return False

    def _matches(self, rule: Rule, ctx: RuleContext) -> Iterator[Rewrite]:
        """The rule's rewrites; a rule that raises while it matches offers no more on this
        state, and is counted and warned about as a failed child is (`failed`)."""
        try:
            yield from rule.match(ctx)
        except Exception as exc:  # noqa: BLE001 - counted and warned about, never silent
            self.failed(rule.name, exc)

    def repaired(
        self,
        child: MState | None,
        objective: Objective | None,
        parent: RuleContext | None = None,
    ) -> MState | None:
        """`child`, or, when it is over `objective`'s latency limit, the child relaxed at its
        own peak (`rules.relax.relaxation_at_peak`: every recomputation and swap that fits
        under it undone) if the undos' estimated time covers the excess and the result ranks
        better. A move that lowers the peak may leave earlier rewrites without a purpose (the
        tensors they freed now live where memory is below the new peak); over the limit, the
        child would be dropped, and relaxation is offered only on the states that are popped
        (`Rule.only_when_wanted`), which a latency-limited search never pops once a state
        meets its limit. `parent` (the context of the state a rewrite was made on) spares
        finding the child's recomputed copies again."""
        if (
            child is None
            or objective is None
            or objective.mode is not Mode.LATENCY_LIMIT
            or objective.satisfied(child)
        ):
            return child
        ctx = self.context(child, True, objective)  # a latency limit's ceiling: child's peak
        excess = child.latency - objective.limit
        rewrite = self.unless_failed(
            RELAX.name, None, self.timed, "transform", relaxation_at_peak, ctx, excess, parent
        )
        if rewrite is None:
            return child
        relaxed = self.child(child, rewrite)
        return relaxed if relaxed is not None and objective.better(relaxed, child) else child

    def fission_child(self, state: MState, build_tree, name: str) -> MState | None:
        """`_fission_child`, or None when it raises (`failed`), as a rule's child is dropped:
        one broken split must not end a user's search."""
        return self.unless_failed(name, None, self._fission_child, state, build_tree, name)

    def _fission_child(self, state: MState, build_tree, name: str) -> MState | None:
        """Materialize the mutated F-Tree on the lineage's base graph: its program order is the
        hierarchical schedule (each enabled region's parts one after the other), with Store/Load
        re-timed. Trees already materialized (the same enabled nodes with the same n, reached
        by another path) are skipped before the expensive materialization."""
        lineage = state.fission
        tree = self.timed("transform", build_tree)
        key = (lineage.epoch, *((i, x.ftrans) for i, x in enumerate(tree.nodes) if x.enabled))
        if key in self.seen_trees:
            self.stats.duplicates += 1
            return None
        self.seen_trees.add(key)
        try:
            done = self.timed("transform", fission_moves.apply, lineage, tree)
        except MagisError:
            return None
        mat = done.materialized
        metas = self.derive_metas(done.graph, mat.touched)
        if metas is None:
            return None
        # What the materialization changed relative to the graph it continued: the parent
        # state's, or the lineage's base (hashed once per lineage).
        if mat.continued and lineage.materialized is not None:
            parent, parent_hash = state.graph, state.hash
        else:
            parent, parent_hash = lineage.base, self.timed("hash", graph_hash, lineage.base)
        retimed = mat.touched | metas.restrided
        h = self.timed(
            "hash", wl_hash_incremental, parent_hash, parent, done.graph, retimed, mat.removed
        )
        if not self.is_new(h.value):
            return None
        # Storages, tables and node times from the parent's (a fresh build of a 49,000-node
        # split took half a second): the copies are new nodes, the re-wired and re-strided
        # ones changed, and every other node is the parent's very Node.
        added = {v for v in retimed if v not in parent}
        self.timed(
            "simulate",
            derive_facts,
            parent,
            done.graph,
            added,
            retimed - added,
            mat.removed,
            self.cost,
        )
        order = done.order
        if self.timed("simulate", tables, done.graph).copy_nodes:  # the storages, built once
            order = self.timed("schedule", time_swaps, done.graph, order, self.cost)
        order = tuple(order)  # one tuple for the state and its simulation
        sim = self.simulate(done.graph, order)
        decision = fission_decision(
            name,
            state.graph,
            state.sim,
            lineage.tree,
            tree,
            done.graph,
            mat.touched,
            mat.removed,
            sim,
        )
        return replace(
            state,
            graph=done.graph,
            order=order,
            sim=sim,
            hash=h,
            history=(*state.history, name),
            decisions=(*state.decisions, decision),
            frozen=done.frozen,
            fission=replace(lineage, tree=tree, materialized=done.materialized),
        )

    def child(self, state: MState, rewrite: Rewrite) -> MState | None:
        """Build a rule's rewrite, skip it when its graph was seen, else schedule and simulate
        it. Any rule other than an F-Tree mutation ends the lineage's fission moves. A rewrite
        that raises is dropped (`failed`): one broken child must not end a user's search."""
        return self.unless_failed(rewrite.rule, None, self._child, state, rewrite)

    def unless_failed(self, rule: str, fallback, fn: Callable, *args):
        """`fn(*args)`, or `fallback` when it raises: counted and warned about under `rule`
        (`failed`)."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - counted and warned about, never silent
            self.failed(rule, exc)
            return fallback

    def failed(self, rule: str, exc: Exception) -> None:
        """A child of `rule` raised while it was built: counted, and warned about the first
        time for each rule (a bug to report; the tests turn the warning into an error)."""
        self.stats.failed_children[rule] += 1
        if self.stats.failed_children[rule] == 1:
            warnings.warn(
                MagisWarning(
                    f"a {rule} child could not be built ({type(exc).__name__}: {exc}); such "
                    "children are skipped (please report it)"
                ),
                stacklevel=2,
            )

    def _child(self, state: MState, rewrite: Rewrite) -> MState | None:
        result: Rewritten = self.timed("transform", rewrite.build)
        metas = self.derive_metas(result.graph, result.touched)
        if metas is None:
            return None
        changed = result.changed | metas.restrided
        touched = result.added | changed  # every node whose Node object is not the parent's
        h = self.timed(
            "hash",
            wl_hash_incremental,
            state.hash,
            state.graph,
            result.graph,
            touched,
            result.removed,
        )
        if not self.is_new(h.value):
            return None
        # Storages, the simulator's tables and node times from the parent's, not rebuilt:
        # rules, scheduler and simulator read them.
        self.timed(
            "simulate",
            derive_facts,
            state.graph,
            result.graph,
            result.added,
            changed,
            result.removed,
            self.cost,
        )
        for derive in (derive_duplicate_index, derive_node_names):
            self.timed("transform", derive, state.graph, result.graph, touched, result.removed)
        order = tuple(
            self.timed(
                "schedule",
                reschedule,
                state.graph,
                state.order,
                result,
                self.cost,
                self.positions(state.order),
            )
        )
        sim = self.simulate(result.graph, order)  # shares the tuple
        decision = rewrite_decision(
            rewrite, state.graph, state.sim, result.graph, result.added, result.removed, sim
        )
        return MState(
            result.graph,
            order,
            sim,
            h,
            (*state.history, rewrite.rule),
            state.frozen,
            decisions=(*state.decisions, decision),
        )

    def polish(self, state: MState) -> MState:
        """The state's graph re-ordered in full by the DP scheduler (then Store/Load timing):
        during the search, re-materialization and swapping place their nodes where the rule
        says (`Rewritten.anchor`), and the winner gets one full re-ordering at the end."""
        try:
            order = self.timed("polish", full_schedule, state.graph, self.cost)
        except MagisError:
            return state
        order = tuple(order)
        return replace(state, order=order, sim=self.simulate(state.graph, order, True))

    def reordered(
        self, state: MState, objective: Objective, affordable: bool
    ) -> tuple[MState, bool]:
        """The search's last step on its best state: the better of the state and its full
        re-ordering (`polish`, when `affordable`), simulated with the report's detail (the
        peak's breakdown); True when the re-ordering won (its decision recorded)."""
        polished = self.polish(state) if affordable else state
        if polished is not state and objective.better(polished, state):
            reorder = reorder_decision("reschedule", state.sim, polished.sim)
            return replace(polished, decisions=(*state.decisions, reorder)), True
        # states are simulated without the report's detail
        return replace(state, sim=self.simulate(state.graph, state.order, True)), False


def full_schedule(graph: Graph, cost: CostModel) -> list[int]:
    order = list(schedule(graph, "dp").order)
    if tables(graph).copy_nodes:
        order = time_swaps(graph, order, cost)
    return order


def round_robin(streams) -> Iterator:
    """One item of each stream in turn, until all are exhausted."""
    active = [iter(s) for s in streams]
    while active:
        for it in list(active):
            item = next(it, None)
            if item is None:
                active.remove(it)
            else:
                yield item
