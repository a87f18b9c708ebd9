"""The `magis` command: a thin edge over `magis.commands` (parse, call, print).

Each command builds its cost model once (`--hardware`) and hands it to the command function,
which returns a report; `tables` draws it, `output` holds the consoles and `--json`, `bench` the
paper's experiments, `optimize` the search. `exits` says how a command ends: errors meant for the
user (MagisError) print one line and exit 1, or 2 for a command line that cannot work; Ctrl-C
exits 130 saying what it leaves; `--debug` shows the traceback. Every command that reports
numbers takes `--json PATH`, checked for being writable before any work.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from magis.cli.bench import bench_app
from magis.cli.exits import ExitCode, Interrupted, check_input_file, exit_code_of
from magis.cli.explain import explain_cmd
from magis.cli.optimize import optimize_cmd
from magis.cli.output import (
    DEFAULT_STEP,
    HARDWARE_HELP,
    HardwareOpt,
    JsonOpt,
    StepOpt,
    console,
    err_console,
    spinner,
    write_json,
)
from magis.cli.report import SnapshotOpt, TraceOpt, report_cmd
from magis.cli.tables import (
    show_analysis,
    show_ftree,
    show_layout,
    show_layout_run,
    show_run,
    show_schedule,
    show_workloads,
)
from magis.errors import MagisError, MagisWarning

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="magis: fit PyTorch training steps in less memory (MAGIS, ASPLOS'24).",
)
app.add_typer(bench_app, name="bench")


@dataclass
class CliOptions:
    """The global options of one `magis` invocation (click's context object)."""

    debug: bool = False


def _warning_printer(options: CliOptions, full: Callable) -> Callable:
    """A `warnings.showwarning` that prints one line, or the usual file:line form with --debug."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if options.debug:
            full(message, category, filename, lineno, file, line)
        else:
            err_console.print(
                f"[yellow]warning:[/yellow] {escape(str(message))}", highlight=False, soft_wrap=True
            )

    return show


def _cost(hardware: str):
    """The cost model of `--hardware`, built once per command (an unknown name fails now)."""
    from magis.cost import get_cost_model

    return get_cost_model(hardware)


@app.callback()
def _main(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    ctx.ensure_object(CliOptions).debug = debug


@app.command("workloads")
def workloads_cmd(
    json_path: JsonOpt = None,
    corpus: Annotated[
        bool, typer.Option("--corpus", help="List the public corpus (corpus:NAME[:tiny]).")
    ] = False,
) -> None:
    """List the workload zoo (MAGIS Table 2 at three sizes), or the public corpus."""
    from magis.commands.workloads import workloads

    rep = workloads(corpus=corpus)
    show_workloads(rep)
    write_json(json_path, rep.to_json())


@app.command("analyze")
def analyze_cmd(
    workload: str,
    hardware: HardwareOpt = "rtx3090",
    batch: Annotated[int | None, typer.Option(help="Override the workload's batch size.")] = None,
    ftree: Annotated[
        bool, typer.Option("--ftree", help="Also build and print the F-Tree (MAGIS Alg. 1).")
    ] = False,
    max_level: Annotated[int, typer.Option("--max-level", help="Alg. 1's L.", min=1)] = 4,
    export_trace: TraceOpt = None,
    export_snapshot: SnapshotOpt = None,
    step: StepOpt = DEFAULT_STEP,
    json_path: JsonOpt = None,
) -> None:
    """Capture a workload's training step and show its memory and time profile."""
    from magis.commands.analyze import analyze

    cost = _cost(hardware)
    with spinner(f"analyzing {workload}") as progress:
        rep = analyze(
            workload,
            cost,
            batch,
            progress,
            ftree=ftree,
            max_level=max_level,
            export_trace=export_trace,
            export_snapshot=export_snapshot,
            step=step,
        )
    show_analysis(rep)
    if rep.ftree is not None:
        show_ftree(rep.ftree, rep.ftree_seconds)
    write_json(json_path, rep.to_json())


def _fission_nodes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise MagisError(
            f"--fission takes F-Tree node numbers like 3 or 3,7; got {text!r}"
        ) from None


def _plan_file(value: Path | None) -> Path | None:
    return check_input_file(value, "--plan")


PlanInOpt = Annotated[
    Path | None,
    typer.Option(
        "--plan", help="Run this saved plan instead of program order.", callback=_plan_file
    ),
]


@app.command("run")
def run_cmd(
    workload: str,
    hardware: Annotated[
        str | None,
        typer.Option("--hardware", "-H", help=f"Simulate on: {HARDWARE_HELP} Default: --device."),
    ] = None,
    device: Annotated[
        str, typer.Option("--device", help="Run the program and eager PyTorch on: cpu or cuda.")
    ] = "cpu",
    plan: PlanInOpt = None,
    layout: Annotated[
        bool,
        typer.Option("--layout", help="Run inside one preallocated arena (ROAM memory layout)."),
    ] = False,
    fission: Annotated[
        str | None,
        typer.Option(
            "--fission", help="Enable these F-Tree nodes (K[,K...], see analyze --ftree)."
        ),
    ] = None,
    parts: Annotated[
        int, typer.Option("--parts", help="Fission number n of the enabled nodes.")
    ] = 2,
    step: StepOpt = DEFAULT_STEP,
    json_path: JsonOpt = None,
) -> None:
    """Execute a :tiny or :small workload as generated code; verify it and measure its peak.

    A paper-size workload runs only if its estimated need fits in the device's free memory."""
    from magis.commands.device import check_device
    from magis.commands.run import run, run_plan

    nodes = _fission_nodes(fission)
    if nodes and (layout or plan is not None):
        raise MagisError(
            "--fission runs the captured program split; it cannot take --plan or --layout"
        )
    dev = check_device(device)
    if layout:
        if dev.type != "cpu":
            raise MagisError(
                "--layout runs on the CPU (and measures CUDA beside it): drop --device"
            )
        _run_layout(workload, plan, json_path)
        return
    cost = _cost(hardware if hardware is not None else dev.type)
    with spinner(f"running {workload}") as progress:
        if plan is not None:
            rep = run_plan(workload, plan, cost, progress, device=dev)
        else:
            rep = run(
                workload,
                cost,
                progress=progress,
                fission=nodes,
                parts=parts,
                device=dev,
                step=step,
            )
    show_run(rep)
    for f in rep.fission or []:
        console.print(
            f"fission: F-Tree node {f['index']} ({f['size']} nodes along {f['dim']}) "
            f"in {f['n']} parts"
        )
    write_json(json_path, rep.to_json())
    if not rep.verified:
        raise typer.Exit(1)


app.command("optimize")(optimize_cmd)
app.command("report")(report_cmd)
app.command("explain")(explain_cmd)


@app.command("schedule")
def schedule_cmd(
    workload: str,
    scheduler: Annotated[
        str, typer.Option("--scheduler", "-s", help="program (as captured) or dp (MAGIS §6.1).")
    ] = "dp",
    hardware: HardwareOpt = "rtx3090",
    batch: Annotated[int | None, typer.Option(help="Override the workload's batch size.")] = None,
    json_path: JsonOpt = None,
) -> None:
    """Re-order a workload's training step for the least peak memory (MAGIS §5.2, §6.1)."""
    from magis.commands.schedule import schedule_workload

    cost = _cost(hardware)
    with spinner(f"scheduling {workload}") as progress:
        rep = schedule_workload(workload, scheduler, cost, batch, progress=progress)
    show_schedule(rep)
    write_json(json_path, rep.to_json())


@app.command("demo")
def demo_cmd(json_path: JsonOpt = None) -> None:
    """Analyze bert-base at paper size, then run and verify bert-base:tiny."""
    from magis.commands.demo import demo

    with spinner("bert-base (Table 2 size, fake tensors), then bert-base:tiny") as progress:
        rep = demo(progress)
    show_analysis(rep.analyze)
    show_run(rep.run)
    write_json(json_path, rep.to_json())


@app.command("layout")
def layout_cmd(
    workload: str,
    method: Annotated[
        str, typer.Option("--method", "-m", help="exact (ROAM: CP-SAT per piece) or llfb.")
    ] = "exact",
    scheduler: Annotated[
        str, typer.Option("--scheduler", "-s", help="program (as captured) or dp (MAGIS §6.1).")
    ] = "program",
    plan: Annotated[
        Path | None,
        typer.Option(
            "--plan", help="Lay out this saved plan's graph and schedule.", callback=_plan_file
        ),
    ] = None,
    batch: Annotated[int | None, typer.Option(help="Override the workload's batch size.")] = None,
    json_path: JsonOpt = None,
) -> None:
    """Give every tensor an offset in one arena (ROAM §IV-B) and report its fragmentation."""
    from magis.commands.layout import layout

    with spinner(f"laying out {workload}") as progress:
        rep = layout(workload, method, scheduler, plan, batch, progress=progress)
    show_layout(rep)
    write_json(json_path, rep.to_json())


def _run_layout(workload: str, plan: Path | None, json_path: Path | None) -> None:
    from magis.commands.layout import run_layout

    with spinner(f"running {workload} in an arena") as progress:
        rep = run_layout(workload, plan=plan, progress=progress)
    show_layout_run(rep)
    write_json(json_path, rep.to_json())
    if not rep.verified:
        raise typer.Exit(1)


def main(argv: list[str] | None = None) -> Any:
    """Entry point: every way a command ends becomes its exit code (`magis.cli.exits`) and at
    most one line on stderr; no traceback without --debug. Warnings are shown as one line while
    the command runs (the process's warning settings are restored after)."""
    options = CliOptions()
    with warnings.catch_warnings():
        warnings.simplefilter("default", MagisWarning)
        warnings.showwarning = _warning_printer(options, warnings.showwarning)
        code = _run_app(argv, options)
    if isinstance(code, int) and code:  # typer.Exit(n) inside a command comes back as n
        if code == ExitCode.INTERRUPTED:  # typer made a KeyboardInterrupt into this, silently
            err_console.print("interrupted")
        sys.exit(code)
    return code


def _run_app(argv: list[str] | None, options: CliOptions) -> Any:
    try:
        return app(args=argv, standalone_mode=False, obj=options)
    except Interrupted as exc:
        err_console.print(str(exc), markup=False, highlight=False, soft_wrap=True)
        sys.exit(int(ExitCode.INTERRUPTED))
    except (typer.Abort, KeyboardInterrupt):  # Ctrl-C outside a command (typer's own code)
        err_console.print("interrupted")
        sys.exit(int(ExitCode.INTERRUPTED))
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except MagisError as exc:
        if options.debug:
            raise
        _error_line(str(exc))
        sys.exit(int(exit_code_of(exc)))
    except typer.TyperException as exc:  # click's usage errors (typer vendors click)
        if options.debug:
            raise
        if _usage_message(exc):  # empty when the help was shown instead (no arguments)
            _error_line(_usage_message(exc))
        sys.exit(int(getattr(exc, "exit_code", ExitCode.USAGE)))
    except Exception as exc:  # a bug: one line, and the traceback with --debug
        if options.debug:
            raise
        _error_line(
            f"internal error: {type(exc).__name__}: {_first_line(exc)} "
            "(magis --debug ... shows the traceback)"
        )
        sys.exit(int(ExitCode.ERROR))


def _error_line(message: str) -> None:
    err_console.print(
        f"[red]error:[/red] {escape(_first_line(message))}", highlight=False, soft_wrap=True
    )


def _first_line(message: object) -> str:
    lines = str(message).strip().splitlines()
    return lines[0] if lines else ""


def _usage_message(exc: Exception) -> str:
    """A click usage error as one line, with the command whose --help lists the options."""
    text = _first_line(exc.format_message() if hasattr(exc, "format_message") else exc)
    ctx = getattr(exc, "ctx", None)
    where = f" (see {ctx.command_path} --help)" if ctx is not None and text else ""
    return f"{text}{where}"
