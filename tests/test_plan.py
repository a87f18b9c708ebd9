"""Plans: limits as users write them, JSON round trips, the optimize -> save -> run loop."""

import json
import os
import subprocess
import sys

import pytest
import torch

from magis.errors import PlanError
from magis.planning import LimitError, Plan, optimize, parse_latency_limit, parse_memory_limit


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0.4", 400),
        (0.8, 800),
        ("1", 1000),
        ("12GiB", 12 * 2**30),
        ("500MB", 500_000_000),
        ("1e9", 10**9),
    ],
)
def test_memory_limits_read_as_users_write_them(text, expected):
    assert parse_memory_limit(text, 1000) == expected


@pytest.mark.parametrize("text", ["2", "abc", "12 parsecs"])
def test_unreadable_memory_limits_are_one_line_errors(text):
    with pytest.raises(LimitError):
        parse_memory_limit(text, 1000)


def test_latency_limits():
    assert parse_latency_limit("1.10", 2.0) == pytest.approx(2.2)
    assert parse_latency_limit("250ms", 2.0) == pytest.approx(0.25)


def test_optimize_model_directly_and_round_trip_the_plan(tmp_path, float64):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    plan = optimize(
        model,
        (x, y),
        loss_fn=lambda o, x, y: torch.nn.functional.cross_entropy(o, y),
        lat_limit=1.10,
        time_budget=5,
    )
    assert "def program(" in plan.code
    assert "memory" in plan.report()
    back = Plan.load(plan.save(tmp_path / "plan.json"))
    assert back.order == plan.order and back.info["memory_ratio"] == plan.info["memory_ratio"]
    inputs = plan.step.make_inputs()
    torch.manual_seed(0)
    ref = plan.step.fn(*[t.clone() for t in inputs])
    torch.manual_seed(0)
    out = plan(*[t.clone() for t in inputs])
    assert torch.equal(out[0], ref[0])


def test_broken_plan_files_are_plan_errors(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(PlanError, match="cannot read plan"):
        Plan.load(path)
    path.write_text(json.dumps({"format": "magis.plan", "version": 7}))
    with pytest.raises(PlanError, match="version 7"):
        Plan.load(path)
    with pytest.raises(PlanError, match="no plan file"):
        Plan.load(tmp_path / "missing.json")


def test_cli_optimize_then_run_the_plan(tmp_path):
    env = {**os.environ, "COLUMNS": "200", "MAGIS_CACHE": str(tmp_path / "ops.sqlite")}
    plan, report = tmp_path / "p.json", tmp_path / "o.json"
    cmd = [
        sys.executable,
        "-m",
        "magis",
        "optimize",
        "bert-base:tiny",
        "--mem-limit",
        "0.9",
        "--time-budget",
        "120",
        "--max-states",
        "30",
        "--plan",
        str(plan),
        "--json",
        str(report),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    info = json.loads(report.read_text())
    for key in (
        "memory_ratio",
        "latency_ratio",
        "satisfied",
        "states_explored",
        "seconds",
        "rules_applied",
        "breakdown",
    ):
        assert key in info
    out = tmp_path / "r.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "magis",
            "run",
            "bert-base:tiny",
            "--plan",
            str(plan),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    ran = json.loads(out.read_text())
    assert ran["verified"] and ran["peak_error"] <= 0.05
    # the host pool is reported beside the device figure, measured and simulated alike
    assert ran["measured_host_peak_bytes"] == ran["simulated_host_peak_bytes"]


def test_optimizer_can_count_memory_as_the_layout_arena(float64):
    from magis.layout import plan_layout
    from magis.sim import simulate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    plan = optimize(
        model,
        (x, y),
        loss_fn=lambda o, x, y: torch.nn.functional.cross_entropy(o, y),
        lat_limit=1.10,
        time_budget=3,
        memory_figure="arena",
    )
    resident = simulate(plan.graph, plan.order, get_cost_model_for_test()).resident_bytes
    arena = plan_layout(plan.graph, plan.order, "llfb").arena_bytes
    assert plan.info["memory_figure"] == "arena"
    assert plan.info["peak_bytes"] == resident + arena
    with pytest.raises(LimitError, match="unknown memory figure"):
        optimize(
            model, (x, y), loss_fn=lambda o, x, y: o.sum(), lat_limit=1.1, memory_figure="nope"
        )


def get_cost_model_for_test():
    from magis.cost import get_cost_model

    return get_cost_model("rtx3090")
