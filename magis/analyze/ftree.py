"""The fission hierarchy tree (MAGIS §4.3): memory heat (Eq. 3), score (Eq. 4), Algorithm 1.

For each connected component D of the D-Graph, Algorithm 1 takes the sub-graph G' of the nodes D
runs through, its dominator tree T, and scores every node v by the peak-memory reduction expected
from splitting the sub-graph v dominates into n = 2 parts:

    heat(v)  = sum of |w| over hot-spots w in T.des(v)                              (Eq. 3)
    score(v) = (1 - 1/n) heat(v) - sum of |u| over u in G.inps(T.des(v)) \\ H        (Eq. 4)

It cuts [0, 1] into L intervals of normalized score s[v] / s_max and, in each, takes the nodes with
no descendant in the same interval as dominators v_dom; S = T.des(v_dom) \\ {v_dom} split along
D restricted to S is a candidate, kept when valid (§4.2, `magis.analyze.ftrans`). Candidates nest
(a dominator subtree inside another): the F-Tree's parent of a node is the smallest other
candidate whose S contains its S.

Decisions, in bytes throughout:

- hot-spots H are storages (§2.1 "tensors"; MAGIS counts storages, so do we), live at the peak of
  the given schedule (`magis.sim.simulate`); a storage counts toward heat(v) when the node that
  allocates it is in T.des(v) (T.des(v) includes v, as the worked example of Fig. 6 requires:
  heat of the entry 12 = its own hot-spot + 11 below it);
- the input term counts each storage once, and not when it is resident (weights, optimizer
  state, data: in memory before and after the split, so splitting does not add them — footnote
  3's weight inputs cost nothing) or already hot;
- S leaves out placeholders (only a virtual entry's subtree has any: they are inputs, sliced or
  shared, never split);
- a candidate is kept when valid and the score's n divides its length: Eq. 4 estimates the
  reduction for that n, and the mutation rules start from it (ViT's 197 tokens are prime);
- the F-Tree lists the candidates of every component, each node with its score and level (the
  interval index i), all with n = 1 (disabled);
- each candidate is grown over its border while that shrinks the whole tensors at it
  (`grown_over_boundary`, our extension): a loss block takes in the LM head's `mm` and its
  weight gradient, so that no [tokens x vocabulary] tensor is made whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import rustworkx as rx

from magis.analyze.dgraph import dgraph, node_dims
from magis.analyze.dominators import VIRTUAL, DomTree, dominator_tree
from magis.analyze.ftrans import (
    FTrans,
    Rejected,
)
from magis.analyze.regions import checked_split, grown_by_gain, grown_over_boundary, piece_score
from magis.ir import Graph, PlaceholderKind, Ref

DEFAULT_MAX_LEVEL = 4


def memory_hotspots(
    graph: Graph, order: list[int] | None = None, near_peak: float = 0.0
) -> frozenset[Ref]:
    """H (§2.1): the storages live at a step where the peak is reached, under `order`; with
    `near_peak`, at a step within that fraction of the peak (`sim.near_peak_storages`)."""
    from magis.sim import near_peak_storages

    order = graph.program_order() if order is None else order
    return near_peak_storages(graph, order, near_peak)


@dataclass(frozen=True)
class Scores:
    """Eq. 3 and Eq. 4 for every node of one dominator tree (indexed like `tree.nodes`)."""

    tree: DomTree
    heat: np.ndarray
    inputs: np.ndarray  # the subtracted input term of Eq. 4
    score: np.ndarray

    def of(self, node: int) -> tuple[float, float]:
        i = self.tree.position()[node]
        return float(self.heat[i]), float(self.score[i])


def get_scores(graph: Graph, tree: DomTree, hot: frozenset[Ref], n: int = 2) -> Scores:
    """heat (Eq. 3) and score (Eq. 4) of every node of `tree` with fission number n."""
    pos = tree.position()
    own = np.zeros(tree.size, dtype=np.float64)
    smap = graph.storages()
    for s in hot:
        i = pos.get(s.node)
        if i is not None:
            own[i] += smap.nbytes[s]
    heat = tree.subtree_sums(own)
    inputs = tree.subtree_sums(_input_weights(graph, tree, pos, hot))
    return Scores(tree, heat, inputs, (1 - 1 / n) * heat - inputs)


def _input_weights(graph: Graph, tree: DomTree, pos: dict[int, int], hot) -> np.ndarray:
    """Point weights whose subtree sums are Eq. 4's input term.

    A storage u costs |u| at v when some node of T.des(v) reads it and its producer p is not in
    T.des(v). With P = readers in the tree ∪ {p}, in preorder, +|u| at each of P and -|u| at the
    LCA of each consecutive pair sums, over a subtree, to [subtree meets P]; a further -|u| at p
    removes the subtrees containing p.
    """
    smap = graph.storages()
    points: list[int] = []
    weights: list[float] = []
    pairs_a: list[int] = []
    pairs_b: list[int] = []
    pair_w: list[float] = []
    touched = {smap.storage_of(r) for v in tree.nodes if v != VIRTUAL for r in graph.node(v).inputs}
    for s in sorted(touched):
        if s in smap.resident or s in hot:
            continue
        size = float(smap.nbytes[s])
        readers = sorted({pos[r] for r in smap.readers[s] if r in pos})
        if not readers:
            continue
        p = pos.get(s.node)
        members = sorted(set(readers) | ({p} if p is not None else set()))
        points.extend(members)
        weights.extend([size] * len(members))
        pairs_a.extend(members[:-1])
        pairs_b.extend(members[1:])
        pair_w.extend([-size] * (len(members) - 1))
        if p is not None:
            points.append(p)
            weights.append(-size)
    w = np.zeros(tree.size, dtype=np.float64)
    np.add.at(w, np.array(points, dtype=np.int64), np.array(weights))
    if pairs_a:
        lcas = tree.lca(np.array(pairs_a, dtype=np.int64), np.array(pairs_b, dtype=np.int64))
        np.add.at(w, lcas, np.array(pair_w))
    return w


@dataclass(frozen=True)
class FTreeNode:
    """A tree-node f = (S, D, n): a candidate (n = 1, disabled) or an applied F-Trans (n > 1)."""

    ftrans: FTrans
    length: int  # n must divide it
    parent: int | None
    component: int  # the D-Graph component D
    dim: str  # a readable name for D: its first vertex, e.g. "input0[0]"
    dominator: int  # v_dom (VIRTUAL for the virtual entry)
    level: int  # the score interval i of Alg. 1 (1..L)
    score: float  # Eq. 4, bytes
    heat: float  # Eq. 3, bytes

    @property
    def n(self) -> int:
        return self.ftrans.n

    @property
    def enabled(self) -> bool:
        return self.ftrans.n > 1

    @property
    def size(self) -> int:
        return len(self.ftrans.split)

    def divisors(self) -> list[int]:
        return [d for d in range(2, self.length + 1) if self.length % d == 0]


@dataclass(frozen=True)
class FTree:
    """The fission hierarchy tree (a forest): nodes, parents by S inclusion."""

    nodes: tuple[FTreeNode, ...]
    rejected: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # (v_dom, why)

    def __len__(self) -> int:
        return len(self.nodes)

    def children(self, i: int) -> list[int]:
        return [j for j, x in enumerate(self.nodes) if x.parent == i]

    def ancestors(self, i: int) -> Iterator[int]:
        p = self.nodes[i].parent
        while p is not None:
            yield p
            p = self.nodes[p].parent

    def descendants(self, i: int) -> Iterator[int]:
        for c in self.children(i):
            yield c
            yield from self.descendants(c)

    def enabled(self) -> list[int]:
        return [i for i, x in enumerate(self.nodes) if x.enabled]

    def with_n(self, i: int, n: int) -> FTree:
        """A new tree with node i's fission number set to n (1 disables it)."""
        node = self.nodes[i]
        new = replace(node, ftrans=replace(node.ftrans, n=n))
        return replace(self, nodes=(*self.nodes[:i], new, *self.nodes[i + 1 :]))

    def preorder(self) -> list[int]:
        """Parents before children (the order enabled nodes are applied in)."""
        out: list[int] = []
        for r in [i for i, x in enumerate(self.nodes) if x.parent is None]:
            out.append(r)
            out.extend(self.descendants(r))
        return out


