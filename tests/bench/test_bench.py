"""`magis bench compare` and `magis bench ablation` (MAGIS §7.2, Figs. 9-13) on a tiny workload,
and the ablation's naive F-Tree (§7.2.5, H1 off)."""

from __future__ import annotations

import csv
import functools
import json

import pytest
import torch
from typer.testing import CliRunner

from magis.analyze import check
from magis.analyze.naive import naive_ftree
from magis.backend import compile_program, verify
from magis.baselines import Failure
from magis.bench import plots
from magis.bench.ablation import SETTINGS, AblationOptions, run_ablation
from magis.bench.compare import _front, baseline_rows, capture_context, run_compare
from magis.bench.compare_report import CompareOptions, MicrobatchScope, Row
from magis.bench.constraints import CONSTRAINTS, Constraint
from magis.rules import materialize, prepare
from magis.search import Mode

TINY = "bert-base:tiny"


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@functools.cache
def _context():
    return capture_context(TINY, "rtx3090")


@functools.cache
def _tiny_base():
    step = _context().step
    return step, prepare(step.graph)


# --- naive F-Tree ------------------------------------------------------------------------------


def test_naive_ftree_is_valid_seeded_and_every_node_verifies(one_thread):
    step, g = _tiny_base()
    tree = naive_ftree(g, max_level=4, seed=0)
    assert len(tree) >= 4
    assert {x.level for x in tree.nodes} == {1, 2, 3, 4}  # L levels, as Alg. 1's tree
    assert naive_ftree(g, max_level=4, seed=0) == tree  # one seed, one tree
    assert naive_ftree(g, max_level=4, seed=1) != tree
    for x in tree.nodes:
        assert check(g, x.ftrans), x.ftrans  # every candidate passes §4.2's validity check
        assert x.length % 2 == 0 and x.score == 0.0
    for i, x in enumerate(tree.nodes):  # nesting by inclusion, as Alg. 1's
        if x.parent is not None:
            assert x.ftrans.nodes <= tree.nodes[x.parent].ftrans.nodes and x.parent != i
    inputs = step.make_inputs()
    largest = max(range(len(tree)), key=lambda i: tree.nodes[i].size)
    for i in sorted({largest, *range(0, len(tree), 3)}):  # a third of them: the file stays fast
        m = materialize(g, tree.with_n(i, 2))
        v = verify(step, compile_program(m.graph, m.order), inputs)
        assert v.verified, f"naive node {i}: {v.worst} differs by {v.max_rel_err:.2e}"


def test_naive_ftree_count_and_levels():
    _, g = _tiny_base()
    tree = naive_ftree(g, max_level=2, seed=3, count=6)
    assert len(tree) == 6
    assert [x.level for x in tree.nodes] == [1, 1, 1, 2, 2, 2]


# --- compare -----------------------------------------------------------------------------------


def _read_csv(path):
    with path.open() as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    options = CompareOptions(
        workloads=(TINY,),
        methods=("magis", "pytorch", "xla-remat"),
        time_budget=1.5,
        out=out,
        pareto_memory_ratios=(0.6,),
        microbatch=MicrobatchScope.ALL,
    )
    seen = []
    report = run_compare(options, lambda what, done, total: seen.append((what, done, total)))
    return report, out, seen


def test_compare_writes_every_file(compared):
    report, out, seen = compared
    for name in ("results.csv", "results.json", "tables.md", plots.FIG9, plots.FIG10, plots.FIG11):
        assert (out / name).stat().st_size > 0, name
    assert (out / plots.FIG12).exists()  # micro-batching asked for every workload
    assert (out / plots.FIG9).read_bytes()[:4] == b"\x89PNG"
    assert seen and seen[-1][1] == seen[-1][2] - 1  # progress went through every step
    assert not report.interrupted and report.workloads[0].complete


def test_compare_rows_are_sane(compared):
    report, out, _ = compared
    rows = _read_csv(out / "results.csv")
    by = {(r["method"], r["constraint"]): r for r in rows}
    for c in CONSTRAINTS:
        for m in ("magis", "pytorch", "xla-remat"):
            assert (m, c.label) in by, (m, c.label)
    # PyTorch is the program order: ratio 1 within a latency limit, and no memory limit < 1 fits
    for c in ("lat<=1.05", "lat<=1.1"):
        r = by[("pytorch", c)]
        assert r["status"] == "ok" and float(r["memory_ratio"]) == 1.0
        assert float(r["latency_ratio"]) == 1.0
    for c in ("mem<=0.8", "mem<=0.4"):
        r = by[("pytorch", c)]
        assert r["status"] == "FAILURE" and r["satisfied"] == "False" and r["reason"]
    # MAGIS within a latency limit never does worse than the program order
    for c in ("lat<=1.05", "lat<=1.1"):
        r = by[("magis", c)]
        assert r["status"] == "ok" and float(r["memory_ratio"]) <= 1.0 + 1e-9
        assert float(r["latency_ratio"]) <= float(c.split("=")[1]) + 1e-9
    assert float(by[("magis", "mem<=0.8")]["memory_bytes"]) > 0
    pareto = [r for r in rows if r["method"] == "magis" and r["constraint"] == "pareto"]
    assert pareto
    mems = [float(r["memory_ratio"]) for r in pareto]
    lats = [float(r["latency_ratio"]) for r in pareto]
    assert mems == sorted(mems) and lats == sorted(lats, reverse=True)
    data = json.loads((out / "results.json").read_text())
    assert data["workloads"][0]["workload"] == TINY
    assert data["workloads"][0]["program_peak_bytes"] > 0
    assert len(data["workloads"][0]["rows"]) == len(rows)


