"""The CLI's edges (issue 14, item 4): bad input refused before any work with one line and exit
code 2, limits no plan can meet refused with their bound, exit code 3 for a limit not met,
Ctrl-C at any moment exits 130 and leaves the best plan so far on disk, paper-size `run`
refused when it would not fit; `run --device`, `bench fuzz` and `bench train`; no traceback
without --debug."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from magis.cli import main
from magis.plan import Plan


def invoke(capsys, *args: str) -> tuple[int, str, str]:
    """`magis ARGS` in this process: (exit code, stdout, stderr)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _sigint_as_a_terminal_delivers_it() -> None:
    """pytest-xdist workers ignore SIGINT, and a child inherits that: restore the default so
    the child's Python installs its KeyboardInterrupt handler, as under a user's shell."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def sigint_raises_keyboard_interrupt():
    """Ctrl-C as a user's shell delivers it, also inside an xdist worker (which ignores it)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def no_capture(monkeypatch):
    """Fails the test if `optimize` captures its workload."""
    from magis.commands import optimize as command

    calls = []
    monkeypatch.setattr(command, "workload_step", lambda *a, **k: calls.append(a) or 1 / 0)
    yield calls
    assert calls == [], "the workload was captured before the bad input was refused"


# --- 1. bad input: one line, exit 2, before the capture -------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["--mem-limit", "0"], "must be more than 0"),
        (["--mem-limit", "0GiB"], "must be more than 0"),
        (["--mem-limit", "-1"], "cannot read memory limit"),
        (["--mem-limit", "2"], "ambiguous"),
        (["--mem-limit", "12 parsecs"], "cannot read memory limit"),
        (["--lat-limit", "0"], "must be more than 0"),
        (["--lat-limit", "-5"], "cannot read latency limit"),
        (["--lat-limit", "0s"], "must be more than 0"),
        (["--lat-limit", "1.1", "--time-budget", "-5"], "--time-budget must be more than 0"),
        (["--lat-limit", "1.1", "--time-budget", "0"], "--time-budget must be more than 0"),
        (["--lat-limit", "1.1", "--memory-figure", "nope"], "unknown memory figure"),
        (["--lat-limit", "1.1", "--max-states", "0"], "--max-states"),
        (["--lat-limit", "1.1", "--hardware", "tpu9"], "unknown hardware"),
    ],
)
def test_bad_limits_and_options_are_refused_before_the_capture(capsys, no_capture, args, words):
    code, _, err = invoke(capsys, "optimize", "bert-base:tiny", *args)
    line = one_line(err)
    assert words in line
    assert code == (1 if "hardware" in words else 2)


@pytest.mark.parametrize("args", [[], ["--mem-limit", "0.5", "--lat-limit", "1.1"]])
def test_both_or_neither_limit_names_the_flags(capsys, no_capture, args):
    code, _, err = invoke(capsys, "optimize", "bert-base:tiny", *args)
    line = one_line(err)
    assert code == 2 and "--mem-limit" in line and "--lat-limit" in line
    assert "mem_limit" not in line


def test_python_api_names_its_arguments():
    from magis.commands.limits import check_one_limit
    from magis.errors import LimitError

    with pytest.raises(LimitError, match="mem_limit .* lat_limit"):
        check_one_limit(None, None)


@pytest.mark.parametrize(
    "flag, path, words",
    [
        ("--json", "{file}/x.json", "is not a folder"),
        ("--save", "{file}/sub/p.json", "is not a folder"),
        ("--save", "{dir}", "is a folder"),
        ("--json", "{dir}", "is a folder"),
    ],
)
def test_unwritable_output_paths_are_refused_before_the_capture(
    capsys, no_capture, tmp_path, flag, path, words
):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    target = path.format(file=a_file, dir=tmp_path)
    code, _, err = invoke(capsys, "optimize", "bert-base:tiny", "--lat-limit", "1.1", flag, target)
    line = one_line(err)
    assert code == 2 and flag in line and words in line


