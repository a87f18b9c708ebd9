"""`magis optimize --parallel`: one rank of a data-parallel job planned without processes."""

from __future__ import annotations

import json

import pytest

from magis.capture import workload_step
from magis.capture.collectives import ParallelError, collective_calls
from magis.capture.sharding import PlannedJob
from magis.ir.ops import ALL_GATHER_OP, ALL_REDUCE_OP, REDUCE_SCATTER_OP
from magis.plan import Plan


def test_optimize_plans_one_rank_of_an_fsdp_job(magis_cli, tmp_path):
    out, saved = tmp_path / "out.json", tmp_path / "plan.json"
    res = magis_cli(
        "optimize", "corpus:llama:tiny", "--parallel", "fsdp", "--world-size", "8",
        "--hardware", "h100", "--lat-limit", "1.10", "--max-states", "30",
        "--json", str(out), "--save", str(saved),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "one rank of FSDP x 8 (h100)" in res.stdout
    fsdp2, ac, plan = json.loads(out.read_text())["ranks"]
    assert [fsdp2["name"], ac["name"], plan["name"]] == ["FSDP2", "FSDP2 + full AC", "magis plan"]
    assert ac["peak_bytes"] < fsdp2["peak_bytes"] and ac["step_s"] > fsdp2["step_s"]
    assert plan["step_s"] <= 1.10 * fsdp2["step_s"] and plan["peak_bytes"] < fsdp2["peak_bytes"]
    assert 0 < fsdp2["overlap"] <= 1 and fsdp2["comm_s"] == plan["comm_s"] > 0
    calls = collective_calls(Plan.load(saved).graph)
    assert {(c.op, c.world_size) for c in calls} == {(ALL_GATHER_OP, 8), (REDUCE_SCATTER_OP, 8)}


def test_a_ddp_job_all_reduces_and_a_bad_kind_is_one_line():
    _, step = workload_step("corpus:llama:tiny", job=PlannedJob("ddp", 4))
    assert {(c.op, c.world_size) for c in collective_calls(step.graph)} == {(ALL_REDUCE_OP, 4)}
    with pytest.raises(ParallelError, match="unknown parallel 'zero'; choose one of ddp, fsdp"):
        PlannedJob("zero", 8)
    with pytest.raises(ParallelError, match="world size 0: a job has at least one rank"):
        PlannedJob("fsdp", 0)


def _collectives_deferred(graph, ops: set[str]) -> list[int]:
    """The program order with every collective of `ops` (and what waits on it) issued as late as
    its readers allow: the order a scheduler blind to the communication stream may make."""
    from magis.sim import tables

    held = {v for v in tables(graph).comm_nodes if graph.node(v).op in ops}
    order, placed = [], set()

    def emit(v: int) -> None:
        for p in graph.predecessors(v):
            if p in held and p not in placed:
                emit(p)
        order.append(v)
        placed.add(v)

    for v in graph.program_order():
        if v not in held:
            emit(v)
    for v in graph.program_order():
        if v not in placed:
            emit(v)
    return order


def test_the_search_starts_from_fsdp2s_order_where_it_dominates_the_dp_order():
    """Issue 44: re-ordering is free on one stream (MAGIS §5.2), not with collectives on their
    own. An order that keeps the peak and loses the reduce-scatters' overlap is not the start;
    one with a lower peak is."""
    from magis.cost import get_cost_model
    from magis.cost.links import Interconnect, get_link
    from magis.search.initial import starting_order
    from magis.search.options import MemoryFigure
    from magis.sim import simulate

    _, step = workload_step("corpus:llama:tiny", float64_when_tiny=True, job=PlannedJob("fsdp", 8))
    graph = step.graph
    cost = get_cost_model("h100").with_interconnect(Interconnect(get_link("nvlink"), 8))
    program = simulate(graph, graph.program_order(), cost)
    slower = _collectives_deferred(graph, {REDUCE_SCATTER_OP})
    late = simulate(graph, slower, cost)
    assert late.peak_bytes == program.peak_bytes and late.latency_s > program.latency_s
    theoretical = MemoryFigure.THEORETICAL
    assert list(starting_order(graph, cost, slower, theoretical)) == graph.program_order()
    leaner = _collectives_deferred(
        graph, {ALL_GATHER_OP, REDUCE_SCATTER_OP}
    )  # gathered weights live shorter
    assert simulate(graph, leaner, cost).peak_bytes < program.peak_bytes
    assert list(starting_order(graph, cost, leaner, theoretical)) == leaner


def test_an_fsdp_search_starts_from_full_checkpointing_and_is_never_behind_it():
    """Issue 44: under FSDP2 + full AC's own peak, the search starts from that program (a peer
    the user would otherwise run) and ends at or below its step time; a checkpointed program
    that draws random numbers the step does not is no start (its masks would differ)."""
    from magis.commands.limits import read_search_limit
    from magis.commands.optimize import find_plan, prepare_workload_search
    from magis.commands.parallel import CHECKPOINTED_WARM_START, job_warm_starts
    from magis.search.options import SearchOptions
    from magis.sim import simulate

    job = PlannedJob("fsdp", 8)
    probe = prepare_workload_search(
        "corpus:llama:tiny", read_search_limit(None, "1.5"), hardware="h100", job=job
    )
    ac = probe.checkpointed
    ac_sim = simulate(ac, ac.program_order(), probe.cost)
    limit = read_search_limit(f"{ac_sim.peak_bytes}B", None)
    setup = prepare_workload_search("corpus:llama:tiny", limit, hardware="h100", job=job)
    plan = find_plan(setup, SearchOptions(max_states=12))
    assert plan.summary.satisfied
    assert plan.summary.latency_s <= ac_sim.latency_s
    assert plan.summary.peak_bytes <= ac_sim.peak_bytes
    starts = job_warm_starts(setup.step.graph, ac)
    assert [w.name for w in starts] == [CHECKPOINTED_WARM_START]
    _, dropout = workload_step("bert-base:tiny")  # its dropout draws: more than llama's none
    assert job_warm_starts(setup.step.graph, dropout.graph) == []
