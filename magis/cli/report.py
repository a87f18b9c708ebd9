"""`magis report PLAN --html OUT`, and the `--export-trace` / `--export-snapshot` options that
`magis analyze` takes (`magis.commands.report`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from magis.cli.exits import UsageError, check_input_file, check_output_path
from magis.cli.output import JsonOpt, console, spinner, write_json


def _trace_path(value: Path | None) -> Path | None:
    return check_output_path(value, "--export-trace")


def _snapshot_path(value: Path | None) -> Path | None:
    return check_output_path(value, "--export-snapshot")


def _html_path(value: Path) -> Path:
    return check_output_path(value, "--html")


def _plan_path(value: Path) -> Path:
    return check_input_file(value, "PLAN")


def _measured_path(value: Path | None) -> Path | None:
    return check_input_file(value, "--measured")


TraceOpt = Annotated[
    Path | None,
    typer.Option(
        "--export-trace",
        help="Write the simulated schedule as a Chrome/Perfetto trace (JSON) to PATH.",
        callback=_trace_path,
    ),
]
SnapshotOpt = Annotated[
    Path | None,
    typer.Option(
        "--export-snapshot",
        help="Write the simulated allocations as a PyTorch memory snapshot (pickle) to PATH.",
        callback=_snapshot_path,
    ),
]


def report_cmd(
    plan: Annotated[
        Path, typer.Argument(help="A plan saved by magis optimize --save.", callback=_plan_path)
    ],
    html: Annotated[
        Path,
        typer.Option(
            "--html", help="Write the self-contained HTML page to PATH.", callback=_html_path
        ),
    ],
    measured: Annotated[
        Path | None,
        typer.Option(
            "--measured",
            help="Show the figures of magis run W --plan PLAN --json RUN.json beside the predicted.",
            callback=_measured_path,
        ),
    ] = None,
    run: Annotated[
        bool,
        typer.Option(
            "--run", help="Run the plan now on the CPU (:tiny, :small) and show what it measured."
        ),
    ] = False,
    json_path: JsonOpt = None,
) -> None:
    """Write one HTML page about a plan: memory over the schedule before and after, the peak by
    category, its decisions, the search's Pareto points, and measured figures when run."""
    from magis.commands.report import report

    if run and measured is not None:
        raise UsageError("--run measures the plan now and --measured reads a measurement: pick one")
    with spinner(f"reporting on {plan}") as progress:
        rep = report(plan, html, measured, run, progress)
    console.print(f"wrote {rep.html} ({rep.html_bytes / 1024:.0f} KiB)")
    write_json(json_path, rep.to_json())
