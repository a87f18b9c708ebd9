"""`magis run`: execute a step as generated code (program order, a saved plan, or with F-Tree
nodes enabled), verify it against eager PyTorch and measure it beside the simulator."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from magis.analyze import FTree
from magis.backend import compile_program
from magis.capture import DEFAULT_STEP, Step, StepKind, workload_step
from magis.commands.analyze import fission_tree
from magis.commands.device import check_device, check_fits
from magis.commands.shared import Progress, prepare_cost, silent, verify_and_measure
from magis.cost import CostModel
from magis.errors import MagisError
from magis.ir import Graph
from magis.plan import Plan
from magis.rules import materialize
from magis.sim import simulate, tensor_peak_bytes


@dataclass(frozen=True)
class RunReport:
    workload: str
    dtype: str
    verified: bool
    max_rel_err: float
    worst_value: str
    tolerance: float
    measured_peak_bytes: int
    # The simulated peak of the tensors, what the dispatch tracker measures (`peak_error`)
    simulated_peak_bytes: int
    peak_error: float  # |simulated - measured| / measured
    latency_s: float  # measured wall time of one step (median)
    simulated_latency_s: float  # by `hardware` (the profiled CPU model by default)
    hardware: str
    seconds: float
    device: str = "cpu"  # where the program and the eager reference ran
    fission: list[dict] | None = None  # `--fission`: the F-Tree nodes enabled, with their n
    # Swapped-out bytes at their peak, in the host pool (beside the device figures above).
    measured_host_peak_bytes: int = 0
    simulated_host_peak_bytes: int = 0
    # The simulated peak with each op's scratch added at its step (`CostModel.scratch_bytes`,
    # under a profiled `hardware`): what the allocator holds, which no tensor tracker sees
    simulated_scratch_peak_bytes: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def run_step(
    step: Step,
    name: str,
    hardware: str | CostModel = "cpu",
    tolerance: float | None = None,
    progress: Progress = silent,
    repeats: int = 10,
    seed: int = 0,
    graph: Graph | None = None,
    order: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> RunReport:
    """Execute `graph` in `order` (default: the step's own graph in program order, or a plan's)
    as generated code on `device`; verify it against the step run eagerly there, measure it,
    and simulate it on `hardware` for comparison."""
    start = time.perf_counter()
    device = torch.device(device)
    graph = step.graph if graph is None else graph
    order = graph.program_order() if order is None else list(order)
    progress("generating code")
    program = compile_program(graph, order, device)
    ran = verify_and_measure(step, program, progress, tolerance, repeats, seed, device)
    cost = prepare_cost(hardware, graph, progress)
    sim = simulate(graph, order, cost)
    tensors = tensor_peak_bytes(graph, order)
    measured = ran.measurement
    return RunReport(
        workload=name,
        dtype=ran.dtype_name,
        verified=ran.verification.verified,
        max_rel_err=ran.verification.max_rel_err,
        worst_value=ran.verification.worst,
        tolerance=ran.tolerance,
        measured_peak_bytes=measured.peak_bytes,
        simulated_peak_bytes=tensors,
        peak_error=abs(tensors - measured.peak_bytes) / max(measured.peak_bytes, 1),
        latency_s=measured.wall_s,
        simulated_latency_s=sim.latency_s,
        hardware=cost.name,
        seconds=time.perf_counter() - start,
        device=str(device),
        measured_host_peak_bytes=measured.host_peak_bytes,
        simulated_host_peak_bytes=sim.host_peak_bytes,
        simulated_scratch_peak_bytes=sim.peak_bytes,
    )


def run(
    workload: str,
    hardware: str | CostModel = "cpu",
    dtype: torch.dtype | None = None,
    progress: Progress = silent,
    fission: Sequence[int] | None = None,
    parts: int = 2,
    device: torch.device | str = "cpu",
    step: StepKind | str = DEFAULT_STEP,
) -> RunReport:
    """Capture a `:tiny` or `:small` workload's `step` with real tensors, execute it on
    `device` and verify it.

    Tiny workloads run in float64 so that verification can be tight (DESIGN principle 1).
    With `fission`, the F-Tree nodes of those indices (`magis analyze W --ftree`) are enabled
    with n = `parts` and the split program is what runs. A paper-size workload that would not
    fit in `device`'s available memory is refused before its model is built (`check_fits`).
    """
    device = check_device(device)
    check_fits(workload, device, progress, dtype)
    progress("capturing")
    _, captured = workload_step(workload, dtype=dtype, step=step, real=True, float64_when_tiny=True)
    if fission:
        return run_fission(captured, workload, fission, parts, hardware, progress, device)
    return run_step(captured, workload, hardware, progress=progress, device=device)


def run_plan(
    workload: str,
    plan_path: str | Path,
    hardware: str | CostModel = "cpu",
    progress: Progress = silent,
    device: torch.device | str = "cpu",
) -> RunReport:
    """Execute a saved plan on `workload` (a :tiny or :small variant) on `device`, verify and
    measure it."""
    device = check_device(device)
    progress("reading the plan")
    plan = Plan.load(plan_path)
    check_fits(workload, device, progress)
    progress("capturing")
    # the step the plan was made for (its summary says which kind)
    _, step = workload_step(workload, step=plan.summary.step, real=True, float64_when_tiny=True)
    plan.check_matches(step)
    return run_step(
        step,
        workload,
        hardware,
        progress=progress,
        graph=plan.graph,
        order=plan.order,
        device=device,
    )


def enable_nodes(tree: FTree, indices: Sequence[int], parts: int) -> FTree:
    """`tree` with nodes `indices` enabled with n = `parts`; a one-line MagisError otherwise."""
    if parts < 2:
        raise MagisError(f"--parts must be at least 2, got {parts}")
    for k in indices:
        if not 0 <= k < len(tree):
            raise MagisError(
                f"no F-Tree node {k}: the tree has {len(tree)} nodes (see magis analyze W --ftree)"
            )
        node = tree.nodes[k]
        if node.length % parts:
            divisors = ", ".join(map(str, node.divisors()))
            raise MagisError(
                f"F-Tree node {k} has length {node.length}: --parts must divide it ({divisors})"
            )
        tree = tree.with_n(k, parts)
    return tree


def run_fission(
    step: Step,
    name: str,
    fission: Sequence[int],
    parts: int = 2,
    hardware: str | CostModel = "cpu",
    progress: Progress = silent,
    device: torch.device | str = "cpu",
) -> RunReport:
    """Run `step` with F-Tree nodes `fission` enabled (n = `parts`, MAGIS §4), materialized as a
    graph rewrite (`magis.rules.fission.materialize`); verified against eager PyTorch and
    measured as `run_step` does the program order."""
    progress("building the F-Tree")
    graph, tree = fission_tree(step)
    tree = enable_nodes(tree, fission, parts)
    progress("splitting")
    split = materialize(graph, tree)
    rep = run_step(
        replace(step, graph=split.graph), name, hardware, progress=progress, device=device
    )
    enabled = [
        {
            "index": k,
            "n": tree.nodes[k].n,
            "size": tree.nodes[k].size,
            "dim": tree.nodes[k].dim,
            "length": tree.nodes[k].length,
        }
        for k in split.applied
    ]
    return replace(rep, fission=enabled)
