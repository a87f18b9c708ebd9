"""Store and Load timing (MAGIS §6.2): Store as early as possible, Load as late as its transfer
can still be hidden behind compute.

A Store moves right after the producer of the tensor it copies, so the device copy can die as
soon as its last early reader has run. A Load moves back from its first user over compute ops
until their time covers its transfer — or until it meets its Store or something it depends on —
so its buffer is allocated no earlier than needed. The copies share one stream, in the order
they are issued: a Load must also be done before the next Load's copy starts, or that one
waits. So the Loads are placed latest first, each one's deadline the earlier of its user's
start and the start of the Load placed after it (times as compute alone would run: the sum of
the compute ops before). Without that, the Loads of one layer's optimizer state (a dozen
tensors, updated one after the other) were each moved back by their own transfer only, and
queued behind each other while the updates waited: offloading half of corpus:gpt2's AdamW
state cost 8.5% of the step, 5.0% placed by deadlines.

`time_swaps` runs on every child of a search state whose graph has swaps (a 7,000-node decoder
split 8 ways has 50,000 nodes and a few hundred copies). Moving each copy with `list.remove`,
`index` and `insert` cost a pass over the order per copy and per neighbour: on corpus:qwen2
under a 0.4 memory limit, a quarter of the workers' time. Here the order is indexed once, each
copy gets a position key between its new neighbours', and the order is rebuilt once from
slices; `time_swaps_by_moves` is the copy-by-copy definition it reproduces exactly (the tests
compare them), and the fallback where a Store depends on another Store.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

import numpy as np

from magis.cost import CostModel
from magis.ir import Graph, positions
from magis.ir.ops import LOAD_OP, STORE_OP
from magis.sim import node_times, tables


def time_swaps(
    graph: Graph,
    order: list[int] | tuple[int, ...],
    cost: CostModel,
    pos: Mapping[int, int] | None = None,
) -> list[int]:
    """`order` with every Store right after its producer and every Load placed by
    `_hidden_position`, each copy in turn in program order (Stores first). `pos`: the
    order's positions, if known (read for the copies and their neighbours only)."""
    t = tables(graph)
    copies = t.copy_nodes
    if not copies:
        return list(order)
    if pos is None or len(copies) * _READS_PER_INDEXED_STEP > len(order):
        pos = positions(order)
    preds = t.wait_preds  # every copy's predecessors
    stores, loads = _copies(graph, copies, pos)
    if any(p in copies and graph.node(p).op == STORE_OP for s in stores for p in preds[s]):
        return time_swaps_by_moves(graph, order, cost)
    times = node_times(graph, cost)
    return _placed_by_keys(graph, order, stores, loads, times, cost, pos, copies, preds)


# A given `pos` (the rescheduler's ranks of an order made by insertions) costs about this many
# times an index of the order per read. Timing reads a few positions per copy: with more copies
# than a 64th of the order (14,000 among 140,000 steps of an unrolled scan, where the reads
# took 0.1 s a child), the order is indexed once instead.
_READS_PER_INDEXED_STEP = 64


def _copies(graph: Graph, copies, pos: Mapping[int, int]) -> tuple[list[int], list[int]]:
    """The Stores and the Loads, each in `pos`'s order (sorted, not found by a scan of the
    order: a few hundred copies among 42,000 steps of a split decoder)."""
    moved = sorted(copies, key=pos.__getitem__)
    stores = [n for n in moved if graph.node(n).op == STORE_OP]
    loads = [n for n in moved if graph.node(n).op == LOAD_OP]
    return stores, loads


