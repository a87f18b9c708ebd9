"""The two baselines with no knob: PyTorch as it runs (program order, each tensor freed after its
last use: §7.1's baseline) and re-ordering alone (the DP scheduler, ROAM-style: no overhead)."""

from __future__ import annotations

from collections.abc import Iterator

from magis.baselines.base import Baseline, Outcome, point
from magis.cost import CostModel
from magis.ir import Graph
from magis.schedule import schedule


def _program_order(graph: Graph, cost: CostModel) -> Iterator[Outcome]:
    yield point("pytorch", graph, graph.program_order(), cost)


def _dp_reorder(graph: Graph, cost: CostModel) -> Iterator[Outcome]:
    yield point("dp-reorder", graph, schedule(graph, "dp").order, cost)


PYTORCH = Baseline("pytorch", "program order, tensors freed after last use", _program_order)
DP_REORDER = Baseline("dp-reorder", "memory-optimal re-ordering (DP scheduler)", _dp_reorder)
