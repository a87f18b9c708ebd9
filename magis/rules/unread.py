"""What a rewrite leaves read by nothing, removed: a node no one reads would still run and hold
its bytes at its step.

Re-materialization redirects a storage's late readers to a copy; when every reader was late,
the original is left unread (the copy is then a move of the segment, not a second run of it),
and so are its views. On SD U-Net such an original, a 4 GiB concatenation of the attention
probabilities, was allocated at the step that held the plan's peak. The duals (`relax`)
merge copies back and leave the copies before them in their segment unread.
"""

from __future__ import annotations

from collections.abc import Iterable

from magis.ir import Graph
from magis.ir.topological import control_followers
from magis.rules.duplicates import recompute_call


def remove_unread(g: Graph, start: Iterable[int]) -> set[int]:
    """Remove the nodes among `start`, and up from them their producers, that are read by
    nothing (none that is an output, an input, an op with effects (`without_effects`), or
    ordered against others by control dependencies); their ids."""
    outputs = {r.node for r in g.outputs}
    frontier, removed = set(start), set()
    while frontier:
        nid = frontier.pop()
        if nid not in g or nid in outputs or g.users(nid) or g.node(nid).is_placeholder:
            continue
        if not without_effects(g, nid) or g.control_deps(nid) or control_followers(g, nid):
            continue
        frontier |= {r.node for r in g.node(nid).inputs}
        g.remove_node(nid)
        removed.add(nid)
    return removed


def remove_unread_upstream(parent: Graph, g: Graph, changed: Iterable[int]) -> frozenset[int]:
    """`remove_unread` from what the `changed` nodes read in `parent` (the values their
    rewrite re-pointed them from); the ids of `parent`'s nodes removed."""
    changed = [n for n in changed if n in parent]
    gone = remove_unread(g, {r.node for n in changed for r in parent.node(n).inputs})
    return frozenset(n for n in gone if n in parent)  # an edit's own new nodes: never added


def without_effects(g: Graph, nid: int) -> bool:
    """Whether running `nid` does nothing but make its outputs: its recomputation is itself (a
    training batch norm that updates running statistics is recomputed without them)."""
    node = g.node(nid)
    return recompute_call(g, nid) == (node.args, node.kwargs_dict)
