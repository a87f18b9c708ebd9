"""The comparison's options, its rows and report, and the files it writes: results.csv,
results.json, tables.md (the tables of MAGIS Figs. 9 and 10) and the figures (`plots`)."""

from __future__ import annotations

import csv
import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from magis.baselines import baseline_names
from magis.bench import plots
from magis.bench.constraints import CONSTRAINTS, MAGIS, Constraint
from magis.capture.step_kinds import DEFAULT_STEP, StepKind
from magis.capture.workloads import WORKLOAD_FAMILIES
from magis.search import Mode

PAPER_WORKLOADS = WORKLOAD_FAMILIES  # at paper (Table 2) size
DEFAULT_TIME_BUDGET = 60.0  # seconds per MAGIS search (the paper gives 3 min; see the README)
PARETO_MEMORY_RATIOS = (0.6, 0.2)  # extra MAGIS searches for its Pareto curve
MICROBATCH_FACTORS = (8, 16, 32)  # §7.2.4


class MicrobatchScope(enum.Enum):
    """Which workloads get the micro-batching comparison of Fig. 12."""

    VIT = "vit"  # the ViT family only, as the paper
    ALL = "all"
    NONE = "none"

    def covers(self, workload: str) -> bool:
        if self is MicrobatchScope.ALL:
            return True
        return self is MicrobatchScope.VIT and workload.split(":")[0] == "vit-base"


@dataclass(frozen=True)
class CompareOptions:
    workloads: tuple[str, ...] = PAPER_WORKLOADS
    methods: tuple[str, ...] = ()  # empty: MAGIS and every registered baseline
    hardware: str = "rtx3090"
    time_budget: float = DEFAULT_TIME_BUDGET
    out: Path = Path("out/bench-compare")
    pareto_memory_ratios: tuple[float, ...] = PARETO_MEMORY_RATIOS
    microbatch: MicrobatchScope = MicrobatchScope.VIT
    microbatch_factors: tuple[int, ...] = MICROBATCH_FACTORS
    step: StepKind = DEFAULT_STEP  # the training step captured (`--step`)

    def all_methods(self) -> tuple[str, ...]:
        return self.methods or (MAGIS, *baseline_names())


@dataclass(frozen=True)
class Row:
    """One workload x method x constraint (or one Pareto / micro-batching point)."""

    workload: str
    method: str
    constraint: str  # Constraint.label, PARETO or MICROBATCH
    memory_ratio: float | None
    latency_ratio: float | None
    memory_bytes: int | None
    latency_s: float | None
    satisfied: bool
    reason: str = ""  # why a FAILURE
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return "ok" if self.satisfied else "FAILURE"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


CSV_FIELDS = (
    "workload",
    "method",
    "constraint",
    "status",
    "memory_ratio",
    "latency_ratio",
    "memory_bytes",
    "latency_s",
    "satisfied",
    "reason",
    "params",
)


@dataclass
class WorkloadResult:
    workload: str
    program_peak_bytes: int
    program_latency_s: float
    resident_bytes: int = 0  # the program order's floor: weights, optimizer state, inputs
    rows: list[Row] = field(default_factory=list)
    seconds: float = 0.0
    complete: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "program_peak_bytes": self.program_peak_bytes,
            "program_latency_s": self.program_latency_s,
            "resident_bytes": self.resident_bytes,
            "seconds": self.seconds,
            "complete": self.complete,
            "rows": [r.to_json() for r in self.rows],
        }


@dataclass
class CompareReport:
    options: CompareOptions
    workloads: list[WorkloadResult] = field(default_factory=list)
    interrupted: bool = False
    seconds: float = 0.0

    def rows(self) -> list[Row]:
        return [r for w in self.workloads for r in w.rows]

    def to_json(self) -> dict[str, Any]:
        o = self.options
        return {
            "hardware": o.hardware,
            "step": o.step.value,
            "time_budget_s": o.time_budget,
            "methods": list(o.all_methods()),
            "constraints": [c.label for c in CONSTRAINTS],
            "pareto_memory_ratios": list(o.pareto_memory_ratios),
            "microbatch_factors": list(o.microbatch_factors),
            "interrupted": self.interrupted,
            "seconds": self.seconds,
            "out": str(o.out),
            "workloads": [w.to_json() for w in self.workloads],
        }


# --- files -----------------------------------------------------------------------------------


