"""`magis schedule`: one scheduler on one workload, against the captured program order."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from magis.capture import Step, workload_step
from magis.commands.shared import Progress, prepare_cost, silent
from magis.cost import CostModel
from magis.schedule import Scheduler, peak_lower_bound, schedule
from magis.sim import simulate


@dataclass(frozen=True)
class ScheduleReport:
    workload: str
    scheduler: str
    hardware: str
    nodes: int
    peak_bytes: int
    program_peak_bytes: int
    peak_ratio: float  # peak_bytes / program_peak_bytes
    lower_bound_bytes: int  # live at some step in every order: no schedule goes below it
    latency_s: float  # simulated; re-ordering leaves it unchanged without Store/Load
    program_latency_s: float
    segments: int
    exact_segments: int  # segments the DP proved optimal
    largest_segment: int  # units
    seconds: float  # the scheduler's wall time
    capture_seconds: float
    total_seconds: float  # capture + scheduling + simulation

    def to_json(self) -> dict:
        return asdict(self)


def schedule_step(
    step: Step,
    name: str,
    scheduler: str = "dp",
    hardware: str | CostModel = "rtx3090",
    budget: int | None = None,
    progress: Progress = silent,
    capture_seconds: float = 0.0,
) -> ScheduleReport:
    """Schedule `step`'s graph with `scheduler` and simulate it against the program order."""
    start = time.perf_counter()
    kind = Scheduler.parse(scheduler)  # a bad name fails before any work
    graph = step.graph
    cost = prepare_cost(hardware, graph, progress)
    progress("simulating program order")
    base = simulate(graph, graph.program_order(), cost)
    progress(f"scheduling ({kind.value})")
    res = schedule(graph, kind) if budget is None else schedule(graph, kind, budget=budget)
    sim = simulate(graph, res.order, cost)
    return ScheduleReport(
        workload=name,
        scheduler=kind.value,
        hardware=cost.name,
        nodes=len(graph),
        peak_bytes=sim.peak_bytes,
        program_peak_bytes=base.peak_bytes,
        peak_ratio=sim.peak_bytes / base.peak_bytes,
        lower_bound_bytes=peak_lower_bound(graph),
        latency_s=sim.latency_s,
        program_latency_s=base.latency_s,
        segments=len(res.segments),
        exact_segments=res.exact_segments,
        largest_segment=max((s.units for s in res.segments), default=0),
        seconds=res.seconds,
        capture_seconds=capture_seconds,
        total_seconds=capture_seconds + time.perf_counter() - start,
    )


def schedule_workload(
    workload: str,
    scheduler: str = "dp",
    hardware: str | CostModel = "rtx3090",
    batch: int | None = None,
    budget: int | None = None,
    progress: Progress = silent,
) -> ScheduleReport:
    """Capture `workload` and re-order its training step (MAGIS §5.2, §6.1)."""
    Scheduler.parse(scheduler)  # a bad name fails before the capture
    progress("capturing")
    start = time.perf_counter()
    _, step = workload_step(workload, batch)
    return schedule_step(
        step, workload, scheduler, hardware, budget, progress, time.perf_counter() - start
    )
