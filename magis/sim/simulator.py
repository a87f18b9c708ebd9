"""Schedule -> latency, memory timeline, peak, hot-spots (MAGIS §2.1, §6.2).

Memory follows MAGIS §2.1 on storages rather than tensors: a storage is allocated when the node
producing it starts and freed when the last reader of any of its aliases finishes; at step i the
active memory M_i sums every storage live at i (the inputs and outputs of the node running
included) plus the resident placeholders, plus, under a cost model that ran the ops, the
scratch the node running allocates and frees inside itself (`CostModel.scratch_bytes`: a
convolution's workspace or padded copies, which the allocator holds and no tensor does). The
peak is max_i M_i and the memory hot-spots are the storages live at a step where the peak is
reached.

Latency: nodes run in schedule order on two streams, compute and copy (Store/Load, §6.2); a node
starts when its stream is free and its inputs are ready. (On a device without copy engines, a
CPU, the copies add their time: `CostModel.copies_overlap`.) The host issues work in schedule order,
so a copy cannot start before the compute op scheduled just ahead of it has started: a Load
placed right before its user is not hidden, one placed earlier is. Without copy nodes this is
the sum of the operator times, as in MAGIS's cost(G). Stored tensors live in host memory: they
are not part of the device timeline, and their peak is reported as `host_peak_bytes`.

Everything that depends only on the graph (storage sizes, readers, node times: tables.py) is
computed once per graph version, or derived from the parent version's in a search; a simulation
of a new order is a few vectorized numpy passes, and the two-stream walk visits only the copies
and the ops waiting for them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from magis.cost import CostModel
from magis.ir import DerivedKey, Graph, PlaceholderKind, Ref
from magis.sim.tables import Tables, node_scratch, node_times, tables, wait_predecessors


class Category(enum.Enum):
    """What a storage holds, for the breakdown of the peak."""

    WEIGHTS = "weights"
    BUFFERS = "buffers"
    OPT_STATE = "optimizer_state"
    INPUTS = "inputs"
    GRADIENTS = "gradients"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"


# How the peak's breakdown counts each kind of input (the report's replay reads it too).
PLACEHOLDER_CATEGORY = {
    PlaceholderKind.WEIGHT: Category.WEIGHTS,
    PlaceholderKind.BUFFER: Category.BUFFERS,
    PlaceholderKind.OPT_STATE: Category.OPT_STATE,
    PlaceholderKind.DATA: Category.INPUTS,
    PlaceholderKind.CONSTANT: Category.INPUTS,
}


@dataclass(frozen=True)
class Hotspot:
    storage: Ref
    name: str  # the node that allocated it
    op: str
    nbytes: int
    shape: tuple[int, ...]
    category: Category | None  # None in a simulation without detail


class HotspotList:
    """The hot-spots of one simulation, made into `Hotspot`s when first read: a search
    simulates thousands of states and expands few of them (only rules read hot-spots). They
    are read from the graph as simulated: read them before mutating it (no search state's
    graph is ever mutated)."""

    __slots__ = ("_graph", "_tables", "_rows", "_cats", "_spots")

    def __init__(self, graph: Graph, t: Tables, rows: np.ndarray, cats) -> None:
        self._graph, self._tables, self._rows, self._cats = graph, t, rows, cats
        self._spots: tuple[Hotspot, ...] | None = None

    def get(self) -> tuple[Hotspot, ...]:
        if self._spots is None:
            graph, t, cats = self._graph, self._tables, self._cats
            spots = []
            for i in self._rows.tolist():
                s = t.storages[i]
                node = graph.node(s.node)
                spots.append(
                    Hotspot(
                        s,
                        node.name,
                        node.op,
                        int(t.nbytes[i]),
                        graph.meta(s).shape,
                        cats[i] if cats is not None else None,
                    )
                )
            self._spots = tuple(spots)
            self._graph = self._tables = self._cats = None  # what they were read from
        return self._spots


@dataclass(frozen=True)
class SimResult:
    """One schedule's simulated figures; bytes in bytes, times in seconds."""

    order: tuple[int, ...]
    peak_bytes: int
    latency_s: float
    timeline: np.ndarray  # M_i for every step i of `order`
    peak_step: int  # first step at which the peak is reached
    resident_bytes: int
    hotspot_list: HotspotList = field(repr=False)
    breakdown: dict[str, int]  # bytes per Category at `peak_step` (empty without detail)
    compute_s: float
    copy_s: float
    host_peak_bytes: int = 0  # stored (swapped-out) bytes at their peak, in host memory
    comm_s: float = 0.0  # busy seconds of the communication stream (collectives)

    @property
    def hotspots(self) -> tuple[Hotspot, ...]:
        """Non-resident storages live at a peak step, largest first."""
        return self.hotspot_list.get()

    def top_hotspots(self, k: int = 10) -> tuple[Hotspot, ...]:
        return self.hotspots[:k]


