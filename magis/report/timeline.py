"""A simulated schedule as files that existing tools open (MAGIS §2.1, §6.2 figures, drawn).

`write_chrome_trace` writes the Chrome trace-event JSON that Perfetto (ui.perfetto.dev) and
chrome://tracing open. The file is one object:

- ``traceEvents``: a list of events; every event has ``ph`` (its phase), ``pid`` and ``ts``.
  Each run (a schedule of a graph, e.g. "program order" and "plan") is a process: ``pid`` is
  the run's position plus one, and ``M`` events name it (``process_name``, ``args.name``) and
  its two threads (``thread_name``): ``tid`` 1 is the compute stream, ``tid`` 2 the copy
  stream (Store/Load, MAGIS §6.2).
  - ``X`` (complete) events, one per operator node: ``name`` is "<op> <node name>", ``cat`` the
    category of what it allocates (a `magis.sim.Category` value, or "none"), ``ts`` its
    simulated start and ``dur`` its time, both in microseconds; ``args`` holds ``bytes`` (device
    bytes it allocates), ``host_bytes`` (bytes a Store puts in host memory), ``category``,
    ``step`` (its position in the schedule) and ``node`` (its id in the graph).
  - ``C`` (counter) events named "live bytes", one per step at the step's start time, with
    ``args.bytes`` the bytes on the device during that step (the simulator's M_i); their
    maximum is the run's simulated peak.
  - one ``i`` (instant) event named "peak" at the first peak step, with ``args.bytes`` and
    ``args.holders``, the largest storages alive there.
- ``displayTimeUnit``: "ms".
- ``otherData``: ``format`` ("magis.trace"), ``version`` and ``runs``, one entry per process
  with ``pid``, ``name``, ``peak_bytes``, ``latency_s`` and ``steps``.

`write_memory_snapshot` writes the pickled dict of `torch.cuda.memory._snapshot()`, which
PyTorch's memory_viz page (pytorch.org/memory_viz) and `torch.cuda._memory_viz` read:
``segments`` (the memory at the end of the step: an arena segment holding the LLFB layout of
the schedule and a second one holding the resident tensors, each block ``active_allocated`` or
``inactive``) and ``device_traces`` (device 0: an ``alloc`` per storage when its producer
starts, ``free_requested`` then ``free_completed`` when its last reader ends, with ``addr``,
``size`` in exact bytes, ``stream`` 0, ``time_us`` and ``frames``, one frame naming the
category as file and "<op> <node>" as function). Resident tensors are blocks without events,
as tensors allocated before recording started are in a real snapshot. It is an output file in
PyTorch's format; magis itself never loads pickles.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from magis.ir import Graph
from magis.layout import ALIGNMENT
from magis.report.replay import Replay, Storage, replay
from magis.sim import tables

if TYPE_CHECKING:
    from magis.cost import CostModel

TRACE_FORMAT = "magis.trace"
TRACE_VERSION = 1
COMPUTE_TID, COPY_TID = 1, 2
ARENA_BASE = 0x7F00_0000_0000  # where a CUDA allocator's first segment typically lands
HOLDERS = 5  # storages named at the peak


def write_chrome_trace(
    path: Path, runs: Sequence[tuple[str, Graph, Sequence[int]]], cost: CostModel
) -> None:
    """Write each (name, graph, order) run, simulated under `cost`, as one process of a Chrome
    trace at `path` (fields in the module docstring)."""
    events: list[dict[str, Any]] = []
    summaries = []
    for k, (name, graph, order) in enumerate(runs):
        r = replay(graph, order, cost)
        pid = k + 1
        events += _process_events(r, name, pid)
        summaries.append(
            {
                "pid": pid,
                "name": name,
                "peak_bytes": r.sim.peak_bytes,
                "latency_s": r.sim.latency_s,
                "steps": len(r.order),
            }
        )
    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"format": TRACE_FORMAT, "version": TRACE_VERSION, "runs": summaries},
    }
    _write_bytes(Path(path), json.dumps(doc, separators=(",", ":")).encode())


def _process_events(r: Replay, name: str, pid: int) -> list[dict[str, Any]]:
    graph = r.graph
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": pid, "ts": 0, "name": "process_name", "args": {"name": name}},
        {"ph": "M", "pid": pid, "ts": 0, "name": "process_sort_index", "args": {"sort_index": pid}},
    ]
    for tid, stream in ((COMPUTE_TID, "compute stream"), (COPY_TID, "copy stream (Store/Load)")):
        events.append(
            {
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "ts": 0,
                "name": "thread_name",
                "args": {"name": stream},
            }
        )
    allocated = r.allocated_by()
    host = _host_bytes(r)
    live = r.live_bytes
    for i, nid in enumerate(r.order):
        node = graph.node(nid)
        ts = r.start_s[i] * 1e6
        events.append(
            {"ph": "C", "pid": pid, "ts": ts, "name": "live bytes", "args": {"bytes": int(live[i])}}
        )
        if node.is_placeholder:
            continue
        made = allocated.get(i, [])
        category = max(made, key=lambda s: s.nbytes).category if made else "none"
        events.append(
            {
                "ph": "X",
                "pid": pid,
                "tid": COPY_TID if r.on_copy_stream[i] else COMPUTE_TID,
                "ts": ts,
                "dur": (r.finish_s[i] - r.start_s[i]) * 1e6,
                "name": f"{node.op} {node.name}",
                "cat": category,
                "args": {
                    "bytes": sum(s.nbytes for s in made),
                    "host_bytes": host.get(nid, 0),
                    "category": category,
                    "step": i,
                    "node": nid,
                },
            }
        )
    events.append(_peak_event(r, pid))
    return events


def _host_bytes(r: Replay) -> dict[int, int]:
    """Node id -> bytes it puts in host memory (Store nodes)."""
    t = tables(r.graph)
    out: dict[int, int] = {}
    for i in t.host_bytes.nonzero()[0].tolist():
        node = int(t.producer[i])
        out[node] = out.get(node, 0) + int(t.host_bytes[i])
    return out


def _peak_event(r: Replay, pid: int) -> dict[str, Any]:
    step = r.sim.peak_step
    holders = [f"{h.name} ({h.nbytes} bytes, {h.op})" for h in r.sim.top_hotspots(HOLDERS)]
    return {
        "ph": "i",
        "s": "p",
        "pid": pid,
        "tid": COMPUTE_TID,
        "ts": r.start_s[step] * 1e6 if len(r.order) else 0,
        "name": "peak",
        "args": {"bytes": r.sim.peak_bytes, "step": step, "holders": holders},
    }


def write_memory_snapshot(path: Path, graph: Graph, order: Sequence[int], cost: CostModel) -> None:
    """Write `graph` run in `order` under `cost` as a pickled PyTorch memory snapshot at `path`
    (format in the module docstring)."""
    _write_bytes(Path(path), pickle.dumps(memory_snapshot(replay(graph, order, cost))))


def memory_snapshot(r: Replay) -> dict[str, Any]:
    """The `torch.cuda.memory._snapshot()` dict of a replay (see the module docstring)."""
    trace: list[dict[str, Any]] = []
    freed = r.freed_after()
    allocated = r.allocated_by()
    for i in range(len(r.order)):
        for s in allocated.get(i, []):
            trace.append(_trace_event("alloc", s, r.start_s[i]))
        for s in freed.get(i, []):
            trace.append(_trace_event("free_requested", s, r.finish_s[i]))
            trace.append(_trace_event("free_completed", s, r.finish_s[i]))
    at_end = [s for s in r.storages if s.free_step is None]
    segments = [_segment(ARENA_BASE, r.arena_bytes, at_end)]
    if r.residents:
        size = sum(_slot(s.nbytes) for s in r.residents)
        segments.append(_segment(ARENA_BASE + r.resident_base, size, list(r.residents)))
    return {"segments": [s for s in segments if s["total_size"] > 0], "device_traces": [trace]}


def _frames(s: Storage) -> list[dict[str, Any]]:
    return [{"filename": s.category, "line": 0, "name": f"{s.op} {s.label}"}]


def _trace_event(action: str, s: Storage, seconds: float) -> dict[str, Any]:
    return {
        "action": action,
        "addr": ARENA_BASE + s.address,
        "size": s.nbytes,
        "stream": 0,
        "time_us": int(seconds * 1e6),
        "frames": _frames(s),
    }


def _slot(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _segment(address: int, total: int, live: list[Storage]) -> dict[str, Any]:
    """A segment of `total` bytes at `address` whose blocks are `live` (addresses relative to
    ARENA_BASE), with inactive blocks filling the gaps."""
    blocks: list[dict[str, Any]] = []
    at = address
    for s in sorted(live, key=lambda s: s.address):
        addr = ARENA_BASE + s.address
        if addr > at:
            blocks.append(_block(at, addr - at, "inactive"))
        blocks.append(_block(addr, _slot(s.nbytes), "active_allocated", s))
        at = addr + _slot(s.nbytes)
    if at < address + total:
        blocks.append(_block(at, address + total - at, "inactive"))
    active = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {
        "device": 0,
        "address": address,
        "total_size": total,
        "allocated_size": active,
        "active_size": active,
        "requested_size": sum(b["requested_size"] for b in blocks if b["state"] != "inactive"),
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }


def _block(address: int, size: int, state: str, s: Storage | None = None) -> dict[str, Any]:
    return {
        "address": address,
        "size": size,
        "requested_size": s.nbytes if s is not None else 0,
        "state": state,
        "frames": _frames(s) if s is not None else [],
    }


def _write_bytes(path: Path, data: bytes) -> None:
    """Write `data` whole or not at all (a file someone opens is never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
