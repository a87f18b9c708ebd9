"""The heuristic ablation of MAGIS §7.2.5 (Fig. 13): five settings, four constraints, best-so-far
curves over search time.

Settings (L = 4 unless named):

- naive-fission: H1 off, the F-Tree's candidates drawn at random (`magis.analyze.naive`, seed 0);
- naive-sch-rules: H2 off, re-materialization and swapping matched on the whole graph
  (`hotspots_only=False`);
- max-level=2, 4, 8: H3, the F-Tree's L.

Each runs one search of Alg. 3 per constraint (latency limits 1.05, 1.10; memory limits 0.8, 0.4)
for `time_budget` seconds; the paper gives 3 minutes, our default is `DEFAULT_TIME_BUDGET` = 60 s
(20 searches: about 20 minutes on bert-base). A curve is the search's improvement records: under a
latency limit, the memory ratio of the best state within it; under a memory limit, its latency
ratio — from the first improvement that meets the limit (before that there is nothing within it
to plot). Each search is a cell (`AblationCell`) that can run in a process pool or on Ray
(`magis.bench.parallel`); files are rewritten after every search, so Ctrl-C keeps what finished.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from magis.bench import plots
from magis.bench.compare import (
    Context,
    Progress,
    check_workloads,
    search,
    workload_memo,
)
from magis.bench.compare_report import DEFAULT_TIME_BUDGET
from magis.bench.constraints import CONSTRAINTS, Constraint
from magis.bench.parallel import CellFailure, CellRunner, SerialRunner, run_cells
from magis.search import Mode, SearchOptions, SearchResult


@dataclass(frozen=True)
class Setting:
    name: str
    hotspots_only: bool = True  # H2
    max_level: int = 4  # H3
    naive_fission_seed: int | None = None  # H1 off when set

    def knobs(self) -> dict[str, Any]:
        return {
            "hotspots_only": self.hotspots_only,
            "max_level": self.max_level,
            "naive_fission_seed": self.naive_fission_seed,
        }

    def options(self, time_budget: float) -> SearchOptions:
        """The search's options under this setting (the ablation's only difference)."""
        return SearchOptions(time_budget=time_budget, **self.knobs())


SETTINGS = (
    Setting("naive-fission", naive_fission_seed=0),
    Setting("naive-sch-rules", hotspots_only=False),
    Setting("max-level=2", max_level=2),
    Setting("max-level=4", max_level=4),
    Setting("max-level=8", max_level=8),
)


@dataclass(frozen=True)
class CurvePoint:
    seconds: float
    memory_ratio: float
    latency_ratio: float
    satisfied: bool


@dataclass(frozen=True)
class Curve:
    """One search: every improvement it recorded, and where it ended."""

    setting: str
    constraint: str
    points: tuple[CurvePoint, ...]
    seconds: float
    states_explored: int
    satisfied: bool
    memory_ratio: float  # of the best state
    latency_ratio: float

    def best_so_far(self, mode: Mode) -> list[tuple[float, float]]:
        """(seconds, value) within the limit, held to the end of the search: the memory ratio
        under a latency limit, the latency ratio under a memory limit."""
        memory = mode is Mode.LATENCY_LIMIT
        pts = [
            (p.seconds, p.memory_ratio if memory else p.latency_ratio)
            for p in self.points
            if p.satisfied
        ]
        if pts:
            pts.append((max(self.seconds, pts[-1][0]), pts[-1][1]))
        return pts

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "points": [asdict(p) for p in self.points]}


@dataclass(frozen=True)
class AblationOptions:
    workload: str = "bert-base"
    hardware: str = "rtx3090"
    time_budget: float = DEFAULT_TIME_BUDGET
    out: Path = Path("out/bench-ablation")
    settings: tuple[Setting, ...] = SETTINGS
    constraints: tuple[Constraint, ...] = CONSTRAINTS


@dataclass
class AblationReport:
    options: AblationOptions
    program_peak_bytes: int = 0
    program_latency_s: float = 0.0
    curves: list[Curve] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # searches that raised, with the reason
    interrupted: bool = False
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        o = self.options
        return {
            "workload": o.workload,
            "hardware": o.hardware,
            "time_budget_s": o.time_budget,
            "settings": {s.name: s.knobs() for s in o.settings},
            "constraints": [c.label for c in o.constraints],
            "program_peak_bytes": self.program_peak_bytes,
            "program_latency_s": self.program_latency_s,
            "interrupted": self.interrupted,
            "seconds": self.seconds,
            "out": str(o.out),
            "curves": [c.to_json() for c in self.curves],
            "failures": self.failures,
        }


@dataclass(frozen=True)
class AblationCell:
    """One search: a setting under a constraint, on the workload named (captured where the
    cell runs, once per process: `magis.bench.compare.workload_memo`)."""

    workload: str
    hardware: str
    setting: Setting
    constraint: Constraint
    time_budget: float

    def describe(self) -> str:
        return f"{self.setting.name} {self.constraint.label} ({self.time_budget:g} s)"


@dataclass(frozen=True)
class AblationResult:
    program_peak_bytes: int
    program_latency_s: float
    curve: Curve
    interrupted: bool = False


def run_ablation_cell(cell: AblationCell) -> AblationResult:
    ctx = workload_memo(cell.workload, cell.hardware).context
    result = search(ctx, cell.constraint, cell.setting.options(cell.time_budget))
    curve = curve_of(ctx, cell.setting, cell.constraint, result)
    return AblationResult(ctx.base.peak_bytes, ctx.base.latency_s, curve, result.interrupted)


def ablation_cells(options: AblationOptions) -> list[AblationCell]:
    o = options
    return [
        AblationCell(o.workload, o.hardware, s, c, o.time_budget)
        for s in o.settings
        for c in o.constraints
    ]


def run_ablation(
    options: AblationOptions, progress: Progress | None = None, runner: CellRunner | None = None
) -> AblationReport:
    """Every setting under every constraint on one workload, each search a cell run by
    `runner` (serial when None); files rewritten after each search, curves in the serial
    order whatever order they finish in. A search that raised is a curve-less FAILURE
    (`AblationReport.failures`)."""
    check_workloads([options.workload])
    report = AblationReport(options)
    cells = ablation_cells(options)
    runner = runner or SerialRunner()
    curves: dict[int, Curve] = {}
    start = time.perf_counter()

    def say(i: int) -> None:
        _say(progress, cells[i].describe(), len(curves) + len(report.failures), len(cells))

    if isinstance(runner, SerialRunner):
        runner = SerialRunner(on_start=say)
    try:
        for done in run_cells(cells, run_ablation_cell, runner):
            cell = cells[done.index]
            if isinstance(done.result, CellFailure):
                report.failures.append(
                    f"{cell.setting.name} {cell.constraint.label}: {done.result.reason}"
                )
            else:
                report.program_peak_bytes = done.result.program_peak_bytes
                report.program_latency_s = done.result.program_latency_s
                curves[done.index] = done.result.curve
            report.curves = [curves[i] for i in sorted(curves)]
            report.seconds = time.perf_counter() - start
            write_outputs(report, figures=False)
            if not isinstance(runner, SerialRunner):
                _say(progress, f"{cell.describe()} done", len(curves), len(cells))
            if getattr(done.result, "interrupted", False):
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        workload_memo.cache_clear()
    report.seconds = time.perf_counter() - start
    write_outputs(report)
    return report


def _say(progress: Progress | None, description: str, done: int, total: int) -> None:
    if progress is not None:
        progress(description, done, total)


def curve_of(ctx: Context, s: Setting, c: Constraint, result: SearchResult) -> Curve:
    objective = result.objective
    peak, lat = ctx.base.peak_bytes, ctx.base.latency_s
    points = tuple(
        CurvePoint(
            i.seconds,
            i.memory / peak,
            i.latency / lat,
            (i.memory if objective.mode is Mode.MEMORY_LIMIT else i.latency) <= objective.limit,
        )
        for i in result.improvements
    )
    return Curve(
        s.name,
        c.label,
        points,
        result.seconds,
        result.stats.states_explored,
        result.satisfied,
        result.best.memory / peak,
        result.best.latency / lat,
    )


# --- files -----------------------------------------------------------------------------------

CSV_FIELDS = ("setting", "constraint", "seconds", "memory_ratio", "latency_ratio", "satisfied")


def write_outputs(report: AblationReport, figures: bool = True) -> None:
    """ablation.csv (every improvement of every search), ablation.json, tables.md, Fig. 13."""
    out = report.options.out
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "ablation.csv.tmp"
    with tmp.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for curve in report.curves:
            for p in curve.points:
                writer.writerow(
                    {"setting": curve.setting, "constraint": curve.constraint, **asdict(p)}
                )
    tmp.replace(out / "ablation.csv")
    _write(out / "ablation.json", json.dumps(report.to_json(), indent=2) + "\n")
    _write(out / "tables.md", tables_markdown(report))
    if figures and report.curves:
        panels, ylabels = figure_panels(report)
        title = f"Fig. 13: ablation on {report.options.workload} ({report.options.time_budget:g} s per search)"
        plots.ablation_figure(panels, ylabels, title, out / plots.FIG13)


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def figure_panels(report: AblationReport):
    """{constraint: {setting: best-so-far points}}, and each panel's y label."""
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    ylabels: dict[str, str] = {}
    for c in report.options.constraints:
        mine = [k for k in report.curves if k.constraint == c.label]
        if not mine:
            continue
        panels[c.label] = {k.setting: k.best_so_far(c.mode) for k in mine}
        ylabels[c.label] = "memory ratio" if c.mode is Mode.LATENCY_LIMIT else "latency ratio"
    return panels, ylabels


def tables_markdown(report: AblationReport) -> str:
    """The best each setting reached under each constraint (what Fig. 13's curves end at)."""
    o = report.options
    labels = [c.label for c in o.constraints]
    found = {(k.setting, k.constraint): k for k in report.curves}
    lines = [
        f"# magis bench ablation: {o.workload} ({o.hardware}, {o.time_budget:g} s per search)",
        "",
        "Best memory ratio under a latency limit, best latency ratio under a memory limit.",
        "",
        "| setting | " + " | ".join(labels) + " |",
        "| --- |" + " --- |" * len(labels),
    ]
    for s in o.settings:
        cells = [_cell(found.get((s.name, c.label)), c) for c in o.constraints]
        lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
    if report.failures:
        lines += ["", "## FAILURE reasons", ""] + [f"- {f}" for f in report.failures]
    if report.interrupted:
        lines += ["", "**Interrupted**: the table holds the searches that finished."]
    return "\n".join(lines) + "\n"


def _cell(curve: Curve | None, c: Constraint) -> str:
    if curve is None:
        return "—"
    if not curve.satisfied:
        return "FAILURE"
    value = curve.memory_ratio if c.mode is Mode.LATENCY_LIMIT else curve.latency_ratio
    return f"{value:.3f}"