def test_output_folders_that_do_not_exist_yet_are_made(tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "w.json"
    code, _, _ = invoke(capsys, "workloads", "--json", str(out))
    assert code == 0 and json.loads(out.read_text())["workloads"]


@pytest.mark.parametrize(
    "content, words",
    [
        (None, "no such file"),
        ("[1, 2, 3]", "not a magis plan"),
        ('{"format": "magis.plan", "version": 2}', "no 'summary' field"),
        ("{not json", "cannot read plan"),
    ],
)
def test_run_plan_files_missing_or_of_the_wrong_shape_are_one_line(
    capsys, monkeypatch, tmp_path, content, words
):
    from magis.commands import run as command

    monkeypatch.setattr(command, "workload_step", lambda *a, **k: 1 / 0)  # never reached
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    code, _, err = invoke(capsys, "run", "bert-base:tiny", "--plan", str(path))
    assert words in one_line(err)
    assert code == (2 if content is None else 1)


# --- 2. limits no plan can meet ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_base():
    from magis.capture import workload_step
    from magis.cost import get_cost_model
    from magis.sim import simulate

    _, step = workload_step("bert-base:tiny", float64_when_tiny=True)
    cost = get_cost_model("rtx3090")
    return step, cost, simulate(step.graph, step.graph.program_order(), cost)


def test_memory_limit_below_the_resident_bytes_is_refused_with_the_bound(capsys, tiny_base):
    _, _, base = tiny_base
    resident_mib = f"{base.resident_bytes / 2**20:.3f} MiB"
    for limit in ("1KB", f"{base.resident_bytes}"):  # below, and exactly at, the bound
        code, _, err = invoke(capsys, "optimize", "bert-base:tiny", "--mem-limit", limit)
        line = one_line(err)
        assert code == 2 and "cannot be met" in line and resident_mib in line, line
    ratio = base.resident_bytes / base.peak_bytes
    code, _, err = invoke(capsys, "optimize", "bert-base:tiny", "--mem-limit", f"{ratio * 0.99}")
    assert code == 2 and f"{ratio:.3f} of the program order" in one_line(err)


def test_latency_limit_under_the_compute_bound_is_refused_with_the_bound(capsys, tiny_base):
    from magis.commands.limits import latency_lower_bound

    step, cost, base = tiny_base
    bound = latency_lower_bound(step.graph, cost)
    assert 0 < bound < base.latency_s
    ratio = bound / base.latency_s
    code, _, err = invoke(capsys, "optimize", "bert-base:tiny", "--lat-limit", f"{ratio * 0.9:.6g}")
    line = one_line(err)
    assert code == 2 and "cannot be met on rtx3090" in line and f"{bound * 1e3:.4g} ms" in line


def test_a_measured_cost_model_has_no_latency_bound(tiny_base):
    from magis.commands.limits import latency_lower_bound
    from magis.cost import get_cost_model

    step, _, _ = tiny_base
    assert latency_lower_bound(step.graph, get_cost_model("unit")) is None


@pytest.mark.parametrize(
    "workload, mem_limit, lat_limit",
    [("bert-base:tiny", "0.6", None), ("bert-base:tiny", None, "1.05"), ("unet:tiny", "0.6", None)],
)
def test_the_latency_bound_holds_for_every_plan_a_search_finds(workload, mem_limit, lat_limit):
    """Fission, TASO, re-materialization and swapping: no state the search records goes under
    the bound, and no plan's own bound is lower than the program's (the FLOPs are kept)."""
    from magis.capture import workload_step
    from magis.commands.limits import latency_lower_bound
    from magis.commands.optimize import find_plan, setup_search
    from magis.search import SearchOptions

    _, step = workload_step(workload, float64_when_tiny=True)
    setup = setup_search(step, mem_limit=mem_limit, lat_limit=lat_limit, hardware="rtx3090")
    seen = []
    plan = find_plan(setup, SearchOptions(max_states=40), on_improvement=seen.append)
    bound = latency_lower_bound(step.graph, setup.cost)
    assert plan.summary.history  # rules were applied
    assert all(i.latency >= bound for i in seen)
    assert plan.summary.latency_s >= bound
    assert latency_lower_bound(plan.graph, setup.cost) >= bound * (1 - 1e-9)


# --- 3. exit code 3: the limit is not met ------------------------------------------------------


def test_a_limit_not_met_exits_3_and_still_saves_the_plan(capsys, tmp_path):
    plan, report = tmp_path / "p.json", tmp_path / "o.json"
    code, out, err = invoke(
        capsys, "optimize", "bert-base:tiny", "--lat-limit", "0.2", "--max-states", "5",
        "--save", str(plan), "--json", str(report),
    )  # fmt: skip
    assert code == 3, err
    assert "limit not met" in err and "NOT met" in out and "Traceback" not in err
    assert json.loads(report.read_text())["satisfied"] is False
    assert Plan.load(plan).summary.satisfied is False


# --- 5. Ctrl-C ---------------------------------------------------------------------------------


def test_ctrl_c_during_capture_says_no_plan(capsys, monkeypatch, tmp_path):
    from magis.commands import optimize as command

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "workload_step", interrupted)
    plan = tmp_path / "p.json"
    code, _, err = invoke(
        capsys, "optimize", "bert-base:tiny", "--lat-limit", "1.1", "--save", str(plan)
    )
    assert code == 130 and "before the search started" in one_line(err)
    assert not plan.exists()


