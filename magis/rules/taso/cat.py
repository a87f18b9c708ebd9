"""Concat/split algebra (TASO): a slice that exactly covers one input of a cat is that input."""

from __future__ import annotations

from magis.ir import Graph, Ref
from magis.rules.base import Rewritten, RuleKind, node_rule
from magis.rules.taso.common import CAT, SLICE, cat_dim


def slice_of_cat(graph: Graph, nid: int) -> Ref | None:
    """The cat input a slice covers exactly, or None."""
    node = graph.node(nid)
    if node.op != SLICE or len(node.args) < 4:
        return None
    src = graph.node(node.args[0].node)
    if src.op != CAT or node.args[1] != cat_dim(src):
        return None
    step = node.args[4] if len(node.args) > 4 else 1
    dim, start, end = node.args[1], node.args[2], node.args[3]
    offset = 0
    for part in src.args[0]:
        width = graph.meta(part).shape[dim]
        if (start, end, step) == (offset, offset + width, 1):
            return part
        offset += width
    return None


def fold_slice_of_cat(graph: Graph, nid: int) -> Rewritten:
    g = graph.copy()
    part = slice_of_cat(g, nid)
    changed = set(g.replace_uses(Ref(nid), part))
    g.remove_node(nid)
    return Rewritten(g, frozenset(), frozenset(changed), frozenset({nid}))


FOLD_SLICE_OF_CAT = node_rule(
    "fold_slice_of_cat",
    RuleKind.TASO,
    accepts=lambda graph, n: slice_of_cat(graph, n) is not None,
    build=fold_slice_of_cat,
    describe=lambda graph, n: f"fold {graph.node(n).name}",
    ops=(SLICE,),
)
RULES = (FOLD_SLICE_OF_CAT,)
