"""`magis explain PLAN`: the plan's decisions as a table, one row each (issue #17)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from magis.cli.exits import UsageError, check_input_file, check_output_path
from magis.cli.output import HARDWARE_HELP, JsonOpt, console, ms, spinner, write_json

MAX_TENSORS = 3  # names shown per row; --json has them all
MAX_MODULES = 2


def _plan_file(value: Path) -> Path:
    return check_input_file(value, "PLAN")


def _trace_path(value: Path | None) -> Path | None:
    return check_output_path(value, "--export-trace")


def _snapshot_path(value: Path | None) -> Path | None:
    return check_output_path(value, "--export-snapshot")


def _sort(value: str) -> str:
    from magis.explain import SORTS

    if value not in SORTS:
        raise UsageError(f"--sort {value}: use one of {', '.join(SORTS)}")
    return value


def explain_cmd(
    plan: Annotated[
        Path, typer.Argument(help="A plan saved by magis optimize --save.", callback=_plan_file)
    ],
    sort: Annotated[
        str,
        typer.Option(
            "--sort", help="program (as the search applied them), bytes or time.", callback=_sort
        ),
    ] = "program",
    json_path: JsonOpt = None,
    export_trace: Annotated[
        Path | None,
        typer.Option(
            "--export-trace",
            help="Also write the plan's simulated timeline as a Chrome/Perfetto trace (JSON).",
            callback=_trace_path,
        ),
    ] = None,
    export_snapshot: Annotated[
        Path | None,
        typer.Option(
            "--export-snapshot",
            help="Also write the plan's memory as a PyTorch memory snapshot (pickle).",
            callback=_snapshot_path,
        ),
    ] = None,
    hardware: Annotated[
        str | None,
        typer.Option(
            "--hardware", "-H", help=f"Time the exports on: {HARDWARE_HELP} Default: the plan's."
        ),
    ] = None,
) -> None:
    """Show why a plan is what it is: each decision of the search, the bytes it took off the
    peak and the time it added (they add up to the plan's figures)."""
    from magis.commands.explain import explain_plan

    with spinner(f"explaining {plan}"):  # loading a paper-size plan takes seconds
        rep = explain_plan(
            plan,
            sort,
            export_trace=export_trace,
            export_snapshot=export_snapshot,
            hardware=hardware,
        )
    show_explanation(rep)
    for what, path in (("trace", rep.trace_path), ("memory snapshot", rep.snapshot_path)):
        if path is not None:
            console.print(f"[dim]wrote {what} {path}[/dim]")
    write_json(json_path, rep.to_json())


def show_explanation(rep) -> None:
    e = rep.explanation
    title = f"{e.workload or 'a step'} on {e.hardware}: {len(e.rows)} decisions ({rep.sort} order)"
    table = Table(title=escape(title))
    table.add_column("#", justify="right")
    table.add_column("kind", no_wrap=True)
    table.add_column("what")
    table.add_column("where (module, or tensors)")
    for header in ("saved", "time", "copy", "peak after"):
        table.add_column(header, justify="right", no_wrap=True)
    for row in rep.rows:
        d = row.decision
        where = _some(d.modules, MAX_MODULES) if d.modules else _some(row.tensors, MAX_TENSORS)
        table.add_row(
            str(row.step), d.kind.value, escape(d.description), escape(where),
            size(row.bytes_saved), _signed_ms(row.time_added), _signed_ms(d.copy_added),
            size(d.after.peak_bytes),
        )  # fmt: skip
    if e.note is not None:
        console.print(f"[yellow]{escape(e.note)}[/yellow]")
    else:
        console.print(table)
    console.print(
        f"peak {size(e.program_order_peak_bytes)} -> {size(e.peak_bytes)} "
        f"(saved {size(e.peak_reduction_bytes)}; rows sum to {size(e.bytes_saved)}); "
        f"latency {ms(e.program_order_latency_s)} -> {ms(e.latency_s)}",
        highlight=False,
    )
    if not e.satisfied:
        _show_bottleneck(e)


def _show_bottleneck(e) -> None:
    console.print(
        f"[red]limit not met[/red] ({e.mode} {e.limit_ratio:.3f} of the program order); "
        f"the least peak the search found: {size(e.least_peak_found_bytes)}",
        highlight=False,
    )
    table = Table("tensor", "op", "shape", "size", "kind", "module", title="live at the peak")
    for b in e.bottleneck:
        table.add_row(
            escape(b.name), b.op, "x".join(map(str, b.shape)), size(b.nbytes), b.category,
            escape(b.module),
        )  # fmt: skip
    console.print(table)


def size(n: int) -> str:
    """Bytes as people read them, signed when negative."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _signed_ms(s: float) -> str:
    return f"{s * 1e3:+.3f} ms"


def _some(items, k: int) -> str:
    items = list(items)
    more = f" +{len(items) - k}" if len(items) > k else ""
    return ", ".join(items[:k]) + more
