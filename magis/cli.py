"""The `magis` command.

Errors meant for the user (MagisError) print one line and exit 1; `--debug` shows the traceback.
Every command that reports numbers takes `--json PATH`.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from magis.errors import MagisError, MagisWarning

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="magis: fit PyTorch training steps in less memory (MAGIS, ASPLOS'24).",
)
console = Console(stderr=False)
err_console = Console(stderr=True)
_state = {"debug": False}

JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write the figures as JSON to PATH.")]
HardwareOpt = Annotated[
    str, typer.Option("--hardware", "-H", help="rtx3090, a100, h100, or cpu (profiled).")
]


def _gib(n: int | float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**26 else f"{n / 2**20:.3f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _write_json(path: Path | None, data: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    console.print(f"[dim]wrote {path}[/dim]")


@contextmanager
def _progress(title: str) -> Iterator[Callable[[str], None]]:
    """A spinner naming the current stage: anything here may take more than two seconds."""
    with console.status(f"{title}…") as status:
        yield lambda stage: status.update(f"{title}: {stage}…")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    err_console.print(f"[yellow]warning:[/yellow] {message}")


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False) -> None:
    _state["debug"] = debug
    if not debug:
        warnings.showwarning = _show_warning
    warnings.simplefilter("default", MagisWarning)


@app.command("workloads")
def workloads_cmd(json_path: JsonOpt = None) -> None:
    """List the workload zoo (MAGIS Table 2 at three sizes)."""
    from magis.capture import list_workloads

    table = Table("name", "batch", "dtype", "description")
    rows = []
    for wl in list_workloads():
        dtype = str(wl.dtype).removeprefix("torch.")
        table.add_row(wl.name, str(wl.batch), dtype, wl.description)
        rows.append({"name": wl.name, "batch": wl.batch, "dtype": dtype, "size": wl.size})
    console.print(table)
    _write_json(json_path, {"workloads": rows})


def _print_analysis(rep) -> None:
    table = Table(title=f"{rep.workload} on {rep.hardware}", show_header=False)
    table.add_row("nodes", f"{rep.nodes} ({rep.ops} ops, {rep.distinct_ops} distinct)")
    table.add_row("weights", _gib(rep.weight_bytes))
    table.add_row("peak memory", _gib(rep.peak_bytes))
    table.add_row("latency", _ms(rep.latency_s))
    table.add_row("capture + analysis", f"{rep.seconds:.1f} s")
    for cat, nbytes in rep.breakdown.items():
        if nbytes:
            table.add_row(f"  peak: {cat}", _gib(nbytes))
    if rep.opaque_ops:
        table.add_row("opaque ops", ", ".join(rep.opaque_ops))
    console.print(table)
    hot = Table("hot-spot", "op", "shape", "size", "kind", title="top-10 memory hot-spots")
    for h in rep.hotspots:
        hot.add_row(
            h["name"], h["op"], "x".join(map(str, h["shape"])), _gib(h["bytes"]), h["category"]
        )
    console.print(hot)


@app.command("analyze")
def analyze_cmd(
    workload: str,
    hardware: HardwareOpt = "rtx3090",
    batch: Annotated[int | None, typer.Option(help="Override the workload's batch size.")] = None,
    json_path: JsonOpt = None,
) -> None:
    """Capture a workload's training step and show its memory and time profile."""
    from magis.api import analyze

    with _progress(f"analyzing {workload}") as progress:
        rep = analyze(workload, hardware, batch, progress)
    _print_analysis(rep)
    _write_json(json_path, rep.to_json())


