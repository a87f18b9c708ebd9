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


def _print_ftree(rows: list[dict], seconds: float) -> None:
    table = Table(
        "#", "parent", "nodes", "dimension", "length", "score", "level", "dominator",
        title=f"F-Tree: {len(rows)} nodes ({seconds:.1f} s)",
    )  # fmt: skip
    for r in rows:
        parent = "" if r["parent"] is None else str(r["parent"])
        table.add_row(
            str(r["index"]), parent, str(r["size"]), r["dim"], str(r["length"]),
            _gib(r["score_bytes"]), str(r["level"]), r["dominator"],
        )  # fmt: skip
    console.print(table)


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
    from magis.api import analyze

    with _progress(f"analyzing {workload}") as progress:
        rep = analyze(workload, hardware, batch, progress, ftree=ftree, max_level=max_level)
    _print_analysis(rep)
    if rep.ftree is not None:
        _print_ftree(rep.ftree, rep.ftree_seconds)
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
    if rep.measured_host_peak_bytes or rep.simulated_host_peak_bytes:
        table.add_row(
            "host pool peak (swapped out)",
            f"{_gib(rep.measured_host_peak_bytes)} measured, "
            f"{_gib(rep.simulated_host_peak_bytes)} simulated",
        )
    table.add_row("measured latency", _ms(rep.latency_s))
    table.add_row(f"simulated latency ({rep.hardware})", _ms(rep.simulated_latency_s))
    console.print(table)


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
    from magis.api import run

    nodes = _fission_nodes(fission)
    if nodes and (layout or plan is not None):
        raise MagisError(
            "--fission runs the captured program split; it cannot take --plan or --layout"
        )
    if layout:
        _run_layout(workload, plan, json_path)
        return
    with _progress(f"running {workload}") as progress:
        if plan is not None:
            from magis.planning import run_plan

            rep = run_plan(workload, plan, hardware, progress)
        else:
            rep = run(workload, hardware, progress=progress, fission=nodes, parts=parts)
    _print_run(rep)
    for f in getattr(rep, "fission", None) or []:
        console.print(
            f"fission: F-Tree node {f['index']} ({f['size']} nodes along {f['dim']}) "
            f"in {f['n']} parts"
        )
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

    from magis.cost import get_cost_model
    from magis.planning import capture_workload, optimize, parse_memory_figure
    from magis.sim import simulate

    parse_memory_figure(memory_figure)  # a typo fails now, not after the capture

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
            memory_figure=memory_figure,
            max_states=max_states,
        )
    console.print()
    console.print(plan.report())
    if plan_out is not None:
        console.print(f"[dim]saved plan to {plan.save(plan_out)}[/dim]")
    _write_json(json_path, plan.info)


def _print_schedule(rep) -> None:
    table = Table(title=f"{rep.workload}: {rep.scheduler} schedule", show_header=False)
    table.add_row("nodes", str(rep.nodes))
    table.add_row("peak memory", f"{_gib(rep.peak_bytes)} ({rep.peak_ratio:.3f} of program order)")
    table.add_row("program order peak", _gib(rep.program_peak_bytes))
    table.add_row("lower bound (any order)", _gib(rep.lower_bound_bytes))
    table.add_row("latency", _ms(rep.latency_s))
    if rep.segments:
        table.add_row(
            "segments (DP-exact)",
            f"{rep.segments} ({rep.exact_segments} exact, largest {rep.largest_segment} units)",
        )
    table.add_row("scheduler / total", f"{rep.seconds:.2f} s / {rep.total_seconds:.1f} s")
    console.print(table)


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
    from magis.api import schedule_workload

    with _progress(f"scheduling {workload}") as progress:
        rep = schedule_workload(workload, scheduler, hardware, batch, progress=progress)
    _print_schedule(rep)
    _write_json(json_path, rep.to_json())


bench_app = typer.Typer(no_args_is_help=True, help="Experiments of the MAGIS paper (§7).")
app.add_typer(bench_app, name="bench")


