"""The naive F-Tree of the §7.2.5 ablation ("naive-fission": heuristic H1 off).

MAGIS §7.2.5 disables H1 "by randomly selecting valid sub-graph & dimension for F-Trans". Alg. 1
picks, per dimension D, the sub-graphs that dominators span and ranks them by memory heat and
score (Eq. 3, 4); here nothing about memory or dominance guides the choice:

- a dimension is a D-Graph component drawn uniformly among those with an op vertex;
- a sub-graph S is grown from a uniformly drawn op of that component by adding random graph
  neighbours that also run along it, up to a uniformly drawn size;
- it is kept when the F-Trans (S, D) passes the same validity check as Alg. 1's candidates
  (`magis.analyze.ftrans.check`: connected, convex, no redundant computation, mergeable outputs)
  and n = 2 divides its length, as Alg. 1 requires of its candidates.

The tree offers as many candidates as Alg. 1 would on the same graph (at least one per level),
so the ablation compares how candidates are chosen, not how many there are; they are spread over
the L levels in the order drawn and nested by S inclusion exactly like Alg. 1's (`nest_by_inclusion`). Score
and heat are 0: nothing was estimated. One seeded `random.Random` makes every draw.
"""

from __future__ import annotations

import random

from magis.analyze.dgraph import dgraph
from magis.analyze.ftrans import FTransInfo, Rejected, check, split_of_component, topo_positions
from magis.analyze.ftree import DEFAULT_MAX_LEVEL, FTree, FTreeNode, build_ftree, nest_by_inclusion
from magis.ir import Graph

ATTEMPTS_PER_CANDIDATE = 40  # random draws tried per candidate wanted before giving up


def naive_ftree(
    graph: Graph,
    max_level: int = DEFAULT_MAX_LEVEL,
    seed: int = 0,
    n: int = 2,
    count: int | None = None,
) -> FTree:
    """A random F-Tree with `count` valid candidates (default: as many as Alg. 1's tree of
    `graph` with the same L has, at least L), over L = `max_level` levels."""
    rng = random.Random(seed)
    if count is None:
        count = max(len(build_ftree(graph, max_level=max_level, n=n)), max_level)
    components = _op_components(graph)
    found: list[FTreeNode] = []
    seen: set[frozenset[int]] = set()
    for _ in range(count * ATTEMPTS_PER_CANDIDATE):
        if len(found) >= count or not components:
            break
        c = rng.choice(sorted(components))
        S = _convex_closure(graph, _grow(graph, components[c], rng), components[c])
        if S is None or S in seen:
            continue
        seen.add(S)
        info = _valid(graph, S, c, n)
        if info is None:
            continue
        level = 1 + len(found) * max_level // count
        label = graph.node(min(S)).name
        found.append(FTreeNode(info.ftrans, info.length, None, c, label, min(S), level, 0.0, 0.0))
    return FTree(nest_by_inclusion(found))


def _op_components(graph: Graph) -> dict[int, frozenset[int]]:
    """D-Graph component -> the ops with exactly one vertex in it (the nodes an F-Trans along
    it may contain: §4.2 (3), no redundant computation)."""
    dg = dgraph(graph)
    per_node: dict[tuple[int, int], int] = {}
    for v, c in zip(dg.vertex_node.tolist(), dg.component.tolist(), strict=True):
        if not graph.node(v).is_placeholder:
            per_node[(c, v)] = per_node.get((c, v), 0) + 1
    out: dict[int, set[int]] = {}
    for (c, v), k in per_node.items():
        if k == 1:
            out.setdefault(c, set()).add(v)
    return {c: frozenset(vs) for c, vs in out.items()}


def _grow(graph: Graph, allowed: frozenset[int], rng: random.Random) -> frozenset[int]:
    """A random weakly connected set of `allowed` nodes of a random size."""
    start = rng.choice(sorted(allowed))
    size = rng.randint(1, len(allowed))
    S = {start}
    frontier = _neighbours(graph, start, allowed)
    while len(S) < size and frontier:
        v = rng.choice(sorted(frontier))
        frontier.discard(v)
        S.add(v)
        frontier |= _neighbours(graph, v, allowed) - S
    return frozenset(S)


def _convex_closure(graph: Graph, S: frozenset[int], allowed: frozenset[int]):
    """S with every node on a path between two of its nodes (§4.2 (2) asks G[S] convex), or None
    when such a node does not run along the dimension."""
    pos = topo_positions(graph)
    first, last = min(pos[v] for v in S), max(pos[v] for v in S)
    below = _reach(S, graph.successors, lambda w: pos[w] <= last)
    above = _reach(S, graph.predecessors, lambda w: pos[w] >= first)
    between = (below & above) - S
    if not between <= allowed:
        return None
    return S | between


def _reach(S, step, keep) -> set[int]:
    seen: set[int] = set()
    stack = list(S)
    while stack:
        for w in step(stack.pop()):
            if w not in seen and keep(w):
                seen.add(w)
                stack.append(w)
    return seen


def _neighbours(graph: Graph, v: int, allowed: frozenset[int]) -> set[int]:
    return {w for w in (*graph.predecessors(v), *graph.successors(v)) if w in allowed}


def _valid(graph: Graph, S: frozenset[int], c: int, n: int) -> FTransInfo | None:
    f = split_of_component(graph, S, c)
    info = check(graph, f) if not isinstance(f, Rejected) else f
    if isinstance(info, Rejected) or info.length % n:
        return None
    return info
