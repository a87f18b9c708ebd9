"""`magis.optimize`: find the fastest equivalent program under a memory limit, or the smallest
under a latency limit (MAGIS §6.2), and hand it to the user as a `Plan`.

A Plan is a graph, a schedule and what the search learned, saved as versioned JSON (never
pickle). It can show its generated code, report its figures, and run.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from magis.backend import compile_program
from magis.capture import Step, training_step
from magis.cost import CostModel, get_cost_model
from magis.errors import MagisError, PlanError
from magis.ir import Graph
from magis.ir.serialize import graph_from_json, graph_to_json
from magis.search import Improvement, MemoryFigure, Mode, Objective, SearchResult, optimize_graph
from magis.search.optimizer import measure_state
from magis.sim import SimResult

PLAN_FORMAT = "magis.plan"
PLAN_VERSION = 1

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class LimitError(MagisError):
    """A memory or latency limit that cannot be read."""


def parse_memory_limit(text: str | float | int, unoptimized_peak: int) -> int:
    """'0.4' (a ratio of the unoptimized peak), '12GiB', '500MB' or a byte count -> bytes."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise LimitError(
                f"cannot read memory limit {text!r}: give a ratio such as 0.4 or a size such as 12GiB"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "" and value <= 1.0:
        return int(value * unoptimized_peak)
    if unit == "" and value <= 1024:  # a ratio above 1 means nothing; so few bytes neither
        raise LimitError(
            f"memory limit {text!r} is ambiguous: write a ratio <= 1 or a size with a unit"
        )
    return int(value * _UNITS[unit])


def parse_latency_limit(text: str | float, unoptimized_latency: float) -> float:
    """'1.10' (a ratio of the unoptimized latency), '250ms' or '0.3s' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", str(text))
    if not m:
        raise LimitError(
            f"cannot read latency limit {text!r}: give a ratio such as 1.10 or a time such as 250ms"
        )
    value, unit = float(m.group(1)), m.group(2)
    if unit is None:
        return value * unoptimized_latency
    return value / 1e3 if unit == "ms" else value


def parse_memory_figure(name: str | MemoryFigure) -> MemoryFigure:
    if isinstance(name, MemoryFigure):
        return name
    try:
        return MemoryFigure(name)
    except ValueError:
        choices = ", ".join(f.value for f in MemoryFigure)
        raise LimitError(f"unknown memory figure {name!r}; choose one of {choices}") from None


@dataclass
class Plan:
    """What the optimizer hands the user: graph, schedule, figures, history."""

    graph: Graph
    order: list[int]
    info: dict[str, Any] = field(default_factory=dict)  # figures and provenance
    step: Step | None = field(default=None, repr=False)  # to run it against eager PyTorch

    @property
    def code(self) -> str:
        """The generated Python source of this plan."""
        from magis.backend import generate

        return generate(self.graph, self.order)

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        """Run the plan on the step's flat inputs (parameters, buffers, state, data)."""
        program = compile_program(self.graph, self.order, _device_of(inputs))
        extra = self.step.program_inputs(inputs)[len(inputs) :] if self.step is not None else []
        return program(*inputs, *extra)

    def report(self) -> str:
        i = self.info
        lines = [
            f"magis plan for {i.get('workload', 'a step')} on {i.get('hardware', '?')}",
            f"  memory  {i.get('memory_ratio', float('nan')):.3f} of the program order "
            f"({i.get('peak_bytes', 0) / 2**30:.3f} GiB)",
            f"  latency {i.get('latency_ratio', float('nan')):.3f} of the program order",
            f"  limit   {'met' if i.get('satisfied') else 'NOT met'} ({i.get('mode')} {i.get('limit_ratio', 0):.3f} "
            "of the program order)",
            f"  rules   {i.get('rules_applied', {})}",
        ]
        if not i.get("satisfied") and i.get("peak_tensors"):
            lines.append("  the peak is held by: " + ", ".join(i["peak_tensors"][:5]))
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "info": self.info,
            "order": list(self.order),
            "graph": graph_to_json(self.graph),
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        tmp.replace(path)  # a plan file is never half-written
        return path

    @staticmethod
    def load(path: str | Path) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlanError(f"no plan file at {path}") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"cannot read plan {path}: {exc}") from exc
        return Plan.from_json(data)

    @staticmethod
    def from_json(data: dict) -> Plan:
        if data.get("format") != PLAN_FORMAT:
            raise PlanError("not a magis plan (its 'format' field is missing or different)")
        if data.get("version") != PLAN_VERSION:
            raise PlanError(
                f"plan format version {data.get('version')} is not {PLAN_VERSION}: upgrade magis"
            )
        graph = graph_from_json(data["graph"])
        order = [int(n) for n in data["order"]]
        if not graph.is_valid_schedule(order):
            raise PlanError("the plan's schedule is not a valid order of its graph")
        return Plan(graph, order, dict(data.get("info", {})))


