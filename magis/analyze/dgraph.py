"""The Dimension Graph (MAGIS §4.1) and its connected components.

For every node v and every axis i of v that fission could split, there is a vertex <v, i>; for
every edge (u, v) of the graph, an edge joins <u, i> and <v, j> when dimension i of the value u
passes to v is the dimension v's call runs along axis j (`magis.ir.dims`). A connected component
is one graph-level "dimension" (the batch, the heads, the hidden size ...) running through many
ops; an F-Trans splits a sub-graph along one (§4.2).

Which vertices exist (decisions):

- op nodes: their splittable axes (`OpDims.splittable`) of length >= 2 — an axis of length 1 cannot
  be split, and a non-splittable axis (a convolution's output height) is no vertex, so the
  dimension downstream of it begins there, with the convolution's output as a sliced input;
- placeholders: every dimension of length >= 2 (slicing an input is a view);
- no vertices for ops without a rule, random ops (a split would reorder the RNG draws) and nodes
  that write into a placeholder (the optimizer's in-place updates): fission stops there.

Vertices are numbered in program order of their nodes, then by axis; components are numbered by
their first vertex. Everything is computed once per graph version (`Graph.derived`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from magis.ir import DerivedKey, Graph, Ref
from magis.ir.dims import OpDims, op_dims, placeholder_dims
from magis.ir.graph import refs_in

_DIMS: DerivedKey[LazyDims] = DerivedKey("fission.dims")
_DGRAPH: DerivedKey[DGraph] = DerivedKey("fission.dgraph")


def node_dims(graph: Graph) -> Mapping[int, OpDims]:
    """The dimension rule's answer for every node that has one (cached per graph version).

    Computed per node on first access: validating one F-Trans on a fresh graph version (every
    fission move in the search) needs the dims of S's nodes only, not of the whole graph."""
    return graph.derived(_DIMS, lambda: LazyDims(graph))


class LazyDims(Mapping):
    """node id -> OpDims, for the nodes that have a dimension rule, each computed when asked."""

    def __init__(self, graph: Graph) -> None:
        self._graph = graph
        self._memo: dict[int, OpDims | None] = {}
        # A rule's answer is a function of the op, its arguments' metas and its outputs: an
        # unrolled loop (Mamba's scan: 24 layers x 124 steps of the same ops) asks the same
        # question thousands of times, 3 s of the D-Graph of a 100,000-node step.
        self._by_call: dict[tuple, OpDims | None] = {}
        self._all: list[int] | None = None

    def _dims(self, nid: int) -> OpDims | None:
        if nid not in self._memo:
            self._memo[nid] = self._answer(nid) if nid in self._graph else None
        return self._memo[nid]

    def _answer(self, nid: int) -> OpDims | None:
        graph = self._graph
        node = graph.node(nid)
        if node.is_placeholder:
            return placeholder_dims(node.outputs[0])
        if node.writes_into is not None or graph.info(nid).is_random:
            return None
        args, kwargs = graph.meta_args(nid)
        key = (node.op, args, tuple(kwargs.items()), node.outputs)
        try:
            hash(key)
        except TypeError:  # an unhashable argument (a list): asked, not kept
            return op_dims(node.op, args, kwargs, node.outputs)
        if key not in self._by_call:
            self._by_call[key] = op_dims(node.op, args, kwargs, node.outputs)
        return self._by_call[key]

    def __getitem__(self, nid: int) -> OpDims:
        d = self._dims(nid)
        if d is None:
            raise KeyError(nid)
        return d

    def __contains__(self, nid: object) -> bool:
        return isinstance(nid, int) and self._dims(nid) is not None

    def _nodes(self) -> list[int]:
        if self._all is None:
            order = self._graph.program_order()
            self._all = [n for n in order if self._dims(n) is not None]
        return self._all

    def __iter__(self) -> Iterator[int]:
        return iter(self._nodes())

    def __len__(self) -> int:
        return len(self._nodes())


