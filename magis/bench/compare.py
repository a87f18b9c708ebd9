"""MAGIS against every baseline on the same graphs, simulator and cost model (MAGIS §7.2, Figs. 9-12).

For each workload: capture the training step, simulate its program order (the PyTorch baseline:
every ratio below is against it, on the same cost model), then for every method

- **baselines** (`magis.baselines`): the method's points are computed ONCE (its Pareto
  candidates), and each constraint picks among them: the least memory within a latency limit
  (`best_under_latency`), the fastest within a memory limit (`best_under_memory`);
- **MAGIS**: one search of Alg. 3 (`optimize_graph`) per constraint, `time_budget` seconds each
  (`DEFAULT_TIME_BUDGET` = 60 s: seven paper-size workloads in well under two hours).

The constraints are §7.2.1's latency limits 1.05 and 1.10 and §7.2.2's memory limits 0.8 and 0.4.
A method that cannot meet one is a FAILURE row with the reason; a baseline whose module is missing
or crashes is a FAILURE row too, never the end of the run.

Pareto sweep (Fig. 11): a baseline's curve is the Pareto front of all its points. MAGIS's curve is
the front of every state its searches recorded as an improvement — the four constrained searches
and `PARETO_MEMORY_RATIOS` extra memory-limit searches (0.6 and 0.2) that fill the curve between
and below them — so a point on it is a real program the search built, and each search costs the
same budget. Micro-batching (Fig. 12): `microbatch_points(workload, POFO, cost, factors)` on the
ViT workloads by default (`MicrobatchScope`), factors 8, 16, 32 as in §7.2.4.

The run is a list of independent cells (`compare_cells`: a baseline on a workload, one MAGIS
search, one workload's micro-batching), run here one after the other or side by side in a
process pool or on Ray (`magis.bench.parallel`); each process captures a workload once
(`workload_memo`). Results are rewritten as each cell finishes (`results.csv`, `results.json`,
`tables.md`; the PNG figures as each workload completes: `compare_report`), in the serial
run's order whatever the order cells finish in, so a run stopped by Ctrl-C keeps everything it
finished.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from magis.baselines import (
    BaselinePoint,
    Failure,
    Outcome,
    baseline_names,
    best_under_latency,
    best_under_memory,
    get_baseline,
    pareto_front,
)
from magis.bench.compare_cells import Board, CellResult, CompareCell, compare_cells
from magis.bench.compare_cells import front as _front  # noqa: F401 - the tests' name for it
from magis.bench.compare_report import CompareOptions, CompareReport, Row, write_outputs
from magis.bench.constraints import CONSTRAINTS, MAGIS, MICROBATCH, PARETO, Constraint
from magis.bench.parallel import CellRunner, SerialRunner, run_cells
from magis.capture import DEFAULT_STEP, Step, StepKind, workload_step
from magis.cost import CostModel, get_cost_model
from magis.errors import MagisError
from magis.ir import Graph
from magis.search import Mode, SearchOptions, SearchResult, optimize_graph
from magis.sim import SimResult, simulate

# Called as progress(description, steps done, steps in all).
Progress = Callable[[str, int, int], None]


class BenchError(MagisError):
    """A benchmark asked for something that does not exist (a method, a workload)."""


@dataclass(frozen=True)
class Context:
    """One workload as every method sees it."""

    workload: str
    step: Step
    cost: CostModel
    base: SimResult  # program order: the PyTorch baseline, the denominator of every ratio
    step_kind: StepKind = DEFAULT_STEP  # what `step` was captured as (`--step`)

    @property
    def graph(self) -> Graph:
        return self.step.graph


# --- the run ---------------------------------------------------------------------------------


def check_methods(methods: Iterable[str]) -> tuple[str, ...]:
    known = (MAGIS, *baseline_names())
    methods = tuple(methods)
    for m in methods:
        if m not in known:
            raise BenchError(f"unknown method {m!r}: choose among {', '.join(known)}")
    return methods


def check_workloads(workloads: Iterable[str]) -> tuple[str, ...]:
    from magis.capture import get_workload

    workloads = tuple(workloads)
    for w in workloads:
        get_workload(w)  # an unknown name fails now, not an hour into the run
    return workloads


def run_compare(
    options: CompareOptions, progress: Progress | None = None, runner: CellRunner | None = None
) -> CompareReport:
    """Every method on every workload under every constraint, as independent cells run by
    `runner` (serial when None; `magis.bench.parallel`); files rewritten as each cell's rows
    come, the figures as each workload completes. Ctrl-C keeps what finished."""
    check_methods(options.all_methods())
    check_workloads(options.workloads)
    report = CompareReport(options)
    cells = compare_cells(options)
    board = Board(report, cells)
    runner = runner or SerialRunner()
    start = time.perf_counter()

    def started(i: int) -> None:
        if progress is not None:
            progress(cells[i].describe(), len(board.results), len(cells))

    try:
        for done in run_cells(cells, run_compare_cell, _announcing(runner, started)):
            workload = board.add(done.index, done.result, done.cpu_seconds)
            report.seconds = time.perf_counter() - start
            write_outputs(report, figures=board.complete(workload))
            if runner.name != "serial" and progress is not None:
                progress(f"{cells[done.index].describe()} done", len(board.results), len(cells))
            if getattr(done.result, "interrupted", False):
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        workload_memo.cache_clear()  # this process's captures: the run is over
    report.seconds = time.perf_counter() - start
    write_outputs(report)
    return report


def _announcing(runner: CellRunner, started: Callable[[int], None]) -> CellRunner:
    """The serial runner announces each cell as it starts (a progress bar that names the
    search running); the others report cells as they finish."""
    if isinstance(runner, SerialRunner):
        return SerialRunner(on_start=started)
    return runner


@dataclass
class WorkloadMemo:
    """One process's capture of a workload (or why it failed: every cell of the workload fails
    with that reason, without capturing again), and the baseline points computed on it there
    (micro-batching reuses POFO's when it runs in the same process)."""

    captured: Context | None
    outcomes: dict[str, list[Outcome]]
    error: str = ""

    @property
    def context(self) -> Context:
        if self.captured is None:
            raise BenchError(self.error)
        return self.captured


@functools.lru_cache(maxsize=2)
def workload_memo(workload: str, hardware: str, step: StepKind = DEFAULT_STEP) -> WorkloadMemo:
    """Per process: the cells of one workload run one after the other in a worker share one
    capture (two kept: a worker moving on to the next workload may still get a late cell)."""
    try:
        return WorkloadMemo(capture_context(workload, hardware, step), {})
    except Exception as exc:  # noqa: BLE001 - each of the workload's cells is a FAILURE row
        return WorkloadMemo(None, {}, f"capture failed: {type(exc).__name__}: {exc}")


def run_compare_cell(cell: CompareCell) -> CellResult:
    """One cell, wherever it runs (`magis.bench.parallel`): capture (memoized), then the
    baseline's points, one MAGIS search, or the micro-batching series."""
    memo = workload_memo(cell.workload, cell.hardware, cell.step)
    ctx = memo.context
    figures = (ctx.base.peak_bytes, ctx.base.latency_s, ctx.base.resident_bytes)
    if cell.method == MAGIS:
        result = search(ctx, cell.constraint, SearchOptions(time_budget=cell.time_budget))
        rows = (magis_row(ctx, cell.constraint, result, cell.time_budget),) if cell.in_table else ()
        records = tuple((i.memory, i.latency, cell.constraint.label) for i in result.improvements)
        return CellResult(*figures, rows, records, result.interrupted)
    if cell.method == MICROBATCH:
        rows = microbatch_rows(ctx, cell.factors, memo.outcomes.get("pofo"))
        return CellResult(*figures, tuple(rows))
    memo.outcomes[cell.method] = baseline_outcomes(cell.method, ctx)
    return CellResult(*figures, tuple(baseline_rows(ctx, cell.method, memo.outcomes[cell.method])))


def capture_context(workload: str, hardware: str, kind: StepKind = DEFAULT_STEP) -> Context:
    # as `magis optimize` captures it
    _, step = workload_step(workload, step=kind, float64_when_tiny=True)
    cost = get_cost_model(hardware)
    base = simulate(step.graph, step.graph.program_order(), cost)
    return Context(workload, step, cost, base, kind)


# --- baselines -------------------------------------------------------------------------------


def baseline_outcomes(method: str, ctx: Context) -> list[Outcome]:
    """All points of one baseline on this workload, computed once; a missing module or a crash
    is one Failure with the reason (Ctrl-C still stops the run)."""
    try:
        return list(_points(method, ctx))
    except Exception as exc:  # noqa: BLE001 - any baseline bug is a FAILURE row, not a crash
        return [Failure(method, _why(exc))]


def _points(method: str, ctx: Context) -> Iterable[Outcome]:
    if method in ("min-cut", "min-cut-budget"):
        if ctx.step_kind is not DEFAULT_STEP:
            return [
                Failure(method, f"AOTAutograd's min-cut traces the {DEFAULT_STEP.value} step only")
            ]
        # PyTorch's partitioner re-traces the model through AOTAutograd: it needs the workload,
        # not our graph. "min-cut" is budget 1.0; "min-cut-budget" sweeps 1.0 .. 0.0.
        from magis.baselines.mincut import DEFAULT_BUDGETS, min_cut_baseline

        budgets = DEFAULT_BUDGETS if method == "min-cut-budget" else None
        return min_cut_baseline(ctx.workload, budgets).points(ctx.graph, ctx.cost)
    return get_baseline(method).points(ctx.graph, ctx.cost)


def _why(exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return f"not available: {exc}"
    return f"crashed: {type(exc).__name__}: {exc}"


def baseline_rows(ctx: Context, method: str, outcomes: Sequence[Outcome]) -> list[Row]:
    rows = []
    for c in CONSTRAINTS:
        limit = c.objective(ctx.base).limit
        if c.mode is Mode.LATENCY_LIMIT:
            chosen = best_under_latency(outcomes, limit, method)
        else:
            chosen = best_under_memory(outcomes, int(limit), method)
        rows.append(_outcome_row(ctx, method, c.label, _explained(chosen, outcomes)))
    points = [o for o in outcomes if isinstance(o, BaselinePoint)]
    rows += [_outcome_row(ctx, method, PARETO, p) for p in pareto_front(points)]
    return rows


def _explained(chosen: Outcome, outcomes: Sequence[Outcome]) -> Outcome:
    """A selection failure over no points at all repeats the method's own failure reason."""
    if isinstance(chosen, Failure) and not any(isinstance(o, BaselinePoint) for o in outcomes):
        reasons = sorted({o.reason for o in outcomes if isinstance(o, Failure)})
        if reasons:
            return Failure(chosen.method, "; ".join(reasons))
    return chosen


def _outcome_row(ctx: Context, method: str, constraint: str, o: Outcome) -> Row:
    if isinstance(o, Failure):
        return Row(
            ctx.workload, method, constraint, None, None, None, None, False, o.reason, o.params
        )
    params = dict(o.params)
    if o.repeats != 1:
        params["repeats"] = o.repeats
    return _figures_row(ctx, method, constraint, o.memory, o.latency, True, "", params)


def _figures_row(ctx, method, constraint, memory, latency, satisfied, reason, params) -> Row:
    return Row(
        ctx.workload,
        method,
        constraint,
        memory / ctx.base.peak_bytes,
        latency / ctx.base.latency_s,
        int(memory),
        float(latency),
        satisfied,
        reason,
        params,
    )


# --- MAGIS -----------------------------------------------------------------------------------


def search(ctx: Context, c: Constraint, options: SearchOptions) -> SearchResult:
    return optimize_graph(ctx.graph, ctx.cost, c.objective(ctx.base), options)


def magis_row(ctx: Context, c: Constraint, result: SearchResult, time_budget: float) -> Row:
    best = result.best
    reason = ""
    if not result.satisfied:
        reason = (
            f"best found in {result.seconds:.0f} s: memory {best.memory / ctx.base.peak_bytes:.3f},"
            f" latency {best.latency / ctx.base.latency_s:.3f} of the program order"
        )
    params = {
        "time_budget_s": time_budget,
        "seconds": round(result.seconds, 2),
        "states_explored": result.stats.states_explored,
        "rules": dict(result.stats.rules_applied),
    }
    return _figures_row(
        ctx, MAGIS, c.label, best.memory, best.latency, result.satisfied, reason, params
    )


# --- micro-batching (Fig. 12) ----------------------------------------------------------------


def microbatch_rows(
    ctx: Context, factors: Sequence[int], pofo: Sequence[Outcome] | None
) -> list[Row]:
    """POFO alone, and POFO on the graph micro-batched by each factor: each one's Pareto front."""
    rows = []
    if pofo is None:
        pofo = baseline_outcomes("pofo", ctx)
    rows += _series_rows(ctx, "pofo", pofo)
    try:
        from magis.baselines.microbatch import microbatch_points

        outcomes = list(microbatch_points(ctx.workload, get_baseline("pofo"), ctx.cost, factors))
    except Exception as exc:  # noqa: BLE001 - a FAILURE row, as for any baseline
        outcomes = [Failure("microbatch", _why(exc))]
    for f in factors:
        mine = [o for o in outcomes if _factor(o) == f]
        rows += _series_rows(ctx, f"pofo x{f}", mine or [_no_points(outcomes, f)])
    return rows


def _factor(o: Outcome) -> int | None:
    if isinstance(o, BaselinePoint):
        return int(o.params.get("factor", o.repeats))
    factor = o.params.get("factor")
    return None if factor is None else int(factor)


def _no_points(outcomes: Sequence[Outcome], factor: int) -> Failure:
    reasons = sorted({o.reason for o in outcomes if isinstance(o, Failure)})
    return Failure(f"pofo x{factor}", "; ".join(reasons) or "no point for this factor")


def _series_rows(ctx: Context, name: str, outcomes: Sequence[Outcome]) -> list[Row]:
    points = [o for o in outcomes if isinstance(o, BaselinePoint)]
    if not points:
        return [
            _outcome_row(ctx, name, MICROBATCH, _explained(Failure(name, "no point"), outcomes))
        ]
    return [_outcome_row(ctx, name, MICROBATCH, p) for p in pareto_front(points)]
