"""One schedule replayed node by node, as the files a person opens need it (MAGIS §2.1, §6.2).

The simulator (`magis.sim`) reports a schedule's peak, latency and memory timeline without
timing each node (a search needs only the totals). A trace or an HTML page draws every node on
its stream at its start time, and every storage from its allocation to its free, so `replay`
walks the schedule once, node by node, under the simulator's rules:

- a node runs on the copy stream if it is a Store or a Load, on the compute stream otherwise;
  it starts when its stream is free and its inputs are ready, and a copy no earlier than the
  compute op issued just before it (`magis.sim.simulator.two_stream_makespan`); on a device
  without copy engines (`CostModel.copies_overlap` false) every node waits for the one before;
- a non-resident storage is allocated when its producer starts and freed after the last reader
  of any of its aliases ends; graph outputs are never freed; placeholders are resident
  throughout (`magis.sim.memory_timeline`).

Addresses come from an LLFB layout of the schedule (`magis.layout`, ROAM §IV-B): storages alive
together never share a byte, and resident tensors sit in a second region after the arena.
The replay's live bytes equal the simulator's timeline step for step and its last finish time
equals the simulated latency; the tests check both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from magis.ir import Graph, Ref
from magis.layout import ALIGNMENT, plan_layout
from magis.sim import SimResult, memory_timeline, node_times, simulate, tables
from magis.sim.simulator import PLACEHOLDER_CATEGORY, storage_categories

if TYPE_CHECKING:
    from magis.cost import CostModel

COMPUTE_STREAM = "compute"
COPY_STREAM = "copy"
RESIDENT_ALIGNMENT = 2**21  # the resident region starts on a 2 MiB boundary after the arena


@dataclass(frozen=True)
class Storage:
    """One allocation of the replay: a storage of the graph with its lifetime and address."""

    ref: Ref
    label: str  # the producing node's name, with the output index when it has several
    op: str
    nbytes: int
    category: str  # a `magis.sim.Category` value
    alloc_step: int  # -1: resident, allocated before the step starts
    free_step: int | None  # None: alive at the end (resident, or a graph output)
    address: int  # bytes from the start of the device's memory


@dataclass(frozen=True)
class Replay:
    """A schedule with every node timed and every storage placed; times in seconds."""

    graph: Graph
    sim: SimResult
    order: tuple[int, ...]
    start_s: np.ndarray  # per step of `order`
    finish_s: np.ndarray
    on_copy_stream: np.ndarray  # bool per step
    storages: tuple[Storage, ...]  # non-resident ones with device bytes, in allocation order
    residents: tuple[Storage, ...]
    arena_bytes: int  # the LLFB layout's arena (resident tensors excluded)

    @property
    def live_bytes(self) -> np.ndarray:
        """Bytes on the device during each step (the simulator's M_i)."""
        return self.sim.timeline

    @property
    def resident_base(self) -> int:
        """Where the resident region starts: the first 2 MiB boundary after the arena."""
        return _resident_base(self.arena_bytes)

    def allocated_by(self) -> dict[int, list[Storage]]:
        """Step -> the storages allocated when the node of that step starts."""
        out: dict[int, list[Storage]] = {}
        for s in self.storages:
            out.setdefault(s.alloc_step, []).append(s)
        return out

    def freed_after(self) -> dict[int, list[Storage]]:
        """Step -> the storages freed when the node of that step ends."""
        out: dict[int, list[Storage]] = {}
        for s in self.storages:
            if s.free_step is not None:
                out.setdefault(s.free_step, []).append(s)
        return out


def replay(graph: Graph, order: Sequence[int], cost: CostModel) -> Replay:
    """Replay `graph` run in `order` under `cost` (see the module docstring)."""
    order = tuple(order)
    sim = simulate(graph, order, cost)
    start, finish, on_copy = _stream_times(graph, order, cost)
    layout = plan_layout(graph, list(order), "llfb")
    storages = _arena_storages(graph, order, layout.offset_of)
    return Replay(
        graph=graph,
        sim=sim,
        order=order,
        start_s=start,
        finish_s=finish,
        on_copy_stream=on_copy,
        storages=storages,
        residents=_resident_storages(graph, _resident_base(layout.arena_bytes)),
        arena_bytes=layout.arena_bytes,
    )


def _resident_base(arena_bytes: int) -> int:
    return -(-arena_bytes // RESIDENT_ALIGNMENT) * RESIDENT_ALIGNMENT


def _stream_times(
    graph: Graph, order: tuple[int, ...], cost: CostModel
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, finish, on the copy stream) of every step, walked one node at a time."""
    times = node_times(graph, cost)
    copies = tables(graph).copy_nodes
    overlap = cost.copies_overlap
    n = len(order)
    start, finish = np.zeros(n), np.zeros(n)
    on_copy = np.array([nid in copies for nid in order], dtype=bool)
    done: dict[int, float] = {}
    compute_free = copy_free = issued = last = 0.0
    for i, nid in enumerate(order):
        ready = max((done[p] for p in graph.predecessors(nid)), default=0.0)
        if not overlap:  # one queue: every node waits for the one before
            begin = max(ready, last)
        elif on_copy[i]:
            begin = max(ready, copy_free, issued)
        else:
            begin = issued = max(ready, compute_free)
        end = begin + float(times[nid])
        if overlap and on_copy[i]:
            copy_free = end
        else:
            compute_free = end
        start[i], finish[i], done[nid], last = begin, end, end, end
    return start, finish, on_copy


def _arena_storages(
    graph: Graph, order: tuple[int, ...], offsets: dict[Ref, int]
) -> tuple[Storage, ...]:
    t = tables(graph)
    _, alloc, free = memory_timeline(graph, order)
    cats = storage_categories(graph)
    rows = [i for i in range(len(t.storages)) if t.nbytes[i] > 0]  # host storages: no device
    rows.sort(key=lambda i: (int(alloc[i]), i))
    out = []
    for i in rows:
        ref = t.storages[i]
        out.append(
            Storage(
                ref=ref,
                label=_label(graph, ref),
                op=graph.node(ref.node).op,
                nbytes=int(t.nbytes[i]),
                category=cats[i].value,
                alloc_step=int(alloc[i]),
                free_step=None if t.is_output[i] else int(free[i]),
                address=offsets[ref],
            )
        )
    return tuple(out)


def _resident_storages(graph: Graph, base: int) -> tuple[Storage, ...]:
    smap = graph.storages()
    out, address = [], base
    for ref in sorted(smap.resident, key=lambda r: (r.node, r.index)):
        node = graph.node(ref.node)
        nbytes = smap.nbytes[ref]
        if nbytes <= 0:
            continue
        kind = PLACEHOLDER_CATEGORY[node.placeholder_kind].value
        out.append(Storage(ref, _label(graph, ref), node.op, nbytes, kind, -1, None, address))
        address += -(-nbytes // ALIGNMENT) * ALIGNMENT
    return tuple(out)


def _label(graph: Graph, ref: Ref) -> str:
    node = graph.node(ref.node)
    return node.name if len(node.outputs) <= 1 else f"{node.name}[{ref.index}]"