_CATEGORIES: DerivedKey[tuple[Category, ...]] = DerivedKey("sim.categories")


def storage_categories(graph: Graph) -> tuple[Category, ...]:
    """The Category of every storage of the tables, in their order (only reports need it:
    a search's thousands of simulations skip it)."""

    def build() -> tuple[Category, ...]:
        cats = _categories(graph)
        return tuple(cats.get(s, Category.TEMPORARIES) for s in tables(graph).storages)

    return graph.derived(_CATEGORIES, build)


def _categories(graph: Graph) -> dict[Ref, Category]:
    """Activations: storages made by the forward pass (ancestors of the loss, the first output).
    Gradients: backward storages of a weight's shape that a weight update reads, or that are
    outputs (a step without optimizer). Everything else produced is a temporary."""
    smap = graph.storages()
    forward: set[int] = set()
    if graph.outputs:
        import rustworkx as rx

        loss = graph.outputs[0].node
        forward = {graph.dag[i] for i in rx.ancestors(graph.dag, graph.rx_index(loss))} | {loss}
    weight_shapes = {
        graph.node(p).outputs[0].shape for p in graph.placeholders(PlaceholderKind.WEIGHT)
    }
    grads: set[Ref] = {smap.storage_of(r) for r in graph.outputs[1:]}
    for nid in graph.ops():
        node = graph.node(nid)
        if node.writes_into is None:
            continue
        for r in node.inputs:
            s = smap.storage_of(r)
            if s not in smap.resident and graph.meta(s).shape in weight_shapes:
                grads.add(s)
    cats: dict[Ref, Category] = {}
    for s in smap.nbytes:
        if s in smap.resident:
            continue
        if s in grads:
            cats[s] = Category.GRADIENTS
        elif s.node in forward:
            cats[s] = Category.ACTIVATIONS
        else:
            cats[s] = Category.TEMPORARIES
    return cats