def test_ctrl_c_in_another_command_exits_130_with_a_word(capsys, monkeypatch):
    from magis.commands import analyze as command

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "workload_step", interrupted)
    code, _, err = invoke(capsys, "analyze", "bert-base:tiny")
    assert code == 130 and one_line(err) == "interrupted"


def test_ctrl_c_during_the_search_keeps_the_best_plan(capsys, monkeypatch, tmp_path):
    from magis.search.core import SearchCore

    real_expand, calls = SearchCore.expand, []

    def expand(self, *args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_expand(self, *args)

    monkeypatch.setattr(SearchCore, "expand", expand)
    plan, report = tmp_path / "p.json", tmp_path / "o.json"
    code, _, err = invoke(
        capsys, "optimize", "bert-base:tiny", "--mem-limit", "0.6", "--time-budget", "600",
        "--save", str(plan), "--json", str(report),
    )  # fmt: skip
    assert code == 130
    assert one_line(err) == f"interrupted: best plan so far saved to {plan}"
    assert Plan.load(plan).summary.interrupted is True
    assert json.loads(report.read_text())["interrupted"] is True


def test_ctrl_c_during_the_final_reordering_keeps_the_plan_before_it(capsys, monkeypatch, tmp_path):
    from magis.search.evaluator import Evaluator

    def polish(self, state):
        raise KeyboardInterrupt

    monkeypatch.setattr(Evaluator, "polish", polish)
    plan = tmp_path / "p.json"
    code, _, err = invoke(
        capsys, "optimize", "bert-base:tiny", "--lat-limit", "1.2", "--max-states", "5",
        "--save", str(plan),
    )  # fmt: skip
    assert code == 130 and one_line(err) == f"interrupted: best plan so far saved to {plan}"
    assert Plan.load(plan).order


def test_ctrl_c_while_saving_waits_for_a_whole_file(capsys, monkeypatch, tmp_path):
    real_save, signalled = Plan.save, []

    def save(self, path):
        if not signalled:
            signalled.append(1)
            os.kill(os.getpid(), signal.SIGINT)  # arrives while the file is written
        return real_save(self, path)

    monkeypatch.setattr(Plan, "save", save)
    handler = signal.getsignal(signal.SIGINT)
    plan = tmp_path / "p.json"
    code, _, err = invoke(
        capsys, "optimize", "bert-base:tiny", "--lat-limit", "1.2", "--max-states", "5",
        "--save", str(plan),
    )  # fmt: skip
    assert code == 130 and one_line(err) == f"interrupted: best plan so far saved to {plan}"
    assert Plan.load(plan).order
    assert signal.getsignal(signal.SIGINT) is handler  # the deferral put it back


def test_without_save_an_interrupted_search_says_the_plan_is_not_saved(capsys, monkeypatch):
    from magis.search.evaluator import Evaluator

    def polish(self, state):
        raise KeyboardInterrupt

    monkeypatch.setattr(Evaluator, "polish", polish)
    code, _, err = invoke(
        capsys, "optimize", "bert-base:tiny", "--lat-limit", "1.2", "--max-states", "5"
    )
    assert code == 130 and "--save PATH" in one_line(err)


# Real SIGINTs to a real process: a driver announces each stage on stderr so the test knows
# when to send them (the polish is slowed down so that a Ctrl-C surely lands inside it).
DRIVER = """
import sys, time
import magis.commands.optimize as command
from magis.search.evaluator import Evaluator
def say(word):
    print(word, file=sys.stderr, flush=True)
real_capture, real_search, real_polish = command.workload_step, command.optimize_graph, Evaluator.polish
def capture(*a, **k):
    say("CAPTURING")
    return real_capture(*a, **k)
def search(*a, **k):
    say("SEARCHING")
    return real_search(*a, **k)
def polish(self, state):
    say("POLISHING")
    time.sleep(float(sys.argv[1]))
    return real_polish(self, state)
from magis.search.core import SearchCore
real_expand, expanded = SearchCore.expand, []
def expand(self, *a):
    if not expanded:
        expanded.append(say("EXPANDING"))
    return real_expand(self, *a)
command.workload_step, command.optimize_graph, Evaluator.polish = capture, search, polish
SearchCore.expand = expand
from magis.cli import main
main(sys.argv[2:])
"""


class Driven:
    """A `magis` process run by DRIVER, its stderr lines read as they come."""

    def __init__(self, tmp_path: Path, polish_sleep: float, *args: str) -> None:
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        env = {**os.environ, "COLUMNS": "200", "MAGIS_CACHE": str(tmp_path / "ops.sqlite")}
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(polish_sleep), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=_sigint_as_a_terminal_delivers_it,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)
            self.lines.put(line.strip())

    def wait_for(self, word: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.lines.get(timeout=1) == word:
                    return
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.err)
        raise AssertionError(f"no {word} in {''.join(self.err)}")

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def finish(self) -> tuple[int, str]:
        code = self.proc.wait(timeout=300)
        time.sleep(0.2)  # the reader thread drains stderr
        return code, "".join(self.err)


