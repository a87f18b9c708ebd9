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
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

from magis.analyze.ftree import FTree, build_ftree, memory_hotspots
from magis.errors import MagisError, MagisWarning
from magis.ir import Graph
from magis.rules import (
    FTREE_MUTATIONS,
    Materialized,
    Mutation,
    MutationKind,
    direct_fission_numbers,
    directly_enableable,
    enable_directly,
    enclosing_enableable,
    materialize,
    mutations,
    nested_enableable,
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


# A re-analysis's H: the storages live within 1% of the peak. After a split in n the parts
# repeat one another, and a part's peak is the next one's within a fraction of a percent
# (Qwen2's batch split in 2: the two loss blocks' steps at 17.952 and 17.949 GiB).
REANALYSIS_NEAR_PEAK = 0.01
# The initial analysis's H: within 3%. A model's repeated layers reach one height within a few
# percent: a GCN's four 128-wide message passings (forward and backward) peak at 0.977-1.000
# of the step's peak, each alone; an F-Tree around the highest one offered its split, which
# left the peak at the next (the search kept 0.977 of the peak for 60 s), where the four
# together (`_peers`) take it to 0.42.
INITIAL_NEAR_PEAK = 0.03


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
    is often an input gradient whose readers alone are not worth splitting. Its hot-spots are
    those near the peak (`REANALYSIS_NEAR_PEAK`), so that a split's parts are hot together;
    the initial analysis's, those within `INITIAL_NEAR_PEAK`, so that repeated layers are.

    `naive_seed` set builds the ablation's naive F-Tree instead of Alg. 1 (MAGIS §7.2.5,
    "naive-fission": valid sub-graphs and dimensions picked at random, heuristic H1 off)."""
    try:
        base = prepare(graph, order)
        base_order = base.program_order() if reanalysis else base.topological_order()
        if naive_seed is None:
            near = REANALYSIS_NEAR_PEAK if reanalysis else INITIAL_NEAR_PEAK
            hot = memory_hotspots(base, base_order, near)
            tree = build_ftree(
                base, max_level, hotspots=hot, order=base_order, hot_entries=reanalysis
            )
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
    scale: float  # analysis cost model: seconds = scale * nodes ** ANALYSIS_EXPONENT
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

    def affordable(self, nodes: int, elapsed: float, left: float = math.inf) -> bool:
        """Whether an analysis of `nodes` nodes fits now: one expected to overrun its share, or
        the `left` seconds of the budget, is not started (a 16-way split gpt-neo-1.3b graph of
        63k nodes takes a minute and more)."""
        expected = analysis_seconds(self.scale, nodes)
        return self.spent + expected <= self.share * elapsed and expected <= left

    def due(self, key: frozenset, nodes: int, elapsed: float, left: float = math.inf) -> bool:
        """Whether a state of `nodes` nodes whose hot-spots are `key` is analysed now (the
        key is then remembered): it is `affordable`, and those hot-spots are new."""
        if key in self.analysed or not self.affordable(nodes, elapsed, left):
            return False
        self.analysed.add(key)
        return True

    def account(self, found: bool, took: float, nodes: int) -> int:
        """Count an analysis that took `took` seconds on `nodes` nodes (wherever it ran); the
        epoch of the lineage it found."""
        self.spent += took
        self.scale = analysis_scale(took, nodes)
        if found:
            self.epochs += 1
        return self.epochs


# How an analysis's time grows with the graph. On Qwen2 the initial state (analysis, schedule,
# hash) of 7,280 nodes took 0.75 s and re-analyses of its batch split's 13,900 nodes 1.0-1.45 s:
# nearly linear. A square law (as before) expected 2.7 s and kept the first re-analysis waiting
# until 27 s into a 45 s search. The 1.5 power stays cautious for the far larger graphs of
# many-way splits (gpt-neo-1.3b split in 16, 63,000 nodes: a minute and more).
ANALYSIS_EXPONENT = 1.5


def analysis_scale(seconds: float, nodes: int) -> float:
    """The cost model's scale from an analysis of `nodes` nodes that took `seconds` (the
    latest one: a search's graphs grow, and the latest is the nearest in size)."""
    return seconds / max(nodes, 1) ** ANALYSIS_EXPONENT


