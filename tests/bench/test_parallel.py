"""A sweep's cells run side by side (issue #18): a local process pool and Ray give the serial
run's rows; a cell that raises is a FAILURE row with its reason; a missing Ray is one line."""

from __future__ import annotations

import sys

import pytest

from magis.bench.ablation import SETTINGS, AblationOptions, run_ablation
from magis.bench.compare import run_compare, run_compare_cell
from magis.bench.compare_cells import CompareCell
from magis.bench.compare_report import CompareOptions, MicrobatchScope
from magis.bench.constraints import CONSTRAINTS
from magis.bench.parallel import (
    CellFailure,
    Finished,
    PoolRunner,
    RayRunner,
    SerialRunner,
    make_runner,
    run_cells,
)
from magis.search.transport import RayMissingError

TINY = "bert-base:tiny"
BASELINES = ("pytorch", "xla-remat")


def _options(out) -> CompareOptions:
    return CompareOptions(
        workloads=(TINY,), methods=BASELINES, out=out, microbatch=MicrobatchScope.NONE
    )


@pytest.fixture(scope="module")
def serial_rows(tmp_path_factory):
    report = run_compare(_options(tmp_path_factory.mktemp("serial")))
    assert not report.interrupted and report.workloads[0].complete
    return report.rows()


def raise_on_three(n: int) -> int:
    """A cell function: the cell 3 raises (module level: a worker imports it by name)."""
    if n == 3:
        raise ValueError("three is not allowed")
    return n * n


def test_pool_gives_the_serial_rows(serial_rows, tmp_path):
    report = run_compare(_options(tmp_path), runner=PoolRunner(2))
    assert not report.interrupted and report.workloads[0].complete
    assert report.rows() == serial_rows
    assert (tmp_path / "results.csv").read_text().count("\n") == len(serial_rows) + 1


def test_a_cell_that_raises_in_a_worker_is_a_failure_with_its_reason():
    done = sorted(run_cells(range(5), raise_on_three, PoolRunner(2)), key=lambda f: f.index)
    assert [f.result for f in done if f.index != 3] == [0, 1, 4, 16]
    assert done[3].result == CellFailure("crashed: ValueError: three is not allowed")
    assert all(f.cpu_seconds >= 0 for f in done)


class _FailingRunner:
    """Runs every cell here, except that the cell `fails` raised in its worker."""

    name = "failing"

    def __init__(self, fails: int) -> None:
        self.fails = fails

    def run(self, cells, fn):
        for done in SerialRunner().run(cells, fn):
            if done.index == self.fails:
                yield Finished(done.index, CellFailure("crashed: RuntimeError: worker lost"))
            else:
                yield done


def test_a_failed_cell_is_a_failure_row_and_the_run_goes_on(serial_rows, tmp_path):
    report = run_compare(_options(tmp_path), runner=_FailingRunner(fails=1))  # xla-remat
    rows = report.rows()
    failed = [r for r in rows if r.method == "xla-remat"]
    assert [r.constraint for r in failed] == [c.label for c in CONSTRAINTS]
    assert all(not r.satisfied and r.reason == "crashed: RuntimeError: worker lost" for r in failed)
    assert [r for r in rows if r.method == "pytorch"] == [
        r for r in serial_rows if r.method == "pytorch"
    ]
    assert "worker lost" in (tmp_path / "tables.md").read_text()


def test_ray_missing_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(RayMissingError, match=r"Ray is not installed: pip install 'magis\[ray\]'"):
        make_runner(2, "local")


def test_make_runner_picks_the_backend():
    assert isinstance(make_runner(1, None), SerialRunner)
    assert isinstance(make_runner(3, None), PoolRunner) and make_runner(3, None).jobs == 3


def test_ray_gives_the_serial_rows(serial_rows, tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'magis[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        report = run_compare(_options(tmp_path), runner=RayRunner())
        cells = [CompareCell(TINY, "rtx3090", "pytorch"), CompareCell("no-such", "rtx3090", "dtr")]
        done = sorted(run_cells(cells, run_compare_cell, RayRunner()), key=lambda f: f.index)
    finally:
        ray.shutdown()
    assert report.rows() == serial_rows
    assert done[0].result.rows == tuple(r for r in serial_rows if r.method == "pytorch")
    failure = done[1].result
    assert isinstance(failure, CellFailure) and "unknown workload 'no-such'" in failure.reason


class _InterruptedRunner:
    """Ctrl-C right after the first cell finished."""

    name = "interrupted"

    def run(self, cells, fn):
        for done in SerialRunner().run(cells, fn):
            yield done
            raise KeyboardInterrupt


def test_ctrl_c_keeps_the_cells_that_finished(serial_rows, tmp_path):
    report = run_compare(_options(tmp_path), runner=_InterruptedRunner())
    assert report.interrupted and not report.workloads[0].complete
    assert report.rows() == [r for r in serial_rows if r.method == "pytorch"]
    csv_text = (tmp_path / "results.csv").read_text()
    assert "pytorch" in csv_text and "xla-remat" not in csv_text
    assert "Interrupted" in (tmp_path / "tables.md").read_text()


def test_ablation_on_a_pool_keeps_the_serial_order_and_a_failed_search(tmp_path):
    settings, constraints = SETTINGS[2:4], CONSTRAINTS[:1]
    options = AblationOptions(TINY, "rtx3090", 1.0, tmp_path / "pool", settings, constraints)
    report = run_ablation(options, runner=PoolRunner(2))
    assert [c.setting for c in report.curves] == [s.name for s in settings]
    assert not report.failures and (tmp_path / "pool" / "ablation.csv").exists()
    options = AblationOptions(TINY, "rtx3090", 1.0, tmp_path / "failed", settings, constraints)
    report = run_ablation(options, runner=_FailingRunner(fails=0))
    assert [c.setting for c in report.curves] == [settings[1].name]
    assert report.failures == [f"{settings[0].name} lat<=1.05: crashed: RuntimeError: worker lost"]
    assert "worker lost" in (tmp_path / "failed" / "tables.md").read_text()


def test_cli_ray_needs_an_address(tmp_path):
    from magis.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "compare", TINY, "--ray", "--jobs", "2", "--out", str(tmp_path)])
    assert exc.value.code == 2


def test_a_capture_that_fails_fails_each_cell_of_the_workload_once(monkeypatch):
    from magis.bench import compare

    calls = []

    def broken(workload, hardware, kind=None):
        calls.append(workload)
        raise RuntimeError("no model")

    monkeypatch.setattr(compare, "capture_context", broken)
    compare.workload_memo.cache_clear()
    cells = [CompareCell("bert-base:tiny", "h", m) for m in BASELINES]
    try:
        done = list(run_cells(cells, run_compare_cell))
    finally:
        compare.workload_memo.cache_clear()
    reasons = [f.result.reason for f in done]
    assert reasons == ["crashed: BenchError: capture failed: RuntimeError: no model"] * 2
    assert calls == ["bert-base:tiny"]
