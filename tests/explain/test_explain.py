"""`magis explain`: a plan's decisions, one row each, whose savings add up to its peak reduction
(issue #17)."""

import json

import pytest

from magis.commands.explain import explain_plan
from magis.commands.optimize import find_plan, setup_search, setup_workload_search
from magis.errors import MagisError, PlanError
from magis.explain import PREDATES_DECISIONS, explain
from magis.ir.trail import DecisionKind, Figures
from magis.plan import Plan
from magis.search import SearchOptions
from magis.search.decisions import full_trail, reorder_decision, warm_start_decision

STATES = 30  # a search bounded by states is deterministic


@pytest.fixture(scope="module", params=["bert-base:tiny", "unet:tiny"])
def optimized(request, tmp_path_factory):
    """(plan, its saved path) of a short, reproducible search under a 1.10 latency limit."""
    setup = setup_workload_search(request.param, lat_limit="1.10", hardware="rtx3090")
    plan = find_plan(setup, SearchOptions(time_budget=60, max_states=STATES))
    path = plan.save(tmp_path_factory.mktemp("plans") / "plan.json")
    return plan, path


def test_rows_add_up_to_the_peak_reduction(optimized):
    plan, _ = optimized
    e = explain(plan)
    s = plan.summary
    reduction = s.program_order_peak_bytes - s.peak_bytes
    assert reduction > 0 and len(e.rows) >= 2
    assert e.bytes_saved == pytest.approx(reduction, rel=0.01)
    assert e.bytes_saved == reduction  # the rows telescope: exact, not only within 1%
    assert e.time_added == pytest.approx(s.latency_s - s.program_order_latency_s, abs=1e-12)


def test_rows_follow_the_trail_from_the_program_order(optimized):
    plan, _ = optimized
    e = explain(plan)
    rows = e.rows
    assert [r.step for r in rows] == list(range(1, len(rows) + 1))
    assert rows[0].decision.kind is DecisionKind.REORDER
    assert rows[0].decision.before.peak_bytes == plan.summary.program_order_peak_bytes
    for a, b in zip(rows, rows[1:], strict=False):
        assert b.decision.before == a.decision.after
    assert rows[-1].decision.after.peak_bytes == plan.summary.peak_bytes
    warm = [r.decision for r in rows if r.decision.kind is DecisionKind.WARM_START]
    assert all(d.created or d.removed for d in warm)  # the search named what it started from
    # every move of the best state's history is a row, in the same order
    moves = [r.decision.rule for r in rows if r.decision.kind is not DecisionKind.REORDER]
    history = [h for h in plan.summary.history if not h.startswith("warm-start:")]
    assert [m for m in moves if m in history or m.startswith("fission:")] == history


def test_rows_say_what_each_move_did(optimized):
    plan, _ = optimized
    rows = explain(plan).rows
    kinds = {r.decision.kind for r in rows}
    assert kinds - {DecisionKind.REORDER, DecisionKind.WARM_START}  # the search's own moves
    # where in the model: a rewrite's and a split's nodes read weights and activations
    rewrites = [r for r in rows if r.decision.kind in (DecisionKind.TASO, DecisionKind.FISSION)]
    assert rewrites and all(r.decision.modules for r in rewrites)
    for row in explain(plan).rows:
        d = row.decision
        assert d.description
        if d.kind in (DecisionKind.TASO, DecisionKind.SWAP, DecisionKind.RECOMPUTE):
            assert d.created or d.removed
        if d.kind is DecisionKind.FISSION:
            assert d.splits and all(s.n_after != s.n_before for s in d.splits)
        if d.kind is DecisionKind.SWAP:
            assert d.after.copy_s > d.before.copy_s  # the Store/Load run on the copy stream


def test_sorted_views(optimized):
    plan, _ = optimized
    e = explain(plan)
    saved = [r.bytes_saved for r in e.by_bytes()]
    added = [r.time_added for r in e.by_time()]
    assert saved == sorted(saved, reverse=True) and added == sorted(added, reverse=True)
    assert sorted(r.step for r in e.by_bytes()) == [r.step for r in e.rows]
    assert e.sorted_rows("time") == e.by_time()
    with pytest.raises(MagisError, match="unknown sort"):
        e.sorted_rows("size")


def test_the_trail_survives_saving_and_loading(optimized):
    plan, path = optimized
    loaded = Plan.load(path)
    assert loaded.summary.decisions == plan.summary.decisions
    assert explain(loaded).to_json() == explain(plan).to_json()


def test_a_version_2_plan_loads_and_explains_with_a_note(optimized, tmp_path):
    _, path = optimized
    data = json.loads(path.read_text())
    data["version"] = 2
    del data["summary"]["decisions"]
    old = tmp_path / "v2.json"
    old.write_text(json.dumps(data))
    e = explain(Plan.load(old))
    assert e.rows == () and e.note == PREDATES_DECISIONS
    assert e.bytes_saved == 0 and e.peak_reduction_bytes > 0


