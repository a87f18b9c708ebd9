"""`magis bench overhead`: what a generated program's own Python costs per op (issue 41, item 5).

Fission-heavy plans run thousands of ops. Run op by op (a CPU, or a GPU without a CUDA graph),
each op pays the generated line's Python and ATen's dispatch on top of its kernel. Two figures:

- the per-op overhead: a generated program of `ops` adds of one-element tensors, whose kernels
  do next to nothing, timed per op (median of `repeats` runs); beside it the same adds called
  from a Python loop through `torch.add`, as eager code calls ops;
- per workload, the op count of the plan found under `lat_limit=1.10` and what those ops cost
  at the measured overhead and at 7 us per op (a GPU launch's order), against the plan's
  simulated step time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from magis.backend import compile_program
from magis.ir.builder import GraphBuilder

GPU_LAUNCH_US = 7.0


@dataclass(frozen=True)
class OpOverhead:
    generated_us: float  # per op of a generated program
    eager_us: float  # per torch.add call from a Python loop
    ops: int
    threads: int

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PlanOps:
    workload: str
    ops: int  # non-placeholder ops the plan runs
    simulated_s: float  # the plan's simulated step time
    latency_ratio: float
    overhead_s: float  # ops x the measured per-op overhead
    at_7us_s: float  # ops x 7 us

    def to_json(self) -> dict:
        return asdict(self)


def per_op_overhead(ops: int = 2000, repeats: int = 15) -> OpOverhead:
    """Seconds per op of a generated chain of `ops` one-element adds, and of eager calls."""
    b = GraphBuilder(torch.float32)
    x = b.input("x", (1,))
    y = x
    for _ in range(ops):
        y = b.add(y, x)
    b.output(y)
    g = b.build()
    program = compile_program(g, g.program_order())
    t = torch.ones(1)

    def eager() -> torch.Tensor:
        out = t
        for _ in range(ops):
            out = torch.add(out, t)
        return out

    generated = _median_seconds(lambda: program(t), repeats) / ops
    called = _median_seconds(eager, repeats) / ops
    return OpOverhead(generated * 1e6, called * 1e6, ops, torch.get_num_threads())


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def plan_ops(
    workloads: Sequence[str],
    overhead: OpOverhead,
    time_budget: float = 30.0,
    hardware: str = "rtx3090",
    progress: Callable[[str], None] = lambda _: None,
) -> list[PlanOps]:
    """Each workload's plan under `lat_limit=1.10`: its op count and what the ops cost."""
    from magis.capture import workload_step
    from magis.commands.optimize import optimize

    rows = []
    for name in workloads:
        progress(f"{name}: capturing and searching {time_budget:g} s")
        _, step = workload_step(name)
        plan = optimize(step, lat_limit=1.10, time_budget=time_budget, hardware=hardware)
        ops = sum(1 for n in plan.order if not plan.graph.node(n).is_placeholder)
        rows.append(
            PlanOps(
                name,
                ops,
                plan.summary.latency_s,
                plan.summary.latency_ratio,
                ops * overhead.generated_us * 1e-6,
                ops * GPU_LAUNCH_US * 1e-6,
            )  # fmt: skip
        )
    return rows