@bench_app.command("incremental")
def bench_incremental_cmd(
    dags: Annotated[int, typer.Option(min=1, help="Random NASNet-shaped DAGs.")] = 10,
    rounds: Annotated[int, typer.Option(min=1, help="Rewrites per DAG.")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the one random generator.")] = 0,
    repeats: Annotated[int, typer.Option(min=1, help="Timings per case (the least is kept).")] = 3,
    json_path: JsonOpt = None,
) -> None:
    """Incremental vs full scheduling after random rewrites (MAGIS §7.3, Fig. 14)."""
    from magis.bench.incremental import run_incremental_bench

    with _progress("incremental vs full scheduling") as progress:
        rep = run_incremental_bench(dags, rounds, seed, progress, repeats)
    table = Table(title="incremental (IS) vs full (FS) scheduling", show_header=False)
    table.add_row("cases", str(len(rep.cases)))
    table.add_row(
        "speedup FS/IS",
        f"mean {rep.mean_speedup:.1f}x, median {rep.median_speedup:.1f}x, "
        f"min {rep.min_speedup:.1f}x, max {rep.max_speedup:.1f}x",
    )
    table.add_row(
        "speedup distribution", ", ".join(f"{k}: {v}" for k, v in rep.speedup_histogram.items())
    )
    table.add_row(
        "IS peak == FS peak",
        f"{rep.equal_quality} of {len(rep.cases)} ({rep.better_quality} IS lower)",
    )
    table.add_row("worst IS/FS peak ratio", f"{rep.worst_quality_ratio:.4f}")
    table.add_row("elapsed", f"{rep.seconds:.0f} s")
    console.print(table)
    _write_json(json_path, rep.to_json())


@contextmanager
def _bar(title: str) -> Iterator[Callable[[str, int, int], None]]:
    """A progress bar over a benchmark's steps, naming the current one, with elapsed time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task(title, total=None)
        yield lambda what, done, total: bar.update(
            task, description=f"{title}: {what}", completed=done, total=total
        )


def _split_names(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())


def _print_compare(rep) -> None:
    from magis.bench.compare import CONSTRAINTS, constraint_table

    for c in CONSTRAINTS:
        workloads, rows = constraint_table(rep, c)
        what = "memory ratio" if c.mode.value == "lat-limit" else "latency overhead"
        table = Table("method", *workloads, title=f"{what} under {c.label}")
        for cells in rows:
            table.add_row(*[f"[red]{x}[/red]" if x == "FAILURE" else x for x in cells])
        console.print(table)


@bench_app.command("compare")
def bench_compare_cmd(
    workloads: Annotated[
        list[str] | None, typer.Argument(help="Workloads (default: the seven at paper size).")
    ] = None,
    hardware: HardwareOpt = "rtx3090",
    time_budget: Annotated[
        float, typer.Option("--time-budget", help="Seconds per MAGIS search (6 per workload).")
    ] = 60.0,
    out: Annotated[Path, typer.Option("--out", help="Folder for CSV, JSON, tables, PNGs.")] = Path(
        "out/bench-compare"
    ),
    methods: Annotated[
        str | None,
        typer.Option("--methods", help="Comma-separated: magis and baseline names (default: all)."),
    ] = None,
    microbatch: Annotated[
        str, typer.Option("--microbatch", help="Fig. 12 on: vit (ViT only), all, none.")
    ] = "vit",
    json_path: JsonOpt = None,
) -> None:
    """MAGIS and every baseline under latency limits 1.05/1.10 and memory limits 0.8/0.4, Pareto
    curves and micro-batching (MAGIS §7.2, Figs. 9-12). Ctrl-C keeps what finished."""
    from magis.bench.compare import (
        PAPER_WORKLOADS,
        BenchError,
        CompareOptions,
        MicrobatchScope,
        check_methods,
        run_compare,
    )

    try:
        scope = MicrobatchScope(microbatch)
    except ValueError:
        raise BenchError(f"--microbatch {microbatch!r}: choose vit, all or none") from None
    options = CompareOptions(
        workloads=tuple(workloads or PAPER_WORKLOADS),
        methods=check_methods(_split_names(methods)),
        hardware=hardware,
        time_budget=time_budget,
        out=out,
        microbatch=scope,
    )
    with _bar("compare") as progress:
        rep = run_compare(options, progress)
    _print_compare(rep)
    _finish_bench(rep, out, json_path)


def _finish_bench(rep, out: Path, json_path: Path | None) -> None:
    """Where the results are, the JSON, and exit 130 when Ctrl-C cut the run short."""
    console.print(f"[dim]results in {out} ({rep.seconds:.0f} s)[/dim]")
    _write_json(json_path, rep.to_json())
    if rep.interrupted:
        err_console.print("interrupted: the results hold what finished")
        raise typer.Exit(130)


@bench_app.command("ablation")
def bench_ablation_cmd(
    workload: Annotated[str, typer.Argument(help="The workload (the paper: bert-base).")] = (
        "bert-base"
    ),
    hardware: HardwareOpt = "rtx3090",
    time_budget: Annotated[
        float, typer.Option("--time-budget", help="Seconds per search (20 searches).")
    ] = 60.0,
    out: Annotated[Path, typer.Option("--out", help="Folder for CSV, JSON, tables, PNG.")] = Path(
        "out/bench-ablation"
    ),
    json_path: JsonOpt = None,
) -> None:
    """naive-fission, naive-sch-rules, max-level 2/4/8 under the four constraints: best-so-far
    curves over search time (MAGIS §7.2.5, Fig. 13). Ctrl-C keeps what finished."""
    from magis.bench.ablation import AblationOptions, run_ablation, tables_markdown

    options = AblationOptions(workload, hardware, time_budget, out)
    with _bar("ablation") as progress:
        rep = run_ablation(options, progress)
    console.print(tables_markdown(rep))
    _finish_bench(rep, out, json_path)


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


def _print_layout(rep) -> None:
    table = Table(title=f"{rep.workload}: memory layout ({rep.schedule} order)", show_header=False)
    table.add_row("theoretical peak", _gib(rep.theoretical_peak_bytes))
    table.add_row(
        f"arena ({rep.method})", f"{_gib(rep.arena_bytes)} ({rep.fragmentation:.3%} fragmentation)"
    )
    table.add_row(
        "arena (llfb)", f"{_gib(rep.llfb_arena_bytes)} ({rep.llfb_fragmentation:.3%} fragmentation)"
    )
    table.add_row("storages / resident", f"{rep.storages} / {_gib(rep.resident_bytes)}")
    if rep.pieces:
        table.add_row(
            "pieces",
            f"{rep.pieces} ({rep.pieces_solved} solved by CP-SAT, {rep.pieces_optimal} optimal)"
            + (", LLFB kept" if rep.fell_back_to_llfb else ""),
        )
    table.add_row(
        "layout / total", f"{rep.seconds:.1f} s / {rep.total_seconds:.1f} s (capture included)"
    )
    console.print(table)


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
    from magis.api import layout

    with _progress(f"laying out {workload}") as progress:
        rep = layout(
            workload, method, scheduler, str(plan) if plan else None, batch, progress=progress
        )
    _print_layout(rep)
    _write_json(json_path, rep.to_json())


def _run_layout(workload: str, plan: Path | None, json_path: Path | None) -> None:
    from magis.api import run_layout

    with _progress(f"running {workload} in an arena") as progress:
        rep = run_layout(workload, plan=str(plan) if plan else None, progress=progress)
    ok = "[green]verified[/green]" if rep.verified else "[red]MISMATCH[/red]"
    table = Table(title=f"{rep.workload} in one arena ({rep.dtype})", show_header=False)
    table.add_row(
        "against eager PyTorch",
        f"{ok}, max relative error {rep.max_rel_err:.2e} ({rep.worst_value})",
    )
    table.add_row("theoretical peak", _gib(rep.theoretical_peak_bytes))
    table.add_row("arena (planned)", f"{_gib(rep.arena_bytes)} ({rep.fragmentation:.3%})")
    table.add_row("measured beyond residents", _gib(rep.measured_nonresident_bytes))
    table.add_row(
        "copied into slots",
        f"{rep.copied_ops} ops (largest transient {_gib(rep.transient_bytes)})",
    )
    table.add_row(
        "out= run as compute-then-copy",
        f"{rep.wrapped_ops} ops (largest hidden temporary {_gib(rep.hidden_bytes)})",
    )
    table.add_row("measured latency", _ms(rep.latency_s))
    if rep.cuda_reserved_peak_bytes is not None:
        table.add_row(
            "CUDA caching allocator",
            f"reserved {_gib(rep.cuda_reserved_peak_bytes)}, "
            f"allocated {_gib(rep.cuda_allocated_peak_bytes)}; "
            f"with the arena reserved {_gib(rep.cuda_arena_reserved_peak_bytes)}",
        )
    console.print(table)
    _write_json(json_path, rep.to_json())
    if not rep.verified:
        raise typer.Exit(1)


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
