"""The Python API behind the `magis` command: analyze a step, run it back and verify it.

Each function returns a plain dataclass whose `to_json()` is what `--json PATH` writes: byte
counts in bytes, times in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from magis.backend import compile_program, measure, verify
from magis.capture import Step, workload_step
from magis.cost import CostModel, get_cost_model
from magis.ir import Graph, PlaceholderKind
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
    ftree: list[dict] | None = None  # `--ftree`: the F-Tree's nodes (MAGIS §4.3), see ftree_rows
    ftree_seconds: float | None = None  # preparing the graph and building the F-Tree

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
    fission: list[dict] | None = None  # `--fission`: the F-Tree nodes enabled, with their n
    # Swapped-out bytes at their peak, in the host pool (beside the device figures above).
    measured_host_peak_bytes: int = 0
    simulated_host_peak_bytes: int = 0

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


def prepare_cost(
    name: str, step: Step, progress: Progress = _nothing, graph: Graph | None = None, **kw
) -> CostModel:
    """The cost model `name`; a profiled one measures the distinct ops of `graph` (the step's
    own by default) first."""
    cost = get_cost_model(name, **kw)
    profile = getattr(cost, "profile_graph", None)
    if profile is not None:
        progress("profiling operators")
        profile(graph if graph is not None else step.graph)
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
    ftree: bool = False,
    max_level: int = 4,
) -> AnalyzeReport:
    """Capture workload `workload` (paper size unless `:tiny`/`:small`) and analyze it; with
    `ftree`, also build its F-Tree (MAGIS Alg. 1, max-level `max_level`)."""
    progress("capturing")
    start = time.perf_counter()
    _, step = workload_step(workload, batch)
    rep = analyze_step(step, workload, hardware, progress, time.perf_counter() - start)
    if ftree:
        progress("building the F-Tree")
        t0 = time.perf_counter()
        graph, tree = fission_tree(step, max_level)
        rep.ftree = ftree_rows(graph, tree)
        rep.ftree_seconds = time.perf_counter() - t0
        rep.seconds += rep.ftree_seconds
    return rep


def run_step(
    step: Step,
    name: str,
    hardware: str = "cpu",
    tolerance: float | None = None,
    progress: Progress = _nothing,
    repeats: int = 10,
    seed: int = 0,
    graph: Graph | None = None,
    order: list[int] | None = None,
) -> RunReport:
    """Execute `graph` in `order` (default: the step's own graph in program order, or a plan's)
    as generated code; verify it against the step run eagerly and measure it."""
    start = time.perf_counter()
    graph = step.graph if graph is None else graph
    order = graph.program_order() if order is None else list(order)
    progress("generating code")
    program = compile_program(graph, order)
    inputs = step.make_inputs(seed=seed)
    dtype = _float_dtype(step)
    tol = tolerance if tolerance is not None else (1e-9 if dtype == torch.float64 else 1e-4)
    progress("verifying against eager PyTorch")
    check = verify(step, program, inputs, tolerance=tol, seed=seed)
    progress("measuring")
    measured = measure(program, step.program_inputs(inputs), repeats=repeats, seed=seed)
    cost = prepare_cost(hardware, step, progress, graph=graph)
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
        measured_host_peak_bytes=measured.host_peak_bytes,
        simulated_host_peak_bytes=sim.host_peak_bytes,
    )


def run(
    workload: str,
    hardware: str = "cpu",
    dtype: torch.dtype | None = None,
    progress: Progress = _nothing,
    fission: Sequence[int] | None = None,
    parts: int = 2,
) -> RunReport:
    """Capture a `:tiny` or `:small` workload with real tensors, execute it and verify it.

    Tiny workloads run in float64 so that verification can be tight (DESIGN principle 1).
    With `fission`, the F-Tree nodes of those indices (`magis analyze W --ftree`) are enabled
    with n = `parts` and the split program is what runs.
    """
    progress("capturing")
    if dtype is None and workload.endswith(":tiny"):
        dtype = torch.float64
    _, step = workload_step(workload, dtype=dtype, real=True)
    if fission:
        return run_fission(step, workload, fission, parts, hardware, progress)
    return run_step(step, workload, hardware, progress=progress)


@dataclass
class ScheduleReport:
    """`magis schedule`: one scheduler on one workload, against the captured program order."""

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
    hardware: str = "rtx3090",
    budget: int | None = None,
    progress: Progress = _nothing,
    capture_seconds: float = 0.0,
) -> ScheduleReport:
    """Schedule `step`'s graph with `scheduler` and simulate it against the program order."""
    from magis.schedule import Scheduler, peak_lower_bound, schedule

    start = time.perf_counter()
    kind = Scheduler.parse(scheduler)  # a bad name fails before any work
    cost = prepare_cost(hardware, step, progress)
    graph = step.graph
    progress("simulating program order")
    base = simulate(graph, graph.program_order(), cost)
    progress(f"scheduling ({kind.value})")
    res = schedule(graph, kind) if budget is None else schedule(graph, kind, budget=budget)
    sim = simulate(graph, res.order, cost)
    return ScheduleReport(
        workload=name,
        scheduler=kind.value,
        hardware=hardware,
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
    hardware: str = "rtx3090",
    batch: int | None = None,
    budget: int | None = None,
    progress: Progress = _nothing,
) -> ScheduleReport:
    """Capture `workload` and re-order its training step (MAGIS §5.2, §6.1)."""
    from magis.schedule import Scheduler

    Scheduler.parse(scheduler)
    progress("capturing")
    start = time.perf_counter()
    _, step = workload_step(workload, batch)
    return schedule_step(
        step, workload, scheduler, hardware, budget, progress, time.perf_counter() - start
    )


