"""`magis layout` and `magis run --layout`: every tensor of a schedule at an offset in one arena
(ROAM §IV-B), and the step executed inside that arena."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from magis.backend.arena import compile_arena_program, cuda_peaks
from magis.capture import Step, workload_step
from magis.commands.shared import Progress, silent, verify_and_measure
from magis.errors import MagisError
from magis.ir import Graph
from magis.layout import LayoutMethod, check_layout, plan_layout
from magis.plan import Plan
from magis.schedule import Scheduler, schedule


@dataclass(frozen=True)
class LayoutReport:
    """`magis layout`: an offset for every tensor of a schedule, and how much the arena wastes."""

    workload: str
    schedule: str  # "program", "dp", or "plan FILE"
    method: str
    storages: int
    theoretical_peak_bytes: int  # non-resident bytes alive together at most (ROAM's Tp)
    arena_bytes: int
    fragmentation: float  # (arena - theoretical peak) / theoretical peak
    llfb_arena_bytes: int
    llfb_fragmentation: float
    resident_bytes: int  # weights, buffers, optimizer state, data: outside the arena
    pieces: int
    pieces_solved: int  # pieces CP-SAT ran on (the rest met the bound greedily)
    pieces_optimal: int
    fell_back_to_llfb: bool
    seconds: float  # the layout alone
    capture_seconds: float
    schedule_seconds: float
    total_seconds: float

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Ordered:
    """A graph and the schedule a layout is made for."""

    graph: Graph
    order: list[int]
    label: str  # "program", "dp", or "plan FILE"
    seconds: float  # reading the plan, or scheduling


def order_for(step: Step, scheduler: str, plan: str | Path | None, progress: Progress) -> Ordered:
    """The step re-ordered by `scheduler`, or the saved plan at `plan` (checked to fit it)."""
    start = time.perf_counter()
    if plan is not None:
        progress("reading the plan")
        saved = Plan.load(plan)
        saved.check_matches(step)
        label = f"plan {Path(plan).name}"
        return Ordered(saved.graph, list(saved.order), label, time.perf_counter() - start)
    kind = Scheduler.parse(scheduler)
    if kind is Scheduler.PROGRAM:
        return Ordered(step.graph, step.graph.program_order(), kind.value, 0.0)
    progress(f"scheduling ({kind.value})")
    order = list(schedule(step.graph, kind).order)
    return Ordered(step.graph, order, kind.value, time.perf_counter() - start)


def layout(
    workload: str,
    method: str = "exact",
    scheduler: str = "program",
    plan: str | Path | None = None,
    batch: int | None = None,
    progress: Progress = silent,
) -> LayoutReport:
    """Capture `workload`, order it (program order, a scheduler, or a saved plan) and lay out
    its tensors in one arena with `method` (ROAM §IV-B)."""
    kind = LayoutMethod.parse(method)  # bad names fail before any work
    Scheduler.parse(scheduler)
    start = time.perf_counter()
    progress("capturing")
    # a plan is made for the step `magis optimize` captures: tiny workloads in float64
    _, step = workload_step(workload, batch, float64_when_tiny=plan is not None)
    capture_s = time.perf_counter() - start
    ordered = order_for(step, scheduler, plan, progress)
    progress(f"laying out ({kind.value})")
    lay = plan_layout(ordered.graph, ordered.order, kind)
    peak = lay.theoretical_peak_bytes
    return LayoutReport(
        workload=workload,
        schedule=ordered.label,
        method=kind.value,
        storages=len(lay.lifetimes),
        theoretical_peak_bytes=peak,
        arena_bytes=lay.arena_bytes,
        fragmentation=lay.fragmentation,
        llfb_arena_bytes=lay.llfb_arena_bytes,
        llfb_fragmentation=(lay.llfb_arena_bytes - peak) / peak if peak else 0.0,
        resident_bytes=resident_bytes(ordered.graph),
        pieces=len(lay.pieces),
        pieces_solved=lay.pieces_solved,
        pieces_optimal=lay.pieces_optimal,
        fell_back_to_llfb=lay.fell_back_to_llfb,
        seconds=lay.seconds,
        capture_seconds=capture_s,
        schedule_seconds=ordered.seconds,
        total_seconds=time.perf_counter() - start,
    )


@dataclass(frozen=True)
class LayoutRunReport:
    """`magis run --layout`: the step executed inside one preallocated arena."""

    workload: str
    dtype: str
    schedule: str
    method: str
    verified: bool
    max_rel_err: float
    worst_value: str
    tolerance: float
    theoretical_peak_bytes: int
    arena_bytes: int  # planned
    fragmentation: float
    measured_peak_bytes: int  # dispatch tracker: residents + arena + transients
    resident_bytes: int
    measured_nonresident_bytes: int  # measured peak - residents: arena + transients
    copied_ops: int  # ops without an out= overload: computed, then copied into their slot
    transient_bytes: int  # the largest result such an op allocates before its copy
    wrapped_ops: int  # out= overloads PyTorch runs as compute-then-copy (hidden temporaries)
    hidden_bytes: int  # the largest temporary those can hide from the tracker
    latency_s: float  # measured wall time of one step in the arena (median)
    device: str
    cuda_reserved_peak_bytes: int | None  # caching allocator, same plan without the arena
    cuda_allocated_peak_bytes: int | None
    cuda_arena_reserved_peak_bytes: int | None  # caching allocator, with the arena
    seconds: float

    def to_json(self) -> dict:
        return asdict(self)


def run_layout(
    workload: str,
    method: str = "exact",
    scheduler: str = "program",
    plan: str | Path | None = None,
    progress: Progress = silent,
    repeats: int = 5,
    seed: int = 0,
) -> LayoutRunReport:
    """Execute a :tiny or :small workload inside one arena laid out by `method`; verify it
    against eager PyTorch and measure it. With CUDA, also run the same plan on the GPU, with and
    without the arena, under the caching allocator."""
    if ":" not in workload or workload.endswith(":paper"):
        raise MagisError(f"{workload} is paper-size (fake tensors): run {workload}:tiny instead")
    start = time.perf_counter()
    progress("capturing")
    _, step = workload_step(workload, float64_when_tiny=True)
    ordered = order_for(step, scheduler, plan, progress)
    graph, order = ordered.graph, ordered.order
    progress(f"laying out ({method})")
    lay = plan_layout(graph, order, method)
    check_layout(lay)
    progress("generating code")
    program = compile_arena_program(graph, order, lay)
    ran = verify_and_measure(step, program.program, progress, repeats=repeats, seed=seed)
    measured = ran.measurement
    cuda = cuda_peaks(graph, order, lay, ran.program_inputs) if torch.cuda.is_available() else None
    return LayoutRunReport(
        workload=workload,
        dtype=ran.dtype_name,
        schedule=ordered.label,
        method=lay.method.value,
        verified=ran.verification.verified,
        max_rel_err=ran.verification.max_rel_err,
        worst_value=ran.verification.worst,
        tolerance=ran.tolerance,
        theoretical_peak_bytes=lay.theoretical_peak_bytes,
        arena_bytes=lay.arena_bytes,
        fragmentation=lay.fragmentation,
        measured_peak_bytes=measured.peak_bytes,
        resident_bytes=measured.resident_bytes,
        measured_nonresident_bytes=measured.peak_bytes - measured.resident_bytes,
        copied_ops=len(program.copied_ops),
        transient_bytes=program.transient_bytes,
        wrapped_ops=len(program.wrapped_ops),
        hidden_bytes=program.hidden_bytes,
        latency_s=measured.wall_s,
        device="cpu",
        cuda_reserved_peak_bytes=cuda.reserved if cuda else None,
        cuda_allocated_peak_bytes=cuda.allocated if cuda else None,
        cuda_arena_reserved_peak_bytes=cuda.arena_reserved if cuda else None,
        seconds=time.perf_counter() - start,
    )


def resident_bytes(graph: Graph) -> int:
    """Bytes of the storages that live outside the arena (weights, state, data)."""
    smap = graph.storages()
    return sum(smap.nbytes[s] for s in smap.resident)
