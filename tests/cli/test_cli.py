"""The `magis` command: JSON fields, one-line errors, warnings for a broken operator cache; the
command functions behind it (`magis.commands`), and no process-wide state left behind."""

import json
import subprocess
import sys
import warnings

import pytest

from magis.cli import main
from magis.commands.analyze import analyze
from magis.commands.demo import demo
from magis.commands.schedule import schedule_workload
from magis.commands.workloads import workloads
from magis.cost import get_cost_model


def test_unknown_workload_is_one_line_error(magis_cli):
    res = magis_cli("analyze", "resnet-51")
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown workload" in lines[0] and "magis workloads" in lines[0]


def test_unknown_hardware_is_one_line_error(magis_cli):
    res = magis_cli("analyze", "bert-base:tiny", "--hardware", "tpu9")
    assert (
        res.returncode == 1 and "unknown hardware" in res.stderr and "Traceback" not in res.stderr
    )


def test_analyze_json_fields(magis_cli, tmp_path):
    out = tmp_path / "a.json"
    res = magis_cli("analyze", "bert-base:tiny", "--json", str(out))
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
def test_run_with_broken_cache_warns_and_verifies(magis_cli, tmp_path, cache):
    if cache == "corrupt":
        path = tmp_path / "ops.sqlite"
        path.write_bytes(b"this is not a database" * 100)
    else:
        blocker = tmp_path / "a_file"
        blocker.write_text("x")
        path = blocker / "ops.sqlite"  # parent is a regular file: cannot be created
    out = tmp_path / "run.json"
    res = magis_cli("run", "bert-base:tiny", "--json", str(out), env={"MAGIS_CACHE": str(path)})
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
        "    capture(lambda x: x * (2 if torch.rand(()) > 0.5 else 1), torch.randn(3))\n"
        "main()\n"
    )
    res = subprocess.run(
        [sys.executable, str(script), "bad"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 1
    assert "Traceback" not in res.stderr and "depends on a random draw" in res.stderr


def test_debug_shows_the_traceback(magis_cli):
    res = magis_cli("--debug", "analyze", "resnet-51")
    assert (
        res.returncode != 0 and "Traceback" in res.stderr and "UnknownWorkloadError" in res.stderr
    )


def test_main_leaves_the_warning_machinery_as_it_found_it(tmp_path, capsys):
    before_show, before_filters = warnings.showwarning, list(warnings.filters)
    main(["workloads", "--json", str(tmp_path / "w.json")])
    assert warnings.showwarning is before_show and warnings.filters == before_filters
    with pytest.raises(SystemExit) as exc:
        main(["analyze", "resnet-51"])
    assert exc.value.code == 1 and warnings.showwarning is before_show
    assert "unknown workload" in capsys.readouterr().err


def test_workloads_command_and_its_json(tmp_path):
    rep = workloads()
    names = [r.name for r in rep.rows]
    assert "bert-base" in names and "bert-base:tiny" in names and "unet:small" in names
    out = tmp_path / "w.json"
    main(["workloads", "--json", str(out)])
    assert json.loads(out.read_text()) == rep.to_json()
    assert {"name", "batch", "dtype", "size"} <= set(rep.to_json()["workloads"][0])


def test_commands_take_a_prepared_cost_model():
    """One cost model object serves a whole command; its name is the report's hardware."""
    cost = get_cost_model("a100")
    rep = analyze("bert-base:tiny", cost)
    assert rep.hardware == "a100" and rep.peak_bytes > rep.weight_bytes > 0
    again = analyze("bert-base:tiny", "a100")  # a name gives the same model
    assert (again.peak_bytes, again.latency_s) == (rep.peak_bytes, rep.latency_s)
    sched = schedule_workload("bert-base:tiny", "dp", cost)
    assert sched.hardware == "a100" and sched.peak_bytes <= sched.program_peak_bytes


def test_demo_analyzes_paper_size_and_verifies_tiny(tmp_path):
    stages = []
    rep = demo(stages.append)
    assert rep.analyze.workload == "bert-base" and rep.analyze.peak_bytes > 2**30
    assert rep.run.workload == "bert-base:tiny" and rep.run.verified
    assert rep.run.dtype == "float64"
    assert any(s.startswith("analyze: ") for s in stages)
    assert any(s.startswith("run: ") for s in stages)
    assert set(rep.to_json()) == {"analyze", "run"}