def has_vertex(graph: Graph, nid: int, axis: int) -> bool:
    """Whether <nid, axis> is a D-Graph vertex, without building the D-Graph (see `_vertices`)."""
    d = node_dims(graph).get(nid)
    if d is None or not 0 <= axis < len(d.lengths) or d.lengths[axis] < 2:
        return False
    return graph.node(nid).is_placeholder or axis in d.splittable


def slot_refs(graph: Graph, nid: int) -> list[Ref]:
    """The Refs a node reads, one per tensor argument slot, in `OpDims.inputs` order."""
    node = graph.node(nid)
    return [*refs_in(node.args), *refs_in([v for _, v in node.kwargs])]


class UnionFind:
    """Disjoint sets over 0..n-1 with path halving and union by size."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))
        self.size = [1] * n

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if self.size[ra] < self.size[rb]:
            ra, rb = rb, ra
        self.parent[rb] = ra
        self.size[ra] += self.size[rb]

    def labels(self) -> np.ndarray:
        return np.array([self.find(x) for x in range(len(self.parent))], dtype=np.int64)


@dataclass(frozen=True)
class DGraph:
    """D-Graph of one graph version: vertices <node, axis>, edges, connected components."""

    vertex_node: np.ndarray  # vertex -> node id
    vertex_axis: np.ndarray  # vertex -> axis of that node's call
    index: dict[tuple[int, int], int]  # (node, axis) -> vertex
    edges: np.ndarray  # (E, 2) vertex pairs, producer side first
    component: np.ndarray  # vertex -> component number

    @property
    def n_components(self) -> int:
        return int(self.component.max()) + 1 if len(self.component) else 0

    def components(self) -> Iterator[np.ndarray]:
        """Vertices of each component, components in order of their first vertex."""
        order = np.argsort(self.component, kind="stable")
        bounds = np.searchsorted(self.component[order], np.arange(self.n_components + 1))
        for c in range(self.n_components):
            yield order[bounds[c] : bounds[c + 1]]

    def vertex(self, node: int, axis: int) -> int | None:
        return self.index.get((node, axis))

    def component_of(self, node: int, axis: int) -> int | None:
        v = self.index.get((node, axis))
        return None if v is None else int(self.component[v])


def dgraph(graph: Graph) -> DGraph:
    """The D-Graph of `graph` (cached per graph version)."""
    return graph.derived(_DGRAPH, lambda: _build(graph))


def _vertices(graph: Graph, dims: dict[int, OpDims]) -> list[tuple[int, int]]:
    verts = []
    for nid in graph.program_order():
        d = dims.get(nid)
        if d is None:
            continue
        axes = range(len(d.lengths)) if graph.node(nid).is_placeholder else sorted(d.splittable)
        verts.extend((nid, a) for a in axes if d.lengths[a] >= 2)
    return verts


def _build(graph: Graph) -> DGraph:
    dims = node_dims(graph)
    verts = _vertices(graph, dims)
    index = {v: i for i, v in enumerate(verts)}
    edges = []
    for nid, d in dims.items():
        if graph.node(nid).is_placeholder:
            continue
        for j, ref in enumerate(slot_refs(graph, nid)):
            src = dims.get(ref.node)
            if src is None:
                continue
            for dim, axis in enumerate(d.inputs[j]):
                dst = index.get((nid, axis)) if axis is not None else None
                src_axis = src.outputs[ref.index][dim] if dst is not None else None
                sv = index.get((ref.node, src_axis)) if src_axis is not None else None
                if sv is not None:
                    edges.append((sv, dst))
    uf = UnionFind(len(verts))
    for a, b in edges:
        uf.union(a, b)
    roots = uf.labels()
    # number components by their first vertex: deterministic, in program order
    _, first = np.unique(roots, return_index=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first)] = np.arange(len(first))
    comp = rank[np.searchsorted(np.unique(roots), roots)] if len(verts) else roots
    return DGraph(
        vertex_node=np.array([v[0] for v in verts], dtype=np.int64),
        vertex_axis=np.array([v[1] for v in verts], dtype=np.int64),
        index=index,
        edges=np.array(edges, dtype=np.int64).reshape(-1, 2),
        component=comp,
    )
