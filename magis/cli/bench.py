"""`magis bench`: the experiments of the MAGIS paper (§7)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from magis.cli.bench_steps import bench_gpu_cmd, bench_train_cmd
from magis.cli.exits import Interrupted, UsageError, check_output_folder, check_positive
from magis.cli.output import (
    DEFAULT_STEP,
    BudgetOpt,
    HardwareOpt,
    JsonOpt,
    StepOpt,
    console,
    err_console,
    progress_bar,
    spinner,
    write_json,
)
from magis.cli.tables import show_compare

bench_app = typer.Typer(
    no_args_is_help=True,
    help="Experiments of the MAGIS paper (§7), random testing of the rules, training speed.",
)


def _out_folder(value: Path) -> Path:
    return check_output_folder(value, "--out")


JobsOpt = Annotated[
    int,
    typer.Option(
        "--jobs", min=1, help="Cells run side by side in this many local processes (or Ray CPUs)."
    ),
]


def _ray_address(value: str | None) -> str | None:
    if value is not None and (not value or value.startswith("-")):
        raise UsageError(f"--ray {value!r}: give an address: local, auto or HOST:PORT")
    return value


RayOpt = Annotated[
    str | None,
    typer.Option(
        "--ray",
        metavar="ADDRESS",
        callback=_ray_address,
        help="Each cell a Ray task: 'local' starts a Ray of --jobs CPUs here; 'auto' or "
        "HOST:PORT joins a cluster (ray start --head). Needs pip install 'magis\\[ray]'.",
    ),
]


def _runner(jobs: int, ray: str | None):
    from magis.bench.parallel import make_runner

    return make_runner(jobs, ray)


OutOpt = Annotated[
    Path, typer.Option("--out", help="Folder for CSV, JSON, tables, PNGs.", callback=_out_folder)
]


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

    with spinner("incremental vs full scheduling") as progress:
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
    write_json(json_path, rep.to_json())


def _split_names(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())


@bench_app.command("compare")
def bench_compare_cmd(
    workloads: Annotated[
        list[str] | None, typer.Argument(help="Workloads (default: the seven at paper size).")
    ] = None,
    hardware: HardwareOpt = "rtx3090",
    time_budget: BudgetOpt = 60.0,
    out: OutOpt = Path("out/bench-compare"),
    methods: Annotated[
        str | None,
        typer.Option("--methods", help="Comma-separated: magis and baseline names (default: all)."),
    ] = None,
    microbatch: Annotated[
        str, typer.Option("--microbatch", help="Fig. 12 on: vit (ViT only), all, none.")
    ] = "vit",
    jobs: JobsOpt = 1,
    ray: RayOpt = None,
    step: StepOpt = DEFAULT_STEP,
    json_path: JsonOpt = None,
) -> None:
    """MAGIS and every baseline under latency limits 1.05/1.10 and memory limits 0.8/0.4, Pareto
    curves and micro-batching (MAGIS §7.2, Figs. 9-12). Ctrl-C keeps what finished."""
    from magis.bench.compare import BenchError, check_methods, run_compare
    from magis.bench.compare_report import PAPER_WORKLOADS, CompareOptions, MicrobatchScope

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
        step=step,
    )
    runner = _runner(jobs, ray)
    with progress_bar("compare") as progress:
        rep = run_compare(options, progress, runner)
    show_compare(rep)
    _finish_bench(rep, out, json_path)


def _finish_bench(rep, out: Path, json_path: Path | None) -> None:
    """Where the results are, the JSON, and exit 130 when Ctrl-C cut the run short."""
    console.print(f"[dim]results in {out} ({rep.seconds:.0f} s)[/dim]")
    write_json(json_path, rep.to_json())
    if rep.interrupted:
        raise Interrupted(f"interrupted: the results in {out} hold what finished")


@bench_app.command("ablation")
def bench_ablation_cmd(
    workload: Annotated[str, typer.Argument(help="The workload (the paper: bert-base).")] = (
        "bert-base"
    ),
    hardware: HardwareOpt = "rtx3090",
    time_budget: BudgetOpt = 60.0,
    out: OutOpt = Path("out/bench-ablation"),
    jobs: JobsOpt = 1,
    ray: RayOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """naive-fission, naive-sch-rules, max-level 2/4/8 under the four constraints: best-so-far
    curves over search time (MAGIS §7.2.5, Fig. 13). Ctrl-C keeps what finished."""
    from magis.bench.ablation import AblationOptions, run_ablation, tables_markdown

    options = AblationOptions(workload, hardware, time_budget, out)
    runner = _runner(jobs, ray)
    with progress_bar("ablation") as progress:
        rep = run_ablation(options, progress, runner)
    console.print(tables_markdown(rep))
    _finish_bench(rep, out, json_path)


@bench_app.command("corpus")
def bench_corpus_cmd(
    models: Annotated[
        str | None, typer.Option("--models", help="Comma-separated corpus names (default: all).")
    ] = None,
    size: Annotated[str, typer.Option("--size", help="full (default) or tiny.")] = "full",
    hardware: HardwareOpt = "rtx3090",
    time_budget: BudgetOpt = 60.0,
    max_states: Annotated[
        int | None, typer.Option("--max-states", min=1, help="States per MAGIS search at most.")
    ] = None,
    methods: Annotated[
        str | None, typer.Option("--methods", help="Comma-separated baselines (default: all).")
    ] = None,
    out: OutOpt = Path("out/bench-corpus"),
    jobs: JobsOpt = 1,
    ray: RayOpt = None,
    workers: Annotated[
        int,
        typer.Option(
            "--workers", min=1, help="Worker processes of each search (as magis optimize's)."
        ),
    ] = 1,
    step: StepOpt = DEFAULT_STEP,
    json_path: JsonOpt = None,
) -> None:
    """MAGIS and the best baseline on every public corpus model (magis workloads --corpus)
    under latency limit 1.10 and memory limit 0.4 (issue #16). Ctrl-C keeps what finished."""
    from magis.bench.corpus import CORPUS_NAMES, CorpusOptions, run_corpus, table_cells

    if workers > 1 and (jobs > 1 or ray is not None):
        from magis.bench.compare import BenchError

        raise BenchError(
            "--workers runs each search on several processes, --jobs/--ray several cells at "
            "once: choose one"
        )

    options = CorpusOptions(
        models=_split_names(models) or CORPUS_NAMES,
        size=size,
        hardware=hardware,
        time_budget=time_budget,
        max_states=max_states,
        methods=_split_names(methods),
        out=out,
        workers=workers,
        step=step,
    )
    runner = _runner(jobs, ray)
    with progress_bar("corpus") as progress:
        rep = run_corpus(options, progress, runner)
    header, body = table_cells(rep)
    table = Table(*header, title="memory ratio under lat<=1.1, latency overhead under mem<=0.4")
    for cells in body:
        table.add_row(*[f"[red]{x}[/red]" if x == "FAILURE" else x for x in cells])
    console.print(table)
    _finish_bench(rep, out, json_path)


@bench_app.command("coverage")
def bench_coverage_cmd(
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            metavar="PATTERN",
            help="Comma-separated class-name patterns (fnmatch: '*ForCTC,UNet2D*'); "
            "@FILE.json: those that failed in that sweep's JSON.",
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="The first N architectures only.")
    ] = None,
    time_budget: BudgetOpt = 10.0,
    max_states: Annotated[
        int | None, typer.Option("--max-states", min=1, help="States per search at most.")
    ] = None,
    hardware: HardwareOpt = "rtx3090",
    jobs: JobsOpt = 1,
    timeout: Annotated[
        float, typer.Option("--timeout", min=1, help="Seconds per architecture before it fails.")
    ] = 600.0,
    markdown: Annotated[
        Path | None, typer.Option("--markdown", help="Write the table as markdown to PATH.")
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """Every architecture of the installed transformers and diffusers with a training head, tiny:
    capture, verify in float64, optimize under mem_limit=0.5, verify the plan, compare the
    simulated and measured peaks (issue 46). Each in a process of its own; Ctrl-C keeps what
    finished."""
    from magis.bench.coverage import CoverageOptions, run_coverage
    from magis.bench.coverage_report import table_markdown

    options = CoverageOptions(
        only=_split_names(only),
        limit=limit,
        time_budget=time_budget,
        max_states=max_states,
        hardware=hardware,
        jobs=jobs,
        timeout_s=timeout,
        json_path=json_path,
        markdown_path=markdown,
    )
    with progress_bar("coverage") as progress:
        rep = run_coverage(options, progress)
    console.print(table_markdown(rep), markup=False, highlight=False)
    if rep.interrupted:
        raise Interrupted("interrupted: the counts hold the architectures that finished")


@bench_app.command("fuzz")
def bench_fuzz_cmd(
    cases: Annotated[int, typer.Option("--cases", min=0, help="Random rule chains to run.")] = 500,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the one random generator.")] = 0,
    max_seconds: Annotated[
        float | None,
        typer.Option("--max-seconds", help="Stop after this long (the report says how many ran)."),
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """Random testing, TASO's way (issue 14): random training steps and random chains of
    rewrites, each result run against eager PyTorch and through the meta check.
    Exit code 1 when any case failed; each failure prints its reproducer."""
    from magis.bench.fuzz import run_fuzz

    check_positive(max_seconds, "--max-seconds")
    with progress_bar("fuzz") as bar:
        rep = run_fuzz(
            cases,
            seed=seed,
            progress=lambda done, total: bar("cases", done, total),
            max_seconds=max_seconds,
        )
    _print_fuzz(rep)
    write_json(json_path, rep.to_json())
    if _fuzz_failures(rep):
        raise typer.Exit(1)


def _fuzz_failures(rep) -> list:
    return [*rep.mismatches, *rep.meta_mismatches, *rep.baseline_failures]


def _print_fuzz(rep) -> None:
    table = Table(title=f"bench fuzz (seed {rep.seed})", show_header=False)
    table.add_row("cases", f"{rep.cases} on {rep.models} random models")
    table.add_row("seconds", f"{rep.seconds:.1f} ({rep.cases_per_second:.1f} cases/s)")
    table.add_row("mismatches against eager", str(len(rep.mismatches)))
    table.add_row("meta check mismatches", str(len(rep.meta_mismatches)))
    table.add_row("unmodified programs failing", str(len(rep.baseline_failures)))
    covered = ", ".join(f"{k} {v}" for k, v in sorted(rep.rules_covered.items()))
    table.add_row("rules covered", f"{len(rep.rules_covered)}: {covered}")
    table.add_row("rule kinds missing", ", ".join(rep.kinds_missing) or "none")
    console.print(table)
    for m in _fuzz_failures(rep)[:20]:
        err_console.print(
            f"[red]mismatch[/red] {escape(m.error)}: {' -> '.join(m.chain) or 'no rewrite'}; "
            f"reproduce with {m.reproducer}",
            highlight=False,
            soft_wrap=True,
        )


bench_app.command("train")(bench_train_cmd)
bench_app.command("gpu")(bench_gpu_cmd)


@bench_app.command("overhead")
def bench_overhead_cmd(
    workloads: Annotated[
        list[str] | None,
        typer.Argument(help="Workloads whose lat-1.10 plans are counted (default: the zoo's)."),
    ] = None,
    budget: BudgetOpt = 30.0,
    hardware: HardwareOpt = "rtx3090",
    json_path: JsonOpt = None,
) -> None:
    """A generated program's own cost per op on this CPU, and the op count of each workload's
    plan at latency 1.10 with what those ops cost at that overhead and at 7 us each (issue 41)."""
    from magis.bench.overhead import GPU_LAUNCH_US, per_op_overhead, plan_ops
    from magis.capture import WORKLOAD_FAMILIES, get_workload

    names = workloads or list(WORKLOAD_FAMILIES)
    for name in names:
        get_workload(name)  # an unknown name fails before any work
    with spinner("bench overhead") as progress:
        progress("timing a generated program of one-element adds")
        overhead = per_op_overhead()
        rows = plan_ops(names, overhead, budget, hardware, progress)
    console.print(
        f"per op: generated program {overhead.generated_us:.2f} us, eager torch.add "
        f"{overhead.eager_us:.2f} us ({overhead.threads} threads)"
    )
    table = Table("workload", "ops at lat 1.10", "simulated ms", "latency ratio",
                  "ops x overhead ms", f"ops x {GPU_LAUNCH_US:g} us ms")  # fmt: skip
    for r in sorted(rows, key=lambda r: -r.ops):
        table.add_row(
            r.workload, f"{r.ops:,}", f"{r.simulated_s * 1e3:.1f}", f"{r.latency_ratio:.3f}",
            f"{r.overhead_s * 1e3:.1f}", f"{r.at_7us_s * 1e3:.1f}",
        )  # fmt: skip
    console.print(table)
    write_json(json_path, {"overhead": overhead.to_json(), "rows": [r.to_json() for r in rows]})
