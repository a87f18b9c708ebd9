"""Plans: limits as users write them, JSON round trips and broken files, the optimize -> save ->
run loop."""

import dataclasses
import json

import pytest
import torch

import magis
from magis.commands.limits import parse_latency_limit, parse_memory_limit
from magis.commands.optimize import find_plan, optimize, setup_search
from magis.errors import LimitError, MagisError, PlanError
from magis.plan import PLAN_VERSION, Plan, PlanSummary
from magis.search import SearchOptions


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
    assert back.order == plan.order and back.summary == plan.summary
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


def _small_model_and_inputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return model, (torch.randn(32, 16), torch.randint(0, 4, (32,)))


def _cross_entropy(o, x, y):
    return torch.nn.functional.cross_entropy(o, y)


@pytest.fixture(scope="module")
def small_plan():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model, inputs = _small_model_and_inputs()
        return magis.optimize(model, inputs, loss_fn=_cross_entropy, lat_limit=1.1, max_states=5)
    finally:
        torch.set_default_dtype(old)


def test_magis_optimize_is_the_command_and_plan_is_magis_plan(small_plan):
    assert magis.optimize is optimize and magis.Plan is Plan
    assert isinstance(small_plan.summary, PlanSummary)
    with pytest.raises(dataclasses.FrozenInstanceError):
        small_plan.summary.satisfied = False


def test_report_of_a_step_without_a_workload_name_says_a_step(small_plan):
    text = small_plan.report()
    assert small_plan.summary.workload is None
    assert "None" not in text and text.startswith("magis plan for a step on rtx3090")


def _mangled(plan: Plan, path, change) -> None:
    data = plan.to_json()
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: d.clear() or d.update(x=[1, 2, 3]), "not a magis plan"),
        (lambda d: d.pop("graph"), "no 'graph' field"),
        (lambda d: d.pop("order"), "no 'order' field"),
        (lambda d: d.pop("summary"), "no 'summary' field"),
        (lambda d: d.update(order={"a": 1}), "'order' field is not a list"),
        (lambda d: d.update(order=["x"]), "node numbers"),
        (lambda d: d.update(order=d["order"][::-1]), "not a valid order"),
        (lambda d: d["summary"].pop("peak_bytes"), "no 'peak_bytes' field"),
        (lambda d: d["summary"].update(satisfied="yes"), "'satisfied' holds str"),
        (lambda d: d["summary"].update(improvements=[[1, 2]]), "'improvements'"),
        (lambda d: d.update(version=1, info={}), "version 1 is not"),
    ],
)
def test_plan_files_of_the_wrong_shape_are_one_line_plan_errors(
    small_plan, tmp_path, change, words
):
    path = tmp_path / "plan.json"
    _mangled(small_plan, path, change)
    with pytest.raises(PlanError, match=words) as exc:
        Plan.load(path)
    assert "\n" not in str(exc.value)
    if "version" in words:
        assert "re-run magis optimize" in str(exc.value)


