"""The exact keep / recompute / offload baseline: its programs run on real tensors and match
eager PyTorch, its simulated figures meet the limits it reports as met, a looser limit never
costs more, and the solver's proven gap is reported."""

import functools

import pytest
import torch

from magis.baselines import BaselinePoint, Failure, Target, get_baseline
from magis.baselines.ilp import ILPOptions, Planner, ilp_points, ilp_solve
from magis.capture.steps import workload_step
from magis.commands.run import run_step
from magis.cost import get_cost_model
from magis.sim import simulate

WORKLOADS = ("bert-base:tiny", "resnet50:tiny")
FAST = ILPOptions(budgets=(0.5, 0.7, 0.9), latency_limits=(1.02, 1.10), time_limit=5.0)


@functools.cache
def _step(name: str):
    return workload_step(name, dtype=torch.float64)[1]


@functools.cache
def _points(name: str) -> tuple:
    step = _step(name)
    return tuple(ilp_points(step.graph, get_cost_model("rtx3090"), FAST))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _base(name: str):
    g = _step(name).graph
    return simulate(g, g.program_order(), get_cost_model("rtx3090"))


def _by_mode(name: str, mode: str) -> list:
    return [o for o in _points(name) if o.params.get("mode") == mode]


@pytest.mark.parametrize("name", WORKLOADS)
def test_points_meet_their_limits_and_report_the_gap(name):
    base = _base(name)
    for o in _points(name):
        if isinstance(o, Failure):
            assert o.params["status"] and o.reason
            continue
        assert o.params["status"] in ("optimal", "feasible")
        assert 0.0 <= o.params["gap"] <= 1.0 and o.params["bound"] <= o.params["objective"] + 1e-9
        if o.params["mode"] == "memory":
            assert o.memory <= o.params["budget"] * base.peak_bytes
        else:
            assert o.latency <= o.params["latency_limit"] * base.latency_s * (1 + 1e-9)


@pytest.mark.parametrize("name", WORKLOADS)
def test_a_looser_limit_never_costs_more(name):
    mem = [o for o in _by_mode(name, "memory") if isinstance(o, BaselinePoint)]
    lat = [o for o in _by_mode(name, "latency") if isinstance(o, BaselinePoint)]
    assert mem and lat
    for tight, loose in zip(mem, mem[1:], strict=False):
        assert loose.params["budget"] > tight.params["budget"]
        assert loose.latency <= tight.latency
    for tight, loose in zip(lat, lat[1:], strict=False):
        assert loose.memory <= tight.memory


@pytest.mark.parametrize("name", WORKLOADS)
def test_programs_verify_against_eager(name):
    """Every distinct plan of the sweep runs and computes what eager PyTorch computes."""
    step, base = _step(name), _base(name)
    plans = {id(p.graph): p for p in _points(name) if isinstance(p, BaselinePoint)}
    moved = [p for p in plans.values() if p.params["recomputed"] + p.params["offloaded"]]
    assert moved and any(p.memory < base.peak_bytes for p in moved)
    for p in moved:
        p.graph.verify()
        assert p.graph.is_valid_schedule(list(p.order))
        report = run_step(step, name, hardware="rtx3090", graph=p.graph, order=p.order, repeats=1)
        assert report.verified, (p.params, report.worst_value, report.max_rel_err)
        assert report.peak_error < 0.05, (p.params, report.peak_error)


def test_recompute_and_offload_both_chosen():
    """Across the sweep the solver uses both levers (bert-base:tiny has dropout masks that can
    only move, and cheap element-wise outputs that are best recomputed)."""
    pts = [p for p in _points("bert-base:tiny") if isinstance(p, BaselinePoint)]
    assert any(p.params["recomputed"] for p in pts)
    assert any(p.params["offloaded"] for p in pts)


def test_unreachable_budget_is_a_failure():
    step = _step("bert-base:tiny")
    cost = get_cost_model("rtx3090")
    (out,) = ilp_points(step.graph, cost, ILPOptions(budgets=(0.01,), latency_limits=()))
    assert isinstance(out, Failure) and out.method == "ilp"
    assert out.params["status"] == "infeasible" and out.params["budget"] == 0.01


def test_solve_for_one_target_is_registered():
    ilp = get_baseline("ilp")
    assert ilp.solve is ilp_solve
    step = _step("resnet50:tiny")
    cost = get_cost_model("rtx3090")
    base = _base("resnet50:tiny")
    p = ilp.solve(step.graph, cost, Target(memory_bytes=int(0.7 * base.peak_bytes)), 5.0)
    assert isinstance(p, BaselinePoint) and p.memory <= 0.7 * base.peak_bytes
    with pytest.raises(ValueError):
        Target()


def test_candidates_and_stages_are_bounded():
    step = _step("bert-base:tiny")
    small = ILPOptions(problem=dataclasses_replace_problem(40, 12))
    planner = Planner(step.graph, get_cost_model("rtx3090"), small)
    assert 0 < len(planner.candidates) <= 40 and planner.stages.n <= 12
    lo, hi = planner.stages.lo, planner.stages.hi
    assert lo[0] == 0 and hi[-1] == len(step.graph.nodes) - 1 and (lo[1:] == hi[:-1] + 1).all()


def dataclasses_replace_problem(cands: int, stages: int):
    from magis.baselines.ilp_problem import ProblemOptions

    return ProblemOptions(max_candidates=cands, max_stages=stages)


def test_bench_compare_reports_the_gap_per_cell(tmp_path):
    """`magis bench compare` with the ilp peer: each of its cells carries the solver's gap,
    in the JSON's params and in tables.md."""
    import json

    from magis.bench.compare import run_compare
    from magis.bench.compare_report import CompareOptions, MicrobatchScope

    options = CompareOptions(
        workloads=("resnet50:tiny",),
        methods=("pytorch", "ilp"),
        out=tmp_path,
        microbatch=MicrobatchScope.NONE,
    )
    run_compare(options)
    rows = json.loads((tmp_path / "results.json").read_text())["workloads"][0]["rows"]
    ilp = [r for r in rows if r["method"] == "ilp" and r["status"] == "ok"]
    assert ilp and all("gap" in r["params"] and "bound" in r["params"] for r in ilp)
    assert "(gap " in (tmp_path / "tables.md").read_text()