def _float_dtype(step: Step) -> torch.dtype:
    g = step.graph
    for p in g.placeholders(PlaceholderKind.WEIGHT) or g.placeholders():
        dt = g.node(p).outputs[0].torch_dtype
        if dt.is_floating_point:
            return dt
    return torch.get_default_dtype()


# --- memory layout (ROAM §IV-B): `magis layout`, `magis run --layout` ---------------------------


@dataclass
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


def _schedule_for(step: Step, scheduler: str, plan: str | None, progress: Progress):
    """(graph, order, schedule label, seconds) of the step re-ordered, or of a saved plan."""
    start = time.perf_counter()
    if plan is not None:
        from magis.planning import Plan, check_plan_matches

        progress("reading the plan")
        saved = Plan.load(plan)
        check_plan_matches(saved, step)
        label = f"plan {Path(plan).name}"
        return saved.graph, list(saved.order), label, time.perf_counter() - start
    from magis.schedule import Scheduler, schedule

    kind = Scheduler.parse(scheduler)
    if kind is Scheduler.PROGRAM:
        return step.graph, step.graph.program_order(), kind.value, 0.0
    progress(f"scheduling ({kind.value})")
    order = list(schedule(step.graph, kind).order)
    return step.graph, order, kind.value, time.perf_counter() - start


