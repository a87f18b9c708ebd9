"""The comparison as independent cells, and the board that puts their rows back in order.

A cell is one workload x method (a baseline's points serve every constraint, so a baseline is
one cell), one MAGIS search (workload x constraint, or an extra Pareto search), or one
workload's micro-batching. Cells carry names and settings, not graphs (`magis.bench.parallel`):
whichever process runs one captures its workload there, once per process.

The board takes cell results in any order and lays the rows out as the serial run writes them:
workloads in the order asked, methods in the order asked, MAGIS's Pareto rows after its last
search, micro-batching last. A serial run and a parallel one therefore write the same files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from magis.bench.compare_report import CompareOptions, CompareReport, Row, WorkloadResult
from magis.bench.constraints import CONSTRAINTS, MAGIS, MICROBATCH, PARETO, Constraint
from magis.bench.parallel import CellFailure
from magis.capture.step_kinds import DEFAULT_STEP, StepKind
from magis.search import Mode

Record = tuple[int, float, str]  # an improvement: memory, latency, the search's constraint


@dataclass(frozen=True)
class CompareCell:
    workload: str
    hardware: str
    method: str  # a baseline's name, MAGIS, or MICROBATCH
    constraint: Constraint | None = None  # MAGIS: the search's constraint
    time_budget: float = 0.0  # MAGIS: seconds
    factors: tuple[int, ...] = ()  # MICROBATCH: the micro-batch counts
    step: StepKind = DEFAULT_STEP  # the training step captured (`--step`)

    def describe(self) -> str:
        if self.method == MAGIS and self.constraint is not None:
            return f"{self.workload}: magis {self.constraint.label} ({self.time_budget:g} s)"
        if self.method == MICROBATCH:
            return f"{self.workload}: micro-batching"
        return f"{self.workload}: {self.method}"

    @property
    def in_table(self) -> bool:
        """Whether the cell has a row of its own (an extra Pareto search has none)."""
        return self.method != MAGIS or self.constraint in CONSTRAINTS


@dataclass(frozen=True)
class CellResult:
    """What a cell sends back: the workload's program-order figures (every ratio's
    denominator), its rows, and for a MAGIS search its improvements (memory, latency, label)."""

    program_peak_bytes: int
    program_latency_s: float
    resident_bytes: int  # the program order's floor: weights, optimizer state, inputs
    rows: tuple[Row, ...]
    records: tuple[Record, ...] = ()
    interrupted: bool = False  # Ctrl-C reached the search (serial runs only)


def compare_cells(options: CompareOptions) -> list[CompareCell]:
    """Every cell of the run, in the serial run's order."""
    cells = []
    step = options.step
    magis = [
        *CONSTRAINTS,
        *(Constraint(Mode.MEMORY_LIMIT, r) for r in options.pareto_memory_ratios),
    ]
    for w in options.workloads:
        for method in options.all_methods():
            if method == MAGIS:
                cells += [
                    CompareCell(w, options.hardware, MAGIS, c, options.time_budget, step=step)
                    for c in magis
                ]
            else:
                cells.append(CompareCell(w, options.hardware, method, step=step))
        if options.microbatch.covers(w):
            cells.append(
                CompareCell(
                    w, options.hardware, MICROBATCH, factors=options.microbatch_factors, step=step
                )
            )
    return cells


def failure_rows(cell: CompareCell, reason: str) -> tuple[Row, ...]:
    """The FAILURE rows of a cell that raised or whose worker died."""
    if cell.method == MICROBATCH:
        labels = [MICROBATCH]
    elif cell.method == MAGIS:
        labels = [cell.constraint.label] if cell.in_table else []
    else:
        labels = [c.label for c in CONSTRAINTS]
    return tuple(
        Row(cell.workload, cell.method, c, None, None, None, None, False, reason) for c in labels
    )


@dataclass
class Board:
    """The report as cell results arrive, rows in the serial run's order."""

    report: CompareReport
    cells: Sequence[CompareCell]
    results: dict[int, CellResult] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # per workload: its cells' time

    def add(self, index: int, result: CellResult | CellFailure, seconds: float) -> str:
        """Record one cell's result; the workload's name."""
        cell = self.cells[index]
        if isinstance(result, CellFailure):
            result = CellResult(0, 0.0, 0, failure_rows(cell, result.reason))
        self.results[index] = result
        self.seconds[cell.workload] = self.seconds.get(cell.workload, 0.0) + seconds
        self._lay_out(cell.workload)
        return cell.workload

    def complete(self, workload: str) -> bool:
        return all(i in self.results for i, c in enumerate(self.cells) if c.workload == workload)

    def _lay_out(self, workload: str) -> None:
        mine = [(i, c) for i, c in enumerate(self.cells) if c.workload == workload]
        done = [self.results[i] for i, _ in mine if i in self.results]
        measured = [r for r in done if r.program_peak_bytes]
        result = WorkloadResult(
            workload,
            measured[0].program_peak_bytes if measured else 0,
            measured[0].program_latency_s if measured else 0.0,
            measured[0].resident_bytes if measured else 0,
        )
        magis = [i for i, c in mine if c.method == MAGIS]
        for i, _ in mine:
            if i in self.results:
                result.rows.extend(self.results[i].rows)
            if magis and i == magis[-1] and all(j in self.results for j in magis) and measured:
                records = [rec for j in magis for rec in self.results[j].records]
                result.rows.extend(magis_pareto_rows(result, records))
        result.seconds = self.seconds[workload]
        result.complete = self.complete(workload)
        self._place(result)

    def _place(self, result: WorkloadResult) -> None:
        order = list(self.report.options.workloads)
        kept = [w for w in self.report.workloads if w.workload != result.workload]
        self.report.workloads[:] = sorted([*kept, result], key=lambda w: order.index(w.workload))


def magis_pareto_rows(result: WorkloadResult, records: Sequence[Record]) -> list[Row]:
    """MAGIS's Pareto curve (Fig. 11): the front of the program order and every improvement
    any of its searches on this workload recorded; each point is a program a search built."""
    peak, latency = result.program_peak_bytes, result.program_latency_s
    everything = [(peak, latency, "program"), *records]
    return [
        Row(result.workload, MAGIS, PARETO, m / peak, lat / latency, int(m), float(lat), True,
            "", {"search": src})
        for m, lat, src in front(everything)
    ]  # fmt: skip


def front(records: Sequence[Record]) -> list[Record]:
    """The records no other beats in both memory and latency (a latency within 1e-9 relative
    of a smaller-memory record's is a tie: summation order, not a faster program)."""
    kept: list[Record] = []
    for rec in sorted(records, key=lambda r: (r[0], r[1])):
        if not kept or rec[1] < kept[-1][1] * (1 - 1e-9):
            kept.append(rec)
    return kept
