"""F-Trans as a graph rewrite (MAGIS §4.2-§4.3): an F-Tree's enabled nodes materialized.

An enabled F-Tree node (n > 1) is *materialized*: the sub-graph S is copied n times with 1/n
shapes, one copy after the other (the hierarchical schedule of MAGIS §4.3 written out), so the
simulator, code generation, execution and verification work on the result unchanged and measure
it honestly. For each part i (MAGIS §4.2, Fig. 5 (c)):

- every sliced input is `aten.slice.Tensor`d along its dimension (a view: no memory), once per
  part, where the part first reads it (and copied to a contiguous tensor for a kernel that
  ignores strides, `OpInfo.dense_inputs`); shared inputs are read whole;
- S's nodes are copied in schedule order with their outputs' split dimension divided by n and
  their shape arguments rewritten (view sizes, expand sizes ...: `OpDims.shape_args`);
- a summed output is accumulated with `aten.add.Tensor` right after each part, so at most the
  running sum and one part are alive; an accumulated one (index_add's x, `OpDims.accumulates`)
  is the argument the next part's call adds into, so only the running result is alive (message
  passing: the nodes receive 1/n of the edges' messages per part); a concatenated output is
  `aten.cat`ed after the last part
  (all n parts and the result are alive together at that moment: 2|v| for an instant, the price of
  merging without in-place writes).

Where the block goes: S is contracted to one node and the graph is sorted topologically by the
original positions (the block takes the position of S's first node), so every other node keeps
its relative order unless a dependency forces it past the block; random ops are chained in their
original order, so the RNG draws happen in the same order (random ops are never inside S: they
have no dimension rule). A contraction that would need to reorder them is rejected.

Nested enabled nodes are applied parents first; a child is applied to each of its parent's part
copies in turn. The generated code is therefore unrolled — one block per part, each freeing its
intermediates (`x = None`) as it goes — rather than a Python `for` loop: the memory it frees and
the order it runs are exactly what the simulator sees.

What prepares a captured graph for fission is in fission_prepare.py; the F-Tree mutations that
choose what to materialize are in ftree_moves.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import rustworkx as rx
import torch

from magis.analyze import FTrans, FTransInfo, FTree, OutputKind, Rejected, check, node_dims
from magis.errors import MagisError
from magis.ir import Graph, Ref, TensorMeta
from magis.ir.dims import split_shape
from magis.ir.guards import checked_at_run_time
from magis.rules.rebuild import GraphRebuilder, map_slots, view_chain_from


class FissionError(MagisError):
    """An F-Trans that cannot be applied to this graph (the message says which node and why)."""


class _NotTogether(FissionError):
    """Regions that cannot be split in one copy of the graph (they share a node, or contracting
    them all at once makes a cycle): the caller splits them one at a time."""


# --- materializing one F-Trans -----------------------------------------------------------------

_BLOCK = -1


@dataclass(frozen=True)
class Split:
    """One F-Trans applied: the new graph (program order = the schedule) and where nodes went."""

    graph: Graph
    ids: dict[int, list[int]]  # old node -> new nodes (n copies for S, one for the rest)
    touched: frozenset[int] = frozenset()  # nodes created or re-wired (incremental hashing)
    removed: frozenset[int] = frozenset()  # old nodes gone (S's originals)


def block_order(graph: Graph, block_of: dict[int, int], order: Sequence[int]) -> list[int]:
    """`order` with each S contracted to one block (`block_of`: node -> its block's key, a
    negative number), re-sorted topologically by original position, random ops kept in their
    order (see the module docstring).

    When `order` is topological only the stretch from the first node of a block to the last
    can change (the sort takes the smallest position ready: every earlier node is ready before
    the blocks, and the stretch holds a ready node until it is done), so only it is sorted."""
    order = list(order)
    at = [i for i, v in enumerate(order) if v in block_of]
    if not at or not _is_topological(graph, order):
        return _sorted_with_blocks(graph, block_of, order)
    first, last = at[0], at[-1]
    middle = _sorted_with_blocks(graph, block_of, order[first : last + 1])
    return [*order[:first], *middle, *order[last + 1 :]]


def _is_topological(graph: Graph, order: list[int]) -> bool:
    """Whether `order` holds every node of `graph` once, each after its predecessors."""
    if len(order) != len(graph):
        return False
    index = np.fromiter((graph.rx_index(v) for v in order), np.int64, len(order))
    pos = np.full(int(index.max()) + 1 if len(index) else 1, -1, dtype=np.int64)
    pos[index] = np.arange(len(order))
    edges = np.asarray(graph.dag.edge_list(), dtype=np.int64).reshape(-1, 2)
    return bool((pos >= 0).sum() == len(order) and (pos[edges[:, 0]] < pos[edges[:, 1]]).all())


def _sorted_with_blocks(graph: Graph, block_of: dict[int, int], order: list[int]) -> list[int]:
    """`order` (a stretch of the graph's, with every node of each S in it) with each S
    contracted and re-sorted topologically by position; edges leaving the stretch are ignored."""
    pos = {v: i for i, v in enumerate(order)}
    dag = rx.PyDiGraph()
    index: dict[int, int] = {}
    key: dict[int, int] = {}
    for v in order:
        k = block_of.get(v, v)
        if k not in index:
            index[k] = dag.add_node(k)
            key[k] = pos[v]
    edges = set()
    for v in order:
        a = index[block_of.get(v, v)]
        for w in graph.successors(v):
            if w in pos and (b := index[block_of.get(w, w)]) != a:
                edges.add((a, b))
    randoms = [v for v in order if v not in block_of and graph.info(v).is_random]
    edges.update((index[a], index[b]) for a, b in zip(randoms, randoms[1:], strict=False))
    dag.add_edges_from_no_data(sorted(edges))
    try:
        out = rx.lexicographical_topological_sort(dag, key=lambda k: f"{key[k]:010d}")
    except rx.DAGHasCycle as exc:
        if len(set(block_of.values())) > 1:
            raise _NotTogether("the regions cannot be contracted together") from exc
        raise FissionError("S cannot be contracted without reordering random ops") from exc
    return list(out)


def split_graph(graph: Graph, info: FTransInfo, order: Sequence[int] | None = None) -> Split:
    """Apply the valid F-Trans `info.ftrans` (n > 1): S's parts one after the other."""
    return split_graphs(graph, (info,), order)


def split_graphs(
    graph: Graph, infos: Sequence[FTransInfo], order: Sequence[int] | None = None
) -> Split:
    """Apply several valid F-Trans with disjoint S (the copies of a nested F-Tree node, one in
    each part of its parent; a level's regions, one layer's feeding the next) in one copy of
    the graph: each S's parts one after the other where S was. Applying them one at a time
    gives the same program and copies the whole graph once per S (a level of twenty regions
    on a 7,000-node graph: twenty copies). `_NotTogether` where they share a node or cannot
    be contracted all at once."""
    for info in infos:
        f = info.ftrans
        if f.n < 2 or info.length % f.n:
            raise FissionError(f"fission number {f.n} does not divide the length {info.length}")
    order = list(graph.program_order() if order is None else order)
    block_of = {v: _BLOCK - j for j, info in enumerate(infos) for v in info.ftrans.nodes}
    if len(block_of) < sum(len(info.ftrans.nodes) for info in infos):
        raise _NotTogether("the regions share a node")
    s_orders: list[list[int]] = [[] for _ in infos]
    for v in order:
        if v in block_of:
            s_orders[_BLOCK - block_of[v]].append(v)
    rb = GraphRebuilder(graph)
    for item in block_order(graph, block_of, order):
        if item <= _BLOCK:
            j = _BLOCK - item
            _emit_parts(rb, graph, infos[j], s_orders[j])
        else:
            rb.copy(item)
    graph_out = rb.finish()
    removed = frozenset(v for v in block_of if v in graph and v not in graph_out)
    return Split(graph_out, rb.ids, frozenset(rb.created) | frozenset(rb.remapped), removed)


def _emit_parts(rb: GraphRebuilder, graph: Graph, info: FTransInfo, s_order: list[int]) -> None:
    f = info.ftrans
    axis_of = f.axis_of()
    dims = node_dims(graph)
    concat: dict[Ref, list[Ref]] = {
        r: [] for r, m in info.outputs.items() if m.kind is OutputKind.CONCAT
    }
    sums: dict[Ref, Ref] = {}
    carried: dict[tuple[int, int], Ref] = {}  # (node, slot) -> what the next part adds into
    for v in s_order:
        rb.ids[v] = []
    outs = {v: _part_outputs(graph.node(v), dims[v], axis_of[v], f.n) for v in s_order}
    for i in range(f.n):
        local: dict[Ref, Ref] = {}
        sliced: dict[tuple[Ref, int], Ref] = {}
        for v in s_order:
            _emit_part_node(rb, graph, info, dims[v], v, outs[v], i, local, sliced, carried)
        for ref, merge in info.outputs.items():
            if merge.kind is OutputKind.CONCAT:
                concat[ref].append(local[ref])
            elif merge.kind is OutputKind.ACCUMULATE:
                carried[(ref.node, merge.slot)] = sums[ref] = local[ref]
            elif ref not in sums:
                sums[ref] = local[ref]
            else:
                name = f"{graph.node(ref.node).name}_sum{i}"
                sums[ref] = rb.add(
                    name, "aten.add.Tensor", (sums[ref], local[ref]), (graph.meta(ref),)
                )
    region = set(f.nodes)
    for ref, parts in concat.items():
        # The parts of a view are slices of what it views: viewed again from the whole, it
        # costs nothing where their concatenation is a copy (GraphSAGE's expanded scatter
        # index, read again by its backward: 2.9 GiB where the step's peak was 1.7 GiB).
        whole = view_chain_from(rb, graph, region, ref, "_whole")
        if whole is not None:
            rb.env[ref] = whole
            continue
        dim = info.outputs[ref].dim
        name = f"{graph.node(ref.node).name}_cat"
        rb.env[ref] = rb.add(name, "aten.cat.default", (parts, dim), (graph.meta(ref),))
    rb.env.update(sums)


def _part_outputs(node, dims, axis, n: int) -> tuple[TensorMeta, ...]:
    """A part's outputs: 1/n along the split axis (the same for every part)."""
    return tuple(
        TensorMeta(split_shape(m.shape, d, n), m.dtype, m.itemsize)
        if (d := dims.output_dim(k, axis)) is not None
        else m
        for k, m in enumerate(node.outputs)
    )


def _emit_part_node(rb, graph, info, dims, v, outs, i, local, sliced, carried) -> None:
    """Copy node v for part i: slots read the previous part's result where v adds into it
    (`carried`), the part's values, slices of sliced inputs, or the shared input; outputs are
    `outs` (`_part_outputs`); shape arguments follow."""
    node = graph.node(v)
    n = info.ftrans.n

    dense = graph.info(v).dense_inputs

    def arg(j: int, ref: Ref) -> Ref:
        if (v, j) in carried:
            return carried[(v, j)]
        if ref in local:
            return local[ref]
        d = info.slices.get((v, j))
        if d is None:
            return rb.env[ref]
        if (ref, d, False) not in sliced:
            sliced[(ref, d, False)] = _slice(rb, graph, ref, d, i, n)
        if not dense or not _strided(graph.meta(ref), d):
            return sliced[(ref, d, False)]
        if (ref, d, True) not in sliced:
            sliced[(ref, d, True)] = _dense_copy(rb, graph, sliced[(ref, d, False)], ref, i, n, d)
        return sliced[(ref, d, True)]

    args, kwargs = map_slots(node, arg)
    args = list(args)
    for p, k, *d in dims.shape_args:
        if p < len(args):
            args[p] = outs[k].shape[d[0]] if d else list(outs[k].shape)
    new = rb.add_op(f"{node.name}_p{i}", node.op, tuple(args), kwargs, outs)
    rb.ids[v].append(new)
    for k in range(len(outs)):
        local[Ref(v, k)] = Ref(new, k)


def _strided(meta: TensorMeta, d: int) -> bool:
    """A slice along dimension d of a dense tensor is strided (not one block of memory) when a
    dimension before d holds more than one index."""
    return any(s > 1 for s in meta.shape[:d])


def _dense_copy(rb: GraphRebuilder, graph: Graph, part: Ref, ref: Ref, i: int, n: int, d: int):
    """A contiguous copy of a strided slice, for a kernel that reads its arguments as dense
    arrays without looking at their strides (`OpInfo.dense_inputs`: oneDNN's RNN layers read a
    (T, N/n, C) slice's memory as if it were dense, silently wrong). It costs the part's size,
    which the simulator sees."""
    meta = graph.meta(ref)
    out = TensorMeta(split_shape(meta.shape, d, n), meta.dtype, meta.itemsize)
    name = f"{graph.node(ref.node).name}_dense{i}"
    return rb.add(
        name, "aten.clone.default", (part,), (out,), memory_format=torch.contiguous_format
    )


def _slice(rb: GraphRebuilder, graph: Graph, ref: Ref, d: int, i: int, n: int) -> Ref:
    meta = graph.meta(ref)
    step = meta.shape[d] // n
    name = f"{graph.node(ref.node).name}_slice{i}"
    out = TensorMeta(split_shape(meta.shape, d, n), meta.dtype, meta.itemsize)
    return rb.add(name, "aten.slice.Tensor", (rb.env[ref], d, i * step, (i + 1) * step), (out,))


# --- materializing an F-Tree -------------------------------------------------------------------


@dataclass(frozen=True)
class Materialized:
    """A graph with every enabled F-Tree node applied; its program order is the schedule."""

    graph: Graph
    ids: dict[int, list[int]]  # original node -> its copies in `graph`
    applied: tuple[int, ...]  # F-Tree node indices, in the order applied
    applied_n: tuple[int, ...] = ()  # their fission numbers
    # When `reuse` was continued: what changed relative to its graph (incremental hashing).
    continued: bool = False
    touched: frozenset[int] = frozenset()
    removed: frozenset[int] = frozenset()

    @property
    def order(self) -> list[int]:
        return self.graph.program_order()


def materialize(
    graph: Graph,
    tree: FTree,
    order: Sequence[int] | None = None,
    reuse: Materialized | None = None,
) -> Materialized:
    """Apply the enabled nodes of `tree` in waves: every node none of whose enabled ancestors
    is still to apply, all in one copy of the graph (a child once per part of its parent).

    `reuse`, a materialization of the same base graph for another tree, is continued from when
    every node it applied is still enabled with the same n and none of the tree's other
    enabled nodes is an ancestor of one of them: then only the new nodes are applied. The
    search's F-Tree moves mostly enable one more node, so this turns k splits into one."""
    start = _reusable(tree, reuse)
    if start is not None:
        current, ids = start.graph, start.ids
        applied, applied_n = list(start.applied), list(start.applied_n)
    else:
        current, ids = _ordered_base(graph, order)
        applied, applied_n = [], []
    done = set(applied)
    changes = SplitChanges(first_new=current.next_id)
    pending = {t: None for t in tree.preorder() if tree.nodes[t].enabled and t not in done}
    while pending:  # a dict: preorder kept, membership in O(1)
        wave = [t for t in pending if not any(a in pending for a in tree.ancestors(t))]
        current, ids = _apply_wave(current, ids, tree, wave, changes)
        applied.extend(wave)
        applied_n.extend(tree.nodes[t].n for t in wave)
        for t in wave:
            del pending[t]
    return Materialized(
        current,
        ids,
        tuple(applied),
        tuple(applied_n),
        start is not None,
        frozenset(changes.touched),
        frozenset(changes.removed),
    )


def _reusable(tree: FTree, reuse: Materialized | None) -> Materialized | None:
    if reuse is None or not reuse.applied_n:
        return None
    if any(tree.nodes[t].n != n for t, n in zip(reuse.applied, reuse.applied_n, strict=True)):
        return None
    kept = set(reuse.applied)
    for t in tree.enabled():
        if t not in kept and any(a in kept for a in tree.descendants(t)):
            return None
    return reuse


def _ordered_base(graph: Graph, order: Sequence[int] | None) -> tuple[Graph, dict]:
    if order is None or list(order) == graph.program_order():
        return graph, {v: [v] for v in graph.nodes}
    current = _reordered(graph, order)
    return current, {v: [i] for v, i in zip(order, current.program_order(), strict=True)}


@dataclass
class SplitChanges:
    """What a materialization changed since it began: nodes created or re-wired (`touched`)
    and nodes of the graph it began from that are gone (`removed`). Node ids only grow, so a
    node at or above `first_new` was created by it: one created and then removed by a later
    wave is no change at all, while one it began with, re-wired by one wave and removed by the
    next, is removed (it was dropped from `touched` and missed from `removed`: the child's
    derived tables kept its storage, T5's loss block split after its batch split)."""

    first_new: int
    touched: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)

    def record(self, res) -> None:
        for v in res.removed:
            self.touched.discard(v)
            if v < self.first_new:
                self.removed.add(v)
        self.touched |= res.touched


