"""The `magis` command: a thin edge over `magis.commands` (parse, call, print).

Each command builds its cost model once (`--hardware`) and hands it to the command function,
which returns a report; `tables` draws it, `output` holds the consoles and `--json`, `bench` the
paper's experiments. Errors meant for the user (MagisError) print one line and exit 1; `--debug`
shows the traceback. Every command that reports numbers takes `--json PATH`.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from magis.cli.bench import bench_app
from magis.cli.output import HardwareOpt, JsonOpt, console, err_console, spinner, write_json
from magis.cli.tables import (
    optimize_table,
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
            err_console.print(f"[yellow]warning:[/yellow] {message}")

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
def workloads_cmd(json_path: JsonOpt = None) -> None:
    """List the workload zoo (MAGIS Table 2 at three sizes)."""
    from magis.commands.workloads import workloads

    rep = workloads()
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
    json_path: JsonOpt = None,
) -> None:
    """Capture a workload's training step and show its memory and time profile."""
    from magis.commands.analyze import analyze

    cost = _cost(hardware)
    with spinner(f"analyzing {workload}") as progress:
        rep = analyze(workload, cost, batch, progress, ftree=ftree, max_level=max_level)
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


@app.command("run")
def run_cmd(
    workload: str,
    hardware: HardwareOpt = "cpu",
    plan: Annotated[
        Path | None, typer.Option("--plan", help="Run this saved plan instead of program order.")
    ] = None,
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
    json_path: JsonOpt = None,
) -> None:
    """Execute a :tiny or :small workload as generated code; verify it and measure its peak."""
    from magis.commands.run import run, run_plan

    nodes = _fission_nodes(fission)
    if nodes and (layout or plan is not None):
        raise MagisError(
            "--fission runs the captured program split; it cannot take --plan or --layout"
        )
    if layout:
        _run_layout(workload, plan, json_path)
        return
    cost = _cost(hardware)
    with spinner(f"running {workload}") as progress:
        if plan is not None:
            rep = run_plan(workload, plan, cost, progress)
        else:
            rep = run(workload, cost, progress=progress, fission=nodes, parts=parts)
    show_run(rep)
    for f in rep.fission or []:
        console.print(
            f"fission: F-Tree node {f['index']} ({f['size']} nodes along {f['dim']}) "
            f"in {f['n']} parts"
        )
    write_json(json_path, rep.to_json())
    if not rep.verified:
        raise typer.Exit(1)


@app.command("optimize")
def optimize_cmd(
    workload: str,
    mem_limit: Annotated[
        str | None,
        typer.Option("--mem-limit", help="Ratio of the unoptimized peak (0.4) or a size (12GiB)."),
    ] = None,
    lat_limit: Annotated[
        str | None,
        typer.Option(
            "--lat-limit", help="Ratio of the unoptimized latency (1.10) or a time (250ms)."
        ),
    ] = None,
    time_budget: Annotated[float, typer.Option("--time-budget", help="Seconds of search.")] = 180.0,
    hardware: HardwareOpt = "rtx3090",
    save: Annotated[
        Path | None, typer.Option("--save", help="Save the best plan here (JSON).")
    ] = None,
    old_save: Annotated[
        Path | None, typer.Option("--plan", hidden=True, help="Deprecated name of --save.")
    ] = None,
    memory_figure: Annotated[
        str,
        typer.Option(
            "--memory-figure", help="theoretical (simulated peak) or arena (LLFB layout's arena)."
        ),
    ] = "theoretical",
    max_states: Annotated[
        int | None,
        typer.Option("--max-states", help="Stop after this many states: a reproducible search."),
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """Find the fastest plan under a memory limit, or the smallest under a latency limit (MAGIS §6.2).

    Ctrl-C or the time budget stop the search; the best plan so far is kept and saved.
    """
    from rich.live import Live

    from magis.commands.optimize import find_plan, setup_workload_search

    if old_save is not None:
        if save is not None:
            raise MagisError("give the plan's path once: --save PATH (--plan is its old name)")
        err_console.print("[yellow]warning:[/yellow] optimize --plan is deprecated: use --save")
        save = old_save
    cost = _cost(hardware)
    with spinner(f"preparing {workload}") as progress:
        setup = setup_workload_search(
            workload,
            mem_limit=mem_limit,
            lat_limit=lat_limit,
            hardware=cost,
            memory_figure=memory_figure,
            progress=progress,
        )
    start = time.perf_counter()
    count = 0
    with Live(
        optimize_table(workload, 1.0, 1.0, 0, 0), console=console, refresh_per_second=4
    ) as live:

        def show(imp) -> None:
            nonlocal count
            count += 1
            memory, latency = setup.memory_ratio(imp.memory), setup.latency_ratio(imp.latency)
            elapsed = time.perf_counter() - start
            live.update(optimize_table(workload, memory, latency, count, elapsed))

        plan = find_plan(setup, time_budget=time_budget, on_improvement=show, max_states=max_states)
    console.print()
    console.print(plan.report())
    if save is not None:
        console.print(f"[dim]saved plan to {plan.save(save)}[/dim]")
    write_json(json_path, plan.summary.to_json())


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
        Path | None, typer.Option("--plan", help="Lay out this saved plan's graph and schedule.")
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
    """Entry point: user errors become one line and exit status 1. Warnings are shown as one
    line while the command runs (the process's warning settings are restored after)."""
    options = CliOptions()
    with warnings.catch_warnings():
        warnings.simplefilter("default", MagisWarning)
        warnings.showwarning = _warning_printer(options, warnings.showwarning)
        try:
            code = app(args=argv, standalone_mode=False, obj=options)
        except MagisError as exc:
            if options.debug:
                raise
            err_console.print(f"[red]error:[/red] {exc}")
            sys.exit(1)
        except typer.Exit as exc:
            sys.exit(exc.exit_code)
        except (typer.Abort, KeyboardInterrupt):
            err_console.print("interrupted")
            sys.exit(130)
        except Exception as exc:  # click usage errors and the like
            import click

            if isinstance(exc, click.ClickException):
                exc.show()
                sys.exit(exc.exit_code)
            raise
    if isinstance(code, int) and code:  # typer.Exit(n) inside a command comes back as n
        sys.exit(code)
    return code
