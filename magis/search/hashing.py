"""Weisfeiler-Lehman graph hashing, incremental (MAGIS Alg. 3 lines 5-8).

A node's level-0 label hashes its op, constants and output metadata; level i+1 hashes its level-i
label with its inputs' level-i labels (in argument order) and its users' (as a multiset). The
graph's hash is the sum of the final labels modulo 2^64 — a multiset hash, so a rewrite updates it
by recomputing only the nodes within `LEVELS` hops of what it touched. Hashing took 75% of the
paper's search time (Fig. 15); this is why it is incremental here.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from magis.ir import DerivedKey, Graph, Ref

LEVELS = 3
_MASK = (1 << 64) - 1


def _h(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _base_label(graph: Graph, nid: int, memo: dict) -> int:
    """The node's level-0 label. `memo`: labels by what they hash, for one hashing of many
    nodes (a split's parts repeat one another: 42,000 nodes, 210 distinct labels). Its key
    holds the constants and keyword arguments as their repr, which the label hashes, so two
    constants that compare equal but print differently (1 and 1.0) keep their own labels."""
    node = graph.node(nid)
    consts = repr(tuple(a for a in node.args if not _is_ref_like(a)))
    kind, writes = node.placeholder_kind, node.writes_into is not None
    key = (node.op, consts, repr(node.kwargs), node.outputs, kind, writes)
    label = memo.get(key)
    if label is None:
        label = memo[key] = _h(node.op, consts, node.kwargs, node.outputs, kind, writes)
    return label


def _is_ref_like(a) -> bool:
    if isinstance(a, Ref):
        return True
    return isinstance(a, list | tuple) and any(isinstance(x, Ref) for x in a)


class Labels:
    """One level's label of every node of one graph version: a dict shared with the versions
    it was derived from, and this version's own changes (None: the node is gone). A search
    keeps thousands of versions, each a few changes away from its parent; copying every level
    of every version cost more than hashing the changes. The changes are folded into a new
    shared dict once they are more than a sixteenth of it."""

    __slots__ = ("_flat", "_delta")

    def __init__(self, flat: dict[int, int], delta: dict[int, int | None] | None = None) -> None:
        self._flat = flat
        self._delta = delta if delta is not None else {}

    def __getitem__(self, nid: int) -> int:
        delta = self._delta
        if nid in delta:
            value = delta[nid]
            if value is None:
                raise KeyError(nid)
            return value
        return self._flat[nid]

    def __contains__(self, nid: int) -> bool:
        delta = self._delta
        if nid in delta:
            return delta[nid] is not None
        return nid in self._flat

    def readable(self) -> Mapping[int, int]:
        """A mapping to read the labels from: the shared dict itself when this version has no
        changes of its own (a fission child refolds them: its level-ups then read a plain
        dict, not this class's `__getitem__`)."""
        return self if self._delta else self._flat

    def updated(self, changes: dict[int, int | None]) -> Labels:
        """These labels with `changes` applied (None removes a node)."""
        delta = {**self._delta, **changes}
        if len(delta) <= max(64, len(self._flat) >> 4):
            return Labels(self._flat, delta)
        flat = dict(self._flat)
        for nid, value in delta.items():
            if value is None:
                flat.pop(nid, None)
            else:
                flat[nid] = value
        return Labels(flat)


@dataclass(frozen=True)
class GraphHash:
    """Per-node labels at every level, and the graph's hash."""

    labels: tuple[Labels, ...]  # level -> node -> label
    value: int

    def __int__(self) -> int:
        return self.value


def _level_up(graph: Graph, prev, nid: int) -> int:
    # A digest of the labels packed as 64-bit words (the input count keeps it unambiguous),
    # not of their repr, which cost three times the digest. Not Python's tuple hash either:
    # with it, a 60-state vit-base search counted two more "duplicates", distinct graphs.
    node = graph.node(nid)
    words = [prev[nid], len(node.inputs)]
    for r in node.inputs:
        words.append(r.index)
        words.append(prev[r.node])
    words.extend(sorted([prev[u] for u in graph.successors(nid)]))
    digest = hashlib.blake2b(array("Q", words).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


_HASH: DerivedKey[GraphHash] = DerivedKey("search.wl_hash")


def graph_hash(graph: Graph) -> GraphHash:
    """`wl_hash(graph)`, kept with the graph version (a lineage's base is hashed once)."""
    return graph.derived(_HASH, lambda: wl_hash(graph))


def wl_hash(graph: Graph) -> GraphHash:
    memo: dict = {}
    labels = [{n: _base_label(graph, n, memo) for n in graph.nodes}]
    for _ in range(LEVELS):
        prev = labels[-1]
        labels.append({n: _level_up(graph, prev, n) for n in graph.nodes})
    value = sum(labels[-1].values()) & _MASK
    return GraphHash(tuple(Labels(level) for level in labels), value)


def neighbours(graph: Graph, nodes: Iterable[int]) -> set[int]:
    """The nodes (those still in `graph`) and their predecessors and successors."""
    out: set[int] = set()
    for n in nodes:
        if n in graph:
            out.add(n)
            out.update(graph.predecessors(n))
            out.update(graph.successors(n))
    return out


def wl_hash_incremental(
    old: GraphHash,
    old_graph: Graph,
    graph: Graph,
    touched: Iterable[int],
    removed: Iterable[int] = (),
) -> GraphHash:
    """The hash of `graph`, a rewrite of `old_graph` (hashed as `old`) that added or changed
    `touched` and dropped `removed`: only labels within LEVELS hops of those are recomputed,
    and the sum is updated by the labels that changed (modulo 2^64, as `wl_hash` sums)."""
    removed = set(removed)
    touched = set(touched)
    # The nodes whose edges changed: the touched ones and their neighbours before and after
    # (a changed node's former inputs lost a user, a new node's inputs gained one), and a
    # removed node's former neighbours.
    dirty = {
        n
        for n in neighbours(old_graph, touched | removed) | neighbours(graph, touched) | touched
        if n in graph
    }
    gone: dict[int, int | None] = dict.fromkeys(removed)
    # A level-0 label is the node's own: only nodes that are not the parent's Node objects
    # get a new one (the others are dirty for their edges, from level 1 on).
    memo: dict = {}
    relabel = {
        n: _base_label(graph, n, memo)
        for n in dirty
        if n not in old_graph or graph.node(n) is not old_graph.node(n)
    }
    labels = [old.labels[0].updated({**gone, **relabel})]
    # A level-i label changes only where the edges changed or a level-(i-1) label in reach
    # changed: level 1 is redone on the dirty nodes and the relabelled ones' neighbours (those
    # of touched nodes are dirty already), and each further level one ring wider (the last
    # ring of level i-1 adds its neighbours).
    frontier = dirty | neighbours(graph, relabel.keys() - touched)
    ring = frontier - set(relabel)
    for level in range(1, LEVELS + 1):
        if level > 1:
            grown = neighbours(graph, ring)
            ring = grown - frontier
            frontier = frontier | grown
        prev = labels[-1].readable()
        changes = {n: _level_up(graph, prev, n) for n in frontier}
        labels.append(old.labels[level].updated({**gone, **changes}))
    last = old.labels[-1]
    before = sum(last[n] for n in removed | frontier if n in last)
    value = (old.value - before + sum(changes.values())) & _MASK
    return GraphHash(tuple(labels), value)
