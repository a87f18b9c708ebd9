"""The fission transformation f = (S, D, n) (MAGIS §4.2): validity and the roles of S's boundary.

An F-Trans is kept as `FTrans(split, n)`: `split` pairs every node of S with the axis of its call
that D runs along (the vertices of D', one per node: the paper's "no redundant computation"), and
`n` is the fission number (1: a candidate, not applied). `check(graph, f)` decides whether f is
valid on a graph version and, if so, what splitting means at S's boundary:

- an input u of S is *sliced* along dimension d for a reader in S whose call runs that dimension
  of u along its split axis, and *shared* otherwise (§4.2: "if there exists i > 0 with <u, i> in
  D, u is sliced for each split part, otherwise shared"); slicing is decided per reader, so one
  tensor may be sliced for one reader and shared by another (mm(a, a));
- an output v of S (read outside S, or a graph output) is *concatenated* along the dimension that
  is its split axis, or *summed* when the split axis is a reduce axis of v's call that the call
  sums over (§4.2: "otherwise reducing them"), or *accumulated* when v's call adds into one of
  its arguments (index_add's x: `OpDims.accumulates`): each part's call adds into the previous
  part's result instead of that argument, the first part's into the argument itself.

Validity (§4.2's three constraints, plus what executing the split needs):

1. G[S] is weakly connected;
2. G[S] is convex: no node outside S is both a descendant and an ancestor of S;
3. no redundant computation: every node of S has its split axis, and along every edge (u, v)
   inside S the dimension u passes to v is the one both are split along (a D-edge), or u's
   output is each part's own and v reads it part by part (`OpDims.part_outputs` /
   `part_inputs`: oneDNN's LSTM workspace, from a forward part to its backward part), both
   split along one D-Graph dimension; such a slot never reads a value from outside S;
and: every output of S can be merged (concatenated or summed; a summed value is not read inside
S), summed outputs are floating point, and the fission number divides the *length* — the gcd of
the lengths of the split axes and of the sliced input dimensions (a reshape [N, T] -> [N*T] joins
dimensions of different lengths).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from math import gcd

import rustworkx as rx

from magis.analyze.dgraph import dgraph, has_vertex, node_dims, slot_refs
from magis.ir import DerivedKey, Graph, Ref


class InputKind(enum.Enum):
    SLICED = "sliced"
    SHARED = "shared"


class OutputKind(enum.Enum):
    CONCAT = "concat"
    SUM = "sum"
    ACCUMULATE = "accumulate"  # parts chained through an argument slot (`OutputMerge.slot`)


@dataclass(frozen=True, order=True)
class FTrans:
    """f = (S, D', n): `split` is ((node, axis), ...) sorted by node, the vertices of D'."""

    split: tuple[tuple[int, int], ...]
    n: int = 1

    @cached_property
    def nodes(self) -> frozenset[int]:
        return frozenset(v for v, _ in self.split)

    def axis_of(self) -> dict[int, int]:
        return dict(self.split)


@dataclass(frozen=True)
class Rejected:
    """Why an F-Trans is not valid on this graph (for messages and tests)."""

    reason: str

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True)
class OutputMerge:
    kind: OutputKind
    dim: int | None  # the concatenation dimension
    slot: int | None = None  # ACCUMULATE: the argument slot each part reads the last part's in


@dataclass(frozen=True)
class FTransInfo:
    """What a valid F-Trans means on one graph version (§4.2's classification of S's boundary)."""

    ftrans: FTrans
    length: int  # every fission number must divide it
    slices: dict[tuple[int, int], int]  # (reader in S, argument slot) -> dim of the sliced input
    inputs: dict[Ref, InputKind]  # values S reads from outside
    outputs: dict[Ref, OutputMerge]  # values of S read outside S or returned

    def __bool__(self) -> bool:
        return True

    def divisors(self) -> list[int]:
        """The fission numbers this F-Trans admits (> 1), ascending."""
        return [d for d in range(2, self.length + 1) if self.length % d == 0]


def check(graph: Graph, f: FTrans) -> FTransInfo | Rejected:
    """Validate f on `graph` and classify S's inputs and outputs (see the module docstring)."""
    axis_of = f.axis_of()
    if not axis_of:
        return Rejected("S is empty")
    dims = node_dims(graph)
    for v, a in f.split:
        if v not in graph or graph.node(v).is_placeholder:
            return Rejected(f"node {v} is not an op of this graph")
        if not has_vertex(graph, v, a):
            return Rejected(f"{graph.node(v).name} cannot be split along axis {a}")
    slices, inputs, sliced_lengths, reason = _inputs(graph, axis_of)
    if reason:
        return Rejected(reason)
    outputs = _outputs(graph, axis_of)
    if isinstance(outputs, Rejected):
        return outputs
    for why in (_connected(graph, axis_of), _convex(graph, axis_of)):
        if why:
            return Rejected(why)
    length = 0
    for x in [dims[v].lengths[a] for v, a in f.split] + sliced_lengths:
        length = gcd(length, x)
    if length < 2:
        return Rejected(f"the split dimensions have no common divisor > 1 (gcd {length})")
    if f.n > 1 and length % f.n:
        return Rejected(f"n = {f.n} does not divide the dimension length {length}")
    return FTransInfo(f, length, slices, inputs, outputs)


def _inputs(graph: Graph, axis_of: dict[int, int]):
    """Check the D-edges inside S; classify what S reads from outside (sliced or shared).

    Returns (slices, input kinds, lengths of the sliced dimensions, reason rejected or "")."""
    dims = node_dims(graph)
    slices: dict[tuple[int, int], int] = {}
    kinds: dict[Ref, InputKind] = {}
    lengths: list[int] = []
    for v, a in axis_of.items():
        dv = dims[v]
        for j, ref in enumerate(slot_refs(graph, v)):
            if ref.node in axis_of:
                du = dims[ref.node]
                d = du.output_dim(ref.index, axis_of[ref.node])
                if d is None and _paired(graph, ref, axis_of, v, j):
                    continue
                if d is None:
                    name = graph.node(ref.node).name
                    why = f"{name}'s output {ref.index} is read inside S but is partial"
                    return {}, {}, [], why
                if dv.inputs[j][d] != a:
                    u, w = graph.node(ref.node).name, graph.node(v).name
                    why = f"no D-edge from {u} to {w}: they are split along unrelated dims"
                    return {}, {}, [], why
                continue
            d = dv.input_dim(j, a)
            if d is None and (j, a) in dv.part_inputs:
                w = graph.node(v).name
                why = f"{w} reads a workspace made outside S, which cannot be sliced"
                return {}, {}, [], why
            if d is None:
                kinds.setdefault(ref, InputKind.SHARED)
                continue
            slices[(v, j)] = d
            kinds[ref] = InputKind.SLICED
            lengths.append(graph.meta(ref).shape[d])
    return slices, kinds, lengths, ""


def _paired(graph: Graph, ref: Ref, axis_of: dict[int, int], v: int, j: int) -> bool:
    """Slot j of v reads, part by part, a part's own output of a node in S (a fused kernel's
    workspace: `OpDims.part_outputs` / `part_inputs`), both split along one D-Graph dimension."""
    u, dims = ref.node, node_dims(graph)
    au, av = axis_of[u], axis_of[v]
    if (ref.index, au) not in dims[u].part_outputs or (j, av) not in dims[v].part_inputs:
        return False
    dg = dgraph(graph)
    return dg.component_of(u, au) == dg.component_of(v, av)


def _outputs(graph: Graph, axis_of: dict[int, int]) -> dict[Ref, OutputMerge] | Rejected:
    """Values of S read outside S or returned, and how their parts merge."""
    dims = node_dims(graph)
    needed: set[Ref] = {r for r in graph.outputs if r.node in axis_of}
    for v in axis_of:
        for user in graph.users(v):
            if user not in axis_of:
                needed.update(r for r in graph.node(user).inputs if r.node == v)
    merges: dict[Ref, OutputMerge] = {}
    for ref in sorted(needed):
        a = axis_of[ref.node]
        d = dims[ref.node].output_dim(ref.index, a)
        name = graph.node(ref.node).name
        if d is not None:
            merges[ref] = OutputMerge(OutputKind.CONCAT, d)
        elif (ref.index, a) in dims[ref.node].sums:
            slot = dims[ref.node].accumulated_slot(ref.index)
            if slot is not None:  # the whole call's additions in its order: any dtype
                merges[ref] = OutputMerge(OutputKind.ACCUMULATE, None, slot)
                continue
            if not graph.meta(ref).torch_dtype.is_floating_point:
                return Rejected(f"{name}'s output {ref.index} would be summed but is not floating")
            merges[ref] = OutputMerge(OutputKind.SUM, None)
        else:
            return Rejected(f"{name}'s output {ref.index} is needed outside S but cannot be merged")
    return merges


def _connected(graph: Graph, axis_of: dict[int, int]) -> str:
    if len(axis_of) == 1:
        return ""
    idx = [graph.rx_index(v) for v in axis_of]
    if rx.is_weakly_connected(graph.dag.subgraph(idx)):
        return ""
    return "G[S] is not weakly connected"


def _convex(graph: Graph, axis_of: dict[int, int]) -> str:
    """No path leaves S and comes back (§4.2 (2)): walk forward from S's outside successors, in
    topological order, up to the last node of S."""
    pos = topo_positions(graph)
    last = max(pos[v] for v in axis_of)
    frontier = [w for v in axis_of for w in graph.successors(v) if w not in axis_of]
    seen: set[int] = set()
    while frontier:
        w = frontier.pop()
        if w in seen or pos[w] > last:
            continue
        seen.add(w)
        for x in graph.successors(w):
            if x in axis_of:
                return f"not convex: {graph.node(w).name} is between parts of S"
            frontier.append(x)
    return ""


_TOPO_POS: DerivedKey[dict[int, int]] = DerivedKey("fission.topo_pos")


def topo_positions(graph: Graph) -> dict[int, int]:
    """Each node's index in the graph's topological order, cached on the graph version (the
    F-Tree builders, Alg. 1's and the naive ablation's, order candidates by it)."""
    return graph.derived(_TOPO_POS, lambda: {n: i for i, n in enumerate(graph.topological_order())})


def without_input_reductions(graph: Graph, f: FTrans) -> FTrans:
    """f without the reductions over D that read only the graph's inputs, and what they read.

    A mean loss split into sum / count (`magis.rules.fission_prepare`) counts the valid targets
    with a reduction over the batch; the backward reads that count inside S, where each part
    would see only its own partial count, so every region holding the loss was rejected (a
    GPT-2's 3 x 1.6 GiB loss block stayed whole). The count depends on the targets alone: it
    can run whole, before S, and S reads it as a shared input. Taking out a set that is closed
    upwards inside S keeps S convex; the set is only taken out when it reads nothing computed
    in S from activations (so no large tensor is left unsplit), else f is returned unchanged.
    """
    axis_of = f.axis_of()
    dims = node_dims(graph)
    partial = {
        ref.node
        for v in axis_of
        for ref in slot_refs(graph, v)
        if ref.node in axis_of and not dims[ref.node].carries(ref.index, axis_of[ref.node])
    }
    if not partial:
        return f
    peeled: set[int] = set()
    stack = list(partial)
    while stack:
        v = stack.pop()
        if v in peeled:
            continue
        peeled.add(v)
        for ref in graph.node(v).inputs:
            u = ref.node
            if u in axis_of:
                stack.append(u)
            elif not graph.node(u).is_placeholder:
                return f  # it reads a value computed outside S from activations: keep f
    if len(peeled) >= len(axis_of):
        return f
    return FTrans(tuple((v, a) for v, a in f.split if v not in peeled), f.n)


def split_of_component(graph: Graph, nodes, component: int) -> FTrans | Rejected:
    """The F-Trans splitting `nodes` along D-Graph component `component`: each node must have
    exactly one vertex in it (§4.2 (3), no redundant computation)."""
    dg = dgraph(graph)
    dims = node_dims(graph)
    split = []
    for v in sorted(nodes):
        d = dims.get(v)
        axes = [] if d is None else [a for a in d.splittable if dg.component_of(v, a) == component]
        if len(axes) != 1:
            what = "no" if not axes else "several"
            return Rejected(f"{graph.node(v).name} has {what} vertices in the dimension")
        split.append((v, axes[0]))
    return FTrans(tuple(split))
