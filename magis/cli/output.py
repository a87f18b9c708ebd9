"""What every `magis` command prints with: the consoles, `--json` and `--hardware` options,
sizes and times as people read them, and the progress of anything that may take more than two
seconds (issue #17 item 5).

Progress has one shape: an `Activity` (a title, the current stage, a clock, figures to show)
drawn by `showing`. On a terminal a rich `Live` redraws it `REFRESH_PER_SECOND` times a second,
reading the clock at every redraw, so the elapsed time shown is never stale; when stdout is not
a terminal (a CI log, a pipe) a `PlainTicker` writes one plain line to stderr every
`MAGIS_PROGRESS_INTERVAL` seconds (default 5; 0 turns the lines off). `spinner`,
`progress_bar` and `magis optimize`'s table are all drawn this way.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console, RenderableType
from rich.live import Live
from rich.spinner import Spinner

from magis.capture.step_kinds import DEFAULT_STEP, STEP_NAMES, StepKind
from magis.cli.exits import check_output_path, check_positive, deferred_interrupt

# Output that is not a terminal (a pipe, a CI log) has no width: rich assumes 80 columns, where
# the wide tables (explain's, bench's) squeeze their text columns to "...". Logs take long
# lines; COLUMNS still decides when it is set.
PIPE_WIDTH = 160


def _stdout_width() -> int | None:
    return None if "COLUMNS" in os.environ or sys.stdout.isatty() else PIPE_WIDTH


# no emoji codes: "model.py:factory: ..." is a path and a message, not ":factory:"
console = Console(stderr=False, emoji=False, width=_stdout_width())
err_console = Console(stderr=True, emoji=False)

PROGRESS_INTERVAL_ENV = "MAGIS_PROGRESS_INTERVAL"
DEFAULT_PROGRESS_INTERVAL = 5.0  # seconds between plain progress lines
REFRESH_PER_SECOND = 4  # redraws of a live display on a terminal


def _json_path(value: Path | None) -> Path | None:
    return check_output_path(value, "--json")


JsonOpt = Annotated[
    Path | None,
    typer.Option("--json", help="Write the figures as JSON to PATH.", callback=_json_path),
]


def _budget(value: float) -> float:
    return check_positive(value, "--time-budget")


# a bench's seconds per MAGIS search
BudgetOpt = Annotated[
    float,
    typer.Option("--time-budget", help="Seconds per MAGIS search (> 0).", callback=_budget),
]
HARDWARE_HELP = "rtx3090, a100, h100 (roofline), or cpu, cuda (profiled on this machine)."
HardwareOpt = Annotated[str, typer.Option("--hardware", "-H", help=HARDWARE_HELP)]
# The training step a command captures (issue 42); typer reads the names off StepKind, so an
# unknown one is a usage error before any work. Commands default to DEFAULT_STEP.
StepOpt = Annotated[
    StepKind,
    typer.Option(
        "--step",
        help=f"The training step: {' or '.join(STEP_NAMES)} (default {DEFAULT_STEP.value}).",
        show_default=False,
    ),
]


def gib(n: int | float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**26 else f"{n / 2**20:.3f} MiB"


def ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def write_json(path: Path | None, data: dict) -> None:
    if path is None:
        return
    with deferred_interrupt():  # a second Ctrl-C does not leave half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    console.print(f"[dim]wrote {path}[/dim]")


def progress_interval() -> float | None:
    """Seconds between plain progress lines ($MAGIS_PROGRESS_INTERVAL, default 5); None when
    set to 0 or less (no lines). A value that is not a number is the default."""
    text = os.environ.get(PROGRESS_INTERVAL_ENV, "").strip()
    try:
        value = float(text) if text else DEFAULT_PROGRESS_INTERVAL
    except ValueError:
        value = DEFAULT_PROGRESS_INTERVAL
    return value if value > 0 else None


@dataclass
class Activity:
    """What a long command is doing: its title, the stage it is in, how long it has run, and
    `figures()`, read whenever it is drawn (a search's best ratios)."""

    title: str
    stage: str = ""
    figures: Callable[[], str] | None = None
    clock: Callable[[], float] = time.monotonic
    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.started

    def enter(self, stage: str) -> None:
        """The progress callback of `magis.commands` (told each stage as it starts)."""
        self.stage = stage

    def line(self) -> str:
        """One plain line: `optimizing bert-base: searching, 12.0 s, best memory 0.610`."""
        parts = [self.stage] if self.stage else []
        parts.append(f"{self.elapsed():.1f} s")
        if self.figures is not None:
            parts.append(self.figures())
        return f"{self.title}: {', '.join(p for p in parts if p)}"


class PlainTicker:
    """Writes `activity.line()` to stderr every `interval` seconds from a daemon thread, until
    stopped: progress a log can show, without a terminal's redraws."""

    def __init__(self, activity: Activity, interval: float) -> None:
        self.activity = activity
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="magis-progress", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            err_console.print(self.activity.line(), markup=False, highlight=False, soft_wrap=True)

    def start(self) -> PlainTicker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)


def live_display(view: Callable[[], RenderableType], *, transient: bool) -> Live:
    """A rich Live that calls `view()` at each of its `REFRESH_PER_SECOND` redraws a second."""
    return Live(
        get_renderable=view,
        console=console,
        auto_refresh=True,
        refresh_per_second=REFRESH_PER_SECOND,
        transient=transient,
    )


@contextmanager
def showing(
    activity: Activity, view: Callable[[], RenderableType], *, transient: bool = True
) -> Iterator[Activity]:
    """Show `activity` while the block runs: `view()` live on a terminal, plain lines on stderr
    otherwise (see the module docstring). A `transient` view is gone at the end; otherwise its
    last state stays (and is printed once where stdout is not a terminal)."""
    interval = progress_interval()
    ticker = None
    if not console.is_terminal and interval is not None:
        ticker = PlainTicker(activity, interval).start()
    try:
        with live_display(view, transient=transient):
            yield activity
    finally:
        if ticker is not None:
            ticker.stop()


def spinner_view(activity: Activity) -> Callable[[], RenderableType]:
    """A spinner naming the stage, with the seconds since the start."""
    spin = Spinner("dots")  # one spinner, so that its frames advance between redraws

    def view() -> RenderableType:
        stage = f": {activity.stage}…" if activity.stage else "…"
        spin.update(text=f"{activity.title}{stage} {activity.elapsed():.0f} s")
        return spin

    return view


@contextmanager
def spinner(title: str) -> Iterator[Callable[[str], None]]:
    """A spinner naming the current stage: anything here may take more than two seconds."""
    activity = Activity(title)
    with showing(activity, spinner_view(activity)):
        yield activity.enter


@contextmanager
def progress_bar(title: str) -> Iterator[Callable[[str, int, int], None]]:
    """A progress bar over a benchmark's steps, naming the current one, with elapsed time (on
    a terminal; plain periodic lines otherwise)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    bar = Progress(*columns, TimeElapsedColumn(), console=console, expand=False)
    task = bar.add_task(title, total=None)
    activity = Activity(title)

    def update(what: str, done: int, total: int) -> None:
        bar.update(task, description=f"{title}: {what}", completed=done, total=total)
        activity.enter(f"{what} {done}/{total}" if total else what)

    with showing(activity, bar.get_renderable, transient=False):
        yield update
