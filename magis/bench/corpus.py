"""`magis bench corpus`: MAGIS and the best baseline on every model of the public corpus
(issue #16 item 4), under the latency limit 1.10 (least memory within it, MAGIS §7.2.1) and the
memory limit 0.4 (least latency within it, §7.2.2).

Each model (`corpus:NAME`, full size by default; `size="tiny"` for tests) is captured once per
process. MAGIS runs as `magis optimize` runs: `setup_search` then `find_plan` (Alg. 3), one
search per constraint of `time_budget` seconds (or `max_states` states). The baselines are those
of `bench compare` (`magis.baselines`), each method's points computed once
(`compare.baseline_outcomes`); under each constraint the best baseline is the best point of all
of them together, chosen as `bench compare` chooses within one method (`best_under_latency`,
`best_under_memory`). Every ratio is against the program order on the same cost model.

The work is a list of cells (one MAGIS search, or one model's baselines) run by a
`magis.bench.parallel` runner (serial, a process pool, or Ray). `results.csv`, `results.json`
and `table.md` (`corpus_report`) are rewritten after every cell, the figure after every model,
so a run stopped by Ctrl-C keeps everything it finished.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from magis.baselines import BaselinePoint, Failure, best_under_latency
from magis.baselines import best_under_memory as best_under_memory_limit
from magis.bench.compare import BenchError, Context, Progress, baseline_outcomes, check_methods
from magis.bench.constraints import Constraint
from magis.bench.corpus_report import (
    BEST_BASELINE,
    CORPUS_CONSTRAINTS,
    EXACT_PEER,
    FIGURE,
    Chosen,
    CorpusOptions,
    CorpusReport,
    ModelResult,
    Searched,
    table_cells,
    table_markdown,
    write_outputs,
)
from magis.bench.parallel import CellFailure, CellRunner, SerialRunner, run_cells
from magis.capture import DEFAULT_STEP, StepKind, workload_step
from magis.capture.corpus import CORPUS_NAMES, FULL, TINY
from magis.commands.limits import parse_memory_figure
from magis.commands.optimize import find_plan, setup_search
from magis.cost import get_cost_model
from magis.errors import MagisError
from magis.search import Mode, SearchOptions, simulate_state

__all__ = [
    "CORPUS_CONSTRAINTS",
    "CORPUS_NAMES",
    "FIGURE",
    "CorpusOptions",
    "CorpusReport",
    "run_corpus",
    "run_corpus_cell",
    "table_cells",
    "table_markdown",
]


@dataclass(frozen=True)
class Cell:
    """One MAGIS search of one model under one constraint, or one model's baselines."""

    workload: str
    hardware: str
    constraint: Constraint | None = None  # None: the baselines
    time_budget: float = 0.0
    max_states: int | None = None
    methods: tuple[str, ...] = ()
    workers: int = 1
    step: StepKind = DEFAULT_STEP

    def describe(self) -> str:
        if self.constraint is None:
            return f"{self.workload}: baselines"
        return f"{self.workload}: magis {self.constraint.label} ({self.time_budget:g} s)"


@dataclass(frozen=True)
class CellResult:
    program_peak_bytes: int
    program_latency_s: float
    nodes: int
    capture_seconds: float
    resident_bytes: int
    searched: Searched | None = None
    chosen: tuple[Chosen, ...] = ()
    exact: tuple[Chosen, ...] = ()  # the exact peer's own point per constraint, when it ran


# --- the run ---------------------------------------------------------------------------------


def check_models(models: Sequence[str]) -> tuple[str, ...]:
    for m in models:
        if m not in CORPUS_NAMES:
            raise BenchError(f"unknown corpus model {m!r}: choose among {', '.join(CORPUS_NAMES)}")
    return tuple(models)


def corpus_cells(options: CorpusOptions) -> list[Cell]:
    """Per model: its baselines, then one MAGIS search per constraint."""
    cells = []
    for model in options.models:
        w = options.workload(model)
        cells.append(Cell(w, options.hardware, methods=options.baselines(), step=options.step))
        cells += [
            Cell(
                w,
                options.hardware,
                c,
                options.time_budget,
                options.max_states,
                (),
                options.workers,
                options.step,
            )
            for c in CORPUS_CONSTRAINTS
        ]
    return cells


def run_corpus(
    options: CorpusOptions, progress: Progress | None = None, runner: CellRunner | None = None
) -> CorpusReport:
    """Every corpus model under both constraints; files rewritten as each cell finishes."""
    check_models(options.models)
    check_methods(options.baselines())
    if options.size not in (FULL, TINY):
        raise BenchError(f"size {options.size!r}: choose {FULL} or {TINY}")
    report = CorpusReport(options, [ModelResult(options.workload(m)) for m in options.models])
    by_name = {m.model: m for m in report.models}
    cells = corpus_cells(options)
    per_model = 1 + len(CORPUS_CONSTRAINTS)
    finished = dict.fromkeys(by_name, 0)
    runner = runner or SerialRunner()
    if isinstance(runner, SerialRunner) and progress is not None:  # name each cell as it starts
        runner = SerialRunner(on_start=lambda i: progress(cells[i].describe(), i, len(cells)))
    start = time.perf_counter()
    try:
        for done in run_cells(cells, run_corpus_cell, runner):
            cell = cells[done.index]
            _record(by_name[cell.workload], cell, done.result)
            finished[cell.workload] += 1
            report.seconds = time.perf_counter() - start
            # the figure as each model completes (a second or so), the rest after every cell
            write_outputs(report, figure=finished[cell.workload] == per_model)
            if progress is not None:
                progress(f"{cell.describe()} done", sum(finished.values()), len(cells))
            if isinstance(done.result, CellResult) and _interrupted(done.result):
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        _prepared.cache_clear()
    report.seconds = time.perf_counter() - start
    write_outputs(report)
    return report


