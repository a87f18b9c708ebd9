"""What the simulation of any order of one graph version reuses: its storages as arrays, and
its nodes' times under a cost model (MAGIS §2.1, §6.2).

Both are facts of a graph version, cached on it. A search simulates thousands of versions, each
a rewrite of its parent touching a handful of nodes, so `derive_facts` builds a child's facts
from its parent's: the storage map through `StorageMap.update_tracked`, the arrays by dropping,
editing and appending the rows of the storages it reports, the times by timing only the nodes
whose objects changed. The result equals a build from scratch, row order included (the
hot-spots list equal-sized storages in that order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from magis.ir import DerivedKey, Graph, PlaceholderKind, Ref, StorageMap
from magis.ir.collectives import comm_nodes
from magis.ir.ops import LOAD_OP, STORE_OP

if TYPE_CHECKING:
    from magis.cost import CostModel

KEY_STRIDE = 1 << 20  # a storage's key: producer id * KEY_STRIDE + output index


@dataclass(frozen=True)
class Tables:
    """The non-resident storages of one graph version, in its StorageMap's order, as arrays."""

    storages: np.ndarray  # Ref objects
    keys: np.ndarray  # int64 key of each storage (rows are found by key)
    nbytes: np.ndarray  # device bytes (0 for a storage in host memory)
    host_bytes: np.ndarray  # bytes held in host memory (0 for device storages)
    producer: np.ndarray  # node id allocating each storage
    reader_storage: np.ndarray  # (row, reader node id) pairs, flattened
    reader_node: np.ndarray
    is_output: np.ndarray
    outputs: frozenset[Ref]  # the StorageMap's output storages these rows were marked from
    resident: frozenset[Ref]
    resident_bytes: int  # placeholders the device holds for the whole step
    resident_by_kind: dict[PlaceholderKind, int]
    id_bound: int  # above every node id
    copy_nodes: frozenset[int]  # Store and Load nodes
    # Collectives (the communication stream's): derived as the copies are, since a search's
    # every state is a new graph version and a scan of 6,419 nodes costs 1.7 ms
    comm_nodes: frozenset[int] = frozenset()
    # Placeholders the device never holds between steps: read only by Loads, written only by a
    # Store (offloaded optimizer state, `magis.rules.offload`). They live in host memory for
    # the whole step, counted there, not in `resident_bytes`; each Load's copy is a device
    # storage like any other.
    host_resident: frozenset[Ref] = frozenset()
    host_resident_bytes: int = 0
    # What the two-stream walk visits one by one (`simulator.two_stream_makespan`): every copy
    # and collective and every node reading one, with its predecessors. Kept with the graph
    # version and derived from the parent's: at 100,000 nodes with 14,000 copies, asking the
    # graph for 23,500 nodes' predecessors on every simulation took 0.05 s. A derived table may
    # also hold nodes that no longer read one (a node on the compute stream alone walks as a
    # run would: the same start and finish).
    wait_preds: Mapping[int, tuple[int, ...]] = field(default_factory=dict, compare=False)


_TABLES: DerivedKey[Tables] = DerivedKey("sim.tables")
_TIMES: DerivedKey[dict] = DerivedKey("sim.node_times")  # cost model -> times by node id
_SCRATCH: DerivedKey[dict] = DerivedKey("sim.node_scratch")  # cost model -> scratch by node id


def tables(graph: Graph) -> Tables:
    """The graph version's tables (built on first use)."""
    return graph.derived(_TABLES, lambda: _build(graph))


def node_times(graph: Graph, cost: CostModel) -> np.ndarray:
    """`cost.node_times(graph)`, kept with the graph version (do not write into it)."""
    per_cost = graph.derived(_TIMES, dict)
    times = per_cost.get(cost)
    if times is None:
        times = per_cost[cost] = cost.node_times(graph)
    return times