def analysis_seconds(scale: float, nodes: int) -> float:
    return scale * nodes**ANALYSIS_EXPONENT


def hotspot_key(hotspots) -> frozenset:
    """What identifies a set of hot-spots to the re-analysis: their storages."""
    return frozenset(h.storage for h in hotspots)


def analyze_timed(graph: Graph, order, max_level: int):
    """`analyze` of a re-analysis, with the seconds it took. An analysis that raises (a bug:
    corpus:lstm_lm's once took `max()` of nothing in a worker and ended the search) finds
    nothing, with a warning: the state is searched on without a new F-Tree."""
    start = time.perf_counter()
    try:
        found = analyze(graph, list(order), max_level, reanalysis=True)
    except Exception as exc:  # noqa: BLE001 - warned about, never silent
        warnings.warn(
            MagisWarning(
                f"a re-analysis (Alg. 1) of a {len(graph)}-node state failed "
                f"({type(exc).__name__}: {exc}); the search goes on without its F-Tree "
                "(please report it)"
            ),
            stacklevel=2,
        )
        found = None
    return found, time.perf_counter() - start


_RULE_RANK = {"enable": 0, "mutate": 1, "lift": 2, "disable": 3, "coarsen": 4}
# When time is what ranks a state first, the mutations that give time back lead.
_TIME_RANK = {"coarsen": 0, "disable": 1, "lift": 2, "enable": 3, "mutate": 4}


def moves(
    tree, limit: int | None = None, wants_memory: bool | None = None, twins: bool = False
) -> Iterator[Mutation]:
    """Lazy mutations (`Mutation`: kind, tree-node, build-new-tree): every applicable one (at most
    `limit`), the most promising first — enabling and splitting further before lifting or
    disabling, and within a kind the tree-nodes of highest score (Eq. 4: the peak reduction an
    F-Trans promises). When the objective wants time, not memory (`wants_memory` False: a
    memory limit met, or a latency limit missed), splitting in fewer parts and disabling come
    first, the repeated layers' levels at once before one node at a time. `twins` offers groups of
    twins, and the twin groups that promise one saving together, enabled at once
    (`_twin_moves`) with the one-step enables (the search always asks for them)."""
    yield from itertools.islice(_all_moves(tree, wants_memory is False, twins), limit)


def _all_moves(tree, wants_time: bool, twins: bool = False) -> Iterator[Mutation]:
    ranks = _TIME_RANK if wants_time else _RULE_RANK

    def rank(cand: Mutation) -> tuple:
        return ranks.get(cand.kind, len(ranks)), -tree.nodes[cand.target].score

    if wants_time:
        yield from _level_moves(tree, (MutationKind.COARSEN,))
    else:
        if twins:
            yield from _twin_moves(tree)
        yield from _direct_moves(tree)
        yield from _level_moves(tree, (MutationKind.ENABLE, MutationKind.MUTATE))
    yield from sorted(mutations(tree), key=rank)
    if wants_time:  # the large splits last: they cost time
        if twins:
            yield from _twin_moves(tree)
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


