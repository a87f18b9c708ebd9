"""Moves that mirror a move already tried on the same state, skipped before they are built.

The search de-duplicates children by their Weisfeiler-Lehman hash (hashing.py, MAGIS Alg. 3
lines 5-8), which does not tell apart the repeated parts of a model: recomputing a tensor in
layer 3 or in layer 4 of a decoder, or in part 3 or part 4 of a split, gives children of one
hash, and the search keeps the first. But each such child was built, checked and hashed before
it was found out: on corpus:phi's 42,000-node split graph (24 layers, 8 parts) 476 of the 609
moves of a 120-child neighbourhood were such duplicates, at 15-20 ms each.

A rewrite's child differs from its parent's hash within `LEVELS` hops of the nodes it touches,
and the rules touch nodes a few hops from those they name in their description (a chain
recomputed behind a named node: up to three). So a move is described here by its rule and its
description with every node name replaced by the final-level labels of the nodes within `RING`
hops of that node: two moves of one state with the same signature are, but for what lies
further away, the same rewrite of two isomorphic places, and the second is skipped. On that
neighbourhood the signature skipped 476 of the 496 duplicates and no move whose child was new.
Two hops were not enough: in a stack of ten identical MLP blocks, recomputing a matmul "and 3
producers behind it" in block 4 and in block 5 gave two graphs (the
chains reach different neighbours) that a two-hop signature took for one; four hops tell them
apart. This is a symmetry reduction of ours, not the paper's; like the hash it rests on, it
may take two different graphs for one.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from magis.ir import DerivedKey, Graph
from magis.ir.storage import Layered
from magis.rules import Rewrite
from magis.search.hashing import neighbours

RING = 4  # hops around a named node whose labels make its part of a signature

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAMES: DerivedKey[Layered[str, int]] = DerivedKey("search.node_names")


def node_names(graph: Graph) -> Mapping[str, int]:
    """name -> node id, kept with the graph version (built once per state expanded, unless
    derived from its parent's: `derive_node_names`)."""
    return graph.derived(_NAMES, lambda: Layered({n.name: nid for nid, n in graph.nodes.items()}))


def derive_node_names(
    parent: Graph, child: Graph, touched: Collection[int], removed: Collection[int]
) -> None:
    """Install on `child` (`parent` with `touched` nodes added or replaced and `removed` ones
    gone) its names, from the parent's when it has them: a 100,000-node step's names took
    40 ms to build for every state expanded."""
    names = parent.known(_NAMES)
    if names is None:
        return
    draft = names.draft()
    for n in (*removed, *touched):
        if n in parent and (name := parent.node(n).name) in draft and draft[name] == n:
            draft.pop(name)
    for n in touched:
        if n in child:
            draft[child.node(n).name] = n
    derived = draft.done()
    child.derived(_NAMES, lambda: derived)


class MoveSignatures:
    """The signatures of the moves tried so far on one state (see the module docstring)."""

    def __init__(self, graph: Graph, labels: Mapping[int, int]) -> None:
        self.graph = graph
        self.labels = labels  # the state's final-level WL labels
        self._rings: dict[int, str] = {}
        self._seen: set[tuple[str, str]] = set()

    def first(self, rewrite: Rewrite) -> bool:
        """False when a move of the same signature was offered before."""
        signature = (rewrite.rule, _NAME.sub(self._token, rewrite.description))
        if signature in self._seen:
            return False
        self._seen.add(signature)
        return True

    def _token(self, match: re.Match) -> str:
        nid = node_names(self.graph).get(match.group())
        if nid is None:
            return match.group()  # a word of the description, not a node
        ring = self._rings.get(nid)
        if ring is None:
            ring = self._rings[nid] = self._ring_labels(nid)
        return ring

    def _ring_labels(self, nid: int) -> str:
        ring, frontier = {nid}, {nid}
        for _ in range(RING):
            frontier = neighbours(self.graph, frontier) - ring
            ring |= frontier
        labels = self.labels
        around = hash(tuple(sorted(labels[m] for m in ring))) & 0xFFFFFFFFFFFF
        return f"<{labels[nid]:x}:{around:x}>"