def _apply_wave(
    current: Graph, ids: dict, tree: FTree, wave: list[int], changes: SplitChanges
) -> tuple[Graph, dict]:
    """Split every copy of the wave's tree nodes (one copy per part of an enabled ancestor;
    no node of the wave is another's ancestor) in one copy of the graph, adding to `touched`
    and `removed` what changed since the materialization began. A level of an F-Tree is
    dozens of small regions, and copying a 7,000-node graph once per region took seconds.
    Where the regions cannot be split together (they share a node, or an order only one at a
    time allows), the wave's nodes are applied one after the other, and a node's copies too."""
    jobs = []
    for t in wave:
        split = tree.nodes[t].ftrans.split
        copies = {len(ids[v]) for v, _ in split}
        if len(copies) > 1:  # regions of one tree nest or are apart; this one was cut across
            raise FissionError(f"F-Tree node {t} overlaps a region split before it")
        for j in range(copies.pop()):
            jobs.append((t, tuple(sorted((ids[v][j], a) for v, a in split))))
    originals = [v for t in wave for v, _ in tree.nodes[t].ftrans.split]
    try:
        return _split_jobs(current, ids, tree, jobs, originals, changes)
    except _NotTogether:
        if len(wave) > 1:  # each node's copies from the ids the previous one left
            for t in wave:
                current, ids = _apply_wave(current, ids, tree, [t], changes)
            return current, ids
        for job in jobs:  # one node's copies are apart: splitting one leaves the others' ids
            current, ids = _split_jobs(current, ids, tree, [job], originals, changes)
        return current, ids


