"""The tables `magis` draws of each command's report (`magis.commands`)."""

from __future__ import annotations

from rich.table import Table

from magis.cli.output import console, gib, ms


def show_workloads(rep) -> None:
    table = Table("name", "batch", "dtype", "description")
    for wl in rep.rows:
        table.add_row(wl.name, str(wl.batch), wl.dtype, wl.description)
    console.print(table)


def show_analysis(rep) -> None:
    table = Table(title=f"{rep.workload} on {rep.hardware}", show_header=False)
    table.add_row("nodes", f"{rep.nodes} ({rep.ops} ops, {rep.distinct_ops} distinct)")
    table.add_row("weights", gib(rep.weight_bytes))
    table.add_row("peak memory", gib(rep.peak_bytes))
    table.add_row("latency", ms(rep.latency_s))
    table.add_row("capture + analysis", f"{rep.seconds:.1f} s")
    for cat, nbytes in rep.breakdown.items():
        if nbytes:
            table.add_row(f"  peak: {cat}", gib(nbytes))
    if rep.opaque_ops:
        table.add_row("opaque ops", ", ".join(rep.opaque_ops))
    console.print(table)
    hot = Table("hot-spot", "op", "shape", "size", "kind", title="top-10 memory hot-spots")
    for h in rep.hotspots:
        hot.add_row(
            h["name"], h["op"], "x".join(map(str, h["shape"])), gib(h["bytes"]), h["category"]
        )
    console.print(hot)


def show_ftree(rows: list[dict], seconds: float) -> None:
    table = Table(
        "#", "parent", "nodes", "dimension", "length", "score", "level", "dominator",
        title=f"F-Tree: {len(rows)} nodes ({seconds:.1f} s)",
    )  # fmt: skip
    for r in rows:
        parent = "" if r["parent"] is None else str(r["parent"])
        table.add_row(
            str(r["index"]), parent, str(r["size"]), r["dim"], str(r["length"]),
            gib(r["score_bytes"]), str(r["level"]), r["dominator"],
        )  # fmt: skip
    console.print(table)


def show_run(rep) -> None:
    ok = "[green]verified[/green]" if rep.verified else "[red]MISMATCH[/red]"
    table = Table(title=f"{rep.workload} executed ({rep.dtype})", show_header=False)
    table.add_row(
        "against eager PyTorch",
        f"{ok}, max relative error {rep.max_rel_err:.2e} ({rep.worst_value})",
    )
    table.add_row("measured peak", gib(rep.measured_peak_bytes))
    table.add_row("simulated peak", f"{gib(rep.simulated_peak_bytes)} ({rep.peak_error:.2%} off)")
    if rep.simulated_scratch_peak_bytes > rep.simulated_peak_bytes:
        table.add_row("with the ops' scratch", gib(rep.simulated_scratch_peak_bytes))
    if rep.measured_host_peak_bytes or rep.simulated_host_peak_bytes:
        table.add_row(
            "host pool peak (swapped out)",
            f"{gib(rep.measured_host_peak_bytes)} measured, "
            f"{gib(rep.simulated_host_peak_bytes)} simulated",
        )
    table.add_row("measured latency", ms(rep.latency_s))
    table.add_row(f"simulated latency ({rep.hardware})", ms(rep.simulated_latency_s))
    console.print(table)


def optimize_table(
    workload: str, memory: float, latency: float, states: int, seconds: float
) -> Table:
    table = Table(title=f"optimizing {workload}", show_header=False)
    table.add_row("best memory (vs program order)", f"{memory:.3f}")
    table.add_row("best latency (vs program order)", f"{latency:.3f}")
    table.add_row("improvements / elapsed", f"{states} / {seconds:.0f} s")
    return table


