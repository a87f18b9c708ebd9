"""Random chains of rule applications for `magis bench fuzz`, made as MAGIS's search makes them.

A chain starts from a captured graph in its program order or in the DP schedule the search
starts from (Alg. 3's initial state) and applies 1..MAX_CHAIN rewrites, each one:

* an F-Tree move (§5.1, Fig. 7) while the state's lineage allows it — the search's own moves
  (`fission_moves.moves`: enable, lift, disable, mutate, the direct and level-wide enables) or
  a tree-node enabled at a random n in {2, 3, 4} — materialized on the lineage's base; after
  other rules, a new analysis first, as the search's re-analysis does;
* or a rewrite drawn from the rules in random order (the first rule that matches anything,
  one of its candidates at random), under heuristic H2 or without it, and sometimes with the
  simulated peak moved: a rule must be right wherever the peak is, the peak only chooses what
  to rewrite. The result is scheduled by the search's placement hints, by Alg. 2, or after
  its inputs, and must be a valid schedule.

As in the search, each result's strides are derived on fake tensors (`MetaChecker.derive`); a
result whose ops cannot run on them is dropped, as the search drops it, and counted.

Every choice is drawn from the `random.Random` given: a chain is reproduced by its seed.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from magis.backend import MetaChecker
from magis.cost import CostModel
from magis.errors import MagisError
from magis.ir import Graph
from magis.ir.topological import place_after_inputs
from magis.rules import (
    Mutation,
    Rewritten,
    Rule,
    RuleContext,
    RuleKind,
    dual_kind,
    fuzzed_rules,
)
from magis.rules.catalog import FIRST_FUZZ_ROUND
from magis.schedule import incremental_schedule, schedule
from magis.schedule.swaps import time_swaps
from magis.search import fission_moves
from magis.search.reschedule import order_without_solving
from magis.sim import SimResult, simulate

MAX_CHAIN = 4  # rewrites per chain
FISSION = "fission"  # the kind of F-Tree moves (they are not `Rule`s)
FISSION_N = (2, 3, 4)
# How a rewrite's result is scheduled, and how often: Alg. 2 costs ~0.1 s on these graphs (five
# cases' worth), so it is drawn rarely; its own tests are in tests/test_schedule.py.
PLACEMENTS = {"hint": 0.6, "after_inputs": 0.35, "incremental": 0.05}
FISSION_SHARE = 0.3  # steps that try an F-Tree move
REANALYSIS_SHARE = 0.25  # of those after other rules: an analysis costs ~50 ms
# The rules of the first fuzz runs: their reproducers replay with these.
FIRST_RULES = fuzzed_rules(FIRST_FUZZ_ROUND)


def all_rules() -> tuple[Rule, ...]:
    """Every rewrite rule the rule catalog marks as fuzzed (`magis.rules.catalog`), by the
    round that first drew it: a seed of an earlier run draws the same chains."""
    return fuzzed_rules()


def dual_kind_name(kind: str) -> str | None:
    """The name of the rule kind that undoes a step of kind `kind` (the catalog's
    `dual_kind`); None after an F-Tree move, which has no dual kind."""
    if kind == FISSION:
        return None
    return dual_kind(RuleKind(kind)).value


def all_kinds() -> frozenset[str]:
    """What "every rule kind covered" means: each kind of `Rule`, and F-Tree fission."""
    return frozenset({k.value for k in RuleKind} | {FISSION})


@dataclass(frozen=True)
class ChainState:
    """A graph, its schedule and simulation, the frozen nodes of enabled F-Tree regions, and
    the F-Tree lineage while only F-Tree moves were applied since its analysis (as `MState`).
    `touched` gathers the nodes the chain's rewrites added or re-wired (None once an F-Tree
    move rebuilt the graph): what the meta check must look at."""

    graph: Graph
    order: tuple[int, ...]
    sim: SimResult | None = None
    frozen: frozenset[int] = frozenset()
    lineage: fission_moves.Lineage | None = None
    chain: tuple[str, ...] = ()  # "rule: what it did [how it was placed]"
    kinds: tuple[str, ...] = ()
    placements: tuple[str, ...] = ()
    touched: frozenset[int] | None = frozenset()
    meta_rejected: tuple[str, ...] = ()  # rewrites dropped: their ops fail on fake tensors


class ChainError(Exception):
    """A rule, an F-Tree move or the scheduling of a result failed: the chain up to it."""

    def __init__(self, chain: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.chain = chain


@dataclass
class Start:
    """Where every chain on one graph begins, computed once per graph: its two initial
    states (program order, DP schedule), simulated, and their F-Trees (Alg. 1); and what the
    chains use: the cost model and the meta checker."""

    graph: Graph
    cost: CostModel
    checker: MetaChecker = field(default_factory=MetaChecker)
    _states: dict = field(default_factory=dict, repr=False)
    _lineages: dict = field(default_factory=dict, repr=False)

    def state(self, kind: str) -> ChainState:
        if kind not in self._states:
            g = self.graph
            order = tuple(g.program_order() if kind == "program" else schedule(g, "dp").order)
            self._states[kind] = ChainState(g, order, simulate(g, order, self.cost, False))
        return self._states[kind]

    def lineage(self, kind: str) -> fission_moves.Lineage | None:
        if kind not in self._lineages:
            self._lineages[kind] = analyze(self.graph, self.state(kind).order, False)
        return self._lineages[kind]


def analyze(graph: Graph, order, reanalysis: bool, frozen=frozenset()):
    """The F-Tree lineage of (graph, order), or None when it offers no fission."""
    found = fission_moves.analyze(graph, list(order), reanalysis=reanalysis)
    if found is None:
        return None
    base, base_order, tree = found
    return fission_moves.Lineage(base, base_order, tree, int(reanalysis), frozen)


def draw_chain(start: Start, rng: random.Random, rules: Sequence[Rule]) -> ChainState:
    """A random chain of 1..MAX_CHAIN rewrites from `start` (fewer when nothing applies)."""
    kind = rng.choice(("program", "dp"))
    state = start.state(kind)
    for _ in range(rng.randint(1, MAX_CHAIN)):
        if rng.random() < FISSION_SHARE:
            done, state = len(state.chain), _try_fission(start, kind, state, rng)
            if len(state.chain) > done:
                continue
        done, state = len(state.chain), rule_step(state, rules, rng, start.cost, start.checker)
        if len(state.chain) == done:  # no rule applies
            break
    return state


def _try_fission(start: Start, kind: str, state: ChainState, rng: random.Random) -> ChainState:
    """`state` after an F-Tree move: from its lineage, or from a new analysis of a state that
    other rules made (the search's re-analysis); `state` itself when none applies."""
    try:
        if state.lineage is None:
            if not state.chain:
                lineage = start.lineage(kind)
            elif rng.random() < REANALYSIS_SHARE:
                lineage = analyze(state.graph, state.order, True, state.frozen)
            else:
                return state
            state = replace(state, lineage=lineage)
        if state.lineage is None:
            return state
        return fission_step(state, rng, start.cost, start.checker)
    except Exception as exc:  # noqa: BLE001 - any failure here is a bug to report
        raise ChainError((*state.chain, FISSION), f"{type(exc).__name__}: {exc}") from exc


def random_n_trees(tree, rng: random.Random) -> Iterator[Mutation]:
    """Moves (of kind "n=<n>") for a few random tree-nodes enabled at a random n in FISSION_N that
    divides what is left of the node's length (and, one time in ten, at one that does not: a
    split the materialization must refuse)."""
    for i in rng.sample(range(len(tree)), min(3, len(tree))):
        node = tree.nodes[i]
        length = node.length
        for a in tree.ancestors(i):
            anc = tree.nodes[a]
            if anc.enabled and anc.component == node.component:
                length //= anc.n
        ns = [n for n in FISSION_N if length % n == 0 and n != node.n]
        if rng.random() < 0.1:
            ns = [n for n in FISSION_N if length % n != 0]
        if ns:
            n = rng.choice(ns)
            built = tree.with_n(i, n)
            yield Mutation(f"n={n}", i, lambda t=built: t)


def fission_step(
    state: ChainState, rng: random.Random, cost: CostModel, checker: MetaChecker
) -> ChainState:
    """`state` after one F-Tree move materialized on the lineage's base, its strides derived;
    `state` with the moves dropped counted when none of the few tried applies (what the search
    skips: n does not divide, a bad split, ops that fail on the derived strides)."""
    lineage = state.lineage
    offered = list(itertools.islice(fission_moves.moves(lineage.tree, twins=True), 24))
    offered += list(random_n_trees(lineage.tree, rng))
    rng.shuffle(offered)
    rejected = state.meta_rejected
    for move in offered[:4]:
        tree = move.build()
        try:
            done = fission_moves.apply(lineage, tree)
        except MagisError:
            continue
        name = f"{FISSION}:{move.kind}"
        if not checker.derive(done.graph, done.materialized.touched).ok:
            rejected = (*rejected, name)
            continue
        order = done.order
        if done.graph.copy_nodes():
            order = time_swaps(done.graph, order, cost)
        return ChainState(
            done.graph,
            tuple(order),
            None,
            done.frozen,
            replace(lineage, tree=tree, materialized=done.materialized),
            (*state.chain, f"{name}: {move.description}"),
            (*state.kinds, FISSION),
            (*state.placements, FISSION),
            None,
            rejected,
        )
    return replace(state, meta_rejected=rejected)


def rules_in_turn(rules: Sequence[Rule], state: ChainState, rng: random.Random) -> list[Rule]:
    """The rules in random order; after a rule, half the time its kind's dual first (after a
    TASO rule, the TASO rules), so that chains also undo and compose what they did."""
    order = list(rules)
    rng.shuffle(order)
    if state.kinds and rng.random() < 0.5:
        dual = dual_kind_name(state.kinds[-1])
        order.sort(key=lambda r: r.kind.value != dual)
    return order


def rule_step(
    state: ChainState,
    rules: Sequence[Rule],
    rng: random.Random,
    cost: CostModel,
    checker: MetaChecker,
) -> ChainState:
    """`state` after one rewrite of the first rule (in random order) that matches anything,
    drawn among its candidates, its strides derived, and its result scheduled; `state` with
    the rewrites dropped counted when no rule applies."""
    sim = state.sim if state.sim is not None else simulate(state.graph, state.order, cost, False)
    hotspots_only = rng.random() < 0.5
    if not hotspots_only and rng.random() < 0.5:
        # The peak chooses what to rewrite, never whether a rewrite is right: elsewhere, it
        # makes other reads "late" (re-materialization, swapping and compaction match more).
        sim = replace(sim, peak_step=rng.randrange(len(state.order)))
    ctx = RuleContext(
        state.graph,
        state.order,
        sim,
        state.frozen,
        hotspots_only=hotspots_only,
        max_candidates=rng.choice((4, 16, 64)),
        # The ceiling a relaxation fills: the peak itself, or half as much room again (no
        # draw, so the chains of the first rules replay unchanged).
        ceiling=sim.peak_bytes * (2 + len(state.chain) % 2) // 2,
        cost=cost,
    )
    rejected = state.meta_rejected
    for rule in rules_in_turn(rules, state, rng):
        found = list(itertools.islice(rule.match(ctx), 64))
        if not found:
            continue
        rewrite = rng.choice(found)
        placement = rng.choices(list(PLACEMENTS), weights=list(PLACEMENTS.values()))[0]
        chain = (*state.chain, f"{rewrite.rule}: {rewrite.description} [{placement}]")
        try:
            result = rewrite.build()
            result.graph.verify()
            metas = checker.derive(result.graph, result.touched)
            if not metas.ok:  # the search drops it: try the next rule
                rejected = (*rejected, rewrite.rule)
                continue
            order = place(state.graph, state.order, result, placement, cost)
        except Exception as exc:  # noqa: BLE001 - any failure of a rule is the rule's bug
            raise ChainError(chain, f"{type(exc).__name__}: {exc}") from exc
        if not result.graph.is_valid_schedule(order):
            raise ChainError(chain, f"not a valid schedule after {placement} placement")
        alive = frozenset(result.graph.nodes)
        new = result.touched | metas.restrided
        touched = None if state.touched is None else (state.touched | new) & alive
        return ChainState(
            result.graph,
            tuple(order),
            None,
            state.frozen & alive,
            None,  # any rule but an F-Tree move ends the lineage (fission_moves)
            chain,
            (*state.kinds, rule.kind.value),
            (*state.placements, placement),
            touched,
            rejected,
        )
    return replace(state, meta_rejected=rejected)


def place(
    old: Graph, old_order: Sequence[int], result: Rewritten, how: str, cost: CostModel
) -> list[int]:
    """A schedule of `result.graph` from the old one. `how`: "hint" (the search's placement:
    `order_without_solving`, after the inputs when it finds none), "incremental" (Alg. 2
    around the touched nodes) or "after_inputs". Store/Load are then timed, as in the search."""
    graph = result.graph
    if how == "incremental":
        touched = set(result.changed) | set(result.removed)
        for n in result.added:
            touched.update(graph.predecessors(n))
            touched.update(graph.successors(n))
        touched = {n for n in touched if n in old}
        order = list(incremental_schedule(old, tuple(old_order), graph, touched).order)
    else:
        order = order_without_solving(old_order, result) if how == "hint" else None
        if order is None:
            order = place_after_inputs(graph, list(old_order), result.added)
    if graph.copy_nodes():
        order = time_swaps(graph, order, cost)
    return order