def _device_of(inputs) -> torch.device:
    for t in inputs:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def check_plan_matches(plan: Plan, step: Step) -> None:
    """A plan runs on a step only if their inputs agree (names may differ, shapes may not)."""
    mine = [plan.graph.node(p).outputs[0] for p in plan.graph.placeholders()]
    theirs = [step.graph.node(p).outputs[0] for p in step.graph.placeholders()]
    if mine != theirs:
        raise PlanError("this plan was made for another step: its inputs' shapes or dtypes differ")


def plan_from_search(result: SearchResult, base: SimResult, step: Step | None, **info) -> Plan:
    best = result.best
    info = {
        **info,
        "mode": result.objective.mode.value,
        "limit": result.objective.limit,
        "limit_ratio": result.objective.limit
        / (base.peak_bytes if result.objective.mode is Mode.MEMORY_LIMIT else base.latency_s),
        "satisfied": result.satisfied,
        "peak_bytes": best.memory,
        "latency_s": best.latency,
        "host_peak_bytes": best.sim.host_peak_bytes,
        "memory_ratio": best.memory / base.peak_bytes,
        "latency_ratio": best.latency / base.latency_s,
        "program_order_peak_bytes": base.peak_bytes,
        "program_order_latency_s": base.latency_s,
        "states_explored": result.stats.states_explored,
        "rules_applied": dict(result.stats.rules_applied),
        "history": list(best.history),
        "seconds": result.seconds,
        "breakdown": dict(result.stats.breakdown),
        "improvements": [[i.seconds, i.memory, i.latency] for i in result.improvements],
        "peak_tensors": [
            f"{h.name} ({h.nbytes / 2**20:.1f} MiB)" for h in best.sim.top_hotspots(10)
        ],
        "interrupted": result.interrupted,
    }
    return Plan(best.graph, list(best.order), info, step)


def optimize(
    step_or_model: Step | torch.nn.Module,
    example_inputs: tuple | None = None,
    *,
    mem_limit: str | float | None = None,
    lat_limit: str | float | None = None,
    time_budget: float = 180.0,
    hardware: str | CostModel = "rtx3090",
    loss_fn: Callable | None = None,
    optimizer: str | None = "sgd",
    on_improvement: Callable[[Improvement], None] | None = None,
    workload: str | None = None,
    memory_figure: str = "theoretical",
    max_states: int | None = None,
) -> Plan:
    """Optimize a captured step — or a model with example inputs, whose training step is
    captured first — under exactly one of `mem_limit` and `lat_limit` (MAGIS §6.2)."""
    if (mem_limit is None) == (lat_limit is None):
        raise LimitError(
            "give exactly one of mem_limit (e.g. 0.4 or 12GiB) and lat_limit (e.g. 1.10)"
        )
    step = step_or_model
    if isinstance(step_or_model, torch.nn.Module):
        if example_inputs is None:
            raise MagisError("optimize(model, example_inputs, ...): the example inputs are missing")
        step = training_step(step_or_model, example_inputs, loss_fn=loss_fn, optimizer=optimizer)
    cost = get_cost_model(hardware) if isinstance(hardware, str) else hardware
    figure = parse_memory_figure(memory_figure)
    # ratios compare like with like: the program order measured by the same memory figure
    base = measure_state(step.graph, step.graph.program_order(), cost, figure)
    if mem_limit is not None:
        objective = Objective(Mode.MEMORY_LIMIT, parse_memory_limit(mem_limit, base.peak_bytes))
    else:
        objective = Objective(Mode.LATENCY_LIMIT, parse_latency_limit(lat_limit, base.latency_s))
    start = time.perf_counter()
    result = optimize_graph(
        step.graph,
        cost,
        objective,
        time_budget=time_budget,
        on_improvement=on_improvement,
        memory_figure=figure,
        max_states=max_states,
    )
    return plan_from_search(
        result,
        base,
        step,
        workload=workload,
        memory_figure=memory_figure,
        hardware=getattr(cost, "name", str(hardware)),
        wall_seconds=time.perf_counter() - start,
    )


def capture_workload(name: str) -> Step:
    """The step `magis optimize` and `magis run` work on: tiny workloads in float64 (so plans
    made for them verify tightly), others in their own dtype."""
    from magis.capture import workload_step

    dtype = torch.float64 if name.endswith(":tiny") else None
    return workload_step(name, dtype=dtype, real=not _is_paper_size(name))[1]


def _is_paper_size(name: str) -> bool:
    return ":" not in name or name.endswith(":paper")


def run_plan(workload: str, plan_path: str | Path, hardware: str = "cpu", progress=None):
    """Execute a saved plan on `workload` (a :tiny or :small variant), verify and measure it."""
    from magis.api import run_step

    plan = Plan.load(plan_path)
    step = capture_workload(workload)
    check_plan_matches(plan, step)
    kw = {"progress": progress} if progress is not None else {}
    return run_step(step, workload, hardware, graph=plan.graph, order=plan.order, **kw)
