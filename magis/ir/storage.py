"""Storages and aliases: which storage every value lives in (MAGIS counts storages, not tensors)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import rustworkx as rx

from magis.ir.node import Node, Ref, map_refs, refs_in
from magis.ir.ops import OpInfo, OpRegistry
from magis.ir.tensor import TensorMeta, broadcast_numel


class GraphLike(Protocol):
    """What the storage bookkeeping reads of a `magis.ir.graph.Graph` (which builds and caches
    a StorageMap, so this module cannot import it)."""

    registry: OpRegistry

    @property
    def dag(self) -> rx.PyDiGraph: ...

    @property
    def nodes(self) -> dict[int, Node]: ...

    @property
    def outputs(self) -> tuple[Ref, ...]: ...

    def node(self, nid: int) -> Node: ...

    def placeholders(self) -> list[int]: ...

    def predecessors(self, nid: int) -> list[int]: ...

    def successors(self, nid: int) -> list[int]: ...


K = TypeVar("K")
V = TypeVar("V")
_GONE = object()  # a shared key deleted


class _Layers(Generic[K, V]):
    """A dict shared with other versions, this version's changes to its keys (`_delta`: a new
    value, or _GONE), and the keys added since (`_tail`, in the order added; a shared key
    deleted and added again is one of them, at the end, as in a dict)."""

    __slots__ = ("_flat", "_delta", "_tail", "_len")

    _flat: dict[K, V]
    _delta: dict
    _tail: dict[K, V]
    _len: int

    def __getitem__(self, key: K) -> V:
        tail = self._tail
        if key in tail:
            return tail[key]
        value = self._delta.get(key, self)  # `self`: no change
        if value is self:
            return self._flat[key]
        if value is _GONE:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        if key in self._tail:
            return True
        value = self._delta.get(key, self)
        if value is self:
            return key in self._flat
        return value is not _GONE

    def _folded(self) -> dict[K, V]:
        """One plain dict of the layers, in their order: the shared dict copied whole (a
        key-by-key rebuild of a split decoder's maps took 14 ms a child), its changed keys
        set in place, its deleted ones dropped, the keys added since appended."""
        flat = dict(self._flat)
        for key, value in self._delta.items():
            if value is _GONE:
                del flat[key]
            else:
                flat[key] = value
        flat.update(self._tail)
        return flat

    def _iter_layers(self) -> Iterator[K]:
        delta = self._delta
        for key in self._flat:
            if delta.get(key) is not _GONE:
                yield key
        yield from self._tail


class Layered(_Layers[K, V], Mapping[K, V]):
    """A read-only dict made of a dict shared with the maps it was derived from and this
    map's own changes, iterating in the order a plain dict given the same insertions and
    deletions would.

    A search keeps thousands of storage maps, each a handful of changes away from its
    parent's: copying every dict of every map cost more time and memory than the changes.
    `draft()` starts the next version; its changes are folded into a new shared dict once they
    outnumber a sixteenth of it."""

    __slots__ = ()

    def __init__(self, flat: dict[K, V]) -> None:
        self._flat, self._delta, self._tail, self._len = flat, {}, {}, len(flat)

    def __iter__(self) -> Iterator[K]:
        if not self._delta and not self._tail:
            return iter(self._flat)
        return self._iter_layers()

    def __len__(self) -> int:
        return self._len

    def items(self):
        """The (key, value) pairs, in order (the shared dict's own view when nothing is
        layered on it: a fresh build's maps are read whole, once per graph version)."""
        if not self._delta and not self._tail:
            return self._flat.items()
        return super().items()

    def draft(self) -> Draft[K, V]:
        return Draft(self)


class Draft(_Layers[K, V]):
    """The next version of a `Layered` map, edited like a dict, then `done()`."""

    __slots__ = ()

    def __init__(self, parent: Layered[K, V]) -> None:
        self._flat, self._len = parent._flat, parent._len
        self._delta, self._tail = dict(parent._delta), dict(parent._tail)

    def __setitem__(self, key: K, value: V) -> None:
        tail, delta = self._tail, self._delta
        if key in tail:
            tail[key] = value
        elif key in self._flat and delta.get(key) is not _GONE:
            delta[key] = value
        else:  # new, or a shared key deleted before: to the end
            tail[key] = value
            self._len += 1

    def pop(self, key: K, default=None):
        tail, delta = self._tail, self._delta
        if key in tail:
            self._len -= 1
            return tail.pop(key)
        if key in self._flat and delta.get(key) is not _GONE:
            value = delta.get(key, self._flat[key])
            delta[key] = _GONE
            self._len -= 1
            return value
        return default

    def setdefault(self, key: K, default: V) -> V:
        if key in self:
            return self[key]
        self[key] = default
        return default

    def done(self) -> Layered[K, V]:
        if len(self._delta) + len(self._tail) > max(64, len(self._flat) >> 4):
            return Layered(self._folded())
        out = Layered(self._flat)
        out._delta, out._tail, out._len = self._delta, self._tail, self._len
        return out


@dataclass(frozen=True)
class StorageMap:
    """Which storage every value lives in (MAGIS counts storages, not tensors).

    A view's outputs share the storage of its first tensor argument; an in-place update's output
    shares the storage it writes into; every other output allocates a storage of its own, named
    by the Ref that allocated it, of the output's size (a loss that resizes its elementwise
    buffer down to the scalar it returns keeps that buffer: `OpInfo.keeps_elementwise_storage`;
    a oneDNN LSTM's workspace has its real size: `OpInfo.workspace`). A storage is live from
    its allocation until the last reader of any of its aliases has run; storages of
    placeholders are resident throughout.
    """

    base: Mapping[Ref, Ref]  # value -> the Ref that allocated its storage
    nbytes: Mapping[Ref, int]  # storage (allocating Ref) -> bytes
    readers: Mapping[Ref, list[int]]  # storage -> nodes that read any alias of it
    resident: frozenset[Ref]  # storages of placeholders
    outputs: frozenset[Ref]  # storages that are graph outputs (live until the end)
    host: frozenset[Ref] = frozenset()  # storages in host memory (made by a Store)

    @staticmethod
    def build(graph: GraphLike) -> StorageMap:
        # Any topological order will do (a view's base is known before the view): rustworkx's
        # plain sort is C-speed, unlike the program-order-stable one. This runs once per
        # graph version, thousands of times in a search.
        dag = graph.dag
        order = [dag[i] for i in rx.topological_sort(dag)]
        nodes = graph.nodes
        lookup = graph.registry.lookup
        base: dict[Ref, Ref] = {}
        nbytes: dict[Ref, int] = {}
        host: set[Ref] = set()
        readers: dict[Ref, list[int]] = {}
        infos: dict[str, OpInfo] = {}  # by op: the registry's lookup is slow at this rate
        for nid in order:
            node = nodes[nid]
            if node.is_placeholder:
                info = None
            else:
                info = infos.get(node.op)
                if info is None:
                    info = infos[node.op] = lookup(node.op)
            aliased = _aliased_input(node, info)
            ins = node.inputs
            if len(ins) == 1:
                readers[base[ins[0]]].append(nid)
            else:
                for s in {base[r] for r in ins}:
                    readers[s].append(nid)
            for i, meta in enumerate(node.outputs):
                ref = Ref(nid, i)
                if aliased is not None:
                    base[ref] = base[aliased]
                else:
                    base[ref] = ref
                    nbytes[ref] = (
                        storage_bytes(nodes, node, info, i, meta, lambda r: nbytes[base[r]])
                        if info is not None and info.sized_by_call
                        else meta.span_bytes
                    )
                    readers[ref] = []
                    if info is not None and info.host_output:
                        host.add(ref)
        resident = frozenset(base[Ref(p, 0)] for p in graph.placeholders())
        outs = frozenset(base[r] for r in graph.outputs)
        return StorageMap(
            Layered(base), Layered(nbytes), Layered(readers), resident, outs, frozenset(host)
        )

    @staticmethod
    def update(
        old: StorageMap,
        parent: GraphLike,
        graph: GraphLike,
        added: set[int],
        changed: set[int],
        removed: set[int],
    ) -> StorageMap:
        """`StorageMap.build(graph)`, computed from `old` (the parent's map) for a rewrite that
        added, re-wired and removed the given nodes (see `derive_storages`)."""
        return StorageMap.update_tracked(old, parent, graph, added, changed, removed)[0]

    @staticmethod
    def update_tracked(
        old: StorageMap,
        parent: GraphLike,
        graph: GraphLike,
        added: set[int],
        changed: set[int],
        removed: set[int],
    ) -> tuple[StorageMap, StorageChanges]:
        """`update`, and which storages it dropped, appended and edited (what a table derived
        from the map, the simulator's, must redo).

        A node's storage can only move if it aliases (a view, an in-place write) a value whose
        storage moved, so the nodes re-resolved are the touched ones and their aliasing
        descendants; the readers re-registered are those and every node reading them."""
        lookup = graph.registry.lookup
        nodes = graph.nodes
        dirty = _aliasing_closure(graph, (added | changed) - removed, lookup)
        reread = {u for n in dirty for u in graph.successors(n)} | dirty
        base, nbytes, readers = _draft(old.base), _draft(old.nbytes), _draft(old.readers)
        host = set(old.host)
        edited: set[Ref] = set()
        dropped: set[Ref] = set()  # every one was in the old map: nothing is dropped twice
        appended: list[Ref] = []
        # Readers are taken out and put back per storage, not per reading node: a weight read
        # at each of 124 unrolled steps of 24 layers had its list copied once per reader.
        leaving: dict[Ref, set[int]] = {}
        for n in (reread | removed) & parent.nodes.keys():
            for s in {old.base[r] for r in parent.node(n).inputs}:
                leaving.setdefault(s, set()).add(n)
        for s, gone in leaving.items():
            if s in readers:
                readers[s] = [x for x in readers[s] if x not in gone]
                edited.add(s)
        for n in (dirty | removed) & parent.nodes.keys():
            for i in range(len(parent.node(n).outputs)):
                ref = Ref(n, i)
                base.pop(ref, None)
                if n in removed or ref not in old.nbytes:
                    if nbytes.pop(ref, None) is not None:
                        dropped.add(ref)
                    readers.pop(ref, None)
                    host.discard(ref)
        for n in _topological(graph, dirty):
            node = nodes[n]
            info = lookup(node.op)
            aliased = _aliased_input(node, info)
            for i, meta in enumerate(node.outputs):
                ref = Ref(n, i)
                if aliased is not None:
                    base[ref] = base[aliased]
                    if nbytes.pop(ref, None) is not None:
                        dropped.add(ref)
                    readers.pop(ref, None)
                    continue
                base[ref] = ref
                if ref in nbytes:
                    edited.add(ref)
                else:
                    appended.append(ref)
                nbytes[ref] = (
                    storage_bytes(nodes, node, info, i, meta, lambda r: nbytes[base[r]])
                    if info.sized_by_call
                    else meta.span_bytes
                )
                readers.setdefault(ref, [])
                if info.host_output:
                    host.add(ref)
        joining: dict[Ref, list[int]] = {}
        for n in reread:
            for s in {base[r] for r in nodes[n].inputs}:
                joining.setdefault(s, []).append(n)
        for s, new in joining.items():
            readers[s] = [*readers[s], *new]
            edited.add(s)
        outs = frozenset(base[r] for r in graph.outputs)
        smap = StorageMap(
            base.done(), nbytes.done(), readers.done(), old.resident, outs, frozenset(host)
        )
        changes = StorageChanges(
            frozenset(dropped),
            tuple(appended),
            frozenset(s for s in edited if s in nbytes and s not in dropped and s in old.nbytes),
        )
        return smap, changes

    def storage_of(self, ref: Ref) -> Ref:
        return self.base[ref]

    def allocations(self, nid: int, graph: GraphLike) -> list[Ref]:
        """Storages that running `nid` allocates."""
        return [
            Ref(nid, i) for i in range(len(graph.node(nid).outputs)) if Ref(nid, i) in self.nbytes
        ]


@dataclass(frozen=True)
class StorageChanges:
    """How `StorageMap.update_tracked` changed a map: storages `dropped` (in the old map, not
    the new), `appended` (new, in the order the new map lists them: after every kept one), and
    `edited` (in both, with readers or size possibly changed). Kept storages keep their order."""

    dropped: frozenset[Ref]
    appended: tuple[Ref, ...]
    edited: frozenset[Ref]


def _draft(mapping: Mapping) -> Draft:
    return (mapping if isinstance(mapping, Layered) else Layered(dict(mapping))).draft()


def _aliasing_closure(graph: GraphLike, start: set[int], lookup) -> set[int]:
    """`start` and every node that aliases (views, writes into) one of them, transitively."""
    out = set(start)
    stack = list(start)
    while stack:
        for u in graph.successors(stack.pop()):
            if u in out:
                continue
            node = graph.node(u)
            if node.writes_into is not None or lookup(node.op).is_view:
                out.add(u)
                stack.append(u)
    return out


def _topological(graph: GraphLike, subset: set[int]) -> list[int]:
    """`subset` in an order where each node follows its predecessors within the subset."""
    done: set[int] = set()
    out: list[int] = []
    for n in sorted(subset):
        stack = [(n, False)]
        while stack:
            v, expanded = stack.pop()
            if v in done:
                continue
            if expanded:
                done.add(v)
                out.append(v)
                continue
            stack.append((v, True))
            stack.extend((p, False) for p in graph.predecessors(v) if p in subset and p not in done)
    return out


def storage_bytes(
    nodes: Mapping[int, Node],
    node: Node,
    info: OpInfo,
    index: int,
    meta: TensorMeta,
    storage_of: Callable[[Ref], int] | None = None,
) -> int:
    """Bytes of the storage output `index` of `node` allocates: the output's own, or more where
    the registry says the kernel's buffer is larger than the output's metadata (a resized loss,
    `OpInfo.keeps_elementwise_storage`; a workspace, `OpInfo.workspace`; a copy of argument
    0's whole storage, `OpInfo.clones_storage`, with `storage_of` its storage's bytes)."""
    if info.clones_storage and storage_of is not None:
        return _cloned_bytes(node, meta, storage_of)
    if info.keeps_elementwise_storage:
        return _allocated_bytes(nodes, node, index, meta)
    if info.workspace is not None:
        return _workspace_bytes(nodes, node, info, index, meta)
    return meta.nbytes


def _cloned_bytes(node: Node, meta: TensorMeta, storage_of: Callable[[Ref], int]) -> int:
    """A functional `copy(self, src)` clones `self`'s whole storage and views it as `self`
    (ATen's `clone_preserve_strides`), but where `self` overlaps itself (an expansion: then a
    plain clone, its elements only)."""
    self_ref = node.args[0] if node.args else None
    if not isinstance(self_ref, Ref):
        return meta.span_bytes
    expanded = any(st == 0 and sz > 1 for sz, st in zip(meta.shape, meta.strides, strict=True))
    return meta.nbytes if expanded else storage_of(self_ref)


def _workspace_bytes(
    nodes: Mapping[int, Node], node: Node, info: OpInfo, index: int, meta: TensorMeta
) -> int:
    """The real size of a workspace output (`OpInfo.workspace`), from the call's argument
    metadata; other outputs keep their own size."""

    def meta_of(r: Ref) -> TensorMeta:
        return nodes[r.node].outputs[r.index]

    args = map_refs(node.args, meta_of)
    kwargs = {k: map_refs(v, meta_of) for k, v in node.kwargs}
    return max(meta.nbytes, info.workspace(args, kwargs, node.outputs).get(index, 0))


def _allocated_bytes(nodes: Mapping[int, Node], node: Node, index: int, meta: TensorMeta) -> int:
    """Bytes of the storage that output `index` of `node`, an op that resizes a larger buffer
    down to its result (`OpInfo.keeps_elementwise_storage`), allocates: a reducing loss's
    scalar keeps the elementwise loss's storage, the broadcast of its first two arguments,
    and the dispatch tracker measures it whole (`storage_bytes` checks the flag)."""
    if index or len(node.args) < 2:
        return meta.nbytes
    a, b = node.args[0], node.args[1]
    if not isinstance(a, Ref) or not isinstance(b, Ref):
        return meta.nbytes
    shapes = (nodes[r.node].outputs[r.index].shape for r in (a, b))
    return max(meta.nbytes, broadcast_numel(*shapes) * meta.itemsize)


def _aliased_input(node: Node, info: OpInfo | None) -> Ref | None:
    """The input whose storage the node's outputs share, or None when they allocate."""
    if node.writes_into is not None:
        return node.writes_into
    if info is None or not info.is_view:
        return None
    return next(refs_in(node.args), None)
