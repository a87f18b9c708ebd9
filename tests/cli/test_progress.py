"""Progress everywhere (issue #17 item 5): live displays on a terminal that redraw at least once
a second with a fresh elapsed time; plain periodic lines on stderr when stdout is not one."""

from __future__ import annotations

import inspect
import io
import time

import pytest
from rich.console import Console

from magis.cli.optimize import search_display
from magis.cli.output import (
    PROGRESS_INTERVAL_ENV,
    Activity,
    PlainTicker,
    live_display,
    progress_bar,
    progress_interval,
    spinner,
    spinner_view,
)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _text(renderable) -> str:
    out = Console(file=io.StringIO(), width=120, color_system=None)
    out.print(renderable)
    return out.file.getvalue()


@pytest.mark.parametrize(
    ("value", "expected"), [("", 5.0), ("0.5", 0.5), ("0", None), ("-1", None), ("soon", 5.0)]
)
def test_progress_interval_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv(PROGRESS_INTERVAL_ENV, value)
    assert progress_interval() == expected


def test_the_live_display_redraws_at_least_once_a_second_reading_the_view_each_time():
    calls = []
    live = live_display(lambda: calls.append(1) or f"frame {len(calls)}", transient=True)
    assert live.auto_refresh and live.refresh_per_second >= 1
    assert _text(live.renderable) != _text(live.renderable)  # the view is called at each redraw


def test_the_optimize_table_shows_the_time_now_not_at_the_last_improvement():
    clock = Clock()
    display = search_display("bert-base:tiny", budget=20, clock=clock)
    display.activity.enter("searching")  # the progress callback find_plan is handed
    display.improved(0.61, 1.04)
    assert "1 / 0 s" in _text(display.table()) and "searching" in _text(display.table())
    clock.now += 7.0  # no improvement in between: the table still moves on
    assert "1 / 7 s" in _text(display.table())
    line = display.activity.line()
    assert line.startswith("optimizing bert-base:tiny: searching, 7.0 s")
    assert "1 improvement, best memory 0.610 latency 1.040 (budget 20 s)" in line
    assert "searching (budget 20 s)" in _text(display.table())


def test_the_spinner_shows_its_stage_and_elapsed_time():
    clock = Clock()
    activity = Activity("analyzing x", clock=clock)
    view = spinner_view(activity)
    activity.enter("capturing")
    clock.now += 3.0
    assert "analyzing x: capturing… 3 s" in _text(view())


def _lines(err: str, prefix: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(prefix)]


def test_plain_ticker_writes_lines_until_stopped(capsys):
    activity = Activity("working", "step one")
    ticker = PlainTicker(activity, 0.01).start()
    deadline = time.monotonic() + 10
    seen = ""
    while len(_lines(seen, "working: step one, ")) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
        seen += capsys.readouterr().err
    ticker.stop()
    assert len(_lines(seen, "working: step one, ")) >= 3
    capsys.readouterr()
    time.sleep(0.05)
    assert capsys.readouterr().err == ""  # stopped means stopped


def test_spinner_and_progress_bar_print_plain_lines_off_a_terminal(capsys, monkeypatch):
    monkeypatch.setenv(PROGRESS_INTERVAL_ENV, "0.02")
    with spinner("laying out w") as progress:
        progress("packing")
        time.sleep(0.2)
    with progress_bar("compare") as bar:
        bar("bert-base", 2, 7)
        time.sleep(0.2)
    err = capsys.readouterr().err
    assert _lines(err, "laying out w: packing, ")
    assert _lines(err, "compare: bert-base 2/7, ")


def test_optimize_prints_periodic_lines_when_not_a_terminal(magis_cli):
    res = magis_cli(
        "optimize", "bert-base:tiny", "--lat-limit", "1.1", "--time-budget", "3",
        env={PROGRESS_INTERVAL_ENV: "0.25"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert _lines(res.stderr, "preparing bert-base:tiny: capturing, ")
    searching = _lines(res.stderr, "optimizing bert-base:tiny: searching, ")
    assert len(searching) >= 2 and all("best memory" in line for line in searching)
    assert "optimizing bert-base:tiny" in res.stdout  # the final table, once


QUICK_COMMANDS = {"workloads"}  # a listing: done as soon as magis is imported


def _commands(app, prefix: str = ""):
    for command in app.registered_commands:
        yield prefix + (command.name or command.callback.__name__), command.callback
    for group in app.registered_groups:
        yield from _commands(group.typer_instance, f"{prefix}{group.name} ")


def test_every_command_that_can_take_seconds_shows_progress():
    """Each command but a listing draws its work through the progress helpers of
    magis.cli.output (a new command without them fails here)."""
    from magis.cli import app

    helpers = ("spinner(", "progress_bar(", "showing(", "_search_live(")
    silent = [
        name
        for name, callback in _commands(app)
        if name not in QUICK_COMMANDS and not any(h in inspect.getsource(callback) for h in helpers)
    ]
    names = [name for name, _ in _commands(app)]
    assert "optimize" in names and "bench fuzz" in names
    assert silent == []
