"""F-Tree mutations as search moves (MAGIS §5.1, Fig. 7, inside Alg. 3).

An F-Tree is built on the initial graph (Analyze, Alg. 1), and again on later states (the
optimizer decides which: re-analysis). While a lineage of states has seen only F-Tree
mutations since its analysis, its graph is the analysed (base) graph with the tree's enabled
nodes materialized (magis.rules.fission), so enable, lift, disable and mutate are exact: each
one re-materializes from the base. Nodes inside materialized regions are frozen — no other
rule matches across an enabled region's boundary (§3) — and the first non-fission rule applied
ends the lineage (re-analysing every state would cost seconds per state on LLM graphs).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from magis.analyze.ftree import FTree, build_ftree
from magis.errors import MagisError
from magis.ir import Graph
from magis.rules import (
    FTREE_MUTATIONS,
    Materialized,
    MutationKind,
    direct_fission_numbers,
    directly_enableable,
    enable_directly,
    materialize,
    mutations,
    prepare,
)


@dataclass(frozen=True)
class Lineage:
    """What a state's F-Tree moves start from: the analysed graph, its schedule, its F-Tree,
    and how the state's graph was materialized from them.

    A re-analysis (epoch > 0) offers each state only its `REANALYSIS_MOVES` most promising
    mutations: every F-Tree move materializes and hashes a whole graph, and on unetpp a
    lineage per improvement, each offering all its moves, took 1,100 of 1,500 states in 60 s."""

    base: Graph
    base_order: tuple[int, ...]
    tree: FTree
    epoch: int  # which analysis built the tree: trees of different analyses share indices
    base_frozen: frozenset[int] = frozenset()  # regions an earlier lineage split
    materialized: Materialized | None = None


@dataclass(frozen=True)
class Fissioned:
    graph: Graph
    order: list[int]
    frozen: frozenset[int]
    tree: FTree
    materialized: Materialized


def analyze(
    graph: Graph,
    order: list[int],
    max_level: int = 4,
    naive_seed: int | None = None,
    reanalysis: bool = False,
):
    """(prepared base graph, its order, F-Tree) for a state, or None when the graph offers no
    fission (an unprepared graph, or nothing hot is splittable).

    The initial state's base is ordered topologically. A `reanalysis` keeps `order`, the
    state's schedule (where re-materializations and Loads were placed matters), and offers hot
    dominators split with their sub-graphs (`build_ftree`'s `hot_entries`): by then the peak
    is often an input gradient whose readers alone are not worth splitting.

    `naive_seed` set builds the ablation's naive F-Tree instead of Alg. 1 (MAGIS §7.2.5,
    "naive-fission": valid sub-graphs and dimensions picked at random, heuristic H1 off)."""
    try:
        base = prepare(graph, order)
        base_order = base.program_order() if reanalysis else base.topological_order()
        if naive_seed is None:
            tree = build_ftree(base, max_level, order=base_order, hot_entries=reanalysis)
        else:
            from magis.analyze.naive import naive_ftree

            tree = naive_ftree(base, max_level=max_level, seed=naive_seed)
    except MagisError:
        return None
    if len(tree) == 0:
        return None
    return base, tuple(base_order), tree


@dataclass
class Reanalysis:
    """Analyze (Alg. 1) again on states the search reaches (Alg. 3: "if rules touched
    un-fissioned regions, rebuild the F-Tree").

    After re-materialization, swapping and compaction the peak moves, often into the backward
    pass, where other tensors are hot: U-Net's input gradients of its up-convolutions, which the
    initial F-Tree (built around the forward activations) does not cover. The search offers
    the best state for re-analysis when it pops it; an analysis runs when the state's hot-spots
    differ from every set analysed before and analysis has taken at most `share` of the time so
    far (an LLM graph's analysis costs seconds, a CNN's tens of milliseconds)."""

    max_level: int
    seconds_per_node2: float  # analysis cost model: seconds per squared node (the largest seen)
    share: float = 0.1
    spent: float = 0.0
    epochs: int = 0
    analysed: set[frozenset] = field(default_factory=set)

    def lineage(
        self, graph: Graph, order, hotspots, frozen, elapsed: float, left: float = math.inf
    ) -> Lineage | None:
        """A new lineage for the state (graph, order), or None when none is due or found."""
        if not self.due(hotspot_key(hotspots), len(graph), elapsed, left):
            return None
        found, took = analyze_timed(graph, order, self.max_level)
        epoch = self.account(found is not None, took, len(graph))
        return None if found is None else Lineage(*found, epoch, frozen)

    def due(self, key: frozenset, nodes: int, elapsed: float, left: float = math.inf) -> bool:
        """Whether a state of `nodes` nodes whose hot-spots are `key` is analysed now (the
        key is then remembered). An analysis expected to overrun its share, or the `left`
        seconds of the budget, is not started: a 16-way split gpt-neo-1.3b graph (63k nodes)
        takes a minute and more."""
        expected = self.seconds_per_node2 * nodes**2
        over_share = self.spent + expected > self.share * elapsed
        if key in self.analysed or over_share or expected > left:
            return False
        self.analysed.add(key)
        return True

    def account(self, found: bool, took: float, nodes: int) -> int:
        """Count an analysis that took `took` seconds on `nodes` nodes (wherever it ran); the
        epoch of the lineage it found."""
        self.spent += took
        self.seconds_per_node2 = max(self.seconds_per_node2, took / nodes**2)
        if found:
            self.epochs += 1
        return self.epochs


def hotspot_key(hotspots) -> frozenset:
    """What identifies a set of hot-spots to the re-analysis: their storages."""
    return frozenset(h.storage for h in hotspots)


def analyze_timed(graph: Graph, order, max_level: int):
    """`analyze` of a re-analysis, with the seconds it took."""
    start = time.perf_counter()
    found = analyze(graph, list(order), max_level, reanalysis=True)
    return found, time.perf_counter() - start


_RULE_RANK = {"enable": 0, "mutate": 1, "lift": 2, "disable": 3, "coarsen": 4}
# When time is what ranks a state first, the mutations that give time back lead.
_TIME_RANK = {"coarsen": 0, "disable": 1, "lift": 2, "enable": 3, "mutate": 4}


def moves(
    tree, limit: int | None = None, wants_memory: bool | None = None
) -> Iterator[tuple[str, object]]:
    """Lazy (description, build-new-tree) pairs: every applicable F-Tree mutation (at most
    `limit`), the most promising first — enabling and splitting further before lifting or
    disabling, and within a kind the tree-nodes of highest score (Eq. 4: the peak reduction an
    F-Trans promises). When the objective wants time, not memory (`wants_memory` False: a
    memory limit met, or a latency limit missed), splitting in fewer parts and disabling come
    first, the repeated layers' levels at once before one node at a time."""
    yield from itertools.islice(_all_moves(tree, wants_memory is False), limit)


def _all_moves(tree, wants_time: bool) -> Iterator[tuple[str, object]]:
    ranks = _TIME_RANK if wants_time else _RULE_RANK

    def rank(cand) -> tuple:
        kind, index = cand.description.split()
        return ranks.get(kind, len(ranks)), -tree.nodes[int(index)].score

    if wants_time:
        yield from _level_moves(tree, (MutationKind.COARSEN,))
    else:
        yield from _direct_moves(tree)
        yield from _level_moves(tree, (MutationKind.ENABLE, MutationKind.MUTATE))
    for cand in sorted(mutations(tree), key=rank):
        yield cand.description, cand.build
    if wants_time:  # the large splits last: they cost time
        yield from _direct_moves(tree)
        yield from _level_moves(tree, (MutationKind.ENABLE, MutationKind.MUTATE))


REANALYSIS_MOVES = 4
DIRECT_MOVES = 3  # highest-score tree-nodes offered as one-step enables
# ... each split in about 2, 4 and 8 at once. The latency cap of the queue ranks a child that
# costs more time below its cheaper siblings, so reaching n = 8 by mutating 2 -> 4 -> 8 needs
# the cap to rise twice between steps; on GPT-2 small (a whole-step region along the batch,
# its loss block 3 x 1.6 GiB) a 40 s search enabled n = 2 and never came back to raise it.
# Largest first: the search follows the first child that improves on the best, and a split
# that breaks the latency limit is not an improvement, so the next smaller one is tried.
DIRECT_FISSION_NUMBERS = (2, 4, 8)


def _direct_moves(tree) -> Iterator[tuple[str, object]]:
    """The highest-score tree-nodes enabled in one move, where Fig. 7's rules need a leaf
    enabled and then lifted level by level. The root of gpt-neo-1.3b's tree (3,556 nodes,
    L = 4) split in 4 gives 0.31 of the peak at 1.04 of the latency; reaching it through leaf
    and lift moves, each a materialization of seconds, outlasted a 180 s budget."""
    nodes = sorted(directly_enableable(tree), key=lambda i: -tree.nodes[i].score)
    for i in nodes[:DIRECT_MOVES]:
        if not tree.children(i):  # a leaf is the ordinary enable move
            continue
        for n in reversed(direct_fission_numbers(tree, i, DIRECT_FISSION_NUMBERS)):
            yield f"enable-direct {i}", lambda i=i, n=n: enable_directly(tree, i, n)


def _level_moves(tree, kinds: tuple[MutationKind, ...]) -> Iterator[tuple[str, object]]:
    """Macro moves over repeated layers: enable (or split further) every tree-node of one level
    at once, levels of the highest total score first.

    A transformer's F-Tree holds one node per layer and level, each worth a small part of the
    peak; one at a time, the 24 layers of gpt-neo-1.3b cost 24 materializations (seconds each)
    before the search sees what splitting them all is worth, and a budget of minutes runs out
    first. The single-node mutations still follow, to undo or refine. `kinds`: the mutations
    offered so (enabling and splitting further; or splitting in fewer parts)."""
    for kind in kinds:
        rule = next(r for r in FTREE_MUTATIONS if r.kind is kind)
        by_level: dict[int, list[int]] = {}
        for i in rule.match(tree):
            by_level.setdefault(tree.nodes[i].level, []).append(i)
        ranked = sorted(by_level.items(), key=lambda kv: -sum(tree.nodes[i].score for i in kv[1]))
        for level, nodes in ranked:
            if len(nodes) >= 2:
                yield (
                    f"{kind.value}-level {level}",
                    lambda r=rule, n=tuple(nodes): _apply_all(tree, r, n),
                )


def _apply_all(tree, rule, nodes: tuple[int, ...]):
    """`rule` applied to each of `nodes` that it still matches once the others are applied."""
    for i in nodes:
        if i in set(rule.match(tree)):
            tree = rule.apply(tree, i)
    return tree


def apply(lineage: Lineage, tree: FTree) -> Fissioned:
    """Materialize `tree`'s enabled nodes on the lineage's base (continuing the parent state's
    materialization where it can); the copies are frozen, and so are the base's frozen nodes
    that remain."""
    mat = materialize(lineage.base, tree, list(lineage.base_order), lineage.materialized)
    frozen = {v for v in lineage.base_frozen if v in mat.graph}
    for t in mat.applied:
        for v, _ in tree.nodes[t].ftrans.split:
            frozen.update(mat.ids.get(v, ()))
    return Fissioned(mat.graph, mat.order, frozenset(frozen), tree, mat)
