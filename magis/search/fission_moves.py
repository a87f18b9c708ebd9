"""F-Tree mutations as search moves (MAGIS §5.1, Fig. 7, inside Alg. 3).

The F-Tree is built once on the initial graph (Analyze, Alg. 1). While a lineage of states has
seen only F-Tree mutations, its graph is the base graph with the tree's enabled nodes
materialized (magis.rules.fission), so enable, lift, disable and mutate are exact: each one
re-materializes from the base. Nodes inside materialized regions are frozen — no other rule
matches across an enabled region's boundary (§3) — and the first non-fission rule applied ends
the lineage's F-Tree moves (re-analysis per state would cost seconds on LLM graphs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from magis.analyze.ftree import build_ftree
from magis.errors import MagisError
from magis.ir import Graph
from magis.rules.fission import (
    FTREE_RULES,
    Materialized,
    RuleKind,
    directly_enableable,
    enable_directly,
    materialize,
    prepare,
)
from magis.rules.fission import candidates as ftree_candidates


@dataclass(frozen=True)
class FissionMove:
    description: str
    tree: object  # the mutated FTree (built lazily by the caller through `build`)
    build: object


@dataclass(frozen=True)
class Fissioned:
    graph: Graph
    order: list[int]
    frozen: frozenset[int]
    tree: object
    materialized: Materialized


def analyze(graph: Graph, order: list[int], max_level: int = 4, naive_seed: int | None = None):
    """(prepared base graph, its order, F-Tree) for the initial state, or None when the graph
    offers no fission (an unprepared graph, or nothing hot is splittable).

    `naive_seed` set builds the ablation's naive F-Tree instead of Alg. 1 (MAGIS §7.2.5,
    "naive-fission": valid sub-graphs and dimensions picked at random, heuristic H1 off)."""
    try:
        base = prepare(graph)
        base_order = base.topological_order()
        if naive_seed is None:
            tree = build_ftree(base, max_level=max_level, order=base_order)
        else:
            from magis.analyze.naive import naive_ftree

            tree = naive_ftree(base, max_level=max_level, seed=naive_seed)
    except MagisError:
        return None
    if len(tree) == 0:
        return None
    return base, tuple(base_order), tree


_RULE_RANK = {"enable": 0, "mutate": 1, "lift": 2, "disable": 3}


def moves(tree) -> Iterator[tuple[str, object]]:
    """Lazy (description, build-new-tree) pairs: every applicable F-Tree mutation, the most
    promising first — enabling and splitting further before lifting or disabling, and within a
    kind the tree-nodes of highest score (Eq. 4: the peak reduction an F-Trans promises)."""

    def rank(cand) -> tuple:
        kind, index = cand.description.split()
        return _RULE_RANK.get(kind, len(_RULE_RANK)), -tree.nodes[int(index)].score

    yield from _direct_moves(tree)
    yield from _level_moves(tree)
    for cand in sorted(ftree_candidates(tree), key=rank):
        yield cand.description, cand.build


DIRECT_MOVES = 3  # highest-score tree-nodes offered as one-step enables


def _direct_moves(tree) -> Iterator[tuple[str, object]]:
    """The highest-score tree-nodes enabled in one move, where Fig. 7's rules need a leaf
    enabled and then lifted level by level. The root of gpt-neo-1.3b's tree (3,556 nodes,
    L = 4) split in 4 gives 0.31 of the peak at 1.04 of the latency; reaching it through leaf
    and lift moves, each a materialization of seconds, outlasted a 180 s budget."""
    nodes = sorted(directly_enableable(tree), key=lambda i: -tree.nodes[i].score)
    for i in nodes[:DIRECT_MOVES]:
        if tree.children(i):  # a leaf is the ordinary enable move
            yield f"enable-direct {i}", lambda i=i: enable_directly(tree, i)


def _level_moves(tree) -> Iterator[tuple[str, object]]:
    """Macro moves over repeated layers: enable (or split further) every tree-node of one level
    at once, levels of the highest total score first.

    A transformer's F-Tree holds one node per layer and level, each worth a small part of the
    peak; one at a time, the 24 layers of gpt-neo-1.3b cost 24 materializations (seconds each)
    before the search sees what splitting them all is worth, and a budget of minutes runs out
    first. The single-node mutations still follow, to undo or refine."""
    for kind in (RuleKind.ENABLE, RuleKind.MUTATE):
        rule = next(r for r in FTREE_RULES if r.kind is kind)
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


def apply(base: Graph, base_order, tree, reuse: Materialized | None = None) -> Fissioned:
    """Materialize `tree`'s enabled nodes on `base` (continuing `reuse`, the parent state's
    materialization, where it can); the copies are frozen."""
    mat = materialize(base, tree, list(base_order), reuse)
    frozen = frozenset()
    for t in mat.applied:
        for v, _ in tree.nodes[t].ftrans.split:
            frozen |= frozenset(mat.ids.get(v, ()))
    return Fissioned(mat.graph, mat.order, frozen, tree, mat)