def node_scratch(graph: Graph, cost: CostModel) -> np.ndarray | None:
    """`cost.node_scratch(graph)`, kept with the graph version (None: the model knows none)."""
    if not cost.measures_scratch:
        return None
    per_cost = graph.derived(_SCRATCH, dict)
    scratch = per_cost.get(cost)
    if scratch is None:
        scratch = per_cost[cost] = cost.node_scratch(graph)
    return scratch


def _key(s: Ref) -> int:
    return s.node * KEY_STRIDE + s.index


def _build(graph: Graph) -> Tables:
    smap = graph.storages()
    resident = smap.resident
    sized = [(s, b) for s, b in smap.nbytes.items() if s not in resident]
    storages = [s for s, _ in sized]
    rs, rn = [], []
    readers = smap.readers
    for i, s in enumerate(storages):
        for reader in readers[s]:
            rs.append(i)
            rn.append(reader)
    copies, comms = graph.copy_nodes(), comm_nodes(graph)
    on_host = host_resident(graph, smap, copies)
    resident_by = _resident_by_kind(graph, smap, on_host)
    sizes = np.array([b for _, b in sized], dtype=np.int64)
    host = np.array([s in smap.host for s in storages], dtype=bool)
    return Tables(
        storages=_objects(storages),
        keys=np.array([_key(s) for s in storages], dtype=np.int64),
        nbytes=np.where(host, 0, sizes),
        host_bytes=np.where(host, sizes, 0),
        producer=np.array([s.node for s in storages], dtype=np.int64),
        reader_storage=np.array(rs, dtype=np.int64),
        reader_node=np.array(rn, dtype=np.int64),
        is_output=np.array([s in smap.outputs for s in storages], dtype=bool),
        outputs=smap.outputs,
        resident=smap.resident,
        resident_bytes=sum(resident_by.values()),
        resident_by_kind=resident_by,
        id_bound=graph.next_id,
        copy_nodes=copies,
        comm_nodes=comms,
        host_resident=on_host,
        host_resident_bytes=sum(smap.nbytes[s] for s in on_host),
        wait_preds=wait_predecessors(graph, copies | comms),
    )


def wait_predecessors(graph: Graph, side: frozenset[int]) -> dict[int, tuple[int, ...]]:
    """Every node of `side` (copies, collectives) and every reader of one, with its
    predecessors: the nodes that may wait on something else than the compute stream."""
    waits = set(side)
    for c in side:
        waits.update(graph.successors(c))
    return {n: tuple(graph.predecessors(n)) for n in waits}


def host_resident(graph: Graph, smap: StorageMap, copies: frozenset[int]) -> frozenset[Ref]:
    """The placeholders' storages that live in host memory (see `Tables.host_resident`): the
    inputs of Loads (found from the copy nodes, a few hundred at most, not by a scan of the
    graph) whose every reader is a Load. Only offloading makes a Load of a placeholder, and it
    makes the placeholder's update write into a device copy that a Store writes back."""
    nodes = graph.nodes
    found = set()
    for c in copies:
        node = nodes[c]
        if node.op != LOAD_OP or not nodes[node.inputs[0].node].is_placeholder:
            continue
        s = smap.base[node.inputs[0]]
        if s not in smap.resident or s in found:
            continue
        if all(nodes[r].op == LOAD_OP for r in smap.readers[s]):
            found.add(s)
    return frozenset(found)


def _objects(items: list) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


# --- deriving a child's facts from its parent's ------------------------------------------------


def derive_facts(
    parent: Graph,
    child: Graph,
    added: Iterable[int],
    changed: Iterable[int],
    removed: Iterable[int],
    cost: CostModel | None = None,
) -> None:
    """Install on `child` (`parent` with `added` nodes, `changed` nodes - re-wired or given new
    metadata - and `removed` nodes) its StorageMap, its tables and, with `cost`, its node
    times, each derived from the parent's. `child` is not mutated afterwards (its facts would be
    dropped). Nodes of `child` not named keep their parent's Node objects."""
    added, changed, removed = set(added), set(changed), set(removed)
    smap, changes = StorageMap.update_tracked(
        parent.storages(), parent, child, added, changed, removed
    )
    child.set_storages(smap)
    derived = _derive_tables(tables(parent), child, smap, changes, added, changed, removed)
    child.derived(_TABLES, lambda: derived)
    if cost is not None:
        derive_node_times(parent, child, cost, added | changed, removed)