def build_ftree(
    graph: Graph,
    max_level: int = DEFAULT_MAX_LEVEL,
    n: int = 2,
    hotspots: Iterable[Ref] | None = None,
    order: list[int] | None = None,
    hot_entries: bool = False,
) -> FTree:
    """Algorithm 1: the F-Tree of `graph` with max-level L = `max_level`.

    `hotspots` are H (default: the storages live at the peak of `order`, program order by
    default); `n` is the fission number the score assumes (the paper's n = 2); `hot_entries`
    also offers hot dominators split with their sub-graph (see `_candidates`).
    """
    hot = frozenset(hotspots) if hotspots is not None else memory_hotspots(graph, order)
    hot_nodes = {s.node for s in hot}
    dg = dgraph(graph)
    found: list[FTreeNode] = []
    rejected: list[tuple[str, str]] = []
    fixed = batch_fixed(graph)  # once: the pieces of every component are cut by it
    for c, verts in enumerate(dg.components()):
        nodes = sorted({int(v) for v in dg.vertex_node[verts]})
        if not hot_nodes.intersection(nodes):
            continue  # heat 0 everywhere: s_max <= 0 (line 8)
        label = _dim_label(graph, dg, int(verts[0]))
        own = _candidates(graph, c, nodes, hot, max_level, n, label, rejected, hot_entries)
        found.extend(own)
        found.extend(_entered_pieces(graph, c, nodes, hot, max_level, n, label, own, fixed))
        if hot_entries:
            found.extend(_hot_seeds(graph, c, nodes, hot, max_level, n, label, found))
    return FTree(nest_by_inclusion(found), tuple(rejected))


