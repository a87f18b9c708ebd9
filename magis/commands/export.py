"""`magis analyze --export-trace / --export-snapshot`: a step's schedules as the files that
Perfetto and PyTorch's memory_viz open (`magis.report.timeline`, issue #17)."""

from __future__ import annotations

from pathlib import Path

from magis.commands.shared import Progress, silent
from magis.cost import CostModel
from magis.ir import Graph
from magis.report.timeline import write_chrome_trace, write_memory_snapshot
from magis.schedule import Scheduler, schedule


def export_timelines(
    graph: Graph,
    cost: CostModel,
    trace: Path | None = None,
    snapshot: Path | None = None,
    progress: Progress = silent,
) -> None:
    """Write `graph`'s program order and DP order (MAGIS §6.1) as a Chrome trace at `trace`, and
    its program order as a PyTorch memory snapshot at `snapshot` (each when given)."""
    order = graph.program_order()
    if trace is not None:
        progress("scheduling (dp) for the trace")
        dp = schedule(graph, Scheduler.DP).order
        progress("writing the trace")
        write_chrome_trace(trace, [("program order", graph, order), ("dp order", graph, dp)], cost)
    if snapshot is not None:
        progress("writing the memory snapshot")
        write_memory_snapshot(snapshot, graph, order, cost)