def _direct_moves(tree) -> Iterator[Mutation]:
    """The highest-score tree-nodes enabled in one move, where Fig. 7's rules need a leaf
    enabled and then lifted level by level. The root of gpt-neo-1.3b's tree (3,556 nodes,
    L = 4) split in 4 gives 0.31 of the peak at 1.04 of the latency; reaching it through leaf
    and lift moves, each a materialization of seconds, outlasted a 180 s budget.

    Second, right after the highest-score node, comes the densest (`_densest`): the node that
    saves the most per op it splits, leaf or not. Splits nest both ways in one move: a node
    holding an enabled one is offered among the highest-score nodes
    (`enclosing_enableable`), a node inside an enabled one among the densest
    (`nested_enableable`)."""
    nodes = sorted(
        [*directly_enableable(tree), *enclosing_enableable(tree)],
        key=lambda i: -tree.nodes[i].score,
    )
    inner = [i for i in nodes[:DIRECT_MOVES] if tree.children(i)]  # a leaf: the plain enable
    dense = [i for i in _densest(tree, [*nodes, *nested_enableable(tree)]) if i not in inner]
    for i in [*inner[:1], *dense, *inner[1:]]:
        kind = "enable-dense" if i in dense else "enable-direct"
        for n in reversed(direct_fission_numbers(tree, i, DIRECT_FISSION_NUMBERS)):
            yield Mutation(kind, i, lambda i=i, n=n: enable_directly(tree, i, n))


DENSE_MOVES = 1  # tree-nodes offered by the bytes they save per op they split


def _densest(tree, enableable: list[int]) -> list[int]:
    """The `DENSE_MOVES` tree-nodes that promise the most per op they split (score / size),
    among those worth a split (`TWIN_MIN_SCORE`).

    The highest scores belong to the largest regions, whose splits cost the most time: on
    Qwen2's FSDP step on an H100 the top three tree-nodes (6,170, 3,879 and 1,401 ops) split
    in 8 cost 1.2-1.8 of the step, while the loss block (17 ops, 7 GiB of the 41 GiB peak)
    split in 8 cost 1.017 and, with a min-cut re-materialization after it, reached 0.399 of
    the peak at 1.17 (full activation checkpointing: 0.357 at 1.28). Offered by score alone,
    it was the fourth, a leaf enabled in 2 parts, and never split further. It is offered
    after the highest-score node, not before it: enabling it closes its ancestors to this
    lineage, and where the whole step's split fits the limit it saves far more (GPT-2 and
    OPT on an RTX 3090 under 1.10, 1,500 states: 0.279 and 0.197 of the peak without it,
    0.348 and 0.307 with it first, 0.321 and 0.203 with it second). What it costs GPT-2 at
    second place (0.277 -> 0.312 at 2,500 states; T5, ViT, Qwen2 within 0.003) is the price
    of Qwen2's FSDP step (0.529 -> 0.465 at 1,500 states; under full checkpointing's peak,
    1.36 -> 1.19 of the step in 60 s)."""
    top = max((x.score for x in tree.nodes), default=0.0)
    worth = [i for i in enableable if tree.nodes[i].score >= TWIN_MIN_SCORE * top]
    return sorted(worth, key=lambda i: -_density(tree, (i,)))[:DENSE_MOVES]


TWIN_MOVES = 1  # twin groups offered, the densest first
TWIN_TOLERANCE = 0.05
# A group is offered only when each of its members promises at least this share of the
# tree's best score: a transformer's 48 per-layer leaves of 0.04 GiB each (the densest group
# once Qwen2's loss blocks are split) cost a materialization of seconds and save nothing.
TWIN_MIN_SCORE = 0.1


def _twin_moves(tree) -> Iterator[Mutation]:
    """Groups of twins (`twin_groups`) each enabled in one move, in about 2, 4 and 8 parts;
    the groups that save the most per node split first (a proxy for the time a split costs:
    Qwen2's loss blocks, 15 nodes saving 2.3 GiB each, before its 2,800-node halves).

    After a split in n the parts repeat one another: enabling one part's region lowers a peak
    that the next part reaches again (Qwen2 split along the batch in 2: splitting one loss
    block's rows moved the peak from 17.952 to its twin's 17.949 GiB), so no single move
    improves and the search never takes the second."""
    groups = sorted(twin_groups(tree), key=lambda g: -_density(tree, g))
    top = max((x.score for x in tree.nodes), default=0.0)
    worth = [g for g in groups if tree.nodes[g[0]].score >= TWIN_MIN_SCORE * top]
    for group in worth[:TWIN_MOVES]:
        for n in reversed(direct_fission_numbers(tree, group[0], DIRECT_FISSION_NUMBERS)):
            yield Mutation("enable-twins", group[0], lambda g=group, n=n: _enable_all(tree, g, n))
    peers = _peers(tree, worth)
    if peers:
        for n in reversed(direct_fission_numbers(tree, peers[0], DIRECT_FISSION_NUMBERS)):
            yield Mutation("enable-peers", peers[0], lambda g=peers, n=n: _enable_all(tree, g, n))


