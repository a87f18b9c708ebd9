"""`magis analyze`: a workload's training step simulated in program order, and its F-Tree."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from magis.analyze import FTree, build_ftree
from magis.capture import DEFAULT_STEP, Step, StepKind, workload_step
from magis.commands.shared import Progress, prepare_cost, silent
from magis.cost import CostModel
from magis.ir import Graph, PlaceholderKind
from magis.rules import prepare
from magis.sim import SimResult, simulate


@dataclass(frozen=True)
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
    ftree: list[dict] | None = None  # `--ftree`: the F-Tree's nodes (MAGIS §4.3), see ftree_rows
    ftree_seconds: float | None = None  # preparing the graph and building the F-Tree

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


def analyze_step(
    step: Step,
    name: str,
    hardware: str | CostModel = "rtx3090",
    progress: Progress = silent,
    capture_seconds: float = 0.0,
) -> AnalyzeReport:
    """Simulate the captured program order of `step` on `hardware`."""
    start = time.perf_counter()
    cost = prepare_cost(hardware, step.graph, progress)
    progress("simulating")
    sim = simulate(step.graph, step.graph.program_order(), cost)
    summary = step.graph.summary()
    return AnalyzeReport(
        workload=name,
        hardware=cost.name,
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
    hardware: str | CostModel = "rtx3090",
    batch: int | None = None,
    progress: Progress = silent,
    ftree: bool = False,
    max_level: int = 4,
    export_trace: Path | None = None,
    export_snapshot: Path | None = None,
    step: StepKind | str = DEFAULT_STEP,
) -> AnalyzeReport:
    """Capture workload `workload` (paper size unless `:tiny`/`:small`) and analyze it; with
    `ftree`, also build its F-Tree (MAGIS Alg. 1, max-level `max_level`); with `export_trace`
    or `export_snapshot`, write its schedule there (`magis.commands.export`)."""
    progress("capturing")
    start = time.perf_counter()
    _, captured = workload_step(workload, batch, step=step)
    rep = analyze_step(captured, workload, hardware, progress, time.perf_counter() - start)
    if export_trace is not None or export_snapshot is not None:
        from magis.commands.export import export_timelines

        cost = prepare_cost(hardware, captured.graph, progress)
        export_timelines(captured.graph, cost, export_trace, export_snapshot, progress)
    if not ftree:
        return rep
    progress("building the F-Tree")
    t0 = time.perf_counter()
    graph, tree = fission_tree(captured, max_level)
    seconds = time.perf_counter() - t0
    return replace(
        rep, ftree=ftree_rows(graph, tree), ftree_seconds=seconds, seconds=rep.seconds + seconds
    )


def fission_tree(step: Step, max_level: int = 4) -> tuple[Graph, FTree]:
    """(prepared graph, F-Tree): the step's graph with the loss opened to fission
    (`magis.rules.fission.prepare`) and its fission hierarchy tree (MAGIS Alg. 1)."""
    graph = prepare(step.graph)
    return graph, build_ftree(graph, max_level=max_level)


def ftree_rows(graph: Graph, tree: FTree) -> list[dict]:
    """One JSON row per F-Tree node: sub-graph size, dimension, length, score (bytes)."""
    rows = []
    for i, x in enumerate(tree.nodes):
        dom = "<entry>" if x.dominator < 0 else graph.node(x.dominator).name
        rows.append(
            {
                "index": i,
                "parent": x.parent,
                "size": x.size,
                "dim": x.dim,
                "length": x.length,
                "score_bytes": x.score,
                "heat_bytes": x.heat,
                "level": x.level,
                "dominator": dom,
                "n": x.n,
            }
        )
    return rows
