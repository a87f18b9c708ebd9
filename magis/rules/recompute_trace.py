"""An execution trace with recomputations, turned into a real program (DTR and XLA baselines,
fusion-aware min-cut re-materialization: `rules/mincut_remat.py`).

Dynamic re-materialization (Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021) and
XLA's HloRematerialization pass both produce the same thing: the sequence of ops a device runs,
in which some op appears more than once because a value it made was dropped and is needed again.
`trace_graph` turns such a sequence into a `Graph` plus an order that our simulator costs and our
executor runs: the first execution of a node is the node itself, every later one is a clone (as
`magis.rules.remat.recompute` builds one), and every use reads the most recent execution of the
node it reads. The simulator frees a storage after its last reader, which is exactly eviction:
once a newer copy exists, nobody reads the old one again.
"""

from __future__ import annotations

from collections.abc import Sequence

from magis.ir import Graph, Ref
from magis.ir.graph import map_refs
from magis.rules.duplicates import recompute_call


def trace_graph(graph: Graph, events: Sequence[int], tag: str = "remat") -> tuple[Graph, list[int]]:
    """The program that runs `events` (node ids of `graph`, in execution order; a repeated id is a
    recomputation), and its order.

    Nodes keep their ids; the k-th recomputation of node `x` is a new node named `x_{tag}{k}`.
    Every node of `graph` must occur at least once.
    """
    g = graph.copy()
    latest: dict[int, int] = {}  # node of `graph` -> the node holding its latest execution
    copies: dict[int, int] = {}
    order: list[int] = []
    for nid in events:
        if nid in latest:
            copies[nid] = copies.get(nid, 0) + 1
            new = _clone(g, graph, nid, latest, f"{tag}{copies[nid]}")
        else:
            new = nid
            _rebind(g, graph, nid, latest)
        latest[nid] = new
        order.append(new)
    missing = set(graph.nodes) - set(latest)
    if missing:
        raise ValueError(f"the trace never runs {len(missing)} node(s), e.g. {min(missing)}")
    return g, order


def _moved(latest: dict[int, int]):
    return lambda r: Ref(latest.get(r.node, r.node), r.index)


def _clone(g: Graph, graph: Graph, nid: int, latest: dict[int, int], suffix: str) -> int:
    """A recomputation of `nid` (as re-materialization makes one: batch norms without their
    running statistics, `recompute_call`) reading the latest copies of its inputs."""
    node = graph.node(nid)
    call = recompute_call(graph, nid)
    if call is None:
        raise ValueError(f"the trace recomputes {node.name}, which cannot be recomputed")
    move = _moved(latest)
    args = map_refs(call[0], move)
    kwargs = {key: map_refs(v, move) for key, v in call[1].items()}
    return g.add_op(f"{node.name}_{suffix}", node.op, args, kwargs, node.outputs)


def _rebind(g: Graph, graph: Graph, nid: int, latest: dict[int, int]) -> None:
    """Make the first execution of `nid` read the latest copies of its inputs."""
    for ref in graph.node(nid).inputs:
        holder = latest.get(ref.node)
        if holder is None:
            raise ValueError(f"the trace runs {graph.node(nid).name} before its input {ref}")
        if holder != ref.node:
            g.replace_uses(ref, Ref(holder, ref.index), [nid])