def _split_jobs(current, ids, tree, jobs, originals, changes: SplitChanges) -> tuple[Graph, dict]:
    infos = []
    for t, split in jobs:
        info = check(current, FTrans(split, tree.nodes[t].n))
        if isinstance(info, Rejected):
            if len(jobs) > 1:  # one at a time, on the graph the others' splits leave
                raise _NotTogether(info.reason)
            raise FissionError(f"F-Tree node {t} cannot be applied: {info.reason}")
        infos.append(info)
    res = split_graphs(current, infos)
    changes.record(res)
    ids = dict(ids)  # only the split originals' copies changed (the rest kept their ids)
    for v in originals:
        ids[v] = [x for old in ids[v] for x in res.ids.get(old, (old,))]
    return res.graph, ids


def _reordered(graph: Graph, order: Sequence[int]) -> Graph:
    rb = GraphRebuilder(graph)
    for v in order:
        rb.copy(v)
    return rb.finish()


def check_shapes(graph: Graph) -> None:
    """Run `graph` in program order on meta tensors (no data, no memory) and compare every
    output shape with its metadata; a view that strides cannot express fails here, naming the
    node, before any real execution."""
    from magis.ir.ops import resolve_overload

    env: dict[Ref, torch.Tensor] = {}

    def val(x):
        if isinstance(x, Ref):
            return env[x]
        if isinstance(x, list):
            return [val(v) for v in x]
        if isinstance(x, tuple):
            return tuple(val(v) for v in x)
        if isinstance(x, torch.device):
            return torch.device("meta")
        return x

    for nid in graph.program_order():
        node = graph.node(nid)
        if node.is_placeholder:
            m = node.outputs[0]
            env[Ref(nid)] = torch.empty(m.shape, dtype=m.torch_dtype, device="meta")
            continue
        if graph.info(nid).copy_stream or checked_at_run_time(graph, nid):
            # Store/Load: a copy, same shape, no ATen kernel; shaped by values: guarded
            for k, m in enumerate(node.outputs):
                env[Ref(nid, k)] = torch.empty(m.shape, dtype=m.torch_dtype, device="meta")
            continue
        kwargs = {k: val(v) for k, v in node.kwargs}
        if "device" in kwargs:
            kwargs["device"] = torch.device("meta")
        try:
            out = resolve_overload(node.op)(*val(node.args), **kwargs)
        except Exception as exc:  # noqa: BLE001 - any kernel error is the node's fault
            raise FissionError(f"{node.name} ({node.op}) fails on its split shapes: {exc}") from exc
        outs = list(out) if isinstance(out, list | tuple) else [out]
        for k, meta in enumerate(node.outputs):
            t = outs[k] if k < len(outs) else None
            if isinstance(t, torch.Tensor) and tuple(t.shape) != meta.shape and meta.numel:
                raise FissionError(
                    f"{node.name} makes shape {tuple(t.shape)}, expected {meta.shape}"
                )
            env[Ref(nid, k)] = t
