"""`magis bench coverage`: every architecture of the installed model libraries, one training
step each, through the path a user's model takes (issue 46).

For each architecture (`coverage_models`: transformers' classes with a training head,
diffusers' 2-D denoisers) at a tiny configuration derived from its config class:

1. build it in float64, and run its loss once eagerly (a model whose kernels refuse float64,
   such as grouped matmul on a CPU, is built again in float32 and verified at float32's
   tolerance; its row says so);
2. capture its training step as a model file's factory is captured (`capture_factored`:
   forward, loss, backward and the zoo's SGD update);
3. verify the captured program against eager PyTorch (`run_step`: generated code, the same
   seeded inputs);
4. optimize it as `magis optimize` does (`setup_search` + `find_plan`) under mem_limit=0.5 for
   `time_budget` seconds (or `max_states` states);
5. verify the plan against eager PyTorch and measure its peak (`run_step` on the plan's graph
   and order: `magis.backend.measure` counts live storages independently of the simulator);
   the simulated peak equals the measured one when they differ by at most `PEAK_TOLERANCE`.

Each architecture runs in a process of its own with a timeout (`IsolatedRunner`): a hang or a
crash is a failure row, never the end of the sweep. A failure is recorded with its stage, a
category (the error's type, and the ATen op it names) and its first line.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from magis.bench.coverage_diffusers import build_diffusers_case, diffusers_architectures
from magis.bench.coverage_models import (
    DIFFUSERS,
    Architecture,
    Case,
    NoTrainingHeadError,
    build_transformers_case,
    transformers_architectures,
)
from magis.bench.coverage_report import CoverageReport, Failure, write_outputs
from magis.bench.parallel import CellFailure, IsolatedRunner, SerialRunner, run_cells
from magis.capture.source import failed_op, failure_site
from magis.capture.trace import Step
from magis.capture.user_model import Factored, ModelSpec, capture_factored
from magis.commands.optimize import SearchSetup, find_plan, setup_search
from magis.commands.run import RunReport, run_step
from magis.errors import LimitError, MagisError, exception_line
from magis.ir.guards import guard_nodes
from magis.search import SearchOptions

MEM_LIMIT = 0.5
PEAK_TOLERANCE = 0.05  # |simulated - measured| / measured: the tests' tolerance for plans
STAGES = ("build", "capture", "verify", "optimize", "plan-verify", "peak")
# What the forkserver imports once for every architecture's process: importing transformers and
# diffusers took 1.75 s of each process's own time (a third of a small model's cell), and each
# process forked from the server finds them imported.
WORKER_PRELOAD = ("magis.bench.coverage", "transformers.utils.logging", "diffusers.utils.logging")


class CoverageInputError(MagisError):
    """An `--only @FILE.json` that names no coverage sweep's JSON."""


Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class CoverageOptions:
    """What the sweep runs: which architectures, the search's budget, the processes."""

    only: tuple[str, ...] = ()  # fnmatch patterns of class names or labels; empty: all
    limit: int | None = None  # the first N architectures (after `only`)
    time_budget: float = 10.0
    max_states: int | None = None
    hardware: str = "rtx3090"
    jobs: int = 1
    timeout_s: float = 600.0  # per architecture
    isolate: bool = True  # each architecture in a process of its own
    warm_start: bool = True  # the baselines' plans as starting states, as `magis optimize`
    json_path: Path | None = None
    markdown_path: Path | None = None


@dataclass(frozen=True)
class Cell:
    """One architecture, and the settings its worker needs (picklable)."""

    architecture: Architecture
    time_budget: float
    max_states: int | None
    hardware: str
    warm_start: bool = True
    threads: int = 0  # torch's intra-op threads in the cell's process; 0: torch's default


@dataclass
class ArchResult:
    """How far one architecture went, its figures, and its failure if it stopped."""

    architecture: str
    task: str
    dtype: str = "float64"
    nodes: int = 0
    value_reads: int = 0  # guards: reads of tensor values the capture specialized to
    captured_verified: bool = False
    plan_verified: bool = False
    peak_equal: bool = False
    limit_met: bool = False
    memory_ratio: float | None = None
    latency_ratio: float | None = None
    simulated_peak_bytes: int = 0
    measured_peak_bytes: int = 0
    seconds: float = 0.0
    failure: Failure | None = None
    notes: list[str] = field(default_factory=list)
    # why the architecture is counted apart, not as one of magis's failures (`EXCLUDED`): it
    # needs an optional library not installed here, or its head computes no loss
    excluded: str = ""

    @property
    def specialized(self) -> bool:
        """Captured and verified for the values its step reads (`magis.capture.specialize`)."""
        return self.captured_verified and self.value_reads > 0


def all_architectures() -> list[Architecture]:
    """The transformers architectures, then the diffusers ones."""
    return transformers_architectures() + diffusers_architectures()


def build_case(arch: Architecture, dtype: torch.dtype, seed: int = 0) -> Case:
    """The architecture at its tiny config in `dtype`, with a batch (and loss) for its task."""
    build = build_diffusers_case if arch.library == DIFFUSERS else build_transformers_case
    return build(arch, dtype, seed)