def rank_table(title: str, rows) -> Table:
    """One rank's figures under each schedule (`magis.commands.parallel.RankFigures`), the
    first row (the job without magis) the ratios' base."""
    table = Table(title=title)
    for col in ("schedule", "peak / rank", "vs first", "step", "vs first", "comm", "overlap"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    base = rows[0]
    for r in rows:
        table.add_row(
            r.name,
            gib(r.peak_bytes),
            f"{r.peak_bytes / base.peak_bytes:.3f}",
            ms(r.step_s),
            f"{r.step_s / base.step_s:.3f}",
            ms(r.comm_s),
            f"{r.overlap:.0%}",
        )
    return table


def show_schedule(rep) -> None:
    table = Table(title=f"{rep.workload}: {rep.scheduler} schedule", show_header=False)
    table.add_row("nodes", str(rep.nodes))
    table.add_row("peak memory", f"{gib(rep.peak_bytes)} ({rep.peak_ratio:.3f} of program order)")
    table.add_row("program order peak", gib(rep.program_peak_bytes))
    table.add_row("lower bound (any order)", gib(rep.lower_bound_bytes))
    table.add_row("latency", ms(rep.latency_s))
    if rep.segments:
        table.add_row(
            "segments (DP-exact)",
            f"{rep.segments} ({rep.exact_segments} exact, largest {rep.largest_segment} units)",
        )
    table.add_row("scheduler / total", f"{rep.seconds:.2f} s / {rep.total_seconds:.1f} s")
    console.print(table)


def show_layout(rep) -> None:
    table = Table(title=f"{rep.workload}: memory layout ({rep.schedule} order)", show_header=False)
    table.add_row("theoretical peak", gib(rep.theoretical_peak_bytes))
    table.add_row(
        f"arena ({rep.method})", f"{gib(rep.arena_bytes)} ({rep.fragmentation:.3%} fragmentation)"
    )
    table.add_row(
        "arena (llfb)", f"{gib(rep.llfb_arena_bytes)} ({rep.llfb_fragmentation:.3%} fragmentation)"
    )
    table.add_row("storages / resident", f"{rep.storages} / {gib(rep.resident_bytes)}")
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


def show_layout_run(rep) -> None:
    ok = "[green]verified[/green]" if rep.verified else "[red]MISMATCH[/red]"
    table = Table(title=f"{rep.workload} in one arena ({rep.dtype})", show_header=False)
    table.add_row(
        "against eager PyTorch",
        f"{ok}, max relative error {rep.max_rel_err:.2e} ({rep.worst_value})",
    )
    table.add_row("theoretical peak", gib(rep.theoretical_peak_bytes))
    table.add_row("arena (planned)", f"{gib(rep.arena_bytes)} ({rep.fragmentation:.3%})")
    table.add_row("measured beyond residents", gib(rep.measured_nonresident_bytes))
    table.add_row(
        "copied into slots",
        f"{rep.copied_ops} ops (largest transient {gib(rep.transient_bytes)})",
    )
    table.add_row(
        "out= run as compute-then-copy",
        f"{rep.wrapped_ops} ops (largest hidden temporary {gib(rep.hidden_bytes)})",
    )
    table.add_row("measured latency", ms(rep.latency_s))
    if rep.cuda_reserved_peak_bytes is not None:
        table.add_row(
            "CUDA caching allocator",
            f"reserved {gib(rep.cuda_reserved_peak_bytes)}, "
            f"allocated {gib(rep.cuda_allocated_peak_bytes)}; "
            f"with the arena reserved {gib(rep.cuda_arena_reserved_peak_bytes)}",
        )
    console.print(table)


def show_compare(rep) -> None:
    """`magis bench compare`'s tables: per constraint, each method's figure per workload."""
    from magis.bench.compare_report import constraint_table
    from magis.bench.constraints import CONSTRAINTS

    for c in CONSTRAINTS:
        workloads, rows = constraint_table(rep, c)
        what = "memory ratio" if c.mode.value == "lat-limit" else "latency overhead"
        table = Table("method", *workloads, title=f"{what} under {c.label}")
        for cells in rows:
            table.add_row(*[f"[red]{x}[/red]" if x == "FAILURE" else x for x in cells])
        console.print(table)


def show_train(rows) -> None:
    """`magis bench train`: a program-order magis step against eager PyTorch's."""
    table = Table("workload", "optimizer", "eager s", "magis s", "magis / eager", "capture s")
    for r in rows:
        table.add_row(
            r.workload, r.optimizer, f"{r.eager_s:.4f}", f"{r.magis_s:.4f}", f"{r.ratio:.3f}",
            f"{r.capture_s:.1f}",
        )  # fmt: skip
    console.print(table)


def show_train_compiled(results) -> None:
    """`magis bench train --compiler inductor`: the five variants per workload."""
    for res in results:
        eager = res.rows[0]
        table = Table(
            "variant", "step s", "/ eager", "measured peak MiB", "/ eager", "budget", "note",
            title=(
                f"{res.workload} ({res.optimizer}, {res.threads} threads, median of "
                f"{res.steps}; magis mem_limit {res.mem_limit:g}: simulated "
                f"{res.magis_simulated_peak_bytes / 2**20:.1f} MiB, {res.magis_memory_ratio:.3f}"
                " of the program order)"
            ),
        )  # fmt: skip
        for r in res.rows:
            table.add_row(
                r.variant, f"{r.step_s:.4f}", f"{r.step_s / eager.step_s:.3f}",
                f"{r.measured_peak_bytes / 2**20:.1f}",
                f"{r.measured_peak_bytes / eager.measured_peak_bytes:.3f}",
                "" if r.budget is None else f"{r.budget:g}", r.note,
            )  # fmt: skip
        console.print(table)