def _last_line(err: str) -> str:
    return [line for line in err.splitlines() if line.strip()][-1]


def test_sigint_during_the_capture_of_a_paper_size_workload(tmp_path):
    plan = tmp_path / "p.json"
    run = Driven(tmp_path, 0, "optimize", "bert-base", "--mem-limit", "0.5", "--save", str(plan))
    run.wait_for("CAPTURING")
    time.sleep(1.0)
    run.interrupt()
    code, err = run.finish()
    assert code == 130 and "Traceback" not in err
    assert _last_line(err) == "interrupted before the search started: no plan to save"
    assert not plan.exists()


def test_sigint_during_the_search_then_again_during_the_final_reordering(tmp_path):
    plan = tmp_path / "p.json"
    run = Driven(
        tmp_path, 60, "optimize", "bert-base:tiny", "--mem-limit", "0.6",
        "--time-budget", "600", "--save", str(plan),
    )  # fmt: skip
    run.wait_for("EXPANDING")
    time.sleep(2.0)
    run.interrupt()  # the search stops, saves its best plan, then re-orders it
    run.wait_for("POLISHING")
    run.interrupt()  # the re-ordering is cut short: the plan saved before it stays
    code, err = run.finish()
    assert code == 130 and "Traceback" not in err
    assert _last_line(err) == f"interrupted: best plan so far saved to {plan}"
    saved = Plan.load(plan)
    assert saved.summary.interrupted is True and saved.summary.states_explored > 0


# --- 6. paper-size run refused -----------------------------------------------------------------


def test_paper_size_run_is_refused_before_the_model_is_built(capsys, monkeypatch):
    from magis.commands import device, run

    built = []
    monkeypatch.setattr(device, "available_memory", lambda dev: 2**30)
    monkeypatch.setattr(run, "workload_step", lambda *a, **k: built.append(a) or 1 / 0)
    code, _, err = invoke(capsys, "run", "bert-base")
    line = one_line(err)
    assert code == 1 and built == []
    assert "bert-base needs about" in line and "1.0 GiB is available" in line
    needed = float(line.split("needs about ")[1].split(" GiB")[0])
    assert needed > 10  # Table 2's batch: tens of GiB


def test_meminfo_is_read_in_bytes():
    from magis.capture.host_memory import meminfo_available
    from magis.commands.device import available_memory

    text = "MemTotal:       24000000 kB\nMemFree: 100 kB\nMemAvailable:   20000000 kB\n"
    assert meminfo_available(text) == 20000000 * 1024
    with pytest.raises(ValueError):
        meminfo_available("MemTotal: 1 kB\n")
    assert available_memory(torch.device("cpu")) > 0