def _candidates(
    graph, c, nodes, hot, max_level, n, label, rejected, hot_entries
) -> list[FTreeNode]:
    """Lines 4-15 of Algorithm 1 for one component.

    With `hot_entries` (our extension, used when the search re-analyses a state), beside S = T.des(v_dom) \\ {v_dom}, a dominator that itself allocates a hot-spot also offers
    S ∪ {v_dom}: its heat counts that hot-spot, which only splitting v_dom itself reduces. In a
    backward pass the largest tensors are often such entries — a convolution's input gradient
    read by a short chain (padding's and upsampling's backward) — and the open S leaves them
    whole. (Alone, v_dom would be split only to be concatenated again: no saving.)"""
    tree = dominator_tree(graph, nodes)
    sc = get_scores(graph, tree, hot, n)
    s_max = float(sc.score.max()) if tree.size else 0.0
    if s_max <= 0:
        return []
    hot_nodes = {s.node for s in hot}
    out = []
    for i in range(1, max_level + 1):
        band = (sc.score / s_max >= i / max_level) & (sc.score / s_max < (i + 1) / max_level)
        for t in _lowest(tree, band):
            dom = int(tree.nodes[t])
            S = [int(v) for v in tree.nodes[t + 1 : tree.tout[t] + 1]]
            S = [v for v in S if not graph.node(v).is_placeholder]  # inputs are never split
            options = [S] if S else []
            entry = hot_entries and dom != VIRTUAL and dom in hot_nodes
            if S and entry and not graph.node(dom).is_placeholder:
                options.append([dom, *S])
            for members in options:
                info = checked_split(graph, members, c, n)
                if isinstance(info, Rejected):
                    rejected.append((_name(graph, dom), info.reason))
                    continue
                info = grown_over_boundary(graph, info, c, n)
                out.append(
                    FTreeNode(
                        info.ftrans,
                        info.length,
                        None,
                        c,
                        label,
                        dom,
                        i,
                        float(sc.score[t]),
                        float(sc.heat[t]),
                    )
                )
    return out


HOT_SEEDS = 4  # hot nodes per component a re-analysis grows regions from


def _hot_seeds(graph, c, nodes, hot, max_level, n, label, found) -> list[FTreeNode]:
    """Our extension to Algorithm 1, on re-analysis (`hot_entries`): regions grown from the
    largest hot nodes of the component that no candidate holds (`regions.grown_by_gain`),
    offered at the top level when their gain is positive. An attention's backward (the
    probabilities' gradient, `_softmax_backward_data`, the `bmm`s reading it) is read from the
    forward and from the layer after: no dominator but the virtual entry covers it, and on SD
    U-Net its three [64 x 4096 x 4096] tensors held the peak of every plan."""
    held = set().union(*(x.ftrans.nodes for x in found))
    smap, inside = graph.storages(), set(nodes)
    sizes: dict[int, int] = {}
    for s in hot:
        v = s.node
        if v in inside and v not in held and not graph.node(v).is_placeholder:
            sizes[v] = max(sizes.get(v, 0), smap.nbytes[s])
    out: list[FTreeNode] = []
    for v in sorted(sizes, key=lambda u: (-sizes[u], u))[:HOT_SEEDS]:
        if any(v in x.ftrans.nodes for x in out):
            continue
        seed = checked_split(graph, [v], c, n)
        if isinstance(seed, Rejected):
            continue
        info, gain = grown_by_gain(graph, seed, c, n, hot)
        if gain > 0 and len(info.ftrans.nodes) > 1:
            heat, _ = piece_score(graph, sorted(info.ftrans.nodes), hot, n)
            out.append(FTreeNode(info.ftrans, info.length, None, c, label, v, max_level,
                                 gain, heat))  # fmt: skip
    return out


