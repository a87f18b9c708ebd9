"""Store and Load timing (MAGIS §6.2): Store as early as possible, Load as late as its transfer
can still be hidden behind compute.

A Store moves right after the producer of the tensor it copies, so the device copy can die as
soon as its last early reader has run. A Load moves back from its first user over compute ops
until their time covers its transfer — or until it meets its Store or something it depends on —
so its buffer is allocated no earlier than needed.
"""

from __future__ import annotations

from magis.cost import CostModel
from magis.ir import Graph
from magis.ir.ops import LOAD_OP, STORE_OP
from magis.sim import node_times, tables


def time_swaps(graph: Graph, order: list[int] | tuple[int, ...], cost: CostModel) -> list[int]:
    order = list(order)
    copies = tables(graph).copy_nodes
    moved = [n for n in order if n in copies]
    stores = [n for n in moved if graph.node(n).op == STORE_OP]
    loads = [n for n in moved if graph.node(n).op == LOAD_OP]
    for s in stores:
        order.remove(s)
        producer_pos = max(order.index(p) for p in graph.predecessors(s))
        order.insert(producer_pos + 1, s)
    times = node_times(graph, cost)
    for ld in loads:
        order.remove(ld)
        order.insert(_hidden_position(graph, order, ld, times, cost.op_time(graph, ld)), ld)
    return order


def _hidden_position(graph: Graph, order: list[int], load: int, times, transfer: float) -> int:
    first_user = min(order.index(u) for u in graph.successors(load))
    floor = max(order.index(p) for p in graph.predecessors(load)) + 1
    covered, at = 0.0, first_user
    while at > floor and covered < transfer:
        at -= 1
        covered += float(times[order[at]])
    return at
