"""The Python API behind the `magis` command: analyze a step, run it back and verify it.

Each function returns a plain dataclass whose `to_json()` is what `--json PATH` writes: byte
counts in bytes, times in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from magis.backend import compile_program, measure, verify
from magis.capture import Step, workload_step
from magis.cost import CostModel, get_cost_model
from magis.ir import PlaceholderKind
from magis.sim import SimResult, simulate

Progress = Callable[[str], None]  # told the name of each stage as it starts


def _nothing(stage: str) -> None:
    return None


@dataclass
class AnalyzeReport:
    workload: str
    hardware: str
    nodes: int
    ops: int
    distinct_ops: int
    weight_bytes: int
    peak_bytes: int
    latency_s: float
    breakdown: dict[str, int]
    hotspots: list[dict]
    seconds: float  # capture + analysis
    capture_seconds: float
    opaque_ops: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class RunReport:
    workload: str
    dtype: str
    verified: bool
    max_rel_err: float
    worst_value: str
    tolerance: float
    measured_peak_bytes: int
    simulated_peak_bytes: int
    peak_error: float  # |simulated - measured| / measured
    latency_s: float  # measured wall time of one step (median)
    simulated_latency_s: float  # by `hardware` (the profiled CPU model by default)
    hardware: str
    seconds: float

    def to_json(self) -> dict:
        return asdict(self)


def weight_bytes(step: Step) -> int:
    g = step.graph
    return sum(g.node(p).outputs[0].nbytes for p in g.placeholders(PlaceholderKind.WEIGHT))


def hotspot_rows(sim: SimResult, k: int = 10) -> list[dict]:
    return [
        {
            "name": h.name,
            "op": h.op,
            "bytes": h.nbytes,
            "shape": list(h.shape),
            "category": h.category.value,
        }
        for h in sim.top_hotspots(k)
    ]


def opaque_ops(step: Step) -> list[str]:
    """Ops of the graph the registry has no entry for (costed generically, still executed)."""
    g = step.graph
    return sorted({g.node(n).op for n in g.ops() if g.info(n).opaque})


def prepare_cost(name: str, step: Step, progress: Progress = _nothing, **kw) -> CostModel:
    """The cost model `name`; a profiled one measures the step's distinct ops first."""
    cost = get_cost_model(name, **kw)
    profile = getattr(cost, "profile_graph", None)
    if profile is not None:
        progress("profiling operators")
        profile(step.graph)
    return cost


def analyze_step(
    step: Step,
    name: str,
    hardware: str = "rtx3090",
    progress: Progress = _nothing,
    capture_seconds: float = 0.0,
) -> AnalyzeReport:
    """Simulate the captured program order of `step` on `hardware`."""
    start = time.perf_counter()
    cost = prepare_cost(hardware, step, progress)
    progress("simulating")
    sim = simulate(step.graph, step.graph.program_order(), cost)
    summary = step.graph.summary()
    return AnalyzeReport(
        workload=name,
        hardware=hardware,
        nodes=summary["nodes"],
        ops=summary["ops"],
        distinct_ops=summary["distinct_ops"],
        weight_bytes=weight_bytes(step),
        peak_bytes=sim.peak_bytes,
        latency_s=sim.latency_s,
        breakdown=sim.breakdown,
        hotspots=hotspot_rows(sim),
        seconds=capture_seconds + time.perf_counter() - start,
        capture_seconds=capture_seconds,
        opaque_ops=opaque_ops(step),
    )


def analyze(
    workload: str,
    hardware: str = "rtx3090",
    batch: int | None = None,
    progress: Progress = _nothing,
) -> AnalyzeReport:
    """Capture workload `workload` (paper size unless `:tiny`/`:small`) and analyze it."""
    progress("capturing")
    start = time.perf_counter()
    _, step = workload_step(workload, batch)
    return analyze_step(step, workload, hardware, progress, time.perf_counter() - start)


def run_step(
    step: Step,
    name: str,
    hardware: str = "cpu",
    tolerance: float | None = None,
    progress: Progress = _nothing,
    repeats: int = 10,
    seed: int = 0,
) -> RunReport:
    """Execute `step`'s program order as generated code; verify it and measure it."""
    start = time.perf_counter()
    graph = step.graph
    order = graph.program_order()
    progress("generating code")
    program = compile_program(graph, order)
    inputs = step.make_inputs(seed=seed)
    dtype = _float_dtype(step)
    tol = tolerance if tolerance is not None else (1e-9 if dtype == torch.float64 else 1e-4)
    progress("verifying against eager PyTorch")
    check = verify(step, program, inputs, tolerance=tol, seed=seed)
    progress("measuring")
    measured = measure(program, step.program_inputs(inputs), repeats=repeats, seed=seed)
    cost = prepare_cost(hardware, step, progress)
    sim = simulate(graph, order, cost)
    return RunReport(
        workload=name,
        dtype=str(dtype).removeprefix("torch."),
        verified=check.verified,
        max_rel_err=check.max_rel_err,
        worst_value=check.worst,
        tolerance=tol,
        measured_peak_bytes=measured.peak_bytes,
        simulated_peak_bytes=sim.peak_bytes,
        peak_error=abs(sim.peak_bytes - measured.peak_bytes) / max(measured.peak_bytes, 1),
        latency_s=measured.wall_s,
        simulated_latency_s=sim.latency_s,
        hardware=hardware,
        seconds=time.perf_counter() - start,
    )


def run(
    workload: str,
    hardware: str = "cpu",
    dtype: torch.dtype | None = None,
    progress: Progress = _nothing,
) -> RunReport:
    """Capture a `:tiny` or `:small` workload with real tensors, execute it and verify it.

    Tiny workloads run in float64 so that verification can be tight (DESIGN principle 1).
    """
    progress("capturing")
    if dtype is None and workload.endswith(":tiny"):
        dtype = torch.float64
    _, step = workload_step(workload, dtype=dtype, real=True)
    return run_step(step, workload, hardware, progress=progress)


def _float_dtype(step: Step) -> torch.dtype:
    g = step.graph
    for p in g.placeholders(PlaceholderKind.WEIGHT) or g.placeholders():
        dt = g.node(p).outputs[0].torch_dtype
        if dt.is_floating_point:
            return dt
    return torch.get_default_dtype()
