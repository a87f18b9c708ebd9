"""`magis optimize`: the search shown live, its plan kept on disk whatever happens.

What the user is owed at each moment (issue 14's CLI edges):

- before any work: the limits, the time budget and the paths are checked (exit 2);
- after the program order is measured: a limit no plan can meet is refused with its bound;
- during the search: its best figures, redrawn several times a second (plain lines every few
  seconds where stdout is not a terminal); Ctrl-C stops it and the best plan so far is kept
  (the search catches it);
- before the final re-ordering: that plan is saved, so a second Ctrl-C loses nothing;
- at the end: the plan is saved (a Ctrl-C waits until the file is whole), the exit code says
  whether the limit was met (3 when not) or the user interrupted (130, with where the plan is).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from magis.cli.exits import (
    ExitCode,
    Interrupted,
    UsageError,
    check_output_path,
    check_positive,
    deferred_interrupt,
)
from magis.cli.output import (
    DEFAULT_STEP,
    Activity,
    HardwareOpt,
    JsonOpt,
    StepOpt,
    console,
    err_console,
    showing,
    spinner,
    write_json,
)
from magis.cli.tables import optimize_table
from magis.errors import MagisError, interrupt_kept
from magis.plan import Plan
from magis.search.options import TIME_BUDGET_S

LIMIT_FLAGS = ("--mem-limit", "--lat-limit")


@dataclass
class PlanKeeper:
    """Where the best plan so far goes (`--save`), and whether one is there yet."""

    path: Path | None
    saved: bool = False

    def keep(self, plan: Plan) -> None:
        if self.path is None:
            return
        with deferred_interrupt():  # a plan file is whole or not written
            plan.save(self.path)
            self.saved = True

    def interrupted(self, search_started: bool) -> Interrupted:
        if self.saved:
            return Interrupted(f"interrupted: best plan so far saved to {self.path}")
        if not search_started:
            return Interrupted("interrupted before the search started: no plan to save")
        if self.path is None:
            return Interrupted("interrupted: plan not saved (--save PATH keeps the best so far)")
        return Interrupted("interrupted before the search had a plan: nothing saved")


def _save_path(value: Path | None) -> Path | None:
    return check_output_path(value, "--save")


def _plan_path(value: Path | None) -> Path | None:
    return check_output_path(value, "--plan")


def _budget(value: float) -> float:
    return check_positive(value, "--time-budget")


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
    time_budget: Annotated[
        float, typer.Option("--time-budget", help="Seconds of search (> 0).", callback=_budget)
    ] = TIME_BUDGET_S,
    hardware: HardwareOpt = "rtx3090",
    save: Annotated[
        Path | None,
        typer.Option("--save", help="Save the best plan here (JSON).", callback=_save_path),
    ] = None,
    old_save: Annotated[
        Path | None,
        typer.Option("--plan", hidden=True, help="Deprecated name of --save.", callback=_plan_path),
    ] = None,
    memory_figure: Annotated[
        str,
        typer.Option(
            "--memory-figure", help="theoretical (simulated peak) or arena (LLFB layout's arena)."
        ),
    ] = "theoretical",
    max_states: Annotated[
        int | None,
        typer.Option(
            "--max-states", min=1, help="Stop after this many states: a reproducible search."
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            min=1,
            help="Build children in N processes: the same plan as 1 with --max-states; under a time budget each expands states of its own.",
        ),
    ] = 1,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="The --workers as Ray actors: local, auto or HOST:PORT (pip install 'magis\\[ray]').",
        ),
    ] = None,
    step: StepOpt = DEFAULT_STEP,
    json_path: JsonOpt = None,
    parallel: Annotated[
        str | None,
        typer.Option(
            "--parallel",
            help="Plan one rank of a data-parallel job: ddp or fsdp (collectives in the step).",
        ),
    ] = None,
    world_size: Annotated[
        int, typer.Option("--world-size", min=1, help="Ranks of the --parallel job.")
    ] = 8,
    link: Annotated[
        str,
        typer.Option("--link", help="Link between the ranks: nvlink, pcie, infiniband, loopback."),
    ] = "nvlink",
) -> None:
    """Find the fastest plan under a memory limit, or the smallest under a latency limit (MAGIS §6.2).

    Ctrl-C or the time budget stop the search; the best plan so far is kept and saved (--save).
    With --parallel, the step is one rank's of a --world-size job, shown beside FSDP2 (and
    FSDP2 with full activation checkpointing) or DDP simulated the same way.
    Exit code 3: the limit is not met; 130: interrupted.
    """
    from magis.commands.limits import read_search_limit
    from magis.commands.optimize import prepare_workload_search
    from magis.search import SearchOptions

    limit = read_search_limit(mem_limit, lat_limit, LIMIT_FLAGS)
    _check_parallel(workers, ray)
    job = _planned_job(parallel, world_size, link)
    options = SearchOptions(
        time_budget=time_budget, max_states=max_states, workers=workers, ray=ray
    )
    if old_save is not None:
        if save is not None:
            raise MagisError("give the plan's path once: --save PATH (--plan is its old name)")
        err_console.print("[yellow]warning:[/yellow] optimize --plan is deprecated: use --save")
        save = old_save
    keeper, setup = PlanKeeper(save), None
    try:
        # the capture runs many finalizers, where a Ctrl-C would be swallowed: keep it
        with interrupt_kept(), spinner(f"preparing {workload}") as progress:
            setup = prepare_workload_search(
                workload,
                limit,
                hardware=hardware,
                memory_figure=memory_figure,
                step=step,
                progress=progress,
                job=job,
                link=link,
            )
        plan = _search_live(workload, setup, options, keeper)
        console.print()
        console.print(plan.report())
        keeper.keep(plan)
        if keeper.saved:
            console.print(f"[dim]saved plan to {save}[/dim]")
        ranks = _job_table(workload, job, setup, plan) if job is not None else None
        write_json(json_path, {**plan.summary.to_json(), **({"ranks": ranks} if ranks else {})})
    except KeyboardInterrupt:
        raise keeper.interrupted(search_started=setup is not None) from None
    if plan.summary.interrupted:
        raise keeper.interrupted(search_started=True)
    if not plan.summary.satisfied:
        where = f"; the best plan is saved to {save}" if keeper.saved else ""
        err_console.print(
            f"limit not met (exit code {ExitCode.LIMIT_NOT_MET:d}){where}", soft_wrap=True
        )
        raise typer.Exit(int(ExitCode.LIMIT_NOT_MET))


@dataclass
class SearchDisplay:
    """The search's best figures as they stand, drawn from `activity` at every redraw (the
    elapsed time is read then, not when the last improvement came)."""

    workload: str
    activity: Activity
    memory: float = 1.0
    latency: float = 1.0
    improvements: int = 0
    budget: float | None = None  # seconds of search (--time-budget)

    def improved(self, memory: float, latency: float) -> None:
        self.memory, self.latency = memory, latency
        self.improvements += 1

    def table(self) -> Table:
        table = optimize_table(
            self.workload, self.memory, self.latency, self.improvements, self.activity.elapsed()
        )
        stage = self.activity.stage  # warm starts, then the search; none once done
        table.caption = f"{stage}{self._of_budget()}" if stage else None
        return table

    def figures(self) -> str:
        plural = "" if self.improvements == 1 else "s"
        return (
            f"{self.improvements} improvement{plural}, best memory {self.memory:.3f} "
            f"latency {self.latency:.3f}{self._of_budget()}"
        )

    def _of_budget(self) -> str:
        return f" (budget {self.budget:.0f} s)" if self.budget is not None else ""


def search_display(
    workload: str, budget: float | None = None, clock: Callable[[], float] = time.monotonic
) -> SearchDisplay:
    activity = Activity(f"optimizing {workload}", clock=clock)
    display = SearchDisplay(workload, activity, budget=budget)
    activity.figures = display.figures
    return display


def _planned_job(parallel: str | None, world_size: int, link: str):
    """The --parallel job, its flags checked before any work (None without --parallel)."""
    if parallel is None:
        return None
    from magis.capture.sharding import PlannedJob
    from magis.cost.links import get_link

    get_link(link)
    return PlannedJob(parallel, world_size)


def _job_table(workload: str, job, setup, plan: Plan) -> list[dict]:
    """Each rank's figures without magis and with the plan (`magis.commands.parallel`),
    printed as a table; returned for --json."""
    from magis.cli.tables import rank_table
    from magis.commands.parallel import job_baselines, rank_figures

    with spinner("simulating the job's baselines"):
        graph, ac = setup.step.graph, setup.checkpointed
        rows = job_baselines(workload, job, setup.step_kind, setup.cost, graph, ac)
    rows.append(rank_figures("magis plan", plan.graph, plan.order, setup.cost))
    title = f"one rank of {job.kind.upper()} x {job.world_size} ({setup.cost.name})"
    console.print(rank_table(title, rows))
    return [r.to_json() for r in rows]


def _check_parallel(workers: int, ray: str | None) -> None:
    """--ray needs workers to run, and Ray itself: both said before any work."""
    if ray is None:
        return
    if workers < 2:
        raise UsageError("--ray runs the --workers as Ray actors: give --workers N (N >= 2)")
    from magis.search.transport import import_ray

    import_ray()


def _search_live(workload: str, setup, options, keeper) -> Plan:
    """The search with its best ratios on screen, under `options` (the `SearchOptions` the
    flags made); the plan before the final re-ordering goes to `keeper`."""
    from magis.commands.optimize import find_plan

    display = search_display(workload, options.time_budget)

    def show(imp) -> None:
        display.improved(setup.memory_ratio(imp.memory), setup.latency_ratio(imp.latency))

    def keep_then_reorder(plan: Plan) -> None:  # the search is over: its best plan is kept
        display.activity.enter("final re-ordering")
        keeper.keep(plan)

    with showing(display.activity, display.table, transient=False):
        plan = find_plan(
            setup,
            options,
            on_improvement=show,
            before_polish=keep_then_reorder if keeper.path is not None else None,
            progress=display.activity.enter,
        )
        display.activity.enter("")  # the table left on screen is the result, not a stage
    return plan