def _interrupted(result: CellResult) -> bool:
    return result.searched is not None and result.searched.interrupted


def _record(model: ModelResult, cell: Cell, result: CellResult | CellFailure) -> None:
    if isinstance(result, CellFailure):
        model.failures.append(f"{cell.describe()}: {result.reason}")
        return
    model.program_peak_bytes, model.program_latency_s = (
        result.program_peak_bytes,
        result.program_latency_s,
    )
    model.nodes, model.capture_seconds = result.nodes, result.capture_seconds
    model.resident_bytes = result.resident_bytes
    if result.searched is not None:
        model.searched[result.searched.constraint] = result.searched
    for chosen in result.chosen:
        model.chosen[chosen.constraint] = chosen
    for exact in result.exact:
        model.exact[exact.constraint] = exact


# --- one cell, wherever it runs --------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _prepared(workload: str, hardware: str, kind: StepKind) -> tuple[Context, float]:
    """Per process: the model's capture (as `magis optimize` captures it) and its program
    order on the cost model, shared by the cells of one model that run here."""
    start = time.process_time()
    _, step = workload_step(workload, step=kind, float64_when_tiny=True)
    seconds = time.process_time() - start
    cost = get_cost_model(hardware)
    # the program order measured as `setup_search` measures it: MAGIS's ratios and the
    # baselines' share their denominator
    figure = parse_memory_figure("theoretical")
    base = simulate_state(step.graph, step.graph.program_order(), cost, figure)
    return Context(workload, step, cost, base, kind), seconds


def run_corpus_cell(cell: Cell) -> CellResult:
    """The baselines' best points under both constraints, or one MAGIS search."""
    ctx, capture_seconds = _prepared(cell.workload, cell.hardware, cell.step)
    figures = (
        ctx.base.peak_bytes,
        ctx.base.latency_s,
        len(ctx.graph.program_order()),
        capture_seconds,
        ctx.base.resident_bytes,
    )
    if cell.constraint is None:
        points = [o for m in cell.methods for o in baseline_outcomes(m, ctx)]
        exact = [o for o in points if o.method == EXACT_PEER]
        return CellResult(
            *figures,
            chosen=tuple(best_baseline(ctx, c, points) for c in CORPUS_CONSTRAINTS),
            exact=tuple(
                best_baseline(ctx, c, exact, EXACT_PEER) for c in CORPUS_CONSTRAINTS if exact
            ),
        )
    return CellResult(*figures, searched=magis_search(ctx, cell))


def best_baseline(
    ctx: Context, c: Constraint, outcomes: Sequence, name: str = BEST_BASELINE
) -> Chosen:
    """The best point of all baselines together under `c` (or of one method's, `name`),
    chosen as `bench compare` chooses within one method; a Failure names why none fits. An
    exact method's point carries the gap its solver proved."""
    limit = c.objective(ctx.base).limit
    if c.mode is Mode.LATENCY_LIMIT:
        best = best_under_latency(outcomes, limit, name)
    else:
        best = best_under_memory_limit(outcomes, int(limit), name)
    if isinstance(best, Failure):
        reasons = sorted({o.reason for o in outcomes if isinstance(o, Failure)})
        return Chosen(c.label, None, None, None, False, "; ".join([best.reason, *reasons]))
    assert isinstance(best, BaselinePoint)
    return Chosen(
        c.label,
        best.method,
        best.memory / ctx.base.peak_bytes,
        best.latency / ctx.base.latency_s,
        True,
        gap=best.params.get("gap"),
    )


def magis_search(ctx: Context, cell: Cell) -> Searched:
    """One search as `magis optimize` runs it; a limit no plan can meet is a FAILURE."""
    c = cell.constraint
    assert c is not None
    limit = {"lat_limit": c.ratio} if c.mode is Mode.LATENCY_LIMIT else {"mem_limit": c.ratio}
    try:
        setup = setup_search(ctx.step, hardware=ctx.cost, workload=cell.workload, **limit)
    except MagisError as exc:
        return Searched(c.label, None, None, False, 0, 0.0, str(exc))
    options = SearchOptions(
        time_budget=cell.time_budget, max_states=cell.max_states, workers=cell.workers
    )
    plan = find_plan(setup, options)
    s = plan.summary
    reason = "" if s.satisfied else "the limit was not met in the search's budget"
    return Searched(
        c.label,
        s.memory_ratio,
        s.latency_ratio,
        s.satisfied,
        s.states_explored,
        s.seconds,
        reason,
        s.interrupted,
        dict(s.breakdown),
    )