def memory_timeline(
    graph: Graph, order: list[int] | tuple[int, ...] | np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(M_i for each step, allocation step, free step) of every non-resident storage."""
    t = tables(graph)
    ids = _as_ids(order)
    n = len(ids)
    pos = np.full(t.id_bound, -1, dtype=np.int64)
    pos[ids] = np.arange(n)
    alloc = pos[t.producer]
    free = alloc.copy()
    if len(t.reader_node):
        np.maximum.at(free, t.reader_storage, pos[t.reader_node])
    free[t.is_output] = n - 1
    timeline = _live_bytes(alloc, free, t.nbytes, n) + t.resident_bytes
    return timeline, alloc, free


def tensor_peak_bytes(graph: Graph, order) -> int:
    """The peak of the storages alone (`memory_timeline`), without any op's scratch."""
    timeline, _, _ = memory_timeline(graph, order)
    return int(timeline.max()) if len(timeline) else tables(graph).resident_bytes


def _as_ids(order) -> np.ndarray:
    if isinstance(order, np.ndarray):
        return order.astype(np.int64, copy=False)
    return np.fromiter(order, np.int64, len(order))


def _live_bytes(alloc: np.ndarray, free: np.ndarray, nbytes: np.ndarray, n: int) -> np.ndarray:
    """The bytes live at each of `n` steps, each storage from its `alloc` to its `free` step.
    Counted with `bincount` (float64, exact below 2**53 bytes: 8 PiB): `np.add.at` took ten
    times as long, a quarter of a 42,000-step simulation."""
    diff = np.bincount(alloc, weights=nbytes, minlength=n + 1)
    diff -= np.bincount(free + 1, weights=nbytes, minlength=n + 1)
    return np.cumsum(diff[:n]).astype(np.int64)


def _host_peak(t: Tables, alloc: np.ndarray, free: np.ndarray, n: int) -> int:
    """Stored tensors at their peak, plus the placeholders kept on the host all step long."""
    stored = np.flatnonzero(t.host_bytes)
    if not len(stored):
        return t.host_resident_bytes
    live = _live_bytes(alloc[stored], free[stored], t.host_bytes[stored], n)
    return int(live.max()) + t.host_resident_bytes


def simulate(
    graph: Graph, order: list[int] | tuple[int, ...], cost: CostModel, detail: bool = True
) -> SimResult:
    """Simulate running `graph` in `order` under `cost` (see the module docstring).

    Without `detail`, the breakdown of the peak by category is left empty and hot-spots carry
    no category: what a search's state needs is the peak, the latency and the hot-spots."""
    t = tables(graph)
    ids = _as_ids(order)  # once: converting a 42,000-step tuple costs more than a pass over it
    timeline, alloc, free = memory_timeline(graph, ids)
    scratch = node_scratch(graph, cost)
    if scratch is not None and len(ids):
        timeline = timeline + scratch[ids]
    if len(timeline) == 0:
        timeline = np.array([t.resident_bytes], dtype=np.int64)
    peak = int(timeline.max())
    peak_steps = np.flatnonzero(timeline == peak)
    latency, compute_s, copy_s, comm_s = _latency(graph, ids, cost)
    cats = storage_categories(graph) if detail else None
    hot = _hotspots(t, alloc, free, peak_steps)
    return SimResult(
        order=tuple(order),
        peak_bytes=peak,
        latency_s=latency,
        timeline=timeline,
        peak_step=int(peak_steps[0]),
        resident_bytes=t.resident_bytes,
        hotspot_list=HotspotList(graph, t, hot, cats),
        breakdown=_breakdown(t, cats, alloc, free, int(peak_steps[0])) if detail else {},
        compute_s=compute_s,
        copy_s=copy_s,
        host_peak_bytes=_host_peak(t, alloc, free, len(ids)),
        comm_s=comm_s,
    )


def near_peak_storages(graph: Graph, order, tolerance: float) -> frozenset[Ref]:
    """The storages live at any step of `order` whose memory is within `tolerance` (a
    fraction) of the peak. With 0, the hot-spots of `simulate`. A step a little below the peak
    matters as much as the peak when lowering the peak moves it there: after a split in n, the
    n parts repeat one another, and each part's copy of a tensor is hot in turn."""
    t = tables(graph)
    timeline, alloc, free = memory_timeline(graph, order)
    if len(timeline) == 0:
        return frozenset()
    floor = int(timeline.max()) * (1.0 - tolerance)
    steps = np.flatnonzero(timeline >= floor)
    return frozenset(t.storages[i] for i in _hotspots(t, alloc, free, steps).tolist())


def _hotspots(t: Tables, alloc, free, peak_steps: np.ndarray) -> np.ndarray:
    """Rows of the storages live at a peak step, largest first (ties in table order)."""
    idx = np.searchsorted(peak_steps, alloc)
    within = idx < len(peak_steps)
    live = np.zeros(len(alloc), dtype=bool)
    live[within] = peak_steps[idx[within]] <= free[within]
    chosen = np.flatnonzero(live & (t.nbytes > 0))  # stored (host) tensors hold no device memory
    return chosen[np.argsort(-t.nbytes[chosen], kind="stable")]


def _breakdown(t: Tables, cats, alloc, free, step: int) -> dict[str, int]:
    out = {c.value: 0 for c in Category}
    for kind, nbytes in t.resident_by_kind.items():
        out[PLACEHOLDER_CATEGORY[kind].value] += nbytes
    live = np.flatnonzero((alloc <= step) & (step <= free))
    for i in live:
        out[cats[i].value] += int(t.nbytes[i])
    return out


def _latency(graph: Graph, order, cost: CostModel) -> tuple[float, float, float, float]:
    """(makespan, busy compute seconds, busy copy seconds, busy communication seconds)."""
    times = node_times(graph, cost)
    t = tables(graph)
    copies, comms = t.copy_nodes, t.comm_nodes
    copy_s = _busy(times, copies)
    comm_s = _busy(times, comms)
    ids = _as_ids(order)
    compute_s = float(times[ids].sum()) - copy_s - comm_s if len(ids) else 0.0
    if not copies and not comms:
        return compute_s, compute_s, 0.0, 0.0
    if not cost.copies_overlap:  # the copies take the computing threads' time
        if not comms:
            return compute_s + copy_s, compute_s, copy_s, 0.0
        copies = frozenset()  # run in line with compute; the collectives still overlap
    makespan = two_stream_makespan(graph, ids, times, copies, comms, t.wait_preds)
    return makespan, compute_s, copy_s, comm_s


def _busy(times: np.ndarray, nodes: frozenset[int]) -> float:
    return float(times[np.sort(np.fromiter(nodes, np.int64, len(nodes)))].sum())


def two_stream_makespan(
    graph: Graph,
    ids: np.ndarray,
    times: np.ndarray,
    copies,
    comms=frozenset(),
    waits: Mapping[int, Sequence[int]] | None = None,
) -> float:
    """Nodes run in `ids` order on two streams (the module docstring), three with collectives:
    a node starts when its stream is free and its inputs are ready, and a copy or a collective
    no earlier than the compute op issued just before it (a collective runs on a communication
    stream of its own, as NCCL's do: the copy stream's mechanism with its own clock).

    Only copies and the compute ops that read a copy can wait for anything but the compute
    stream; every other op starts when the one before it ends. So the runs of compute ops
    between those events are running sums (`accumulate`: the same additions in the same order
    as a node-by-node walk) and only the events are walked one by one, on Python floats (a
    numpy call per event cost more than the event: 14,000 copies among 140,000 nodes took
    0.17 s a simulation, 0.05 s so). `waits`: each event node's predecessors
    (`Tables.wait_preds`, which may hold more nodes than read a copy), else asked of the
    graph."""
    n = len(ids)
    if n == 0:
        return 0.0
    side = copies | comms
    if waits is None:
        waits = wait_predecessors(graph, side)
    pos = np.full(max(int(ids.max()) + 1, 1), -1, dtype=np.int64)
    pos[ids] = np.arange(n)
    nodes = np.fromiter(waits, np.int64, len(waits))
    nodes = nodes[nodes < len(pos)]
    at_pos = pos[nodes]
    by_pos = np.argsort(at_pos, kind="stable")
    nodes, at_pos = nodes[by_pos], at_pos[by_pos]
    first = int(np.searchsorted(at_pos, 0))  # the nodes not in `ids` sort first
    index = pos.tolist()
    t = times[ids].tolist()
    finish = [0.0] * n
    compute_free = copy_free = comm_free = issued = 0.0
    at = 0  # first position not yet timed
    for nid, e in zip(nodes[first:].tolist(), at_pos[first:].tolist(), strict=True):
        if e > at:  # a run of compute ops, each starting when the one before ends
            run = list(accumulate(t[at:e], initial=compute_free))
            finish[at:e] = run[1:]
            issued, compute_free = run[-2], run[-1]
        preds = waits[nid]
        ready = max([finish[index[p]] for p in preds]) if preds else 0.0
        if nid in copies:
            start = max(ready, copy_free, issued)
            finish[e] = copy_free = start + t[e]
        elif nid in comms:
            start = max(ready, comm_free, issued)
            finish[e] = comm_free = start + t[e]
        else:
            start = issued = max(ready, compute_free)
            finish[e] = compute_free = start + t[e]
        at = e + 1
    if n > at:
        finish[at:] = list(accumulate(t[at:], initial=compute_free))[1:]
    return max(finish)