def test_a_json_list_is_not_a_plan(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(PlanError, match="not a magis plan"):
        Plan.load(path)


def test_a_plan_refuses_a_step_with_other_inputs(small_plan, mlp_step_factory):
    with pytest.raises(PlanError, match="made for another step"):
        small_plan.check_matches(mlp_step_factory())


def test_search_is_prepared_once_outside_the_budget(monkeypatch, float64):
    """A profiled cost model measures the graph before the search starts, and the ratios a
    caller shows live (`SearchSetup`) are those the plan reports, memory figure included."""
    from magis.commands import optimize as command
    from magis.cost import get_cost_model
    from magis.layout import plan_layout

    events = []
    cost = get_cost_model("rtx3090")
    cost.profile_graph = lambda graph, progress=None: events.append(("profile", len(graph)))
    real_search = command.optimize_graph

    def search(*args, **kw):
        events.append(("search", None))
        return real_search(*args, **kw)

    monkeypatch.setattr(command, "optimize_graph", search)
    model, inputs = _small_model_and_inputs()
    step = magis.training_step(model, inputs, loss_fn=_cross_entropy)
    setup = setup_search(step, lat_limit=1.1, hardware=cost, memory_figure="arena")
    plan = find_plan(setup, SearchOptions(max_states=5))
    assert events == [("profile", len(step.graph)), ("search", None)]
    s = plan.summary
    assert s.memory_figure == "arena" and s.program_order_peak_bytes == setup.base.peak_bytes
    assert setup.memory_ratio(s.peak_bytes) == s.memory_ratio
    assert setup.latency_ratio(s.latency_s) == s.latency_ratio
    arena = plan_layout(step.graph, step.graph.program_order(), "llfb").arena_bytes
    assert setup.base.peak_bytes == setup.base.resident_bytes + arena


def test_limits_are_checked_before_any_work():
    with pytest.raises(LimitError, match="exactly one"):
        optimize(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(MagisError, match="example inputs are missing"):
        optimize(torch.nn.Linear(2, 2), lat_limit=1.1)
    assert issubclass(LimitError, MagisError)


def test_cli_save_writes_the_plan_and_run_verifies_it(tmp_path, monkeypatch, capsys):
    from magis.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("MAGIS_CACHE", str(tmp_path / "ops.sqlite"))
    plan, report, ran = tmp_path / "p.json", tmp_path / "j.json", tmp_path / "r.json"
    main(["optimize", "bert-base:tiny", "--lat-limit", "1.2", "--time-budget", "3",
          "--save", str(plan), "--json", str(report)])  # fmt: skip
    summary = json.loads(report.read_text())
    assert summary["workload"] == "bert-base:tiny" and summary["satisfied"] is True
    assert Plan.load(plan).summary.to_json() == summary
    assert json.loads(plan.read_text())["version"] == PLAN_VERSION
    main(["run", "bert-base:tiny", "--plan", str(plan), "--json", str(ran)])
    assert json.loads(ran.read_text())["verified"] is True
    assert "deprecated" not in capsys.readouterr().err


def test_cli_optimize_then_run_the_plan(magis_cli, tmp_path):
    env = {"MAGIS_CACHE": str(tmp_path / "ops.sqlite")}
    plan, report = tmp_path / "p.json", tmp_path / "o.json"
    res = magis_cli(
        "optimize", "bert-base:tiny", "--mem-limit", "0.95", "--time-budget", "120",
        "--max-states", "30",
        "--plan", str(plan),  # the deprecated name of --save still works
        "--json", str(report), env=env,
    )  # fmt: skip
    assert res.returncode in (0, 3), res.stderr
    assert "--plan is deprecated: use --save" in res.stderr
    info = json.loads(report.read_text())
    assert res.returncode == (0 if info["satisfied"] else 3)  # 3: the limit is not met
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
    res = magis_cli("run", "bert-base:tiny", "--plan", str(plan), "--json", str(out), env=env)
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
    assert plan.summary.memory_figure == "arena"
    assert plan.summary.peak_bytes == resident + arena
    with pytest.raises(LimitError, match="unknown memory figure"):
        optimize(
            model, (x, y), loss_fn=lambda o, x, y: o.sum(), lat_limit=1.1, memory_figure="nope"
        )


def get_cost_model_for_test():
    from magis.cost import get_cost_model

    return get_cost_model("rtx3090")


def test_the_step_plans_are_made_for_is_float64_when_tiny():
    from magis.capture import workload_step

    tiny = workload_step("bert-base:tiny", float64_when_tiny=True)[1]
    small = workload_step("bert-base:small", float64_when_tiny=True)[1]
    as_is = workload_step("bert-base:tiny")[1]
    dtypes = [
        {s.graph.node(p).outputs[0].torch_dtype for p in s.graph.placeholders()}
        for s in (tiny, small, as_is)
    ]
    assert torch.float64 in dtypes[0] and torch.float32 not in dtypes[0]
    assert torch.float64 not in dtypes[1] and torch.float64 not in dtypes[2]


def test_a_plan_loads_and_explains_without_the_search(tmp_path):
    """`magis.plan` reads its decision trail from `magis.ir.trail`, not from the search: loading
    a plan, its report and its explanation import no module of `magis.search` (issue 45)."""
    import subprocess
    import sys
    from pathlib import Path

    from magis.capture import workload_step

    path = tmp_path / "plan.json"
    optimize(workload_step("bert-base:tiny")[1], lat_limit=1.1, max_states=2).save(path)
    code = (
        "import sys\n"
        "from magis.plan import Plan\n"
        f"plan = Plan.load({str(path)!r})\n"
        "plan.report(), plan.explain()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:2] == ['magis', 'search']))\n"
    )
    root = str(Path(magis.__file__).parents[1])  # this checkout's magis, not an installed one
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
