"""Dominator trees (MAGIS §2.1, §4.3) of a sub-graph, with the queries Alg. 1 needs.

"A computation graph usually has many input nodes (input tensor, label tensor, and weight
tensors), so the dominator tree we use here usually takes the input tensor as the entry" (§2.1).
Decisions:

- the entry is the model's data input (the first DATA placeholder) when the sub-graph contains
  it; paths from other inputs (labels, weights: footnote 3) are ignored, as the reference MAGIS
  does, and nodes it does not reach are left out of the tree;
- a sub-graph without it (a dimension that starts behind a batch norm, a weight dimension) gets a
  virtual entry joined to its computed sources, so that, as with the data input, paths from
  other inputs (the labels) are ignored; joined to all its sources when every one is an input (a
  weight dimension). The virtual entry is no node of the graph; as a dominator (Alg. 1's v_dom)
  its sub-graph is the whole sub-graph, as the data input's is. (Joined to the labels too, the
  loss block of a re-analysed decoder — its log-softmax, NLL and their backward, 3 x 781 MiB on
  Bloom — had two entries, the logits and the labels, and no dominator but the virtual one.)

The tree is laid out for subtree queries: `order` is a preorder (DFS) numbering, so the
descendants of v are the preorder interval [tin[v], tout[v]], and subtree sums are differences of
prefix sums. `lca` is vectorized binary lifting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import rustworkx as rx

from magis.ir import DerivedKey, Graph, PlaceholderKind

VIRTUAL = -1  # node id of the virtual entry


@dataclass(frozen=True)
class DomTree:
    """T(G') over tree positions 0..m-1; `nodes[i]` is the graph node (or VIRTUAL) at i."""

    nodes: np.ndarray  # tree index -> node id, in preorder (index 0 is the entry)
    parent: np.ndarray  # tree index -> parent's tree index (-1 for the entry)
    depth: np.ndarray
    tout: np.ndarray  # last preorder index in the subtree (tin is the index itself)
    up: np.ndarray  # (levels, m) binary-lifting ancestors

    @property
    def size(self) -> int:
        return len(self.nodes)

    def position(self) -> dict[int, int]:
        return {int(n): i for i, n in enumerate(self.nodes)}

    def descendants(self, i: int) -> np.ndarray:
        """Tree indices of v's subtree, v included (T.des(v) ∪ {v})."""
        return np.arange(i, int(self.tout[i]) + 1)

    def subtree_sums(self, weights: np.ndarray) -> np.ndarray:
        """For every v, the sum of `weights` (indexed by tree index) over v's subtree."""
        cs = np.concatenate([[0], np.cumsum(weights)])
        idx = np.arange(self.size)
        return cs[self.tout + 1] - cs[idx]

    def lca(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Lowest common ancestors of the pairs (a[i], b[i]), vectorized."""
        a, b = a.copy(), b.copy()
        swap = self.depth[a] < self.depth[b]
        a[swap], b[swap] = b[swap], a[swap]
        diff = self.depth[a] - self.depth[b]
        for k in range(len(self.up)):
            move = (diff >> k) & 1 == 1
            a[move] = self.up[k][a[move]]
        for k in reversed(range(len(self.up))):
            ua, ub = self.up[k][a], self.up[k][b]
            differ = ua != ub
            a[differ], b[differ] = ua[differ], ub[differ]
        same = a == b
        return np.where(same, a, self.up[0][a])


def entry_of(graph: Graph, nodes: Sequence[int]) -> int:
    """The data input if `nodes` contains it, else VIRTUAL."""
    data = graph.placeholders(PlaceholderKind.DATA)
    if data and data[0] in set(nodes):
        return data[0]
    return VIRTUAL


def dominator_tree(graph: Graph, nodes: Sequence[int], entry: int | None = None) -> DomTree:
    """T(G[nodes]) with `entry` (default `entry_of`), nodes unreachable from it left out."""
    entry = entry_of(graph, nodes) if entry is None else entry
    sub, payload = _subgraph(graph, nodes, entry)
    start = payload.index(entry)
    idom = rx.immediate_dominators(sub, start)
    rank = _rank(graph)
    children: dict[int, list[int]] = {}
    for v, d in sorted(idom.items(), key=lambda vd: rank.get(payload[vd[0]], -1)):
        if v != start:
            children.setdefault(d, []).append(v)  # children in program order: deterministic
    return _layout(start, children, payload)


def _subgraph(graph: Graph, nodes: Sequence[int], entry: int) -> tuple[rx.PyDiGraph, list[int]]:
    """G[nodes] in program order (the virtual entry first, joined to every source)."""
    ix = [graph.rx_index(v) for v in nodes]
    sub = graph.dag.subgraph(ix)  # payloads are node ids
    payload = [sub[i] for i in sub.node_indices()]
    if entry == VIRTUAL:
        root = sub.add_node(VIRTUAL)
        sources = [i for i in sub.node_indices() if i != root and sub.in_degree(i) == 0]
        computed = [i for i in sources if not graph.node(sub[i]).is_placeholder]
        sub.add_edges_from_no_data([(root, s) for s in computed or sources])
        payload.append(VIRTUAL)
    return sub, payload


_RANK: DerivedKey[dict[int, int]] = DerivedKey("dom.rank")


def _rank(graph: Graph) -> dict[int, int]:
    return graph.derived(_RANK, lambda: {n: i for i, n in enumerate(graph.program_order())})


def _layout(start: int, children: dict[int, list[int]], payload: list[int]) -> DomTree:
    """Preorder numbering (children in program order), depths and binary-lifting tables."""
    order, parent_of, stack = [], {start: -1}, [start]
    while stack:
        v = stack.pop()
        order.append(v)
        kids = children.get(v, [])
        for c in kids:
            parent_of[c] = v
        stack.extend(reversed(kids))
    pos = {v: i for i, v in enumerate(order)}
    m = len(order)
    parent = np.array([pos[parent_of[v]] if parent_of[v] >= 0 else -1 for v in order])
    depth = np.zeros(m, dtype=np.int64)
    tout = np.arange(m, dtype=np.int64)
    for i in range(1, m):
        depth[i] = depth[parent[i]] + 1
    for i in range(m - 1, 0, -1):  # children come after their parent in preorder
        tout[parent[i]] = max(tout[parent[i]], tout[i])
    levels = max(1, int(depth.max()).bit_length()) if m else 1
    up = np.zeros((levels, m), dtype=np.int64)
    up[0] = np.where(parent < 0, 0, parent)
    for k in range(1, levels):
        up[k] = up[k - 1][up[k - 1]]
    nodes = np.array([payload[v] for v in order], dtype=np.int64)
    return DomTree(nodes, parent.astype(np.int64), depth, tout, up)
