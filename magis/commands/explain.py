"""`magis explain` and `magis.explain`: a saved plan's decisions, one row each (issue #17).

The rows come from the decision trail the plan keeps (`magis.explain`); the command can also
hand the plan's schedule to the report's exporters, as a Chrome/Perfetto trace and as a PyTorch
memory snapshot, so that a row's tensors can be found on the timeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from magis.commands.shared import cost_model
from magis.cost import CostModel
from magis.errors import MagisError
from magis.explain import SORTS, Explanation, Row, explain
from magis.plan import Plan


@dataclass(frozen=True)
class ExplainReport:
    """A plan's explanation, the view asked for, and the files written beside it."""

    plan_path: Path
    explanation: Explanation
    sort: str
    trace_path: Path | None = None
    snapshot_path: Path | None = None

    @property
    def rows(self) -> tuple[Row, ...]:
        return self.explanation.sorted_rows(self.sort)

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": str(self.plan_path),
            "sort": self.sort,
            **self.explanation.to_json(),
            "rows": [r.to_json() for r in self.rows],
            "trace": None if self.trace_path is None else str(self.trace_path),
            "snapshot": None if self.snapshot_path is None else str(self.snapshot_path),
        }


def explain_plan(
    plan_path: str | Path,
    sort: str = "program",
    *,
    export_trace: str | Path | None = None,
    export_snapshot: str | Path | None = None,
    hardware: str | CostModel | None = None,
) -> ExplainReport:
    """Load the plan at `plan_path` and explain it, rows in `sort` order (program, bytes or
    time); write its simulated timeline to `export_trace` (Chrome trace JSON) and its memory to
    `export_snapshot` (PyTorch memory snapshot) when given, timed by `hardware` (default: the
    cost model the plan was made with)."""
    if sort not in SORTS:
        raise MagisError(f"unknown sort {sort!r}: use {', '.join(SORTS)}")
    plan = Plan.load(plan_path)
    explanation = explain(plan)
    trace = Path(export_trace) if export_trace is not None else None
    snapshot = Path(export_snapshot) if export_snapshot is not None else None
    if trace is not None or snapshot is not None:
        _export(plan, cost_model(hardware or plan.summary.hardware), trace, snapshot)
    return ExplainReport(Path(plan_path), explanation, sort, trace, snapshot)


def _export(plan: Plan, cost: CostModel, trace: Path | None, snapshot: Path | None) -> None:
    from magis.report.timeline import write_chrome_trace, write_memory_snapshot  # json, pickle

    if trace is not None:
        write_chrome_trace(trace, [("plan", plan.graph, plan.order)], cost)
    if snapshot is not None:
        write_memory_snapshot(snapshot, plan.graph, plan.order, cost)