def derive_node_times(
    parent: Graph, child: Graph, cost: CostModel, retime: Iterable[int], removed: Iterable[int]
) -> None:
    """Install on `child` its node times under `cost`: the parent's, the `retime` nodes (every
    node whose Node object is not the parent's) and their readers (whose inputs' metadata, a
    part of their cost key, may have changed) timed again, the `removed` ones dropped."""
    retime = set(retime)
    retime.update(r for n in list(retime) if n in child for r in child.successors(n))
    removed = set(removed)
    times = _derive_per_node(node_times(parent, cost), child, retime, removed, cost.op_time)
    child.derived(_TIMES, dict).setdefault(cost, times)
    if cost.measures_scratch:
        parent_scratch = node_scratch(parent, cost)
        scratch = _derive_per_node(parent_scratch, child, retime, removed, cost.scratch_bytes)
        child.derived(_SCRATCH, dict).setdefault(cost, scratch)


def _derive_tables(
    t: Tables,
    child: Graph,
    smap: StorageMap,
    changes,
    added: set[int],
    changed: set[int],
    removed: set[int],
) -> Tables:
    """The parent's rows minus the dropped ones, the edited ones redone in place, the appended
    ones at the end: the order `StorageMap.update_tracked` gives the child's map."""
    resident = smap.resident
    dropped = [_key(s) for s in changes.dropped if s not in resident]
    edited = [_key(s) for s in changes.edited if s not in resident]
    drop, edit = _rows_with(t.keys, dropped), _rows_with(t.keys, edited)
    keep = ~drop
    row = np.cumsum(keep) - 1  # old row -> new row
    pairs = ~(drop | edit)[t.reader_storage]
    reader_storage = [row[t.reader_storage[pairs]]]
    reader_node = [t.reader_node[pairs]]
    appended = [s for s in changes.appended if s not in resident]
    storages = np.concatenate([t.storages[keep], _objects(appended)])
    sizes = np.concatenate([t.nbytes[keep] + t.host_bytes[keep], np.zeros(len(appended), np.int64)])
    host = np.concatenate([t.host_bytes[keep] > 0, np.zeros(len(appended), dtype=bool)])
    redo = [*zip(row[edit].tolist(), t.storages[edit].tolist(), strict=True)]
    redo += [(len(storages) - len(appended) + j, s) for j, s in enumerate(appended)]
    for r, s in redo:
        sizes[r] = smap.nbytes[s]
        host[r] = s in smap.host
        readers = smap.readers[s]
        reader_storage.append(np.full(len(readers), r, dtype=np.int64))
        reader_node.append(np.asarray(readers, dtype=np.int64))
    copies = _derive_copy_nodes(t.copy_nodes, child, added, removed)
    comms = _derive_comm_nodes(t.comm_nodes, child, added, removed)
    on_host = host_resident(child, smap, copies) if copies or t.host_resident else frozenset()
    if on_host != t.host_resident:
        resident_by = _resident_by_kind(child, smap, on_host)
    else:
        resident_by = t.resident_by_kind
    if smap.outputs == t.outputs:
        is_output = np.concatenate([t.is_output[keep], [s in smap.outputs for s in appended]])
    else:
        is_output = np.array([s in smap.outputs for s in storages.tolist()], dtype=bool)
    return Tables(
        storages=storages,
        keys=np.concatenate([t.keys[keep], np.array([_key(s) for s in appended], np.int64)]),
        nbytes=np.where(host, 0, sizes),
        host_bytes=np.where(host, sizes, 0),
        producer=np.concatenate([t.producer[keep], [s.node for s in appended]]).astype(np.int64),
        reader_storage=np.concatenate(reader_storage).astype(np.int64, copy=False),
        reader_node=np.concatenate(reader_node).astype(np.int64, copy=False),
        is_output=is_output.astype(bool),
        outputs=smap.outputs,
        resident=resident,
        resident_bytes=sum(resident_by.values()),
        resident_by_kind=resident_by,
        id_bound=child.next_id,
        copy_nodes=copies,
        comm_nodes=comms,
        host_resident=on_host,
        host_resident_bytes=sum(smap.nbytes[s] for s in on_host),
        wait_preds=_derive_wait_preds(
            t.wait_preds, child, copies | comms, added | changed, removed
        ),
    )