def _print_run(rep) -> None:
    ok = "[green]verified[/green]" if rep.verified else "[red]MISMATCH[/red]"
    table = Table(title=f"{rep.workload} executed ({rep.dtype})", show_header=False)
    table.add_row(
        "against eager PyTorch",
        f"{ok}, max relative error {rep.max_rel_err:.2e} ({rep.worst_value})",
    )
    table.add_row("measured peak", _gib(rep.measured_peak_bytes))
    table.add_row("simulated peak", f"{_gib(rep.simulated_peak_bytes)} ({rep.peak_error:.2%} off)")
    table.add_row("measured latency", _ms(rep.latency_s))
    table.add_row(f"simulated latency ({rep.hardware})", _ms(rep.simulated_latency_s))
    console.print(table)


@app.command("run")
def run_cmd(
    workload: str,
    hardware: HardwareOpt = "cpu",
    plan: Annotated[
        Path | None, typer.Option("--plan", help="Run this saved plan instead of program order.")
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """Execute a :tiny or :small workload as generated code; verify it and measure its peak."""
    from magis.api import run

    with _progress(f"running {workload}") as progress:
        if plan is not None:
            from magis.planning import run_plan

            rep = run_plan(workload, plan, hardware, progress)
        else:
            rep = run(workload, hardware, progress=progress)
    _print_run(rep)
    _write_json(json_path, rep.to_json())
    if not rep.verified:
        raise typer.Exit(1)


def _optimize_table(
    workload: str, memory: float, latency: float, states: int, seconds: float
) -> Table:
    table = Table(title=f"optimizing {workload}", show_header=False)
    table.add_row("best memory (vs program order)", f"{memory:.3f}")
    table.add_row("best latency (vs program order)", f"{latency:.3f}")
    table.add_row("improvements / elapsed", f"{states} / {seconds:.0f} s")
    return table


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
    plan_out: Annotated[
        Path | None, typer.Option("--plan", help="Save the best plan here (JSON).")
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """Find the fastest plan under a memory limit, or the smallest under a latency limit (MAGIS §6.2).

    Ctrl-C or the time budget stop the search; the best plan so far is kept and saved.
    """
    from rich.live import Live

    from magis.cost import get_cost_model
    from magis.planning import capture_workload, optimize
    from magis.sim import simulate

    with _progress(f"capturing {workload}"):
        step = capture_workload(workload)
        cost = get_cost_model(hardware)
        base = simulate(step.graph, step.graph.program_order(), cost)
    start = time.perf_counter()
    count = [0]
    with Live(
        _optimize_table(workload, 1.0, 1.0, 0, 0), console=console, refresh_per_second=4
    ) as live:

        def show(imp) -> None:
            count[0] += 1
            elapsed = time.perf_counter() - start
            live.update(
                _optimize_table(
                    workload,
                    imp.memory / base.peak_bytes,
                    imp.latency / base.latency_s,
                    count[0],
                    elapsed,
                )
            )

        plan = optimize(
            step,
            mem_limit=mem_limit,
            lat_limit=lat_limit,
            time_budget=time_budget,
            hardware=cost,
            on_improvement=show,
            workload=workload,
        )
    console.print()
    console.print(plan.report())
    if plan_out is not None:
        console.print(f"[dim]saved plan to {plan.save(plan_out)}[/dim]")
    _write_json(json_path, plan.info)


@app.command("demo")
def demo_cmd(json_path: JsonOpt = None) -> None:
    """Analyze bert-base at paper size, then run and verify bert-base:tiny."""
    from magis.api import analyze, run

    with _progress("analyzing bert-base (Table 2 size, fake tensors)") as progress:
        rep = analyze("bert-base", "rtx3090", None, progress)
    _print_analysis(rep)
    with _progress("running bert-base:tiny") as progress:
        ran = run("bert-base:tiny", "cpu", progress=progress)
    _print_run(ran)
    _write_json(json_path, {"analyze": rep.to_json(), "run": ran.to_json()})


def main(argv: list[str] | None = None) -> Any:
    """Entry point: user errors become one line and exit status 1."""
    try:
        return app(args=argv, standalone_mode=False)
    except MagisError as exc:
        if _state["debug"]:
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