# --- 8. devices --------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize(
    "args", [["--device", "cuda"], ["--hardware", "cuda"], ["--device", "cuda:0"]]
)
def test_cuda_without_a_gpu_is_one_line(capsys, args):
    code, _, err = invoke(capsys, "run", "bert-base:tiny", *args)
    line = one_line(err)
    assert code == 1 and ("no CUDA device" in line or "has none" in line)


def test_unknown_device_is_one_line(capsys):
    code, _, err = invoke(capsys, "run", "bert-base:tiny", "--device", "tpu")
    assert code == 1 and "unknown device 'tpu'" in one_line(err)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA"))],
)  # fmt: skip
def test_run_on_a_device_verifies(capsys, monkeypatch, tmp_path, device):
    import magis.cli
    from magis.cost import get_cost_model

    asked = []
    monkeypatch.setattr(
        magis.cli, "_cost", lambda name: asked.append(name) or get_cost_model("a100")
    )
    out = tmp_path / "r.json"
    code, _, err = invoke(capsys, "run", "bert-base:tiny", "--device", device, "--json", str(out))
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["verified"] and data["device"].startswith(device)
    assert asked == [device]  # simulated on the device it ran on, unless --hardware says


# --- 9. bench fuzz, bench train ----------------------------------------------------------------


def test_bench_fuzz_reports_and_its_exit_code_follows_the_failures(capsys, tmp_path):
    out = tmp_path / "f.json"
    code, stdout, _ = invoke(capsys, "bench", "fuzz", "--cases", "6", "--seed", "3",
                             "--json", str(out))  # fmt: skip
    data = json.loads(out.read_text())
    for key in ("cases", "mismatches", "rules_covered", "seconds", "cases_per_second"):
        assert key in data
    assert data["cases"] == 6 and "cases/s" in stdout and "rules covered" in stdout
    failures = data["mismatches"] + data["meta_mismatches"] + data["baseline_failures"]
    assert code == (1 if failures else 0)


def test_bench_fuzz_prints_each_mismatch_with_its_reproducer(capsys, monkeypatch):
    from magis.bench import fuzz

    report = fuzz.FuzzReport(seed=7, cases=1, models=1, seconds=0.5)
    report.mismatches.append(
        fuzz.Mismatch(7, 0, 2, "mlp", ("remat: x",), "max relative error 0.3", 0.3, "loss")
    )
    monkeypatch.setattr(fuzz, "run_fuzz", lambda *a, **k: report)
    code, _, err = invoke(capsys, "bench", "fuzz", "--cases", "1", "--seed", "7")
    assert code == 1 and "magis.bench.fuzz.replay(7, 0, 2)" in one_line(err)


def test_bench_train_times_a_program_order_step_against_eager(capsys, tmp_path):
    pytest.importorskip("magis.bench.train")
    out = tmp_path / "t.json"
    code, stdout, err = invoke(
        capsys, "bench", "train", "bert-base:tiny", "--repeats", "2", "--json", str(out)
    )
    assert code == 0, err
    (row,) = json.loads(out.read_text())["rows"]
    assert row["workload"] == "bert-base:tiny" and row["eager_s"] > 0 and row["magis_s"] > 0
    assert row["ratio"] == pytest.approx(row["magis_s"] / row["eager_s"])
    assert row["compiler"] == "python"


def test_bench_train_refuses_an_unknown_compiler_in_one_line(capsys):
    code, _, err = invoke(capsys, "bench", "train", "bert-base:tiny", "--compiler", "xla")
    assert code == 2 and "--compiler 'xla'" in one_line(err)


# --- 10. no traceback without --debug ----------------------------------------------------------

BAD_INPUTS = [
    ["workloads", "--json", "{file}/w.json"],
    ["analyze", "resnet-51"],
    ["analyze", "bert-base:tiny", "--max-level", "0"],
    ["run", "bert-base:tiny", "--fission", "x"],
    ["run", "bert-base:tiny", "--plan", "{dir}/missing.json"],
    ["run", "bert-base:tiny", "--parts", "1", "--fission", "0"],
    ["optimize", "bert-base:tiny", "--mem-limit", "0"],
    ["schedule", "bert-base:tiny", "--scheduler", "nope"],
    ["layout", "bert-base:tiny", "--method", "nope"],
    ["layout", "bert-base:tiny", "--plan", "{file}"],
    ["demo", "--json", "{dir}"],
    ["bench", "incremental", "--dags", "0"],
    ["bench", "compare", "--time-budget", "0"],
    ["bench", "ablation", "--out", "{file}"],
    ["bench", "fuzz", "--cases", "-1"],
    ["bench", "fuzz", "--max-seconds", "0"],
    ["bench", "train", "nope:tiny"],
    ["bench", "train", "--optimizer", "lion"],
    ["--bogus"],
    ["frobnicate"],
]