def test_compare_tables_have_fig9_and_fig10(compared):
    _, out, _ = compared
    text = (out / "tables.md").read_text()
    assert "Fig. 9" in text and "Fig. 10" in text
    # Fig. 9, latency limits: the program order is all above the floor, which has a row
    assert "| pytorch | 1.000 [1.000] |" in text
    assert "| resident floor | 0." in text
    assert "| pytorch | FAILURE |" in text  # Fig. 10, memory limits


def test_an_unavailable_or_crashing_baseline_is_a_failure_row(monkeypatch):
    from magis.bench import compare

    def broken(name):
        raise RuntimeError("boom")

    monkeypatch.setattr(compare, "get_baseline", broken)
    ctx = _context()
    outcomes = compare.baseline_outcomes("dtr", ctx)
    assert outcomes == [Failure("dtr", "crashed: RuntimeError: boom")]
    rows = baseline_rows(ctx, "dtr", outcomes)
    assert [r.constraint for r in rows] == [c.label for c in CONSTRAINTS]
    assert all(not r.satisfied and "boom" in r.reason for r in rows)


def test_pareto_front_ignores_rounding_ties():
    recs = [(100, 1.0, "a"), (90, 1.0 + 1e-15, "b"), (95, 0.9, "c"), (80, 1.2, "d")]
    assert _front(recs) == [(80, 1.2, "d"), (90, 1.0 + 1e-15, "b"), (95, 0.9, "c")]


def test_constraint_objective_is_a_ratio_of_the_program_order():
    base = _context().base
    lat = Constraint(Mode.LATENCY_LIMIT, 1.1).objective(base)
    mem = Constraint(Mode.MEMORY_LIMIT, 0.4).objective(base)
    assert lat.limit == pytest.approx(1.1 * base.latency_s)
    assert mem.limit == int(0.4 * base.peak_bytes)
    assert Row(TINY, "m", "c", None, None, None, None, False, "why").status == "FAILURE"


# --- ablation and the CLI ----------------------------------------------------------------------


def test_ablation_curves_and_files(tmp_path):
    settings = (SETTINGS[0], SETTINGS[2])  # naive-fission, max-level=2
    constraints = (CONSTRAINTS[1], CONSTRAINTS[2])  # lat 1.10, mem 0.8
    options = AblationOptions(TINY, time_budget=1.0, out=tmp_path, settings=settings,
                              constraints=constraints)  # fmt: skip
    report = run_ablation(options)
    assert [(c.setting, c.constraint) for c in report.curves] == [
        (s.name, c.label) for s in settings for c in constraints
    ]
    for curve in report.curves:
        assert curve.points[0].seconds == 0.0  # the initial state
        secs = [p.seconds for p in curve.points]
        assert secs == sorted(secs) and curve.seconds >= secs[-1]
    lat_curve = report.curves[0]
    best = lat_curve.best_so_far(Mode.LATENCY_LIMIT)
    assert best and [v for _, v in best] == sorted((v for _, v in best), reverse=True)
    for name in ("ablation.csv", "ablation.json", "tables.md", plots.FIG13):
        assert (tmp_path / name).stat().st_size > 0, name
    rows = _read_csv(tmp_path / "ablation.csv")
    assert {r["setting"] for r in rows} == {"naive-fission", "max-level=2"}
    data = json.loads((tmp_path / "ablation.json").read_text())
    assert data["settings"]["naive-fission"]["naive_fission_seed"] == 0
    assert "| max-level=2 |" in (tmp_path / "tables.md").read_text()


def test_cli_bench_compare_json(tmp_path):
    from magis.cli import app

    out, js = tmp_path / "out", tmp_path / "c.json"
    args = ["bench", "compare", TINY, "--methods", "pytorch,dp-reorder", "--time-budget", "1",
            "--microbatch", "none", "--out", str(out), "--json", str(js)]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "memory ratio under lat<=1.05" in res.output
    data = json.loads(js.read_text())
    assert data["methods"] == ["pytorch", "dp-reorder"]
    methods = {r["method"] for r in data["workloads"][0]["rows"]}
    assert methods == {"pytorch", "dp-reorder"}
    assert (out / "results.csv").exists()


def test_cli_bench_compare_rejects_an_unknown_method(tmp_path):
    from magis.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "compare", TINY, "--methods", "magis,nope", "--out", str(tmp_path)])
    assert exc.value.code == 1


def test_the_figures_do_not_import_the_comparison():
    """plots reads the constraints from bench.constraints: no cycle with bench.compare."""
    import subprocess
    import sys

    code = "import sys, magis.bench.plots; print('magis.bench.compare' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr
