"""The one contract every rewrite rule follows (MAGIS §5, STYLE habits 3-4).

A `Rule` is data: a name, a kind, and a `match` function that, given the current state
(`RuleContext`), yields lazy `Rewrite`s. A rewrite's `build()` produces the new graph only when
the search decides to evaluate it, and says which nodes it added or changed — what incremental
scheduling (Alg. 2) and incremental hashing need. Rules never edit the graph they match on.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

from magis.ir import Graph
from magis.sim import SimResult


class RuleKind(enum.Enum):
    TASO = "taso"
    FISSION = "fission"
    REMAT = "remat"
    DEREMAT = "deremat"
    SWAP = "swap"
    DESWAP = "deswap"
    COMPACT = "compact"
    DECOMPACT = "decompact"


@dataclass(frozen=True)
class RuleContext:
    """What a rule may look at: the graph, its schedule and that schedule's simulation.

    `frozen` holds the nodes of enabled F-Tree regions: no rule matches across their boundary
    (MAGIS §3). `hotspots_only` is heuristic H2 (§5.2): re-materialization and swapping only
    for tensors among the memory hot-spots.
    """

    graph: Graph
    order: tuple[int, ...]
    sim: SimResult
    frozen: frozenset[int] = frozenset()
    hotspots_only: bool = True
    max_candidates: int = 16

    @cached_property
    def position(self) -> dict[int, int]:
        """Node -> step of `order`; built once per context (every hot storage's candidate
        generation reads it, thousands of times per search)."""
        return {nid: i for i, nid in enumerate(self.order)}


@dataclass(frozen=True)
class Rewritten:
    """A rewrite's result: the new graph and the nodes it added, changed or removed."""

    graph: Graph
    added: frozenset[int]
    changed: frozenset[int] = frozenset()
    removed: frozenset[int] = frozenset()
    # Where the added nodes belong when the rule knows it: right before this node of the old
    # schedule, in id order (ids grow in creation order, which is topological). Re-
    # materialization and swapping know it (the first late reader); the scheduler may use the
    # hint instead of re-solving (search/optimizer.py says when).
    anchor: int | None = None
    # Or, for a rewrite that replaces nodes by others (an op split in two, or two merged):
    # (old nodes, new nodes) pairs, the new nodes in this order where the first of the old ran.
    in_place_of: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()

    @property
    def touched(self) -> frozenset[int]:
        """Nodes of the new graph whose position or inputs the rewrite decided (Alg. 2's input)."""
        return self.added | self.changed


@dataclass(frozen=True)
class Rewrite:
    rule: str
    kind: RuleKind
    description: str
    build: Callable[[], Rewritten] = field(compare=False)


@dataclass(frozen=True)
class Rule:
    name: str
    kind: RuleKind
    match: Callable[[RuleContext], Iterator[Rewrite]]


def node_rewrites(
    ctx: RuleContext,
    rule: str,
    kind: RuleKind,
    accepts: Callable[[int], bool],
    describe: Callable[[int], str],
    build: Callable[[int], Rewritten],
    nodes: Iterable[int] | None = None,
) -> Iterator[Rewrite]:
    """One rewrite per node that `accepts` (outside frozen regions), in schedule order (or in
    the order of `nodes`), at most `ctx.max_candidates`: the shape of the rules that rewrite
    one node, and of the duals that undo one node's rewrite."""
    emitted = 0
    for nid in ctx.order if nodes is None else nodes:
        if emitted >= ctx.max_candidates:
            return
        if nid in ctx.frozen or not accepts(nid):
            continue
        yield Rewrite(rule, kind, describe(nid), lambda n=nid: build(n))
        emitted += 1


def candidates(rules: Iterable[Rule], ctx: RuleContext) -> Iterator[Rewrite]:
    """Every rule's rewrites, rule by rule (lazy: nothing is built)."""
    for rule in rules:
        yield from rule.match(ctx)


def place_after_inputs(graph: Graph, order: list[int], new: Iterable[int]) -> list[int]:
    """`order` with each new node inserted as late as possible: right before its first user, or
    after its last predecessor when nothing uses it yet. A cheap, valid placement that the
    scheduler refines; used where no better one is asked for (tests, the first guess)."""
    result = [n for n in order if n in graph]
    for nid in sorted(new, key=lambda n: -n):  # later-added nodes first: they feed earlier ones
        if nid in result:
            continue
        pos = {n: i for i, n in enumerate(result)}
        users = [pos[u] for u in graph.successors(nid) if u in pos]
        preds = [pos[p] for p in graph.predecessors(nid) if p in pos]
        at = min(users) if users else (max(preds) + 1 if preds else 0)
        if preds and at <= max(preds):  # no room between its inputs and its users
            return _stable_topological(graph, order)
        result.insert(at, nid)
    return result


def _stable_topological(graph: Graph, order: list[int]) -> list[int]:
    """A valid order that keeps the old nodes' relative order (Kahn's algorithm by rank); a new
    node ranks just ahead of its earliest old user."""
    rank: dict[int, float] = {n: float(i) for i, n in enumerate(order) if n in graph}
    for n in sorted(set(graph.nodes) - set(rank), reverse=True):
        users = [rank[u] for u in graph.successors(n) if u in rank]
        rank[n] = min(users) - 0.5 if users else float(len(order) + n)
    indegree = {n: len(graph.predecessors(n)) for n in graph.nodes}
    heap = [(rank[n], n) for n, d in indegree.items() if d == 0]
    heapq.heapify(heap)
    result = []
    while heap:
        _, n = heapq.heappop(heap)
        result.append(n)
        for s in graph.successors(n):
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(heap, (rank[s], s))
    return result