def _placed_by_keys(
    graph: Graph,
    order,
    stores: list[int],
    loads: list[int],
    times,
    cost: CostModel,
    pos: Mapping[int, int] | None = None,
    copies: frozenset[int] = frozenset(),
    preds: Mapping[int, tuple[int, ...]] | None = None,
) -> list[int]:
    """The Stores, then each Load (latest user first), taken out and put back as
    `time_swaps_by_moves` does, on position keys: a node of `order` keeps its index, a placed
    copy gets a key between its new neighbours' keys, and the order is rebuilt once at the
    end. `pos`: `order`'s positions, if known."""
    pos = positions(order) if pos is None else pos
    removed: set[int] = set()  # indices in `order` of the copies taken out
    keys: list[float] = []  # the placed copies' keys, sorted, and the copies
    placed: list[int] = []
    key_of: dict[int, float] = {}

    def key(n: int) -> float:
        k = key_of.get(n)
        return pos[n] if k is None else k

    def before(k: float) -> tuple[float, int] | None:
        """The key and node right before key `k` in the current order."""
        i = math.ceil(k) - 1
        while i in removed:
            i -= 1
        j = bisect.bisect_left(keys, k) - 1
        if j >= 0 and (i < 0 or keys[j] > i):
            return keys[j], placed[j]
        return (i, order[i]) if i >= 0 else None

    def place(n: int, k: float) -> None:
        j = bisect.bisect_left(keys, k)
        keys.insert(j, k)
        placed.insert(j, n)
        key_of[n] = k

    def lowest_above(k: float) -> float | None:
        """The lowest key in the current order above key `k`."""
        i = math.floor(k) + 1
        while i in removed:
            i += 1
        j = bisect.bisect_right(keys, k)
        found = ([i] if i < len(order) else []) + keys[j : j + 1]
        return min(found, default=None)

    def hidden_key(at: float, floor: float, need: float) -> float:
        """Where a Load due before key `at` goes: back over compute ops until their time
        covers `need`, never to or before key `floor`. `time_swaps_by_moves` walks node by
        node; here the compute ops' start times say at once where the walk ends (a Load of
        a large tensor is moved back over thousands of small ops: on an FSDP step of 11,821
        nodes, the walks were a quarter of the search's time)."""
        if need <= 0:
            return at
        ends = math.ceil(at)
        covering = min(bisect.bisect_right(start, start[ends] - need) - 1, ends - 1)
        if covering > floor:
            return covering  # a compute op with time: never a removed copy
        lowest = lowest_above(floor)
        return lowest if lowest is not None and lowest < at else at

    # No Store depends on a Store, so each Store's latest predecessor is where it was in
    # `order`; the Stores after one producer run latest-moved first (each went right after it).
    preds = tables(graph).wait_preds if preds is None else preds  # every copy's predecessors
    after: dict[int, list[int]] = {}
    for s in stores:
        removed.add(pos[s])
        after.setdefault(max(pos[p] for p in preds[s]), []).append(s)
    for producer, group in after.items():
        for j, s in enumerate(reversed(group)):
            place(s, producer + (j + 1) / (len(group) + 1))
    # a Load's users are compute ops or Stores, placed already: their keys stay as they are
    users_at = {ld: min(key(u) for u in graph.successors(ld)) for ld in loads}
    # Stores only: not needed. A list: read one value at a time, bisected
    start = _compute_starts(order, times, copies).tolist() if loads else []
    stream = math.inf  # when the copy of the Load placed last (the next one in time) starts
    for ld in sorted(loads, key=lambda n: (-users_at[n], -pos[n])):
        removed.add(pos[ld])
        at = users_at[ld]
        floor = max(key(p) for p in preds[ld])
        user_starts = start[math.ceil(at)]
        need = float(times[ld]) + max(0.0, user_starts - stream)
        at = hidden_key(at, floor, need)
        prev = before(at)
        stream = start[math.ceil(at)]
        k = ((prev[0] if prev is not None else at - 1) + at) / 2
        if not (prev is None or prev[0] < k) or not k < at:  # keys ran out of float precision
            return time_swaps_by_moves(graph, order, cost)
        place(ld, k)
    inserted = [(k, 0, n) for k, n in zip(keys, placed, strict=True)]
    return _rebuilt(list(order), list(removed), inserted)


def _rebuilt(order: list[int], removed: list[int], inserted: list[tuple]) -> list[int]:
    """`order` without the nodes at the indices `removed`, with each `inserted` (key, tie,
    node) put before the first index at or above its key (equal keys by their tie)."""
    # An insertion before a removal at the same key: the removed index is not skipped twice.
    events = sorted(
        [(k, 0, tie, node) for k, tie, node in inserted] + [(i, 1, 0, -1) for i in removed]
    )
    out: list[int] = []
    start = 0
    for k, is_removal, _, node in events:
        i = math.ceil(k)
        out.extend(order[start:i])
        if is_removal:
            start = max(start, i + 1)
        else:
            out.append(node)
            start = max(start, i)
    out.extend(order[start:])
    return out


def time_swaps_by_moves(
    graph: Graph, order: list[int] | tuple[int, ...], cost: CostModel
) -> list[int]:
    """The definition: each Store, then each Load (latest user first), taken out of the order
    and put back."""
    order = list(order)
    pos = positions(order)
    stores, loads = _copies(graph, tables(graph).copy_nodes, pos)
    for s in stores:
        order.remove(s)
        producer_pos = max(order.index(p) for p in graph.predecessors(s))
        order.insert(producer_pos + 1, s)
    times = node_times(graph, cost)
    copies = tables(graph).copy_nodes
    at_user = positions(order)
    stream = math.inf
    for ld in sorted(loads, key=lambda n: (-min(at_user[u] for u in graph.successors(n)), -pos[n])):
        order.remove(ld)
        start = _compute_starts(order, times, copies)
        first_user = min(order.index(u) for u in graph.successors(ld))
        need = cost.op_time(graph, ld) + max(0.0, float(start[first_user]) - stream)
        at = _hidden_position(graph, order, ld, times, need, copies)
        stream = float(start[at])
        order.insert(at, ld)
    return order


def _compute_starts(order, times: np.ndarray, copies: frozenset[int]) -> np.ndarray:
    """When each node of `order` (and the end, last) starts if only the compute ops took time:
    one vectorized pass (a split decoder's order has 50,000 nodes, timed on every child)."""
    ids = np.asarray(order, dtype=np.int64)
    t = times[ids]
    if copies:
        t = t.copy()
        t[np.isin(ids, np.fromiter(copies, np.int64, len(copies)))] = 0.0
    return np.concatenate(([0.0], np.cumsum(t)))


def _hidden_position(
    graph: Graph, order: list[int], load: int, times, transfer: float, copies=frozenset()
) -> int:
    first_user = min(order.index(u) for u in graph.successors(load))
    floor = max(order.index(p) for p in graph.predecessors(load)) + 1
    covered, at = 0.0, first_user
    while at > floor and covered < transfer:
        at -= 1
        if order[at] not in copies:
            covered += float(times[order[at]])
    return at
