"""What every `magis` command prints with: the consoles, `--json` and `--hardware` options,
sizes and times as people read them, a spinner naming the current stage, a progress bar."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from magis.cli.exits import check_output_path, deferred_interrupt

# no emoji codes: "model.py:factory: ..." is a path and a message, not ":factory:"
console = Console(stderr=False, emoji=False)
err_console = Console(stderr=True, emoji=False)


def _json_path(value: Path | None) -> Path | None:
    return check_output_path(value, "--json")


JsonOpt = Annotated[
    Path | None,
    typer.Option("--json", help="Write the figures as JSON to PATH.", callback=_json_path),
]
HARDWARE_HELP = "rtx3090, a100, h100 (roofline), or cpu, cuda (profiled on this machine)."
HardwareOpt = Annotated[str, typer.Option("--hardware", "-H", help=HARDWARE_HELP)]


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


@contextmanager
def spinner(title: str) -> Iterator[Callable[[str], None]]:
    """A spinner naming the current stage: anything here may take more than two seconds."""
    with console.status(f"{title}…") as status:
        yield lambda stage: status.update(f"{title}: {stage}…")


@contextmanager
def progress_bar(title: str) -> Iterator[Callable[[str, int, int], None]]:
    """A progress bar over a benchmark's steps, naming the current one, with elapsed time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task(title, total=None)
        yield lambda what, done, total: bar.update(
            task, description=f"{title}: {what}", completed=done, total=total
        )
