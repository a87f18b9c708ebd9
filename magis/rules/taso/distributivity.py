"""Distributivity (TASO): a*c + b*c = (a + b)*c, and back."""

from __future__ import annotations

from magis.ir import Graph, Ref
from magis.rules.base import Rewritten, RuleKind, node_rule
from magis.rules.taso.common import ADD, MUL


def distributable(graph: Graph, nid: int) -> tuple[Ref, Ref, Ref] | None:
    """(a, b, c) when `nid` is a*c + b*c with both products used only here and alpha 1."""
    node = graph.node(nid)
    if node.op != ADD or dict(node.kwargs).get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    left, right = node.args
    if not isinstance(left, Ref) or not isinstance(right, Ref) or left.node == right.node:
        return None
    lhs, rhs = graph.node(left.node), graph.node(right.node)
    if (
        lhs.op != MUL
        or rhs.op != MUL
        or graph.users(left.node) != [nid]
        or graph.users(right.node) != [nid]
    ):
        return None
    if not all(isinstance(a, Ref) for a in (*lhs.args, *rhs.args)):
        return None
    for a, c in ((lhs.args[0], lhs.args[1]), (lhs.args[1], lhs.args[0])):
        for b, c2 in ((rhs.args[0], rhs.args[1]), (rhs.args[1], rhs.args[0])):
            same_shapes = graph.meta(a) == graph.meta(b) == graph.node(nid).outputs[0]
            if c == c2 and same_shapes:
                return a, b, c
    return None


def factor(graph: Graph, nid: int) -> Rewritten:
    """a*c + b*c -> (a + b)*c."""
    g = graph.copy()
    a, b, c = distributable(g, nid)
    out = g.node(nid).outputs[0]
    total = g.add_op(f"{g.node(nid).name}_sum", ADD, (a, b), outputs=(out,))
    product = g.add_op(f"{g.node(nid).name}_factored", MUL, (Ref(total), c), outputs=(out,))
    changed = set(g.replace_uses(Ref(nid), Ref(product)))
    muls = [r.node for r in g.node(nid).inputs]
    g.remove_node(nid)
    for m in muls:
        g.remove_node(m)
    return Rewritten(g, frozenset({total, product}), frozenset(changed), frozenset({nid, *muls}))


def expandable(graph: Graph, nid: int) -> tuple[Ref, Ref, Ref] | None:
    """(a, b, c) when `nid` is (a + b)*c with the sum used only here."""
    node = graph.node(nid)
    if node.op != MUL or len(node.args) != 2 or not all(isinstance(x, Ref) for x in node.args):
        return None
    for s, c in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        total = graph.node(s.node)
        if (
            total.op == ADD
            and graph.users(s.node) == [nid]
            and dict(total.kwargs).get("alpha", 1) == 1
        ):
            a, b = total.args[0], total.args[1]
            if (
                isinstance(a, Ref)
                and isinstance(b, Ref)
                and graph.meta(a) == graph.meta(b) == node.outputs[0]
            ):
                return a, b, c
    return None


def expand(graph: Graph, nid: int) -> Rewritten:
    """(a + b)*c -> a*c + b*c."""
    g = graph.copy()
    a, b, c = expandable(g, nid)
    out = g.node(nid).outputs[0]
    name = g.node(nid).name
    ac = g.add_op(f"{name}_l", MUL, (a, c), outputs=(out,))
    bc = g.add_op(f"{name}_r", MUL, (b, c), outputs=(out,))
    total = g.add_op(f"{name}_expanded", ADD, (Ref(ac), Ref(bc)), outputs=(out,))
    changed = set(g.replace_uses(Ref(nid), Ref(total)))
    old_sum = next(
        r.node for r in g.node(nid).inputs if g.node(r.node).op == ADD and g.users(r.node) == [nid]
    )
    g.remove_node(nid)
    g.remove_node(old_sum)
    return Rewritten(g, frozenset({ac, bc, total}), frozenset(changed), frozenset({nid, old_sum}))


FACTOR = node_rule(
    "factor",
    RuleKind.TASO,
    accepts=lambda graph, n: distributable(graph, n) is not None,
    build=factor,
    ops=(ADD,),
)
EXPAND = node_rule(
    "expand",
    RuleKind.TASO,
    accepts=lambda graph, n: expandable(graph, n) is not None,
    build=expand,
    ops=(MUL,),
)
RULES = (FACTOR, EXPAND)
