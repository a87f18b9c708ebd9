"""`magis bench corpus`'s options, its results per model and the files it writes:
results.csv, results.json, table.md and `corpus_constraints.png` (`plots.constraint_bars`)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from magis.baselines import baseline_names
from magis.bench import plots
from magis.bench.compare_report import above_floor, floor_ratio
from magis.bench.constraints import Constraint
from magis.capture.corpus import CORPUS_NAMES, CORPUS_PREFIX, FULL
from magis.capture.step_kinds import DEFAULT_STEP, StepKind
from magis.search import Mode

CORPUS_CONSTRAINTS = (Constraint(Mode.LATENCY_LIMIT, 1.10), Constraint(Mode.MEMORY_LIMIT, 0.4))
FIGURE = "corpus_constraints.png"
BEST_BASELINE = "best baseline"
# The exact peer (`magis.baselines.ilp`): its own point under each constraint is shown beside
# the best baseline with the gap its solver proved, the anchor magis is measured against.
EXACT_PEER = "ilp"


@dataclass(frozen=True)
class CorpusOptions:
    models: tuple[str, ...] = CORPUS_NAMES
    size: str = FULL  # full, or tiny (tests)
    hardware: str = "rtx3090"
    time_budget: float = 60.0
    max_states: int | None = None
    methods: tuple[str, ...] = ()  # baselines; empty: every registered one
    out: Path = Path("out/bench-corpus")
    workers: int = 1  # worker processes of each MAGIS search (`magis optimize --workers`)
    step: StepKind = DEFAULT_STEP  # the training step captured (`--step`)

    def workload(self, model: str) -> str:
        return f"{CORPUS_PREFIX}{model}" + ("" if self.size == FULL else f":{self.size}")

    def baselines(self) -> tuple[str, ...]:
        return self.methods or baseline_names()


@dataclass(frozen=True)
class Searched:
    """What a MAGIS search found (its plan's summary)."""

    constraint: str
    memory_ratio: float | None
    latency_ratio: float | None
    satisfied: bool
    states_explored: int
    seconds: float
    reason: str = ""
    interrupted: bool = False
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds per search phase

    @property
    def states_per_second(self) -> float | None:
        return self.states_explored / self.seconds if self.seconds > 0 else None

    @property
    def exploring_states_per_second(self) -> float | None:
        """States per second of the search without its final full re-ordering of the best
        (`breakdown["polish"]`: 8 s of a 60 s search on a 49,000-node split graph), the
        rate at which it evaluates states."""
        exploring = self.seconds - self.breakdown.get("polish", 0.0)
        return self.states_explored / exploring if exploring > 0 else None


@dataclass(frozen=True)
class Chosen:
    """The best baseline point under one constraint, or why there is none."""

    constraint: str
    method: str | None
    memory_ratio: float | None
    latency_ratio: float | None
    satisfied: bool
    reason: str = ""
    gap: float | None = None  # the optimality gap the method's solver proved (an exact peer)


CSV_FIELDS = (
    "model",
    "constraint",
    "resident_floor_ratio",
    "memory_ratio",
    "memory_above_floor_ratio",
    "latency_ratio",
    "satisfied",
    "states_explored",
    "seconds",
    "states_per_second",
    "exploring_states_per_second",
    "reason",
    "baseline_method",
    "baseline_memory_ratio",
    "baseline_latency_ratio",
    "baseline_satisfied",
    "exact_memory_ratio",
    "exact_latency_ratio",
    "exact_gap",
)


@dataclass
class ModelResult:
    """One model: its program order and, per constraint, MAGIS's result and the best baseline's."""

    model: str
    program_peak_bytes: int = 0
    program_latency_s: float = 0.0
    nodes: int = 0
    capture_seconds: float = 0.0
    resident_bytes: int = 0  # the program order's floor: weights, optimizer state, inputs
    searched: dict[str, Searched] = field(default_factory=dict)
    chosen: dict[str, Chosen] = field(default_factory=dict)
    exact: dict[str, Chosen] = field(default_factory=dict)  # the exact peer's own point
    failures: list[str] = field(default_factory=list)  # cells that raised

    def rows(self) -> list[dict[str, Any]]:
        return [self._row(c.label) for c in CORPUS_CONSTRAINTS if self._has(c.label)]

    def _has(self, label: str) -> bool:
        return label in self.searched or label in self.chosen

    def _row(self, label: str) -> dict[str, Any]:
        s, b, x = self.searched.get(label), self.chosen.get(label), self.exact.get(label)
        floor = self.floor_ratio
        return {
            "model": self.model,
            "constraint": label,
            "resident_floor_ratio": floor,
            "memory_ratio": s.memory_ratio if s else None,
            "memory_above_floor_ratio": (
                above_floor(s.memory_ratio, floor) if s and s.memory_ratio is not None else None
            ),
            "latency_ratio": s.latency_ratio if s else None,
            "satisfied": s.satisfied if s else None,
            "states_explored": s.states_explored if s else None,
            "seconds": s.seconds if s else None,
            "states_per_second": s.states_per_second if s else None,
            "exploring_states_per_second": s.exploring_states_per_second if s else None,
            "breakdown": dict(s.breakdown) if s else {},
            "reason": s.reason if s else "",
            "baseline_method": b.method if b else None,
            "baseline_memory_ratio": b.memory_ratio if b else None,
            "baseline_latency_ratio": b.latency_ratio if b else None,
            "baseline_satisfied": b.satisfied if b else None,
            "baseline_reason": b.reason if b else "",
            "exact_memory_ratio": x.memory_ratio if x else None,
            "exact_latency_ratio": x.latency_ratio if x else None,
            "exact_gap": x.gap if x else None,
        }

    @property
    def floor_ratio(self) -> float | None:
        """The resident bytes over the program order's peak (None before a cell reported)."""
        return floor_ratio(self.resident_bytes, self.program_peak_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "program_peak_bytes": self.program_peak_bytes,
            "resident_bytes": self.resident_bytes,
            "program_latency_s": self.program_latency_s,
            "nodes": self.nodes,
            "capture_seconds": self.capture_seconds,
            "failures": self.failures,
            "constraints": self.rows(),
        }


@dataclass
class CorpusReport:
    options: CorpusOptions
    models: list[ModelResult] = field(default_factory=list)
    interrupted: bool = False
    seconds: float = 0.0

    def rows(self) -> list[dict[str, Any]]:
        return [r for m in self.models for r in m.rows()]

    def to_json(self) -> dict[str, Any]:
        o = self.options
        return {
            "hardware": o.hardware,
            "step": o.step.value,
            "size": o.size,
            "time_budget_s": o.time_budget,
            "max_states": o.max_states,
            "baselines": list(o.baselines()),
            "constraints": [c.label for c in CORPUS_CONSTRAINTS],
            "interrupted": self.interrupted,
            "seconds": self.seconds,
            "out": str(o.out),
            "models": [m.to_json() for m in self.models],
        }


# --- files -----------------------------------------------------------------------------------


def write_outputs(report: CorpusReport, figure: bool = True) -> None:
    """results.csv, results.json, table.md and the figure, each rewritten whole (atomically)."""
    out = report.options.out
    out.mkdir(parents=True, exist_ok=True)
    _atomic(out / "results.csv", _csv_text(report.rows()))
    _atomic(out / "results.json", json.dumps(report.to_json(), indent=2, default=str) + "\n")
    _atomic(out / "table.md", table_markdown(report))
    if figure:
        bar_rows = [r for m in report.models for r in _bar_rows(m)]
        models = [m.model for m in report.models if m.rows()]
        if bar_rows:
            plots.constraint_bars(
                bar_rows, models, ["magis", BEST_BASELINE], CORPUS_CONSTRAINTS, out / FIGURE
            )


@dataclass(frozen=True)
class _BarRow:
    workload: str
    method: str
    constraint: str
    memory_ratio: float | None
    latency_ratio: float | None
    satisfied: bool


def _bar_rows(model: ModelResult) -> list[_BarRow]:
    rows = [
        _BarRow(model.model, "magis", s.constraint, s.memory_ratio, s.latency_ratio, s.satisfied)
        for s in model.searched.values()
    ]
    rows += [
        _BarRow(
            model.model, BEST_BASELINE, b.constraint, b.memory_ratio, b.latency_ratio, b.satisfied
        )
        for b in model.chosen.values()
    ]
    return rows


def _csv_text(rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: "" if r[k] is None else r[k] for k in CSV_FIELDS})
    return buffer.getvalue()


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def table_cells(report: CorpusReport) -> tuple[list[str], list[list[str]]]:
    """The table's header and one row of cells per model: MAGIS and the best baseline under
    each constraint (memory ratio under the latency limit, latency overhead under the memory
    limit). Beside the nodes, the resident floor (weights, optimizer state, inputs) over the
    program order's peak; beside a memory ratio, in brackets, the part of its peak above that
    floor over the program order's (below 0: under the floor)."""
    header = ["model", "nodes", "resident floor"]
    exact = any(m.exact for m in report.models)
    for c in CORPUS_CONSTRAINTS:
        header += [f"magis {c.label}", f"best baseline {c.label}"]
        header += [f"{EXACT_PEER} {c.label} (gap)"] if exact else []
    body = []
    for m in report.models:
        floor = m.floor_ratio
        cells = [m.model, str(m.nodes or "—"), "—" if floor is None else f"{floor:.3f}"]
        for c in CORPUS_CONSTRAINTS:
            s, b = m.searched.get(c.label), m.chosen.get(c.label)
            cells.append(
                _cell(c, s.satisfied, s.memory_ratio, s.latency_ratio, floor) if s else "—"
            )
            if b is None:
                cells.append("—")
            else:
                text = _cell(c, b.satisfied, b.memory_ratio, b.latency_ratio, floor)
                cells.append(f"{text} ({b.method})" if b.satisfied else text)
            if exact:
                cells.append(_exact_cell(c, m.exact.get(c.label), floor))
        body.append(cells)
    return header, body


