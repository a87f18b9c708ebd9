"""`magis bench train --compiler inductor`: five ways to run one training step (issue 43).

For a workload (a zoo `:small` one on a CPU, a corpus model, or a user's model file), the same
model, batch and `torch.optim` optimizer take steps five ways, each on its own copy of the
model, interleaved so that a machine's drift falls on all of them alike:

* eager: `zero_grad`, forward and loss, `backward`, `optimizer.step()`;
* torch.compile: the model compiled with default settings (Dynamo, AOTAutograd's min-cut
  partitioner, Inductor), the optimizer's step eager;
* torch.compile with `torch._functorch.config.activation_memory_budget` found by bisection: the
  largest budget tried whose measured peak is at most magis (Inductor)'s. The peak is not
  monotonic in the budget (pytorch/pytorch#197838), so the bisection finds a budget that
  reaches that peak, not always the largest; when no budget tried reaches it, the row is the
  budget with the lowest peak and says so (on unet:small budget 0 measured above budget 1);
* magis (python): `magis.compile(..., mem_limit=M)`, its plan run as generated Python; searched
  without host copies (`rules_without_host_copies`: on a CPU a Store's copy stays in the memory
  measured, so swapping saves nothing there);
* magis (inductor): the same plan (`plan=`) compiled by Inductor (`compiler="inductor"`).

Each row has the median step time and the measured peak of one step, the same way for all
five: the bytes held before the step (parameters, buffers, optimizer state, batch; distinct
storages) plus the most the CPU allocator held at once during it above that
(`magis.backend.memory.allocated_peak_bytes`: the profiler's memory events, which see
Inductor's buffers; `LiveBytesTracker` does not, and Dynamo runs a compiled model eagerly
under a dispatch mode). Gradients are cleared before the measured step, so none of the
previous step's dies inside it.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from magis.backend.memory import allocated_peak_bytes, storage_bytes
from magis.bench.gpu_measure import user_case
from magis.bench.train import OPTIMIZERS, workload_loss
from magis.capture.steps import default_dtype
from magis.capture.user_model import is_model_file
from magis.capture.workloads import get_workload
from magis.train import compile as magis_compile
from magis.train.compile import rules_without_host_copies

BISECTION_STEPS = 2  # budget to 1/4 after the two ends: each probe is a whole compile


@dataclass
class VariantRow:
    variant: str
    step_s: float  # median step time
    measured_peak_bytes: int
    budget: float | None = None  # activation_memory_budget, torch.compile rows
    note: str = ""


@dataclass
class CompiledBenchResult:
    workload: str
    optimizer: str
    threads: int
    steps: int  # timed steps of each variant
    mem_limit: float
    magis_simulated_peak_bytes: int
    magis_memory_ratio: float  # the plan's simulated peak over the program order's
    rows: list[VariantRow] = field(default_factory=list)
    budgets_tried: dict[str, int] = field(default_factory=dict)  # budget -> measured peak
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class _Setup:
    """One workload ready to run: a model to copy, its batch, loss and optimizer maker."""

    model: torch.nn.Module
    batch: tuple
    loss_fn: Callable
    make_opt: Callable


def bench_train_compiled(
    workload_names: Sequence[str],
    repeats: int = 5,
    optimizer: str = "adamw",
    mem_limit: float = 0.5,
    time_budget: float = 60.0,
    warmup: int = 2,
    progress: Callable[[str], None] = lambda _: None,
) -> list[CompiledBenchResult]:
    """The five variants of the module docstring, per workload."""
    return [
        _bench_one(name, repeats, optimizer, mem_limit, time_budget, warmup, progress)
        for name in workload_names
    ]


def _bench_one(name, repeats, optimizer, mem_limit, time_budget, warmup, progress):
    start = time.perf_counter()
    setup = training_setup(name, optimizer)

    progress(f"{name}: magis search (mem_limit={mem_limit})")
    python_step, peak_python = _magis_step(setup, "python", mem_limit, time_budget)
    plan = python_step.plan
    progress(f"{name}: magis (inductor) compiling")
    inductor_step, peak_inductor = _magis_step(setup, "inductor", plan=plan)
    progress(f"{name}: torch.compile budgets (target {peak_inductor / 2**20:.1f} MiB)")
    tried = _tune_budget(lambda b: _compiled_peak(setup, b), peak_inductor, progress)
    budget, budget_peak = _chosen(tried, peak_inductor)
    default_peak = tried[1.0]  # torch.compile's default budget is 1.0: the same compile

    progress(f"{name}: timing {repeats} steps of each")
    torch._dynamo.reset()  # the two timed compiles below stay in the cache side by side
    eager = _eager_step(setup)
    steps = {
        "eager": eager,
        "torch.compile": _compiled_step(setup, None),
        "torch.compile budget": _compiled_step(setup, budget),
        "magis (python)": lambda: python_step(*setup.batch),
        "magis (inductor)": lambda: inductor_step(*setup.batch),
    }
    times = _interleaved(list(steps.values()), repeats, warmup)
    peaks = [_eager_peak(setup), default_peak, budget_peak, peak_python, peak_inductor]
    reached = budget_peak <= peak_inductor
    notes = ["", "", "" if reached else "cannot reach magis's peak"]
    notes += [_host_note(python_step), _host_note(inductor_step)]
    budgets = [None, None, budget, None, None]
    rows = [
        VariantRow(v, t, p, b, n)
        for v, t, p, b, n in zip(steps, times, peaks, budgets, notes, strict=True)
    ]
    return CompiledBenchResult(
        name,
        optimizer,
        torch.get_num_threads(),
        repeats,
        mem_limit,
        plan.summary.peak_bytes,
        plan.summary.memory_ratio,
        rows,
        {f"{b:g}": p for b, p in sorted(tried.items())},
        time.perf_counter() - start,
    )


def training_setup(name: str, optimizer: str = "adamw") -> _Setup:
    """A zoo or corpus workload, or a user's model file (`path/to/model.py:factory`, built for
    real in float32 on the CPU), with the optimizer the five variants each make a copy of."""
    if is_model_file(name):
        case = user_case(name, torch.device("cpu"))
        return _Setup(case.model, case.batch, case.loss_fn, OPTIMIZERS[optimizer])
    wl = get_workload(name)
    with default_dtype(wl.dtype):
        torch.manual_seed(0)
        model = wl.build()
        batch = tuple(wl.make_inputs(wl.batch))
    return _Setup(model, batch, workload_loss(wl), OPTIMIZERS[optimizer])


def _fresh(setup: _Setup) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(setup.model)
    return model, setup.make_opt(model.parameters())


def _magis_step(setup: _Setup, compiler: str, mem_limit=None, time_budget=60.0, plan=None):
    """A TrainStep on its own model copy (its first call, which compiles, made here) and the
    measured peak of its second call."""
    # on a CPU a Store's host copy is in the memory measured: plan without host copies
    kwargs = {"plan": plan} if plan is not None else {"mem_limit": mem_limit}
    kwargs["rules"] = rules_without_host_copies()
    model, opt = _fresh(setup)
    step = magis_compile(
        model, opt, setup.batch, loss_fn=setup.loss_fn, compiler=compiler,
        time_budget=time_budget, **kwargs,
    )  # fmt: skip
    step(*setup.batch)
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    resident = [*model.parameters(), *model.buffers(), *state, *setup.batch]
    return step, storage_bytes(resident) + allocated_peak_bytes(lambda: step(*setup.batch))


def _host_note(step) -> str:
    """On a CPU a Store's copy is in the same memory: the measured peak includes it."""
    host = step.program.host_pool.peak_bytes
    return f"incl. {host / 2**20:.1f} MiB of Store copies" if host else ""


