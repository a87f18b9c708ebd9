"""The `magis` command: JSON fields, one-line errors, warnings for a broken operator cache."""

import json
import os
import subprocess
import sys

import pytest


def magis(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {}), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "magis", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )


def test_unknown_workload_is_one_line_error():
    res = magis("analyze", "resnet-51")
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown workload" in lines[0] and "magis workloads" in lines[0]


def test_unknown_hardware_is_one_line_error():
    res = magis("analyze", "bert-base:tiny", "--hardware", "tpu9")
    assert (
        res.returncode == 1 and "unknown hardware" in res.stderr and "Traceback" not in res.stderr
    )


def test_analyze_json_fields(tmp_path):
    out = tmp_path / "a.json"
    res = magis("analyze", "bert-base:tiny", "--json", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    for key in (
        "workload",
        "nodes",
        "peak_bytes",
        "weight_bytes",
        "latency_s",
        "hotspots",
        "seconds",
    ):
        assert key in data
    assert data["peak_bytes"] > data["weight_bytes"] > 0
    assert len(data["hotspots"]) == 10


@pytest.mark.parametrize("cache", ["corrupt", "unwritable"])
def test_run_with_broken_cache_warns_and_verifies(tmp_path, cache):
    if cache == "corrupt":
        path = tmp_path / "ops.sqlite"
        path.write_bytes(b"this is not a database" * 100)
    else:
        blocker = tmp_path / "a_file"
        blocker.write_text("x")
        path = blocker / "ops.sqlite"  # parent is a regular file: cannot be created
    out = tmp_path / "run.json"
    res = magis("run", "bert-base:tiny", "--json", str(out), env={"MAGIS_CACHE": str(path)})
    assert res.returncode == 0, res.stderr
    assert "warning" in res.stderr.lower()
    data = json.loads(out.read_text())
    assert data["verified"] is True
    for key in ("max_rel_err", "measured_peak_bytes", "simulated_peak_bytes", "latency_s"):
        assert key in data
    assert (
        abs(data["simulated_peak_bytes"] - data["measured_peak_bytes"])
        <= 0.05 * data["measured_peak_bytes"]
    )


def test_capture_error_from_cli_api_is_one_line(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(
        "import torch\n"
        "from magis.cli import main\n"
        "from magis.capture import capture\n"
        "import typer\n"
        "from magis.cli import app\n"
        "@app.command('bad')\n"
        "def bad():\n"
        "    capture(lambda x: x * x.sum().item(), torch.randn(3))\n"
        "main()\n"
    )
    res = subprocess.run(
        [sys.executable, str(script), "bad"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 1
    assert "Traceback" not in res.stderr and "reads a tensor's value" in res.stderr