def _resident_by_kind(
    graph: Graph, smap: StorageMap, on_host: frozenset[Ref]
) -> dict[PlaceholderKind, int]:
    """The device-resident bytes per kind of placeholder (those on the host left out)."""
    out: dict[PlaceholderKind, int] = {}
    for s in smap.resident - on_host:
        kind = graph.node(s.node).placeholder_kind
        out[kind] = out.get(kind, 0) + smap.nbytes[s]
    return out


# Keys looked for one by one below this many: each is a compare over the rows, where `np.isin`
# sorts the rows (23,600 storages of a split decoder: 0.15 ms a child for a handful of keys).
_FEW_KEYS = 32


def _rows_with(keys: np.ndarray, wanted: list[int]) -> np.ndarray:
    """A mask of the rows whose key is one of `wanted`."""
    if len(wanted) > _FEW_KEYS:
        return np.isin(keys, wanted)
    mask = np.zeros(len(keys), dtype=bool)
    for k in wanted:
        mask |= keys == k
    return mask


def _derive_copy_nodes(
    parent: frozenset[int], child: Graph, added: set[int], removed: set[int]
) -> frozenset[int]:
    new = [n for n in added if child.node(n).op in (STORE_OP, LOAD_OP)]
    if not new and not (removed & parent):
        return parent
    return frozenset((parent - removed).union(new))


def _derive_comm_nodes(
    parent: frozenset[int], child: Graph, added: set[int], removed: set[int]
) -> frozenset[int]:
    lookup = child.registry.lookup
    new = [n for n in added if lookup(child.node(n).op).comm_stream]
    if not new and not (removed & parent):
        return parent
    return frozenset((parent - removed).union(new))


def _derive_wait_preds(
    parent: Mapping[int, tuple[int, ...]],
    child: Graph,
    side: frozenset[int],
    redo: set[int],
    removed: set[int],
) -> Mapping[int, tuple[int, ...]]:
    """`Tables.wait_preds` of `child` from its parent's: the `redo` nodes (added, re-wired or
    re-strided: the only ones whose predecessors can differ) asked again, the removed dropped.
    A node that starts reading a copy or collective is re-wired or new, so it is asked."""
    if not side and not parent:
        return parent
    out = {n: p for n, p in parent.items() if n not in removed and n not in redo}
    for n in redo:
        if n not in child:
            continue
        preds = tuple(child.predecessors(n))
        if n in side or any(p in side for p in preds):
            out[n] = preds
    return out


def _derive_per_node(
    parent: np.ndarray,
    child: Graph,
    redo: set[int],
    removed: set[int],
    value_of: Callable[[Graph, int], float],
) -> np.ndarray:
    """A per-node array of `child` from its `parent`'s (node times, scratch bytes): the
    `redo` nodes valued again by `value_of(child, node)`, the removed ones zeroed."""
    out = np.zeros(child.next_id, dtype=parent.dtype)
    out[: len(parent)] = parent[: child.next_id]
    if removed:
        out[[n for n in removed if n < len(out)]] = 0
    for n in redo:
        if n in child:
            out[n] = value_of(child, n)
    return out