@dataclass
class LoopStep:
    """One step of a user's loop on `model` (compiled or not): `zero_grad`, forward and loss,
    `backward`, `optimizer.step()`."""

    model: torch.nn.Module  # what the loop calls: the model, or torch.compile's wrapper of it
    opt: torch.optim.Optimizer
    setup: _Setup

    def __call__(self) -> None:
        self.opt.zero_grad()
        self.setup.loss_fn(self.model, *self.setup.batch).backward()
        self.opt.step()

    def resident(self) -> list[torch.Tensor]:
        """What the step holds before it starts: parameters, buffers, optimizer state, batch."""
        module = getattr(self.model, "_orig_mod", self.model)  # torch.compile's wrapper
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return [*module.parameters(), *module.buffers(), *state, *self.setup.batch]


def _eager_step(setup: _Setup) -> LoopStep:
    return LoopStep(*_fresh(setup), setup)


def _compiled_step(setup: _Setup, budget: float | None) -> LoopStep:
    """A torch.compile step, default (`budget` None) or at `activation_memory_budget=budget`,
    compiled now (its first step runs here)."""
    model, opt = _fresh(setup)
    compiled = (
        torch.compile(model) if budget is None else torch.compile(model, backend=at_budget(budget))
    )
    step = LoopStep(compiled, opt, setup)
    step()
    return step


def at_budget(budget: float) -> Callable:
    """torch.compile's default backend (Inductor's `compile_fx`) partitioning at `budget`. A
    backend of its own: Dynamo guards each compiled graph on its backend, so a model copy
    compiled at another budget never runs this one's graph (with `inline_inbuilt_nn_modules`
    the parameters are graph inputs, and two copies of a model would share it); and AOTAutograd
    partitions inside `compile_fx`, so the patch is in force when the budget is read."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    return backend


def _compiled_peak(setup: _Setup, budget: float | None) -> int:
    torch._dynamo.reset()  # each probe's compile alone in Dynamo's cache
    return _measured_peak(_compiled_step(setup, budget))


def _eager_peak(setup: _Setup) -> int:
    step = _eager_step(setup)
    step()  # the optimizer's state exists from here on, as in the magis steps
    return _measured_peak(step)


def _measured_peak(step: LoopStep) -> int:
    """The peak of one more step: what it holds before it starts, and what it allocates."""
    step.opt.zero_grad()
    return storage_bytes(step.resident()) + allocated_peak_bytes(step)


def _tune_budget(
    probe: Callable[[float], int], target: int, progress: Callable[[str], None]
) -> dict[float, int]:
    """Measured peaks at the budgets a bisection on [0, 1] tries, for the largest budget whose
    peak is at most `target`: both ends first, then BISECTION_STEPS midpoints."""
    tried: dict[float, int] = {}

    def peak(budget: float) -> int:
        if budget not in tried:
            tried[budget] = probe(budget)
            progress(f"budget {budget:g}: {tried[budget] / 2**20:.1f} MiB")
        return tried[budget]

    if peak(1.0) <= target or peak(0.0) > target:
        return tried
    lo, hi = 0.0, 1.0
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if peak(mid) <= target else (lo, mid)
    return tried


def _chosen(tried: dict[float, int], target: int) -> tuple[float, int]:
    """The largest budget tried whose peak is at most `target`, else the lowest peak's."""
    fits = [b for b, p in tried.items() if p <= target]
    budget = max(fits) if fits else min(tried, key=lambda b: (tried[b], b))
    return budget, tried[budget]


def _interleaved(steps: list[Callable[[], None]], repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        for fn in steps:
            fn()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for fn, mine in zip(steps, times, strict=True):
            start = time.perf_counter()
            fn()
            mine.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]