def select(options: CoverageOptions, archs: Sequence[Architecture]) -> list[Architecture]:
    """The architectures `only` matches (class name or `library:Class`; `@FILE.json`: those
    that failed in that earlier sweep, to iterate on them), at most `limit`."""
    patterns = [q for p in options.only for q in _expanded(p)]
    chosen = [
        a
        for a in archs
        if not options.only
        or any(fnmatch.fnmatch(a.name, p) or fnmatch.fnmatch(a.label, p) for p in patterns)
    ]
    return chosen[: options.limit] if options.limit is not None else chosen


def _expanded(pattern: str) -> list[str]:
    """`pattern`, or for `@FILE.json` the architectures of that sweep's failures."""
    if not pattern.startswith("@"):
        return [pattern]
    path = Path(pattern[1:])
    try:
        failures = json.loads(path.read_text())["failures"]
        return [f["architecture"] for f in failures]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CoverageInputError(
            f"--only {pattern}: {path} is no coverage JSON with a failures list ({exc}); "
            "pass the file `magis bench coverage --json` wrote"
        ) from exc


def run_coverage(options: CoverageOptions, progress: Progress | None = None) -> CoverageReport:
    """Sweep the architectures; the JSON and markdown files are rewritten after each one."""
    archs = select(options, all_architectures())
    threads = cell_threads(options)
    cells = [
        Cell(
            a,
            options.time_budget,
            options.max_states,
            options.hardware,
            options.warm_start,
            threads,
        )
        for a in archs
    ]
    report = CoverageReport(options.time_budget, options.max_states, MEM_LIMIT, PEAK_TOLERANCE)

    def started(i: int) -> None:
        if progress is not None:
            progress(f"{archs[i].label} ...", len(report.results), len(cells))

    runner = (
        IsolatedRunner(options.jobs, options.timeout_s, WORKER_PRELOAD, started)
        if options.isolate
        else SerialRunner(on_start=started)
    )
    start = time.perf_counter()
    try:
        for done in run_cells(cells, run_architecture, runner):
            result = done.result
            if isinstance(result, CellFailure):
                result = _crashed(archs[done.index], result.reason)
            report.results.append(result)
            report.seconds = time.perf_counter() - start
            write_outputs(report, options.json_path, options.markdown_path)
            if progress is not None:
                progress(
                    f"{result.architecture}: {_outcome(result)}", len(report.results), len(cells)
                )
    except KeyboardInterrupt:
        report.interrupted = True
    report.seconds = time.perf_counter() - start
    write_outputs(report, options.json_path, options.markdown_path)
    return report


