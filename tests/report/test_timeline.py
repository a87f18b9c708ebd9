"""The Chrome trace and the PyTorch memory snapshot of a simulated schedule load back, with the
documented fields, and show the simulator's peak and latency."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from torch.cuda import _memory_viz

from magis.capture import workload_step
from magis.cost import get_cost_model
from magis.plan import Plan
from magis.report import replay, write_chrome_trace, write_memory_snapshot
from magis.schedule import Scheduler, schedule
from magis.sim import simulate


@pytest.fixture(scope="module")
def cost():
    return get_cost_model("rtx3090")


@pytest.fixture(scope="module", params=["bert-base:tiny", "bert-base"])
def step(request):
    return workload_step(request.param)[1]


@pytest.fixture(scope="module")
def swap_plan(tmp_path_factory):
    """A small real plan with Store/Load copies: an MLP step searched for a few states."""
    import torch
    from torch import nn

    import magis

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.GELU())
        x = torch.randn(32, 64)
        s = magis.training_step(model, (x,), loss_fn=lambda out, x: out.square().mean())
        plan = magis.optimize(s, mem_limit=0.7, max_states=30, time_budget=60)
    finally:
        torch.set_default_dtype(old)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return Plan.load(path)


def test_replay_matches_the_simulator(step, cost):
    g = step.graph
    order = g.program_order()
    r = replay(g, order, cost)
    sim = simulate(g, order, cost)
    assert r.finish_s.max() == pytest.approx(sim.latency_s, rel=1e-12)
    live = np.zeros(len(order), dtype=np.int64)
    for s in r.storages:
        end = len(order) - 1 if s.free_step is None else s.free_step
        live[s.alloc_step : end + 1] += s.nbytes
    assert np.array_equal(live + sum(s.nbytes for s in r.residents), sim.timeline)


def test_replay_of_a_plan_with_copies_matches_the_simulator(swap_plan, cost):
    r = replay(swap_plan.graph, swap_plan.order, cost)
    assert r.on_copy_stream.any()
    assert r.finish_s.max() == pytest.approx(r.sim.latency_s, rel=1e-12)


def test_chrome_trace_loads_with_the_documented_fields(step, cost, tmp_path):
    g = step.graph
    program = g.program_order()
    dp = schedule(g, Scheduler.DP).order
    path = tmp_path / "trace.json"
    write_chrome_trace(path, [("program order", g, program), ("dp", g, dp)], cost)
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    assert doc["otherData"]["format"] == "magis.trace"
    runs = doc["otherData"]["runs"]
    assert [r["name"] for r in runs] == ["program order", "dp"]
    events = doc["traceEvents"]
    assert all({"ph", "pid", "ts"} <= e.keys() for e in events)
    for run, order in zip(runs, (program, dp), strict=True):
        mine = [e for e in events if e["pid"] == run["pid"]]
        names = {e["args"]["name"] for e in mine if e["ph"] == "M" and e["name"] == "thread_name"}
        assert names == {"compute stream", "copy stream (Store/Load)"}
        ops = [e for e in mine if e["ph"] == "X"]
        assert len(ops) == len(g.ops())
        assert all({"name", "cat", "dur", "tid"} <= e.keys() for e in ops)
        assert all({"bytes", "category", "step", "node"} <= e["args"].keys() for e in ops)
        sim = simulate(g, order, cost)
        counter = [e["args"]["bytes"] for e in mine if e["ph"] == "C"]
        assert len(counter) == len(order)
        assert max(counter) == sim.peak_bytes == run["peak_bytes"]
        end = max(e["ts"] + e["dur"] for e in ops)
        assert end == pytest.approx(sim.latency_s * 1e6, rel=1e-9)
        (peak,) = [e for e in mine if e["ph"] == "i"]
        assert peak["args"]["bytes"] == sim.peak_bytes and peak["args"]["holders"]


def test_trace_puts_copies_on_the_copy_stream(swap_plan, cost, tmp_path):
    path = tmp_path / "trace.json"
    write_chrome_trace(path, [("plan", swap_plan.graph, swap_plan.order)], cost)
    ops = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    copies = {e["name"].split()[0] for e in ops if e["tid"] == 2}
    assert copies == {"magis.store", "magis.load"}
    assert any(e["args"]["host_bytes"] > 0 for e in ops if e["name"].startswith("magis.store"))


def _replayed_peak(snapshot: dict) -> int:
    """The peak the memory_viz page draws (its process_alloc_data): the blocks active at the end
    that no event allocated were there from the start; then each alloc adds, each free
    subtracts."""
    events = snapshot["device_traces"][0]
    alive: dict[int, int] = {}
    now = peak = 0
    for e in events:
        if e["action"] == "alloc":
            assert e["addr"] not in alive, "an address allocated twice without a free"
            alive[e["addr"]] = e["size"]
            now += e["size"]
            peak = max(peak, now)
        elif e["action"] == "free_completed":
            now -= alive.pop(e["addr"])
    initial = sum(
        b["requested_size"]
        for seg in snapshot["segments"]
        for b in seg["blocks"]
        if b["state"] == "active_allocated" and b["address"] not in alive
    )
    return initial + max(peak, now)


def _load_as_pytorch_does(path) -> dict:
    """`python -m torch.cuda._memory_viz` reads a snapshot with pickle.load, then its views."""
    with open(path, "rb") as f:
        data = pickle.load(f)
    assert isinstance(data, dict)
    _memory_viz.segsum(data)  # checks every segment's blocks add up to its size
    assert "entries" in _memory_viz.trace(data)
    _memory_viz.segments(data, format_flamegraph=lambda lines: lines)
    _memory_viz.memory(data, format_flamegraph=lambda lines: lines)
    assert "snapshot.pickle" in _memory_viz.trace_plot(data)
    return data


def test_memory_snapshot_loads_through_pytorchs_reader_with_the_simulated_peak(
    step, cost, tmp_path
):
    g = step.graph
    order = g.program_order()
    path = tmp_path / "snapshot.pickle"
    write_memory_snapshot(path, g, order, cost)
    data = _load_as_pytorch_does(path)
    sim = simulate(g, order, cost)
    assert _replayed_peak(data) == sim.peak_bytes
    events = data["device_traces"][0]
    assert {e["action"] for e in events} == {"alloc", "free_requested", "free_completed"}
    assert all({"addr", "size", "stream", "time_us", "frames"} <= e.keys() for e in events)
    _check_no_overlap(data)


def test_snapshot_of_a_plan_with_swaps_has_the_plans_peak(swap_plan, cost, tmp_path):
    path = tmp_path / "snapshot.pickle"
    write_memory_snapshot(path, swap_plan.graph, swap_plan.order, cost)
    data = _load_as_pytorch_does(path)
    assert _replayed_peak(data) == simulate(swap_plan.graph, swap_plan.order, cost).peak_bytes


def _check_no_overlap(snapshot: dict) -> None:
    """Allocations alive together never share a byte, and all lie inside a segment."""
    spans = [(s["address"], s["address"] + s["total_size"]) for s in snapshot["segments"]]
    alive: dict[int, int] = {}
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            lo, hi = e["addr"], e["addr"] + e["size"]
            assert any(a <= lo and hi <= b for a, b in spans)
            assert all(hi <= a or a + size <= lo for a, size in alive.items())
            alive[lo] = e["size"]
        elif e["action"] == "free_completed":
            del alive[e["addr"]]
