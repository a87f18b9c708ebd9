"""Micro-batching (MAGIS §7.2.4, Fig. 12): the step split along the batch by a factor f, then
the best baseline applied to the micro-step.

The workload is captured again at batch B / f (a factor that does not divide B is a `Failure`)
and its graph runs f times per training step: a `BaselinePoint` with `repeats=f`. Gradients
must survive from one micro-batch to the next, so a real micro-batched step keeps one
accumulation buffer per weight gradient: `extra_bytes` is their total size (outside the
graph, resident through every micro-step).

The captured micro-step ends with its own weight update (`p -= lr g`, in place). In a
micro-batched step that slot is taken by the accumulation `acc += g`, which moves the same
bytes (two reads, one write of a gradient-sized tensor), so the f runs of the graph's update
stand for the f accumulations; the one real update per step is not in the graph, and
`extra_latency_s` is its time: one add of each weight's shape, costed by the cost model (the
roofline's memory side for an elementwise op). Only SGD is exact here; for Adam the graph's
update costs more than the accumulation, so the figure is an upper bound.

Not checked here: that f micro-steps with accumulation compute the full-batch step (true for
models without batch statistics; batch norm normalizes per micro-batch, as it does in any
micro-batched PyTorch run). What is checked (tests) is that every micro-step plan computes its
own micro-step exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from magis.baselines.base import Baseline, BaselinePoint, Failure, Outcome
from magis.capture.steps import workload_step
from magis.capture.workloads import get_workload
from magis.cost import CostModel, OpKey
from magis.ir import Graph, PlaceholderKind

FACTORS = (2, 4, 8, 16, 32)
_ADD = "aten.add.Tensor"


def accumulator_bytes(graph: Graph) -> int:
    """Bytes of one gradient accumulation buffer per weight."""
    return sum(graph.node(p).outputs[0].nbytes for p in graph.placeholders(PlaceholderKind.WEIGHT))


def update_seconds(graph: Graph, cost: CostModel) -> float:
    """Time of one weight update outside the graph: an add of each weight's shape."""
    info = graph.registry.lookup(_ADD)
    total = 0.0
    for p in graph.placeholders(PlaceholderKind.WEIGHT):
        meta = graph.node(p).outputs[0]
        total += cost.time_of(OpKey(_ADD, (meta, meta), (), (meta,)), info)
    return total


def _wrap(outcome: Outcome, method: str, factor: int, extra_bytes: int, extra_s: float):
    params = {**outcome.params, "factor": factor}
    if isinstance(outcome, Failure):
        return Failure(method, outcome.reason, params)
    return dataclasses.replace(
        outcome,
        method=method,
        params=params,
        repeats=factor,
        extra_bytes=extra_bytes,
        extra_latency_s=extra_s,
    )


def microbatch_points(
    workload: str,
    inner: Baseline,
    cost: CostModel,
    factors: Iterable[int] = FACTORS,
    dtype: torch.dtype | None = None,
) -> Iterator[Outcome]:
    """`inner`'s points on the micro-step of `workload` for each factor, as whole-step points
    (`repeats`, accumulators and the final update added: module docstring)."""
    method = f"microbatch+{inner.name}"
    batch = get_workload(workload).batch
    for f in factors:
        if f < 1 or batch % f:
            why = f"factor {f} does not divide the batch of {batch}"
            yield Failure(method, why, {"factor": f})
            continue
        _, step = workload_step(workload, batch=batch // f, dtype=dtype)
        graph = step.graph
        extra_bytes = accumulator_bytes(graph)
        extra_s = update_seconds(graph, cost)
        for outcome in inner.points(graph, cost):
            yield _wrap(outcome, method, f, extra_bytes, extra_s)


def best_per_factor(outcomes: Iterable[Outcome]) -> dict[int, list[BaselinePoint]]:
    """The points of `microbatch_points`, grouped by factor (for Fig. 12's curves)."""
    out: dict[int, list[BaselinePoint]] = {}
    for o in outcomes:
        if isinstance(o, BaselinePoint):
            out.setdefault(o.params["factor"], []).append(o)
    return out