def cell_threads(options: CoverageOptions) -> int:
    """Each isolated cell's share of the cores: torch's default of one thread per core in each
    of `jobs` processes oversubscribes them, and its spinning workers then wait on each other
    (a sweep at --jobs 2 on 2 cores ran EfficientNet in 191 s, 48 s alone). A serial sweep runs
    in the caller's process, at the caller's setting."""
    if not options.isolate:
        return 0
    return max(1, (os.cpu_count() or 1) // options.jobs)


def _crashed(arch: Architecture, reason: str) -> ArchResult:
    category = "timeout" if reason.startswith("timed out") else "crash"
    return ArchResult(
        arch.label, arch.task, failure=Failure(arch.label, "worker", category, reason)
    )


def _outcome(result: ArchResult) -> str:
    if result.failure is not None:
        return f"FAILED at {result.failure.stage}: {result.failure.message}"
    return f"ok (memory {result.memory_ratio:.3f}, latency {result.latency_ratio:.3f})"


def run_architecture(cell: Cell) -> ArchResult:
    """One architecture through every stage (module docstring); the first stage that fails
    ends it, recorded as its failure."""
    _quiet_libraries()
    if cell.threads:
        torch.set_num_threads(cell.threads)  # a process of its own (`cell_threads`)
    arch = cell.architecture
    result = ArchResult(arch.label, arch.task)
    start = time.perf_counter()
    stage = "build"
    try:
        case = _built(arch, result)
        stage = "capture"
        spec = ModelSpec(arch.label, Path(arch.label), arch.name)
        step = capture_factored(spec, _factored(arch, case))
        result.nodes = len(step.graph.program_order())
        result.value_reads = len(guard_nodes(step.graph))
        stage = "verify"
        ran = run_step(step, arch.label, cell.hardware, repeats=1)
        result.captured_verified = _verified(ran, result, stage)
        if not result.captured_verified:
            return result
        stage = "optimize"
        setup = _search_setup(step, cell.hardware, result)
        options = SearchOptions(cell.time_budget, max_states=cell.max_states)
        plan = find_plan(setup, options, warm_start=cell.warm_start)
        s = plan.summary
        result.memory_ratio, result.latency_ratio, result.limit_met = (
            s.memory_ratio,
            s.latency_ratio,
            s.satisfied,
        )
        stage = "plan-verify"
        ran = run_step(step, arch.label, setup.cost, repeats=1, graph=plan.graph, order=plan.order)
        result.plan_verified = _verified(ran, result, stage)
        result.simulated_peak_bytes = ran.simulated_peak_bytes
        result.measured_peak_bytes = ran.measured_peak_bytes
        result.peak_equal = ran.peak_error <= PEAK_TOLERANCE
        if not result.peak_equal:
            result.failure = Failure(
                arch.label,
                "peak",
                "peak differs",
                f"simulated {ran.simulated_peak_bytes:,} B, measured "
                f"{ran.measured_peak_bytes:,} B ({ran.peak_error:.1%})",
            )
    except Exception as exc:  # noqa: BLE001 - any failure of one architecture is its row
        result.failure = Failure(arch.label, stage, _category(exc), _message(exc))
        result.excluded = _exclusion(stage, exc)
    finally:
        result.seconds = time.perf_counter() - start
    return result


def _search_setup(step: Step, hardware: str, result: ArchResult) -> SearchSetup:
    """The search under mem_limit=0.5; where a tiny model's resident bytes (its weights, at
    tiny sizes a large share) already take more, under the limit halfway between them and the
    program order's peak (noted): the stage tests the search and its plan, at any limit."""
    try:
        return setup_search(step, mem_limit=MEM_LIMIT, hardware=hardware)
    except LimitError:
        base = setup_search(step, lat_limit=2.0, hardware=hardware).base
    resident = base.resident_bytes / base.peak_bytes
    limit = (resident + 1) / 2
    result.notes.append(
        f"resident {resident:.3f} of the peak: searched under mem_limit {limit:.3f}"
    )
    return setup_search(step, mem_limit=limit, hardware=hardware)


def _built(arch: Architecture, result: ArchResult) -> Case:
    """The tiny model in float64 whose loss runs eagerly, else in float32 (noted)."""
    try:
        case = build_case(arch, torch.float64)
        _eager_loss(arch, case)
        return case
    except Exception as exc:  # noqa: BLE001 - a kernel without float64: try float32
        first = exception_line(exc)
    case = build_case(arch, torch.float32)
    _eager_loss(arch, case)
    result.dtype = "float32"
    result.notes.append(f"float64 failed ({first}): verified in float32")
    return case


def _eager_loss(arch: Architecture, case: Case) -> None:
    loss = _factored(arch, case).loss_fn
    with torch.no_grad():
        if loss is not None:
            loss(case.model, **case.batch)
        else:
            case.model(**case.batch)


def _factored(arch: Architecture, case: Case) -> Factored:
    """The case as a model file's factory result: a dict batch passed by keyword."""
    names = tuple(case.batch)
    return Factored(arch.label, case.model, tuple(case.batch.values()), names, True, case.loss_fn)


def _verified(ran: RunReport, result: ArchResult, stage: str) -> bool:
    if not ran.verified:
        result.failure = Failure(
            result.architecture,
            stage,
            "mismatch",
            f"{ran.worst_value} differs from eager PyTorch by {ran.max_rel_err:.2e} "
            f"(tolerance {ran.tolerance:.0e})",
        )
    return ran.verified


NOT_INSTALLABLE, NO_TRAINING_HEAD = "not installable here", "no training head"


def _exclusion(stage: str, exc: BaseException) -> str:
    """Why a build failure is no failure of magis's: the model needs an optional library that
    is not installed (transformers' `requires_backends`: natten, detectron2, timm), or its
    head computes no loss (an inference-only head such as DeiT's with a teacher)."""
    if stage != "build":
        return ""
    if isinstance(exc, ImportError):
        return NOT_INSTALLABLE
    return NO_TRAINING_HEAD if isinstance(exc, NoTrainingHeadError) else ""


def _innermost_magis_error(exc: BaseException) -> BaseException:
    """A capture's own error rather than the model file's wrapper around it."""
    cause = exc.__cause__
    return cause if isinstance(exc, MagisError) and isinstance(cause, MagisError) else exc


def _category(exc: BaseException) -> str:
    """The error's type, with the ATen op it names (what groups failures of one cause)."""
    name = type(_innermost_magis_error(exc)).__name__
    op = failed_op(exc)
    return f"{name} in {op}" if op else name


def _message(exc: BaseException) -> str:
    """The error's line; for an error of the model's own code (a build whose model never ran
    at the tiny configuration), where it was raised in the library (magis's capture errors
    name their line themselves)."""
    inner = _innermost_magis_error(exc)
    line = exception_line(inner)
    if isinstance(inner, MagisError):
        return line
    site = failure_site(exc)
    return f"{line} (at {site})" if site is not None else line


def _quiet_libraries() -> None:
    """The libraries' advice to their users (dtype casts, loss types) is noise in a sweep."""
    warnings.filterwarnings("ignore")
    for name in ("transformers", "diffusers", "torch._subclasses.fake_tensor"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        import diffusers.utils.logging as dlog
        import transformers.utils.logging as tlog

        tlog.set_verbosity_error()
        dlog.set_verbosity_error()
    except ImportError:
        pass