def _exact_cell(c: Constraint, x: Chosen | None, floor: float | None) -> str:
    """The exact peer's point under `c`, with the gap its solver proved."""
    if x is None:
        return "—"
    text = _cell(c, x.satisfied, x.memory_ratio, x.latency_ratio, floor)
    return text if x.gap is None or not x.satisfied else f"{text} (gap {x.gap:.1%})"


def _cell(
    c: Constraint,
    satisfied: bool,
    memory: float | None,
    latency: float | None,
    floor: float | None = None,
) -> str:
    if not satisfied or memory is None or latency is None:
        return "FAILURE"
    if c.mode is Mode.LATENCY_LIMIT:
        above = above_floor(memory, floor)
        return f"{memory:.3f}" + ("" if above is None else f" [{above:.3f}]")
    return f"{(latency - 1) * 100:+.1f}%"


def table_markdown(report: CorpusReport) -> str:
    o = report.options
    budget = f"{o.time_budget:g} s" + (f", {o.max_states} states" if o.max_states else "")
    lines = [
        f"# magis bench corpus ({o.hardware}, {o.size} size, {o.step.value} step, MAGIS {budget}"
        " per search)",
        "",
        "Memory ratio under the latency limit, latency overhead under the memory limit; both "
        "against PyTorch's program order on the same cost model. The resident floor is the "
        "weights', optimizer state's and inputs' bytes over the program order's peak; in "
        "brackets, the part of a peak above that floor over the program order's.",
    ]
    if report.interrupted:
        lines.append("\n**Interrupted**: the table holds what finished.")
    header, body = table_cells(report)
    lines += ["", _md(header), _md(["---"] * len(header)), *(_md(r) for r in body)]
    failures = [
        f"- {m.model} / {r['constraint']}: {r['reason'] or r['baseline_reason']}"
        for m in report.models
        for r in m.rows()
        if r["reason"] or (r["baseline_reason"] and not r["baseline_satisfied"])
    ] + [f"- {f}" for m in report.models for f in m.failures]
    if failures:
        lines += ["", "## FAILURE reasons", "", *failures]
    return "\n".join(lines) + "\n"


def _md(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