def _entered_pieces(graph, c, nodes, hot, max_level, n, label, found, fixed) -> list[FTreeNode]:
    """Our extension to Algorithm 1: the regions of a component entered from the batch at
    several places, which no dominator but the virtual entry covers.

    Message passing reads the edge list at both ends of every layer (the sources gathered, the
    destinations scattered into) and the edge weights in between: in G' each layer's edge ops
    are dominated by the virtual entry alone, whose S spans every layer and is not convex, so
    Alg. 1 offers none of them. Taking out, as inputs (never split, as placeholders), the nodes
    whose values depend on the batch alone (`batch_fixed`: the edge lists' selects, the weights'
    views, a degree normalization), G' falls apart into one piece per layer and direction; each
    piece is offered with Eq. 3 and 4 over it, at the level of its
    normalized score among the pieces (below 1/L: not offered, as in Alg. 1) unless a candidate
    of Alg. 1 holds it already. `fixed`: `batch_fixed(graph)`."""
    rest = [v for v in nodes if v not in fixed and not graph.node(v).is_placeholder]
    sub = graph.dag.subgraph([graph.rx_index(v) for v in rest])
    pieces = [sorted(sub[i] for i in part) for part in rx.weakly_connected_components(sub)]
    if len(pieces) < 2:
        return []  # one piece: the virtual entry's S, less what the batch fixes
    pieces = [p for p in pieces if not any(set(p) <= x.ftrans.nodes for x in found)]
    if not pieces:
        return []  # Alg. 1's candidates hold every piece already (an LSTM step, re-analysed)
    scored = [(piece_score(graph, p, hot, n), p) for p in sorted(pieces)]
    s_max = max(sc[1] for sc, _ in scored)
    out = []
    for (heat, score), members in scored:
        level = int(score / s_max * max_level) if s_max > 0 else 0
        if level < 1:
            continue
        info = checked_split(graph, members, c, n)
        if not isinstance(info, Rejected):
            level = min(level, max_level)
            out.append(FTreeNode(info.ftrans, info.length, None, c, label, VIRTUAL, level,
                                 score, heat))  # fmt: skip
    return out


def batch_fixed(graph: Graph) -> frozenset[int]:
    """The nodes no weight reaches: their values are fixed by the batch (an edge list's selects,
    edge weights and their views), the same in every layer and every part of a split."""
    weighted: set[int] = set(graph.placeholders(PlaceholderKind.WEIGHT))
    for v in graph.topological_order():
        if v not in weighted and any(u in weighted for u in graph.predecessors(v)):
            weighted.add(v)
    return frozenset(v for v in graph.nodes if v not in weighted)


def _lowest(tree: DomTree, band: np.ndarray) -> list[int]:
    """Line 11: the nodes in the band with no descendant in the band (T.des(v) ∩ V = ∅)."""
    cs = np.concatenate([[0], np.cumsum(band)])
    idx = np.flatnonzero(band)
    inside = cs[tree.tout[idx] + 1] - cs[idx + 1]  # band members strictly below
    return [int(i) for i in idx[inside == 0]]


def nest_by_inclusion(found: list[FTreeNode]) -> tuple[FTreeNode, ...]:
    """Parent of each node: the smallest other node whose S contains its S (ties: the earlier)."""
    sets = [x.ftrans.nodes for x in found]
    out = []
    for i, x in enumerate(found):
        best = None
        for j in range(len(found)):
            if j == i or not sets[i] <= sets[j]:
                continue
            if len(sets[i]) == len(sets[j]) and j > i:
                continue  # equal S: the earlier one is the parent, never both ways
            if best is None or len(sets[j]) < len(sets[best]):
                best = j
        out.append(replace(x, parent=best))
    return tuple(out)


def _name(graph: Graph, node: int) -> str:
    return "<entry>" if node == VIRTUAL else graph.node(node).name


def _dim_label(graph: Graph, dg, vertex: int) -> str:
    """'input0[0]' for a dimension whose first vertex is dim 0 of input0; reduce axes of ops as
    'mm[r2]' (axis 2, a reduce axis)."""
    node, axis = int(dg.vertex_node[vertex]), int(dg.vertex_axis[vertex])
    dims = node_dims(graph)[node]
    d = dims.output_dim(0, axis) if dims.outputs else None
    return f"{graph.node(node).name}[{d if d is not None else f'r{axis}'}]"