def layout(
    workload: str,
    method: str = "exact",
    scheduler: str = "program",
    plan: str | None = None,
    batch: int | None = None,
    progress: Progress = _nothing,
) -> LayoutReport:
    """Capture `workload`, order it (program order, a scheduler, or a saved plan) and lay out
    its tensors in one arena with `method` (ROAM §IV-B)."""
    from magis.layout import LayoutMethod, plan_layout
    from magis.schedule import Scheduler

    kind = LayoutMethod.parse(method)  # bad names fail before any work
    Scheduler.parse(scheduler)
    start = time.perf_counter()
    progress("capturing")
    if plan is not None:
        from magis.planning import capture_workload

        step = capture_workload(workload)
    else:
        _, step = workload_step(workload, batch)
    capture_s = time.perf_counter() - start
    graph, order, label, schedule_s = _schedule_for(step, scheduler, plan, progress)
    progress(f"laying out ({kind.value})")
    lay = plan_layout(graph, order, kind)
    peak = lay.theoretical_peak_bytes
    return LayoutReport(
        workload=workload,
        schedule=label,
        method=kind.value,
        storages=len(lay.lifetimes),
        theoretical_peak_bytes=peak,
        arena_bytes=lay.arena_bytes,
        fragmentation=lay.fragmentation,
        llfb_arena_bytes=lay.llfb_arena_bytes,
        llfb_fragmentation=(lay.llfb_arena_bytes - peak) / peak if peak else 0.0,
        resident_bytes=_resident_bytes(graph),
        pieces=len(lay.pieces),
        pieces_solved=lay.pieces_solved,
        pieces_optimal=lay.pieces_optimal,
        fell_back_to_llfb=lay.fell_back_to_llfb,
        seconds=lay.seconds,
        capture_seconds=capture_s,
        schedule_seconds=schedule_s,
        total_seconds=time.perf_counter() - start,
    )


@dataclass
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
    plan: str | None = None,
    progress: Progress = _nothing,
    repeats: int = 5,
    seed: int = 0,
) -> LayoutRunReport:
    """Execute a :tiny or :small workload inside one arena laid out by `method`; verify it
    against eager PyTorch and measure it. With CUDA, also run the same plan on the GPU, with and
    without the arena, under the caching allocator."""
    from magis.backend.arena import compile_arena_program, cuda_peaks
    from magis.errors import MagisError
    from magis.layout import check_layout, plan_layout
    from magis.planning import capture_workload

    if ":" not in workload or workload.endswith(":paper"):
        raise MagisError(f"{workload} is paper-size (fake tensors): run {workload}:tiny instead")
    start = time.perf_counter()
    progress("capturing")
    step = capture_workload(workload)
    graph, order, label, _ = _schedule_for(step, scheduler, plan, progress)
    progress(f"laying out ({method})")
    lay = plan_layout(graph, order, method)
    check_layout(lay)
    progress("generating code")
    program = compile_arena_program(graph, order, lay)
    inputs = step.make_inputs(seed=seed)
    dtype = _float_dtype(step)
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    progress("verifying against eager PyTorch")
    check = verify(step, program.program, inputs, tolerance=tol, seed=seed)
    progress("measuring")
    measured = measure(program.program, step.program_inputs(inputs), repeats=repeats, seed=seed)
    cuda = cuda_peaks(graph, order, lay, step.program_inputs(inputs)) if _has_cuda() else None
    return LayoutRunReport(
        workload=workload,
        dtype=str(dtype).removeprefix("torch."),
        schedule=label,
        method=lay.method.value,
        verified=check.verified,
        max_rel_err=check.max_rel_err,
        worst_value=check.worst,
        tolerance=tol,
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


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def _resident_bytes(graph) -> int:
    smap = graph.storages()
    return sum(smap.nbytes[s] for s in smap.resident)


# --- fission (MAGIS §4, §5.1): `magis analyze --ftree`, `magis run --fission` ------------------


def fission_tree(step: Step, max_level: int = 4):
    """(prepared graph, F-Tree): the step's graph with the loss opened to fission
    (`magis.rules.fission.prepare`) and its fission hierarchy tree (Alg. 1)."""
    from magis.analyze import build_ftree
    from magis.rules.fission import prepare

    graph = prepare(step.graph)
    return graph, build_ftree(graph, max_level=max_level)


def ftree_rows(graph, tree) -> list[dict]:
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


def enable_nodes(tree, indices: Sequence[int], parts: int):
    """`tree` with nodes `indices` enabled with n = `parts`; a one-line MagisError otherwise."""
    from magis.errors import MagisError

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
    hardware: str = "cpu",
    progress: Progress = _nothing,
) -> RunReport:
    """Run `step` with F-Tree nodes `fission` enabled (n = `parts`), materialized as a graph
    rewrite (`magis.rules.fission.materialize`); verified against eager PyTorch and measured as
    `run_step` does the program order."""
    from dataclasses import replace

    from magis.rules.fission import materialize

    progress("building the F-Tree")
    graph, tree = fission_tree(step)
    tree = enable_nodes(tree, fission, parts)
    progress("splitting")
    split = materialize(graph, tree)
    rep = run_step(replace(step, graph=split.graph), name, hardware, progress=progress)
    rep.fission = [
        {
            "index": k,
            "n": tree.nodes[k].n,
            "size": tree.nodes[k].size,
            "dim": tree.nodes[k].dim,
            "length": tree.nodes[k].length,
        }
        for k in split.applied
    ]
    return rep


