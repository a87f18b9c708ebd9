"""Swapping and its dual (MAGIS §5.2, Fig. 8).

Swapping puts a Store after a hot-spot tensor's producer and a Load before one late user, which
then reads the loaded copy: the device copy can die after its early users while the host holds
the bytes. De-swapping removes a Store/Load pair. Where Store and Load sit in the schedule (Store
as early as possible, Load as late as its transfer can still be hidden, §6.2) is decided by the
scheduler, not here.
"""

from __future__ import annotations

from collections.abc import Iterator

from magis.ir import Graph, Ref
from magis.ir.ops import LOAD_OP, STORE_OP
from magis.rules.base import Rewrite, Rewritten, Rule, RuleContext, RuleKind
from magis.rules.remat import hot_value_users


def swap(graph: Graph, value: Ref, user: int) -> Rewritten:
    g = graph.copy()
    meta = g.meta(value)
    name = g.node(value.node).name
    store = g.add_op(f"{name}_store", STORE_OP, (value,), outputs=(meta,))
    load = g.add_op(f"{name}_load", LOAD_OP, (Ref(store),), outputs=(meta,))
    changed = g.replace_uses(value, Ref(load), [user])
    return Rewritten(g, frozenset({store, load}), frozenset(changed))


def unswap(graph: Graph, load: int) -> Rewritten:
    """Users of the Load read the original tensor again; the Store goes when nothing needs it."""
    g = graph.copy()
    store = g.node(load).inputs[0].node
    original = g.node(store).inputs[0]
    changed = set(g.replace_uses(Ref(load), original))
    g.remove_node(load)
    removed = {load}
    if not g.users(store):
        g.remove_node(store)
        removed.add(store)
    return Rewritten(g, frozenset(), frozenset(changed), frozenset(removed))


def _swappable(graph: Graph, value: Ref) -> bool:
    return not graph.node(value.node).is_placeholder and not graph.info(value.node).copy_stream


def _match_swap(ctx: RuleContext) -> Iterator[Rewrite]:
    graph = ctx.graph
    for value, user in hot_value_users(ctx, lambda v: _swappable(graph, v)):
        yield Rewrite(
            "swap",
            RuleKind.SWAP,
            f"swap {graph.node(value.node).name} out until {graph.node(user).name}",
            lambda v=value, u=user: swap(graph, v, u),
        )


def _match_deswap(ctx: RuleContext) -> Iterator[Rewrite]:
    for nid in ctx.order:
        if ctx.graph.node(nid).op == LOAD_OP and nid not in ctx.frozen:
            yield Rewrite(
                "deswap",
                RuleKind.DESWAP,
                f"drop the swap of {ctx.graph.node(nid).name}",
                lambda n=nid: unswap(ctx.graph, n),
            )


SWAP = Rule("swap", RuleKind.SWAP, _match_swap)
DESWAP = Rule("deswap", RuleKind.DESWAP, _match_deswap)
