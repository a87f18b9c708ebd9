"""Valid orders of a rewritten graph: where its new nodes go in the old schedule (MAGIS §6.1).

A rule's rewrite adds, changes or removes nodes; before the scheduler (Alg. 2) refines the
schedule, the search, the rules and the fuzzer need an order that respects the new graph's
edges and keeps the old nodes' relative order where it can. These helpers read only the graph,
so they live with it: the rules and the search both import them from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import rustworkx as rx

from magis.ir.graph import Graph


def place_after_inputs(graph: Graph, order: Sequence[int], new: Iterable[int]) -> list[int]:
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
            return stable_topological_order(graph, order)
        result.insert(at, nid)
    return result


def stable_topological_order(graph: Graph, order: Sequence[int]) -> list[int]:
    """A valid order that keeps the old nodes' relative order where dependencies allow (Kahn's
    algorithm by rank, rustworkx's lexicographical sort); a new node ranks just ahead of its
    earliest old user."""
    rank: dict[int, float] = {n: float(i) for i, n in enumerate(order) if n in graph}
    for n in sorted(set(graph.nodes) - set(rank), reverse=True):
        ahead = rank_ahead_of_users(graph, n, rank)
        rank[n] = float(len(order) + n) if ahead is None else ahead
    return sorted_by_rank(graph, rank)


def rank_ahead_of_users(graph: Graph, nid: int, rank: Mapping[int, float]) -> float | None:
    """A new node's rank in `stable_topological_order`: just ahead of its earliest ranked user
    (rank the later-made nodes first: they feed the earlier ones); None when none is ranked."""
    users = [rank[u] for u in graph.successors(nid) if u in rank]
    return min(users) - 0.5 if users else None


def sorted_by_rank(
    graph: Graph, rank: Mapping[int, float], nodes: Sequence[int] | None = None
) -> list[int]:
    """`nodes` (default: every node, all ranked) in a topological order of the edges among
    them, the ready node of the lowest (rank, id) first: equal ranks (new nodes ahead of one
    user) go by id, and ids grow in creation order."""
    dag = graph.dag if nodes is None else graph.dag.subgraph([graph.rx_index(n) for n in nodes])
    ranked = sorted(rank if nodes is None else nodes, key=lambda n: (rank[n], n))
    key = {n: f"{i:09d}" for i, n in enumerate(ranked)}
    return list(rx.lexicographical_topological_sort(dag, key=key.__getitem__))


def control_followers(graph: Graph, nid: int) -> list[int]:
    """The nodes that must run after `nid` through a control dependency, in id order: read
    off `nid`'s successors (a rewrite asks this for each node it replaces, and a scan of every
    node cost 5 ms a child on a 100,000-node step)."""
    return sorted(a for a in graph.successors(nid) if nid in graph.control_deps(a))


def carry_control_deps(graph: Graph, old: int, new: Iterable[int]) -> None:
    """The nodes `new`, made in place of `old` by a rewrite, run after what `old` had to run
    after, and before what had to run after `old` (a joint graph's backward waits for its
    forward through such edges: `magis.capture.joint`)."""
    followers = control_followers(graph, old)
    for nid in new:
        for before in graph.control_deps(old):
            graph.add_control_dep(before, nid)
        for after in followers:
            graph.add_control_dep(nid, after)