@dataclass
class FissionReport:
    """Fission alone on one workload: each F-Tree node and n simulated, the best kept.

    `best` has the lowest simulated peak; `best_within` the lowest peak whose latency is within
    `latency_limit` of program order (MAGIS §7.2.1 sets 5% and 10%). Ratios are against the
    captured graph's program order on the same cost model.
    """

    workload: str
    hardware: str
    nodes: int
    ftree_nodes: int
    ftree_seconds: float
    program_peak_bytes: int
    program_latency_s: float
    latency_limit: float
    best: dict | None
    best_within: dict | None
    tried: list[dict]
    seconds: float

    def to_json(self) -> dict:
        return asdict(self)


def fission_alone(
    step: Step,
    name: str,
    hardware: str = "rtx3090",
    max_parts: int = 32,
    top: int = 4,
    latency_limit: float = 1.10,
    progress: Progress = _nothing,
) -> FissionReport:
    """Simulate every F-Tree node alone with n = 2, then the `top` best of them with every
    divisor of their length up to `max_parts`; report the best single node and n."""
    from magis.rules.fission import materialize

    start = time.perf_counter()
    cost = prepare_cost(hardware, step, progress)
    base = simulate(step.graph, step.graph.program_order(), cost)
    progress("building the F-Tree")
    t0 = time.perf_counter()
    graph, tree = fission_tree(step)
    ftree_seconds = time.perf_counter() - t0

    def trial(k: int, n: int) -> dict:
        split = materialize(graph, tree.with_n(k, n))
        sim = simulate(split.graph, split.order, cost)
        x = tree.nodes[k]
        return {
            "index": k,
            "n": n,
            "size": x.size,
            "dim": x.dim,
            "length": x.length,
            "peak_bytes": sim.peak_bytes,
            "latency_s": sim.latency_s,
            "peak_ratio": sim.peak_bytes / base.peak_bytes,
            "latency_ratio": sim.latency_s / base.latency_s,
        }

    progress("simulating each node with n = 2")
    tried = [trial(k, 2) for k in range(len(tree))]
    ranked = sorted(tried, key=lambda r: (r["peak_bytes"], r["latency_s"]))[:top]
    progress("trying more parts on the best nodes")
    for r in ranked:
        length = tree.nodes[r["index"]].length
        tried += [
            trial(r["index"], n) for n in range(3, min(length, max_parts) + 1) if length % n == 0
        ]
    by_peak = sorted(tried, key=lambda r: (r["peak_bytes"], r["latency_s"]))
    within = [r for r in by_peak if r["latency_ratio"] <= latency_limit]
    return FissionReport(
        workload=name,
        hardware=hardware,
        nodes=len(step.graph),
        ftree_nodes=len(tree),
        ftree_seconds=ftree_seconds,
        program_peak_bytes=base.peak_bytes,
        program_latency_s=base.latency_s,
        latency_limit=latency_limit,
        best=by_peak[0] if by_peak else None,
        best_within=within[0] if within else None,
        tried=tried,
        seconds=time.perf_counter() - start,
    )
