"""Value guards in a graph (`EXPECT_OP`, `magis.capture.specialize`): the nodes whose outputs
the capture recorded from a real run and a guard checks at run time, since no shape function
can (their shapes or values come from the data)."""

from __future__ import annotations

import functools

import torch

from magis.errors import MagisError
from magis.ir.graph import Graph
from magis.ir.ops import EXPECT_OP, resolve_overload


def guard_nodes(graph: Graph) -> list[int]:
    """The graph's value guards, in program order."""
    return [n for n in graph.program_order() if graph.node(n).op == EXPECT_OP]


def checked_at_run_time(graph: Graph, nid: int) -> bool:
    """A guard, or a node whose output's shape came from the data (a boolean-mask index,
    nonzero, unique) and a guard checks: fake and meta kernels cannot make its outputs, so
    the meta checks take the recorded ones. Cheap for the ops that cannot be either (the meta
    check asks it of every node it checks)."""
    op = graph.node(nid).op
    if op == EXPECT_OP:
        return True
    if not _shaped_by_data(op):
        return False
    return any(graph.node(u).op == EXPECT_OP for u in graph.users(nid))


@functools.cache
def _shaped_by_data(op: str) -> bool:
    """Whether ATen op `op` may make an output whose shape depends on its inputs' values."""
    if not op.startswith("aten."):
        return False
    try:
        overload = resolve_overload(op)
    except MagisError:
        return False
    return torch.Tag.dynamic_output_shape in overload.tags
