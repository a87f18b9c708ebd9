"""Weisfeiler-Lehman graph hashing, incremental (MAGIS Alg. 3 lines 5-8).

A node's level-0 label hashes its op, constants and output metadata; level i+1 hashes its level-i
label with its inputs' level-i labels (in argument order) and its users' (as a multiset). The
graph's hash is the sum of the final labels modulo 2^64 — a multiset hash, so a rewrite updates it
by recomputing only the nodes within `LEVELS` hops of what it touched. Hashing took 75% of the
paper's search time (Fig. 15); this is why it is incremental here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from itertools import chain

import numpy as np

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


# The level-up's mixing: splitmix64's finalizer (a bijection of 64-bit words with full
# avalanche), and odd salts that set apart a node's own label, its input count, each input's
# argument position and output index, and its users.
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_COUNT, _POSITION, _INDEX, _USER = (
    0x9E3779B97F4A7C15,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0xD6E8FEB86659FD93,
)
# Frontiers at least this large are levelled up as arrays (`_level_up_many`); below it, node
# by node (numpy's call overhead is larger than the work).
ARRAY_FRONTIER = 128


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _mix_array(z: np.ndarray) -> np.ndarray:
    """`_mix` of every word of a uint64 array (its products wrap modulo 2^64 as `_mix`'s)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def _level_up(graph: Graph, prev, nid: int) -> int:
    """The node's next label: its own, its input count, each input's label salted by its
    argument position and output index (inputs are ordered), and its users' labels (a
    multiset: summed), mixed. Arithmetic rather than a digest of the labels' bytes, so that
    a whole frontier levels up as arrays (`_level_up_many`) to the same labels: a split
    decoder's 42,000 nodes took 0.2 s a level as digests."""
    node = graph.node(nid)
    total = prev[nid] + _COUNT * len(node.inputs)
    for j, r in enumerate(node.inputs, 1):
        total += _mix((prev[r.node] + _POSITION * j + _INDEX * r.index) & _MASK)
    for u in graph.successors(nid):
        total += _mix(prev[u] ^ _USER)
    return _mix(total & _MASK)


def _segment_sums(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sums of consecutive runs of `values`, `counts` long each, modulo 2^64."""
    ends = np.cumsum(counts)
    prefix = np.concatenate([np.zeros(1, np.uint64), np.cumsum(values, dtype=np.uint64)])
    return prefix[ends] - prefix[ends - counts]


class _Rows:
    """Nodes levelled up as arrays (`_level_up` of each, the same labels): their inputs and
    users read once as positions in `among` (the rows first, then every node they read), for
    every level of one hashing."""

    def __init__(self, graph: Graph, rows: list[int]) -> None:
        inputs = [graph.node(n).inputs for n in rows]
        users = [graph.successors(n) for n in rows]
        refs = [r for rs in inputs for r in rs]
        self.in_counts = np.fromiter(map(len, inputs), dtype=np.int64, count=len(rows))
        self.counted = np.uint64(_COUNT) * self.in_counts.astype(np.uint64)  # every level's
        self.user_counts = np.fromiter(map(len, users), dtype=np.int64, count=len(rows))
        read = np.fromiter((r.node for r in refs), dtype=np.int64, count=len(refs))
        used = np.fromiter(chain.from_iterable(users), dtype=np.int64, count=-1)
        # node id -> position in `among`: the rows first, then the other nodes they read
        where = np.full(graph.next_id, -1, dtype=np.int64)
        where[np.asarray(rows, dtype=np.int64)] = np.arange(len(rows))
        both = np.concatenate([read, used])
        others = np.unique(both[where[both] < 0])
        where[others] = np.arange(len(rows), len(rows) + len(others))
        self.rows, self.among = rows, rows + others.tolist()
        self.in_at, self.user_at = where[read], where[used]
        # each input's argument position (from 1) and output index, as `_level_up` salts them
        starts = np.repeat(np.cumsum(self.in_counts) - self.in_counts, self.in_counts)
        position = (np.arange(len(refs)) - starts + 1).astype(np.uint64)
        index = np.fromiter((r.index for r in refs), dtype=np.uint64, count=len(refs))
        self.salts = np.uint64(_POSITION) * position + np.uint64(_INDEX) * index

    def level_up(self, prev) -> list[int]:
        """The rows' next labels, `prev` (node -> label) holding every node of `among`."""
        labels = np.fromiter((prev[n] for n in self.among), dtype=np.uint64, count=len(self.among))
        total = labels[: len(self.rows)] + self.counted
        total += _segment_sums(_mix_array(labels[self.in_at] + self.salts), self.in_counts)
        users = _mix_array(labels[self.user_at] ^ np.uint64(_USER))
        total += _segment_sums(users, self.user_counts)
        return _mix_array(total).tolist()


def _level(graph: Graph, prev, nodes: Collection[int], rows: _Rows | None) -> dict[int, int]:
    """Node -> next label for `nodes` (all of `rows`' rows, or a set of some of them): as
    arrays where `rows` holds them, else node by node."""
    if rows is None:
        return {n: _level_up(graph, prev, n) for n in nodes}
    labels = rows.level_up(prev)
    if len(nodes) == len(rows.rows):
        return dict(zip(rows.rows, labels, strict=True))
    return {n: x for n, x in zip(rows.rows, labels, strict=True) if n in nodes}


_HASH: DerivedKey[GraphHash] = DerivedKey("search.wl_hash")


def graph_hash(graph: Graph) -> GraphHash:
    """`wl_hash(graph)`, kept with the graph version (a lineage's base is hashed once)."""
    return graph.derived(_HASH, lambda: wl_hash(graph))


def wl_hash(graph: Graph) -> GraphHash:
    memo: dict = {}
    labels = [{n: _base_label(graph, n, memo) for n in graph.nodes}]
    nodes = list(graph.nodes)
    rows = _Rows(graph, nodes) if len(nodes) >= ARRAY_FRONTIER else None
    for _ in range(LEVELS):
        labels.append(_level(graph, labels[-1], nodes, rows))
    value = sum(labels[-1].values()) & _MASK
    return GraphHash(tuple(Labels(level) for level in labels), value)


def _frontiers(graph: Graph, first: set[int], relabelled: Mapping[int, int]) -> list[set[int]]:
    """The nodes whose label may change at each level from 1 on: `first` at level 1, and
    each further level one ring wider (the last ring of the level before adds its
    neighbours; the relabelled nodes' own ring is the first level's)."""
    frontiers = [first]
    ring = first - set(relabelled)
    for _ in range(1, LEVELS):
        grown = neighbours(graph, ring)
        ring = grown - frontiers[-1]
        frontiers.append(frontiers[-1] | grown)
    return frontiers


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
    frontiers = _frontiers(graph, dirty | neighbours(graph, relabel.keys() - touched), relabel)
    widest = frontiers[-1]
    rows = _Rows(graph, list(widest)) if len(widest) >= ARRAY_FRONTIER else None
    for level, frontier in enumerate(frontiers, 1):
        changes = _level(graph, labels[-1].readable(), frontier, rows)
        labels.append(old.labels[level].updated({**gone, **changes}))
    frontier = widest
    last = old.labels[-1]
    before = sum(last[n] for n in removed | frontier if n in last)
    value = (old.value - before + sum(changes.values())) & _MASK
    return GraphHash(tuple(labels), value)
