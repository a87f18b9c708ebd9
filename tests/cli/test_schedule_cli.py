"""`magis schedule` and `magis bench incremental`: JSON fields, one-line errors."""

import json

import pytest


def test_schedule_json_fields(magis_cli, tmp_path):
    out = tmp_path / "s.json"
    res = magis_cli("schedule", "bert-base:tiny", "--scheduler", "dp", "--json", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    for key in ("peak_bytes", "latency_s", "seconds", "peak_ratio", "exact_segments", "segments"):
        assert key in data
    assert data["peak_ratio"] <= 1.0
    assert data["lower_bound_bytes"] <= data["peak_bytes"] <= data["program_peak_bytes"]
    # re-ordering costs no time: the same op times, summed in another order (float rounding)
    assert data["latency_s"] == pytest.approx(data["program_latency_s"], rel=1e-12)
    assert 0 < data["exact_segments"] <= data["segments"]


def test_program_scheduler_is_the_baseline(magis_cli, tmp_path):
    out = tmp_path / "p.json"
    res = magis_cli("schedule", "resnet50:tiny", "-s", "program", "--json", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert data["peak_ratio"] == 1.0 and data["segments"] == 0


def test_unknown_scheduler_is_one_line_error(magis_cli):
    res = magis_cli("schedule", "bert-base:tiny", "--scheduler", "serenity")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown scheduler" in lines[0] and "program, dp" in lines[0]


def test_bench_incremental_json_fields(magis_cli, tmp_path):
    out = tmp_path / "b.json"
    res = magis_cli(
        "bench", "incremental", "--dags", "1", "--rounds", "2", "--repeats", "1", "--json", str(out)
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    for key in (
        "cases",
        "mean_speedup",
        "min_speedup",
        "max_speedup",
        "equal_quality",
        "worst_quality_ratio",
    ):
        assert key in data
    assert len(data["cases"]) == 2
