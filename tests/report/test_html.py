"""The HTML report: self-contained, with every section, built from a real bert-base:tiny plan;
its measured figures checked against the plan; the `magis report` and `magis analyze
--export-*` command lines."""

from __future__ import annotations

import json
import re

import pytest

from magis.commands.report import MeasuredRunError, read_measured, report
from magis.cost import get_cost_model
from magis.errors import MagisError
from magis.report.html import pareto_points, render_report
from magis.sim import simulate

SECTIONS = ("summary", "timeline", "breakdown", "explain", "pareto", "measured")


@pytest.fixture(scope="module")
def page(plan_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("html") / "report.html"
    rep = report(plan_file, out)
    assert rep.program_order_drawn and not rep.measured
    assert rep.html_bytes == len(out.read_bytes())
    return out.read_text()


def test_the_page_is_self_contained(page):
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page.lower()
    links = re.findall(r'\b(?:src|href)\s*=\s*"([^"]*)"', page)
    assert links and all(link.startswith(("data:", "#")) for link in links)
    assert "@import" not in page and "url(http" not in page
    # the only address is SVG's namespace, which no browser fetches
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg"}


def test_the_page_has_every_section_with_the_plans_figures(page, plan):
    for section in SECTIONS:
        assert f'<section id="{section}">' in page
    sim = simulate(plan.graph, plan.order, get_cost_model(plan.summary.hardware))
    for h in sim.top_hotspots(3):
        assert h.name in page  # the peak's holders are named
    assert "limit " in page and 'class="limit"' in page  # the memory limit line
    assert "program order" in page and page.count("<svg") == 3
    for rule in {d.rule for d in plan.summary.decisions}:
        assert rule in page  # the explain table
    assert "not run for this report" in page


def test_pareto_points_are_the_search_s_improvements(plan):
    points = pareto_points(plan)
    s = plan.summary
    assert [p.kind for p in points][0] == "program" and points[-1].kind == "plan"
    found = points[1:-1]
    assert [(p.latency_s, p.peak_bytes) for p in found] == [
        (lat, m) for _, m, lat in s.improvements
    ]
    front = [p for p in found if p.kind == "front"]
    assert front
    for p in front:  # nothing found beats a front point in both figures
        assert not any(
            q.latency_s <= p.latency_s
            and q.peak_bytes <= p.peak_bytes
            and (q.latency_s, q.peak_bytes) != (p.latency_s, p.peak_bytes)
            for q in found
        )


def _run_json(plan, **changes) -> dict:
    """A `magis run --json` report of `plan` as `RunReport.to_json` writes it."""
    sim = simulate(plan.graph, plan.order, get_cost_model("cpu"))
    data = {
        "workload": "bert-base:tiny",
        "dtype": "float64",
        "verified": True,
        "max_rel_err": 3e-14,
        "worst_value": "loss",
        "tolerance": 1e-9,
        "measured_peak_bytes": sim.peak_bytes + 4096,
        "simulated_peak_bytes": sim.peak_bytes,
        "peak_error": 4096 / (sim.peak_bytes + 4096),
        "latency_s": 0.0123,
        "simulated_latency_s": sim.latency_s,
        "hardware": "cpu",
        "seconds": 1.0,
        "device": "cpu",
    }
    return {**data, **changes}


def test_measured_figures_of_this_plan_are_shown(plan, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_run_json(plan)))
    measured = read_measured(path, plan)
    page = render_report(plan, measured)
    assert "verified" in page and "12.30 ms" in page and "not run for this report" not in page
    assert "program order" in page  # without the program graph, a note says why


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"simulated_peak_bytes": 1}, "measured another program"),
        ({"verified": "yes"}, "'verified' field"),
        ({"latency_s": None}, "'latency_s' field"),
    ],
)
def test_a_measurement_of_something_else_is_refused(plan, tmp_path, changes, message):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_run_json(plan, **changes)))
    with pytest.raises(MeasuredRunError, match=message):
        read_measured(path, plan)
    path.write_text("[1, 2]")
    with pytest.raises(MeasuredRunError, match="not an object"):
        read_measured(path, plan)


def test_report_runs_the_plan_when_asked(plan_file, tmp_path, monkeypatch):
    monkeypatch.setenv("MAGIS_CACHE", str(tmp_path / "ops.sqlite"))
    out = tmp_path / "r.html"
    rep = report(plan_file, out, run=True)
    page = out.read_text()
    assert rep.measured and "verified" in page and "NOT verified" not in page


def test_cli_report_and_analyze_exports(plan_file, tmp_path, monkeypatch, capsys):
    from magis.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    out, js = tmp_path / "r.html", tmp_path / "r.json"
    main(["report", str(plan_file), "--html", str(out), "--json", str(js)])
    assert json.loads(js.read_text())["html_bytes"] == len(out.read_bytes())
    with pytest.raises(SystemExit) as exited:
        main(["report", str(tmp_path / "none.json"), "--html", str(out)])
    assert exited.value.code == 2 and "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["report", str(plan_file), "--html", str(out), "--run", "--measured", str(js)])
    assert exited.value.code == 2 and "pick one" in capsys.readouterr().err
    trace, snap = tmp_path / "t.json", tmp_path / "s.pickle"
    main(
        ["analyze", "bert-base:tiny", "--export-trace", str(trace), "--export-snapshot", str(snap)]
    )
    runs = json.loads(trace.read_text())["otherData"]["runs"]
    assert [r["name"] for r in runs] == ["program order", "dp order"]
    assert snap.read_bytes()[:1] == b"\x80"  # a pickle, as torch.cuda.memory._dump_snapshot


def test_a_latency_limited_plan_of_a_users_step(tmp_path, float64):
    """No workload to capture again: the program order is a note, not a curve; the latency
    limit is a vertical line among the Pareto points, not a memory line."""
    import torch
    from torch import nn

    import magis

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    step = magis.training_step(
        model, (x, y), loss_fn=lambda o, x, y: nn.functional.cross_entropy(o, y)
    )
    path = tmp_path / "plan.json"
    magis.optimize(step, lat_limit=1.1, max_states=5).save(path)
    out = tmp_path / "r.html"
    rep = report(path, out)
    page = out.read_text()
    assert not rep.program_order_drawn and rep.workload is None
    assert "is not drawn" in page and "a captured step" in page
    timeline = page[page.index('<section id="timeline">') : page.index('<section id="breakdown">')]
    pareto = page[page.index('<section id="pareto">') : page.index('<section id="measured">')]
    assert 'class="limit"' not in timeline and 'class="limit"' in pareto
    with pytest.raises(MagisError, match="user's step"):
        report(path, out, run=True)
