"""Which nodes of a graph are collectives: the communication stream's (issue 44)."""

from __future__ import annotations

from magis.ir.derived import DerivedKey
from magis.ir.graph import Graph

_COMM_NODES: DerivedKey[frozenset[int]] = DerivedKey("ir.comm_nodes")


def comm_nodes(graph: Graph) -> frozenset[int]:
    """The collectives of `graph` (ops whose `OpInfo.comm_stream` is set), once per version."""

    def build() -> frozenset[int]:
        lookup = graph.registry.lookup
        return frozenset(n for n, node in graph.nodes.items() if lookup(node.op).comm_stream)

    return graph.derived(_COMM_NODES, build)