def write_outputs(report: CompareReport, figures: bool = True) -> None:
    """results.csv, results.json, tables.md and the figures, rewritten whole (atomically)."""
    out = report.options.out
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "results.csv", report.rows())
    _atomic_write(out / "results.json", json.dumps(report.to_json(), indent=2, default=str) + "\n")
    _atomic_write(out / "tables.md", tables_markdown(report))
    if figures:
        methods = list(report.options.all_methods())
        workloads = [w.workload for w in report.workloads]
        plots.compare_figures(report.rows(), workloads, methods, out)


def write_csv(path: Path, rows: Iterable[Row]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            d = r.to_json()
            d["params"] = json.dumps(d["params"], sort_keys=True, default=str)
            writer.writerow({k: ("" if d[k] is None else d[k]) for k in CSV_FIELDS})
    tmp.replace(path)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def constraint_table(report: CompareReport, c: Constraint) -> tuple[list[str], list[list[str]]]:
    """(workloads, one row of cells per method) for one constraint: the memory ratio under a
    latency limit (Fig. 9), the latency overhead under a memory limit (Fig. 10). The first row
    is each workload's resident floor (weights, optimizer state, inputs) over its program
    order's peak; a memory ratio has beside it, in brackets, the part of its peak above that
    floor over the program order's (below 0: under the floor, optimizer state offloaded)."""
    results = {w.workload: w for w in report.workloads}
    workloads = list(results)
    found = {(r.workload, r.method): r for r in report.rows() if r.constraint == c.label}
    table = [[FLOOR_ROW, *(_floor_cell(results[w]) for w in workloads)]]
    for m in report.options.all_methods():
        table.append([m] + [_cell(found.get((w, m)), c, results[w]) for w in workloads])
    return workloads, table


FLOOR_ROW = "resident floor"


def floor_ratio(resident_bytes: int, program_peak_bytes: int) -> float | None:
    """The resident bytes over the program order's peak; None where either is unknown."""
    if not resident_bytes or not program_peak_bytes:
        return None
    return resident_bytes / program_peak_bytes


def above_floor(memory_ratio: float, floor: float | None) -> float | None:
    """The part of a peak above the resident floor over the program order's part above it
    (both peaks as ratios of the program order's), None without a floor below the peak."""
    if floor is None or floor >= 1:
        return None
    return (memory_ratio - floor) / (1 - floor)


def _floor_cell(w: WorkloadResult) -> str:
    floor = floor_ratio(w.resident_bytes, w.program_peak_bytes)
    return "—" if floor is None else f"{floor:.3f}"


def _cell(row: Row | None, c: Constraint, w: WorkloadResult) -> str:
    if row is None:
        return "—"
    if not row.satisfied:
        return "FAILURE"
    if c.mode is Mode.LATENCY_LIMIT:
        text = f"{row.memory_ratio:.3f}"
        above = above_floor(row.memory_ratio, floor_ratio(w.resident_bytes, w.program_peak_bytes))
        text += "" if above is None else f" [{above:.3f}]"
    else:
        text = f"{(row.latency_ratio - 1) * 100:+.1f}%"
    return text + _gap(row)


def _gap(row: Row) -> str:
    """The gap an exact method's solver proved for the plan (`ilp`), where it has one."""
    gap = row.params.get("gap")
    return "" if gap is None else f" (gap {gap:.1%})"


def tables_markdown(report: CompareReport) -> str:
    o = report.options
    lines = [
        f"# magis bench compare ({o.hardware}, {o.step.value} step, MAGIS {o.time_budget:g} s "
        "per search)",
        "",
        "Ratios against PyTorch's program order on the same cost model. The first row is the "
        "resident floor (weights, optimizer state, inputs) over the program order's peak; in "
        "brackets, the part of a peak above that floor over the program order's.",
    ]
    if report.interrupted:
        lines.append("\n**Interrupted**: the tables hold what finished.")
    titles = {
        Mode.LATENCY_LIMIT: "Fig. 9: peak memory ratio under latency limit {r:g} (lower is better)",
        Mode.MEMORY_LIMIT: "Fig. 10: latency overhead under memory limit {r:g} (lower is better)",
    }
    for c in CONSTRAINTS:
        workloads, table = constraint_table(report, c)
        lines += ["", "## " + titles[c.mode].format(r=c.ratio), ""]
        lines += [_md_row(["method", *workloads]), _md_row(["---"] * (len(workloads) + 1))]
        lines += [_md_row(cells) for cells in table]
    failures = [r for r in report.rows() if not r.satisfied]
    if failures:
        lines += ["", "## FAILURE reasons", ""]
        lines += [f"- {r.workload} / {r.method} / {r.constraint}: {r.reason}" for r in failures]
    return "\n".join(lines) + "\n"


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