def _peers(tree, groups: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Twin groups that promise one saving (scores within `TWIN_TOLERANCE`, along dimensions
    as long) but differ in size, sharing no graph node, as one group: the most promising such
    union of two groups and more; () when there is none. A GCN's forward and backward message
    passing (3 and 4 ops along its 4,000,000 edges) reach one peak height in all four layers'
    passes; split one kind, the other holds the peak (MAGIS §5.1's F-Tree offers them as
    separate nodes; the union is ours)."""
    best: tuple[int, ...] = ()
    for i, first in enumerate(groups):
        head = tree.nodes[first[0]]
        members, taken, count = list(first), set(_group_nodes(tree, first)), 1
        for other in groups[i + 1 :]:
            node = tree.nodes[other[0]]
            own = _group_nodes(tree, other)
            if (
                node.length == head.length
                and _close(node.score, head.score)
                and taken.isdisjoint(own)
            ):
                members.extend(other)
                taken |= own
                count += 1
        if count > 1 and _score(tree, members) > _score(tree, best):
            best = tuple(members)
    return best


def _group_nodes(tree, group) -> set[int]:
    return {v for i in group for v in _split_nodes(tree.nodes[i])}


def _score(tree, group) -> float:
    return sum(tree.nodes[i].score for i in group)


def twin_groups(tree) -> list[tuple[int, ...]]:
    """The directly enableable tree-nodes that repeat one another, in groups of two and more:
    at one level, along dimensions as long, sizes and scores within `TWIN_TOLERANCE`, sharing
    no graph node. Twins are hot together only under near-peak hot-spots (`INITIAL_NEAR_PEAK`,
    `REANALYSIS_NEAR_PEAK`)."""
    buckets: dict[tuple[int, int], list[int]] = {}
    for i in directly_enableable(tree):
        buckets.setdefault((tree.nodes[i].level, tree.nodes[i].length), []).append(i)
    groups = []
    for members in buckets.values():
        members.sort(key=lambda i: -tree.nodes[i].score)
        grouped: set[int] = set()
        for i in members:
            if i in grouped:
                continue
            group, taken = [i], set(_split_nodes(tree.nodes[i]))
            for j in members:
                if j in grouped or j == i or not _repeats(tree.nodes[i], tree.nodes[j]):
                    continue
                own = _split_nodes(tree.nodes[j])
                if taken.isdisjoint(own):
                    group.append(j)
                    taken.update(own)
            if len(group) > 1:
                grouped.update(group)
                groups.append(tuple(group))
    return groups


def _repeats(a, b) -> bool:
    if (a.level, a.length) != (b.level, b.length):
        return False
    return _close(a.size, b.size) and _close(a.score, b.score)


def _close(x: float, y: float) -> bool:
    return abs(x - y) <= TWIN_TOLERANCE * max(abs(x), abs(y))


def _density(tree, group: tuple[int, ...]) -> float:
    return sum(tree.nodes[i].score for i in group) / sum(tree.nodes[i].size for i in group)


def _split_nodes(node) -> list[int]:
    return [v for v, _ in node.ftrans.split]


def _enable_all(tree, nodes: tuple[int, ...], n: int):
    """Every one of `nodes` enabled with fission number n."""
    for i in nodes:
        tree = enable_directly(tree, i, n)
    return tree


def _level_moves(tree, kinds: tuple[MutationKind, ...]) -> Iterator[Mutation]:
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
                yield Mutation(
                    f"{kind.value}-level",
                    level,
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
