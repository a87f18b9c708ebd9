"""`magis bench gpu`: plans measured where users train, beside what the simulator said (issue 41).

For each workload, one model and one `torch.optim.AdamW` on the device take steps five ways:

- `eager`: `zero_grad`, forward and loss, `backward`, `optimizer.step()`;
- `program-order`: `magis.compile`'s step with the captured program order as its plan;
- `mem-0.5` and `lat-1.10`: plans searched (`magis.optimize`) on the cost model profiled on this
  device (`--hardware cuda`: every op of the step timed here first), under each limit;
- `swap`: the offloading peer's (POFO) point that stores the most bytes, so that its
  Store/Load copies on the side stream are measured against the two-stream simulation.

With `inductor` (`--inductor`; issue 43), three more: `torch.compile` (the model compiled with
default settings, the optimizer's step eager), and `inductor-program-order` and
`inductor-mem-0.5`: those two plans compiled by Inductor. Compiled rows verify to
`COMPILED_TOLERANCE`, torch.compile's with eager's random numbers
(`fallback_random`, as magis's segments). Their peaks on a CPU are the allocator's (Inductor's
buffers bypass the dispatcher), which also holds a plan's Store copies there: a CPU's "host"
is the same memory.

Each magis variant is a `TrainStep` (on a GPU replayed as a CUDA graph, `magis.train.cuda_graph`)
on the same model and optimizer, so all five hold the same weights and optimizer state; one
variant runs at a time and its program (its graph's memory pool) is dropped before the next.

How each figure is measured:

- `measured_peak_bytes`: the step's own peak: the allocator's peak during the step (reset per
  step) minus what was allocated before it, plus the step's resident tensors (weights, buffers,
  optimizer state, the batch). On a GPU that is `torch.cuda.max_memory_allocated`; under a CUDA
  graph, the peak while the program was captured (replays allocate nothing). On a CPU, the
  dispatch tracker (`magis.backend.LiveBytesTracker`). The largest over the timed steps.
- `step_s`: the median over `steps` timed steps after `warmup` untimed ones (CUDA events on a
  GPU, the wall clock on a CPU).
- `simulated_*`: the simulator on the profiled cost model, for the graph and order the variant
  runs (null for eager).
- `verified`: from the same weights, optimizer state and RNG seed, one step of the variant and
  one eager step; the loss, every parameter and every optimizer state tensor agree to
  `tolerance` (relative to the largest magnitude, `magis.backend.executor.relative_error`).
  Float32 with TF32 off; 1e-3 on a GPU (atomics in embedding and index backward sum in any
  order), 1e-4 on a CPU.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from magis.bench.gpu_measure import Case, DeviceMeter, StateSnapshot, build_case
from magis.capture.user_model import is_model_file
from magis.capture.workloads import get_workload
from magis.cost import HARDWARE_PRESETS, CostModel, get_cost_model
from magis.cost.op_classes import OP_CLASSES, op_class
from magis.errors import MagisError, exception_line
from magis.ir import Graph
from magis.sim import simulate, tensor_peak_bytes

VARIANTS: tuple[str, ...] = ("eager", "program-order", "mem-0.5", "lat-1.10", "swap")
# with --inductor (issue 43): torch.compile's own step, and two of the plans above compiled by
# Inductor (`magis.compile(..., compiler="inductor")`); the name after "inductor-" is the plan
INDUCTOR_VARIANTS: tuple[str, ...] = ("torch.compile", "inductor-program-order", "inductor-mem-0.5")
GPU_WORKLOADS: tuple[str, ...] = ("bert-base", "resnet50", "unet", "corpus:gpt2")
CPU_WORKLOADS: tuple[str, ...] = ("bert-base:tiny", "resnet50:tiny", "unet:tiny")
# Compiled rows verify to 1e-2: Inductor's fused kernels sum float32 in another order, and
# AdamW turns the rounding noise of a gradient that is zero in exact arithmetic (a key
# projection's bias under softmax) into a whole step: on a tiny ALBERT (CPU) the key bias
# differed from eager's by 3.2e-3 (relative) through torch.compile itself and 6.3e-3 through a
# plan, where loss and moments agreed to 1e-6. Exactness is checked in float64
# (tests/train/test_inductor.py: 1e-9).
COMPILED_TOLERANCE = 1e-2
LIMITS = {"mem-0.5": {"mem_limit": 0.5}, "lat-1.10": {"lat_limit": 1.10}}


class NoGpuError(MagisError):
    """`magis bench gpu` on a machine whose torch sees no CUDA device."""


@dataclass
class GpuRow:
    """One workload run one way (`variant`); see the module docstring for each figure."""

    workload: str
    variant: str
    measured_peak_bytes: int | None = None
    simulated_peak_bytes: int | None = None
    step_s: float | None = None
    simulated_latency_s: float | None = None
    # the simulated peak of the tensors alone: `simulated_peak_bytes` less the ops' scratch
    simulated_tensor_peak_bytes: int | None = None
    verified: bool | None = None
    max_rel_err: float | None = None
    errors: dict[str, list] = field(default_factory=dict)  # kind -> [max rel err, tensor]
    ops: int | None = None  # ops the variant's program runs (None for eager)
    stores: int = 0  # Store ops (host offloads) in its program
    cuda_graph: bool = False
    search_s: float | None = None  # the search's (or the peer's) seconds
    largest_workspace_bytes: int | None = None  # the largest scratch of an op run (GPU)
    largest_workspace_op: str | None = None
    error: str | None = None  # why the variant has no figures

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class OpClassRow:
    """One roofline preset against the profiled model on one class of ops, over all workloads."""

    preset: str
    op_class: str
    ops: int
    profiled_s: float
    preset_s: float

    @property
    def ratio(self) -> float | None:
        return self.preset_s / self.profiled_s if self.profiled_s > 0 else None

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


@dataclass
class GpuReport:
    device: str
    torch: str
    device_type: str
    tolerance: float
    time_budget: float
    steps: int
    rows: list[GpuRow] = field(default_factory=list)
    op_classes: list[OpClassRow] = field(default_factory=list)
    profiling_s: dict[str, float] = field(default_factory=dict)  # workload -> seconds
    wall_s: float = 0.0

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "torch": self.torch,
            "device_type": self.device_type,
            "tolerance": self.tolerance,
            "time_budget": self.time_budget,
            "steps": self.steps,
            "wall_s": self.wall_s,
            "profiling_s": self.profiling_s,
            "rows": [r.to_json() for r in self.rows],
            "op_classes": [r.to_json() for r in self.op_classes],
        }


@dataclass(frozen=True)
class GpuBenchOptions:
    device: str = "cuda"
    time_budget: float = 30.0  # seconds per search
    steps: int = 10  # timed steps per variant
    warmup: int = 3
    tolerance: float | None = None  # None: 1e-3 on a GPU, 1e-4 on a CPU
    deadline_s: float | None = None  # stop starting workloads after this many seconds
    inductor: bool = False  # add INDUCTOR_VARIANTS' rows


def bench_gpu(
    workloads: Sequence[str] | None = None,
    options: GpuBenchOptions = GpuBenchOptions(),
    progress: Callable[[str], None] = lambda _: None,
    on_update: Callable[[GpuReport], None] = lambda _: None,
) -> GpuReport:
    """Measure every workload's five variants (module docstring); `on_update` gets the report
    after every row, so that an interrupted run leaves what it measured."""
    device = _device(options.device)
    names = list(workloads or (GPU_WORKLOADS if device.type == "cuda" else CPU_WORKLOADS))
    for name in names:
        if not is_model_file(name):
            get_workload(name)  # an unknown name fails before any work
    tolerance = options.tolerance or (1e-3 if device.type == "cuda" else 1e-4)
    report = GpuReport(
        _device_name(device), torch.__version__, device.type, tolerance,
        options.time_budget, options.steps,
    )  # fmt: skip
    start = time.perf_counter()
    cost = get_cost_model(device.type)
    sums: dict[tuple[str, str], list[float]] = {}
    with _exact_float32():
        for name in names:
            if options.deadline_s is not None and time.perf_counter() - start > options.deadline_s:
                report.rows.append(GpuRow(name, "eager", error="skipped: past the deadline"))
                continue
            _bench_workload(name, device, cost, options, tolerance, report, sums, progress,
                            on_update)  # fmt: skip
            report.op_classes = _op_class_rows(sums)
            report.wall_s = time.perf_counter() - start
            on_update(report)
            _release(device)
    report.wall_s = time.perf_counter() - start
    return report


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NoGpuError(
            "magis bench gpu needs a GPU and torch sees none: run it on the GPU machine "
            "(scripts/gpu-check), or give --device cpu for the same figures on this CPU"
        )
    if device.type not in ("cuda", "cpu"):
        raise MagisError(f"--device {name!r}: choose cuda or cpu")
    return device


def _device_name(device: torch.device) -> str:
    from magis.cost.profiled import device_name

    return device_name(device)


class _exact_float32:
    """TF32 off for the run: float32 means float32, on both the eager and the magis side."""

    def __enter__(self):
        self._saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._saved


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --- one workload --------------------------------------------------------------------------------


def _bench_workload(name, device, cost, options, tolerance, report, sums, progress, on_update):
    def add(row: GpuRow) -> None:
        report.rows.append(row)
        on_update(report)

    progress(f"{name}: building on {device}")
    try:
        case = build_case(name, device)
    except Exception as exc:  # noqa: BLE001 - one workload's failure leaves the others' rows
        add(GpuRow(name, "eager", error=_why(exc)))
        return
    meter = DeviceMeter(device)
    progress(f"{name}: eager")
    add(_measured(GpuRow(name, "eager"), case.eager_step, case, meter, options))
    try:
        progress(f"{name}: capturing")
        from magis.train.compile import ProgramOrder, prepare_step

        prepared = prepare_step(case.model, case.optimizer, case.batch, loss_fn=case.loss_fn)
        graph = prepared.step.graph
        progress(f"{name}: profiling its ops on {device}")
        t0 = time.perf_counter()
        _profile(cost, graph)
        report.profiling_s[name] = time.perf_counter() - t0
        _add_op_classes(sums, graph, cost)
    except Exception as exc:  # noqa: BLE001
        for variant in VARIANTS[1:] + (INDUCTOR_VARIANTS if options.inductor else ()):
            add(GpuRow(name, variant, error=_why(exc)))
        return
    plans = {"program-order": lambda: (ProgramOrder(graph, graph.program_order()), None)}
    for variant, limit in LIMITS.items():
        plans[variant] = lambda limit=limit: _searched(prepared.step, cost, limit, options)
    plans["swap"] = lambda: _swap_heavy(graph, cost)
    made = {}
    for variant, make in plans.items():
        progress(f"{name}: {variant}")
        row = GpuRow(name, variant, cuda_graph=device.type == "cuda")
        try:
            plan, row.search_s = make()
            made[variant] = (plan, row)  # the Inductor rows run the plan again: its figures too
            row.ops, row.stores = _op_counts(plan.graph, plan.order)
            sim = simulate(plan.graph, plan.order, cost)
            row.simulated_peak_bytes, row.simulated_latency_s = sim.peak_bytes, sim.latency_s
            row.simulated_tensor_peak_bytes = tensor_peak_bytes(plan.graph, plan.order)
            train_step = prepared.train_step(plan)
            if variant == "program-order" and device.type == "cuda":
                _op_workspaces(row, case, prepared.train_step(plan, cuda_graph=False), device)
            row = _verified(row, case, train_step, meter, tolerance)
            row = _measured(row, lambda ts=train_step: ts(*case.batch), case, meter, options,
                            train_step)  # fmt: skip
            del train_step
        except Exception as exc:  # noqa: BLE001
            row.error = _why(exc)
        add(row)
        _release(device)
    if options.inductor:
        _bench_inductor(case, prepared, made, meter, options, tolerance, add, progress)


def _bench_inductor(case, prepared, made, meter, options, tolerance, add, progress) -> None:
    """torch.compile's default step, then the program-order and mem-0.5 plans compiled by
    Inductor: what issue 43 bounds (peak within 2% of the plan's simulated one; with the program
    order, step time at most 1.05x torch.compile's). No CUDA graphs on either side."""
    progress(f"{case.name}: torch.compile")
    row = GpuRow(case.name, "torch.compile")
    # random ops draw eager's numbers, as in magis's Inductor segments (`fx_export`): without
    # it a dropout's mask is Inductor's own and no step could verify against eager's
    with torch._inductor.config.patch(fallback_random=True):
        _torch_compile_row(row, case, meter, options, tolerance)
    add(row)
    torch._dynamo.reset()  # drop the compiled model's code and guards before the next rows
    for variant in INDUCTOR_VARIANTS[1:]:
        progress(f"{case.name}: {variant}")
        row = GpuRow(case.name, variant)
        source = variant.removeprefix("inductor-")
        try:
            if source not in made:
                raise MagisError(f"no {source} plan to compile")
            plan, planned = made[source]
            row.ops, row.stores = planned.ops, planned.stores
            row.simulated_peak_bytes = planned.simulated_peak_bytes
            row.simulated_latency_s = planned.simulated_latency_s
            train_step = prepared.train_step(plan, compiler="inductor")
            row = _verified(row, case, train_step, meter, max(tolerance, COMPILED_TOLERANCE))
            row = _measured(row, lambda ts=train_step: ts(*case.batch), case, meter, options,
                            compiled=True)  # fmt: skip
            del train_step
        except Exception as exc:  # noqa: BLE001
            row.error = _why(exc)
        add(row)
        _release(meter.device)


def _torch_compile_row(row: GpuRow, case: Case, meter: DeviceMeter, options, tolerance) -> None:
    """torch.compile(model) in the user's loop, verified and measured into `row`."""
    try:
        compiled = torch.compile(case.model)

        def step(*_batch: torch.Tensor) -> torch.Tensor:  # the case's batch, as the others'
            return case.loop_step(compiled)

        _verified(row, case, step, meter, max(tolerance, COMPILED_TOLERANCE))
        _measured(row, lambda: step(*case.batch), case, meter, options, compiled=True)
    except Exception as exc:  # noqa: BLE001
        row.error = _why(exc)


def _profile(cost: CostModel, graph: Graph) -> None:
    profile = getattr(cost, "profile_graph", None)
    if profile is not None:
        profile(graph)


def _searched(step, cost: CostModel, limit: dict, options: GpuBenchOptions):
    """A plan for the prepared step as `magis.compile` searches it: the plans run on the
    optimizer's own state tensors, so its rules keep that state where it is."""
    from magis.commands.optimize import optimize
    from magis.train.compile import rules_keeping_state

    start = time.perf_counter()
    plan = optimize(
        step, time_budget=options.time_budget, hardware=cost, rules=rules_keeping_state(), **limit
    )
    return plan, time.perf_counter() - start


def _swap_heavy(graph: Graph, cost: CostModel):
    """The offloading peer's point that stores the most bytes (its least-memory setting)."""
    from magis.baselines import BaselinePoint, get_baseline
    from magis.train.compile import ProgramOrder

    start = time.perf_counter()
    points = [p for p in get_baseline("pofo").points(graph, cost) if isinstance(p, BaselinePoint)]
    swapping = [p for p in points if p.sim.host_peak_bytes > 0]
    if not swapping:
        raise MagisError("the offloading peer (pofo) stores nothing on this workload")
    best = max(swapping, key=lambda p: (p.sim.host_peak_bytes, -p.memory))
    return ProgramOrder(best.graph, list(best.order)), time.perf_counter() - start


def _op_counts(graph: Graph, order: Sequence[int]) -> tuple[int, int]:
    from magis.ir.ops import STORE_OP

    ops = stores = 0
    for nid in order:
        node = graph.node(nid)
        if node.is_placeholder:
            continue
        ops += 1
        stores += node.op == STORE_OP
    return ops, stores


def _op_workspaces(row: GpuRow, case: Case, train_step, device: torch.device) -> None:
    """One step of the program run op by op, its largest op scratch recorded (`OpWorkspaces`)."""
    from magis.bench.gpu_measure import OpWorkspaces

    tracker = OpWorkspaces(device)
    with tracker:
        train_step(*case.batch)
    row.largest_workspace_bytes, row.largest_workspace_op = (
        tracker.largest_bytes,
        tracker.largest_op,
    )


def _verified(row: GpuRow, case: Case, train_step, meter: DeviceMeter, tolerance: float):
    """One step of the variant and one eager step from the same state and seed, compared.

    The variant is warmed up first (its first call runs the generated code; on a GPU the
    second captures the CUDA graph), so that what is compared is what is timed: a replay."""
    for _ in range(2):
        train_step(*case.batch)
    snapshot = StateSnapshot.of(case.model, case.optimizer)
    torch.manual_seed(1234)
    expected_loss = case.eager_step()
    expected = StateSnapshot.of(case.model, case.optimizer)
    snapshot.restore(case.model, case.optimizer)
    torch.manual_seed(1234)
    loss = train_step(*case.batch)
    meter.sync()
    errors = expected.errors_by_kind(StateSnapshot.of(case.model, case.optimizer))
    errors["loss"] = (_rel(loss, expected_loss), "loss")
    row.errors = {kind: [err, name] for kind, (err, name) in errors.items()}
    row.max_rel_err = max(err for err, _ in errors.values())
    row.verified = row.max_rel_err <= tolerance
    return row


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    from magis.backend.executor import relative_error

    return relative_error(actual.detach().cpu(), expected.detach().cpu())


def _measured(row: GpuRow, step: Callable[[], object], case: Case, meter: DeviceMeter,
              options: GpuBenchOptions, train_step=None, compiled: bool = False) -> GpuRow:  # fmt: skip
    """Warm-up steps, then `steps` timed ones: median time and largest peak."""
    try:
        for _ in range(options.warmup):
            step()
        times, peaks = [], []
        for _ in range(options.steps):
            seconds, peak = meter.step(step, case.model, case.optimizer, case.batch, compiled)
            times.append(seconds)
            peaks.append(peak)
        captured = getattr(train_step, "captured_peak_bytes", None)
        row.step_s = statistics.median(times)
        row.measured_peak_bytes = max([*peaks, captured or 0])
    except Exception as exc:  # noqa: BLE001
        row.error = _why(exc)
    return row


def _why(exc: BaseException) -> str:
    return exception_line(exc)[:300]  # a row's note, not a traceback


# --- the presets against the profiled model --------------------------------------------------------


def _add_op_classes(sums: dict, graph: Graph, profiled: CostModel) -> None:
    """Add each op's time on the profiled model and on every preset to its class's sums."""
    presets = {name: get_cost_model(name) for name in HARDWARE_PRESETS}
    for nid in graph.program_order():
        node = graph.node(nid)
        if node.is_placeholder or graph.info(nid).is_view:
            continue
        klass = op_class(node.op)
        measured = profiled.op_time(graph, nid)
        for name, model in presets.items():
            row = sums.setdefault((name, klass), [0, 0.0, 0.0])
            row[0] += 1
            row[1] += measured
            row[2] += model.op_time(graph, nid)


def _op_class_rows(sums: dict) -> list[OpClassRow]:
    rows = []
    for preset in HARDWARE_PRESETS:
        for klass in OP_CLASSES:
            if (preset, klass) in sums:
                n, measured, estimated = sums[preset, klass]
                rows.append(OpClassRow(preset, klass, int(n), measured, estimated))
    return rows