@pytest.mark.parametrize("args", BAD_INPUTS, ids=[" ".join(a) for a in BAD_INPUTS])
def test_no_traceback_reaches_the_user(capsys, tmp_path, args):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    argv = [a.format(file=a_file, dir=tmp_path) for a in args]
    code, out, err = invoke(capsys, *argv)
    assert code in (1, 2), (code, err)
    assert "Traceback" not in out + err
    assert one_line(err).startswith("error:")


def test_a_bug_is_one_line_and_debug_shows_it(capsys, monkeypatch):
    from magis.commands import workloads as command

    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug\nwith two lines")

    monkeypatch.setattr(command, "workloads", broken)
    code, _, err = invoke(capsys, "workloads")
    line = one_line(err)
    assert code == 1 and "internal error: RuntimeError: a bug" in line and "--debug" in line
    with pytest.raises(RuntimeError, match="a bug"):
        main(["--debug", "workloads"])


def test_usage_errors_from_a_real_process_are_one_line():
    res = subprocess.run(
        [sys.executable, "-m", "magis", "optimize", "bert-base:tiny", "--bogus"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "No such option: --bogus" in one_line(res.stderr)


# --- 7. typer pinned to the tested range -------------------------------------------------------


def test_installed_typer_is_in_the_pinned_range():
    """`main` relies on typer's vendored click (`typer.TyperException`) and on its turning a
    KeyboardInterrupt into exit status 130; the pin in pyproject.toml is the tested range."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    (typer_req,) = [Requirement(d) for d in deps if Requirement(d).name == "typer"]
    assert typer_req.specifier.contains(importlib.metadata.version("typer"))
    assert typer_req.specifier.contains("0.29.2") and not typer_req.specifier.contains("0.30")


def test_deferred_interrupt_holds_ctrl_c_until_the_block_is_done():
    from magis.errors import deferred_interrupt

    handler, done = signal.getsignal(signal.SIGINT), []
    with pytest.raises(KeyboardInterrupt), deferred_interrupt():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the signal is delivered here, and only remembered
        done.append(1)
    assert done == [1] and signal.getsignal(signal.SIGINT) is handler
    with deferred_interrupt():  # no signal: nothing raised
        done.append(2)
    errors = []

    def elsewhere():  # outside the main thread nothing can be deferred, and nothing breaks
        try:
            with deferred_interrupt():
                done.append(3)
        except Exception as exc:  # noqa: BLE001 - recorded for the assert
            errors.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert done == [1, 2, 3] and errors == []


class _InterruptedWhileCollected:
    """A finalizer that sees a Ctrl-C: Python prints its KeyboardInterrupt and ignores it."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs here, inside the finalizer
            pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_swallowed_by_a_finalizer_is_raised_when_the_block_ends():
    from magis.errors import interrupt_kept

    handler, done = signal.getsignal(signal.SIGINT), []
    swallowed = _InterruptedWhileCollected()
    del swallowed  # without interrupt_kept the key press is lost: nothing is raised
    done.append(0)
    with pytest.raises(KeyboardInterrupt), interrupt_kept():
        lost = _InterruptedWhileCollected()
        del lost
        done.append(1)  # the work went on: the interrupt comes when the block ends
    assert done == [0, 1] and signal.getsignal(signal.SIGINT) is handler
    with pytest.raises(KeyboardInterrupt), interrupt_kept():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # an ordinary Ctrl-C interrupts at once
        done.append(2)
    with interrupt_kept():  # no signal: nothing raised
        done.append(3)
    assert done == [0, 1, 3] and signal.getsignal(signal.SIGINT) is handler


@pytest.mark.parametrize("args", [[], ["bench"]])
def test_no_arguments_shows_the_help_and_no_error_line(capsys, args):
    code, out, err = invoke(capsys, *args)
    assert code == 2 and "Usage: " in out and "COMMAND" in out and "error" not in err