def test_a_broken_trail_in_a_plan_file_is_a_plan_error(optimized, tmp_path):
    _, path = optimized
    data = json.loads(path.read_text())
    data["summary"]["decisions"][0]["before"] = ["many", 0, 0, 0]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"decisions\[0\]\.before"):
        Plan.load(bad)


def test_a_warm_start_without_its_own_decision_gets_a_row():
    program, initial = Figures(100, 1.0, 1.0, 0.0), Figures(90, 1.0, 1.0, 0.0)
    warm, best = Figures(60, 1.2, 1.1, 0.1), Figures(50, 1.3, 1.2, 0.1)
    move = reorder_decision("reschedule", warm, best)
    trail = full_trail(program, initial, best, [move], ["warm-start:pofo", "reschedule"])
    assert [d.kind for d in trail] == [
        DecisionKind.REORDER,
        DecisionKind.WARM_START,
        DecisionKind.REORDER,
    ]
    assert trail[1].rule == "pofo" and sum(d.bytes_saved for d in trail) == 50
    # a warm start that recorded its decision (`warm_start_decision`) gets no second row
    own = warm_start_decision("pofo", initial, warm)
    assert len(full_trail(program, initial, best, [own, move])) == 3


def test_a_limit_not_met_names_the_tensors_at_the_peak():
    setup = setup_workload_search("bert-base:tiny", mem_limit="0.9", hardware="rtx3090")
    # just above what stays resident: no plan can meet it (limits.check_memory_reachable)
    ratio = (setup.base.resident_bytes + 64) / setup.base.peak_bytes
    setup = setup_search(setup.step, mem_limit=ratio, hardware=setup.cost, workload="bert")
    plan = find_plan(setup, SearchOptions(time_budget=60, max_states=10))
    assert not plan.summary.satisfied
    e = explain(plan)
    assert e.bottleneck and e.bottleneck[0].nbytes == max(b.nbytes for b in e.bottleneck)
    assert all(b.category for b in e.bottleneck) and any(b.module for b in e.bottleneck)
    assert e.least_peak_found_bytes <= plan.summary.peak_bytes
    assert e.bytes_saved == e.peak_reduction_bytes


def test_cli_prints_the_table_and_writes_json(optimized, magis_cli, tmp_path):
    plan, path = optimized
    out = tmp_path / "explain.json"
    done = magis_cli("explain", str(path), "--sort", "bytes", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "decisions (bytes order)" in done.stdout and "rows sum to" in done.stdout
    data = json.loads(out.read_text())
    assert data["sort"] == "bytes" and data["bytes_saved"] == data["peak_reduction_bytes"]
    assert [r["bytes_saved"] for r in data["rows"]] == [
        r.bytes_saved for r in explain(plan).by_bytes()
    ]


def test_cli_refuses_an_unknown_sort(magis_cli, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{}")
    done = magis_cli("explain", str(path), "--sort", "size")
    assert done.returncode == 2 and "--sort size" in done.stderr


def test_exports_write_a_trace_and_a_snapshot(optimized, tmp_path):
    pytest.importorskip("magis.report.timeline")
    _, path = optimized
    trace, snapshot = tmp_path / "t.json", tmp_path / "s.pickle"
    rep = explain_plan(path, "time", export_trace=trace, export_snapshot=snapshot)
    assert rep.trace_path == trace and rep.snapshot_path == snapshot
    runs = json.loads(trace.read_text())["otherData"]["runs"]
    assert [r["name"] for r in runs] == ["plan"]
    assert runs[0]["peak_bytes"] == Plan.load(path).summary.peak_bytes
    assert snapshot.stat().st_size > 0


def test_a_warm_start_given_both_graphs_names_what_the_baseline_changed(optimized):
    plan, _ = optimized
    figures = Figures(1, 1.0, 1.0, 0.0)
    d = warm_start_decision("pofo", figures, figures, plan.step.graph, plan.graph)
    captured = {plan.step.graph.node(n).name for n in plan.step.graph.program_order()}
    final = {plan.graph.node(n).name for n in plan.graph.program_order()}
    assert set(d.created) == final - captured and set(d.removed) == captured - final
    assert d.created and d.modules and "nodes added" in d.description


def test_plan_explain_is_the_explanation(tmp_path):
    plan = find_plan(
        setup_workload_search("bert-base:tiny", lat_limit=1.10), SearchOptions(max_states=5)
    )
    assert plan.explain() == explain(plan)
    assert Plan.load(plan.save(tmp_path / "p.json")).explain().rows == plan.explain().rows
