"""Re-materialization and its dual (MAGIS §5.2, Fig. 8).

Re-materialization gives one late user of a hot-spot tensor its own recomputed copy of the
producer, so the original can die after its early users; de-re-materialization merges a
recomputed copy back into the original (it is common-subexpression elimination). Random ops are
never recomputed: a second draw would differ (fusion-aware-checkpointing §3.4 bans them too).
"""

from __future__ import annotations

from collections.abc import Iterator

from magis.ir import Graph, Ref
from magis.rules.base import Rewrite, Rewritten, Rule, RuleContext, RuleKind


def recomputable(graph: Graph, nid: int) -> bool:
    node = graph.node(nid)
    info = graph.info(nid)
    return not (
        node.is_placeholder
        or info.is_random
        or info.copy_stream
        or info.mutates
        or node.writes_into is not None
    )


def late_users(ctx: RuleContext, value: Ref) -> list[int]:
    """Users of `value` scheduled after the peak: they are what keeps it alive through it."""
    pos = ctx.position
    graph = ctx.graph
    return [
        u
        for u in graph.users(value.node)
        if value in graph.node(u).inputs and pos[u] > ctx.sim.peak_step and u not in ctx.frozen
    ]


def hot_values(ctx: RuleContext) -> Iterator[Ref]:
    """The allocating values of the hot-spot storages, largest first (heuristic H2), or every
    allocating value when H2 is off."""
    if ctx.hotspots_only:
        for spot in ctx.sim.hotspots:
            yield spot.storage
        return
    smap = ctx.graph.storages()
    for s in sorted(smap.nbytes, key=lambda s: -smap.nbytes[s]):
        if s not in smap.resident:
            yield s


def recompute(graph: Graph, value: Ref, user: int) -> Rewritten:
    """A new graph where `user` reads a recomputed copy of `value`'s producer."""
    g = graph.copy()
    node = g.node(value.node)
    twin = g.add_op(f"{node.name}_remat", node.op, node.args, node.kwargs_dict, node.outputs)
    changed = set()
    for i in range(len(node.outputs)):
        changed.update(g.replace_uses(Ref(value.node, i), Ref(twin, i), [user]))
    return Rewritten(g, frozenset({twin}), frozenset(changed))


def hot_value_users(ctx: RuleContext, eligible) -> Iterator[tuple[Ref, int]]:
    """(hot value, late user) pairs for the values `eligible(value)` accepts, at most
    `ctx.max_candidates` of them: the candidates of both re-materialization and swapping (H2)."""
    emitted = 0
    for value in hot_values(ctx):
        if value.node in ctx.frozen or not eligible(value):
            continue
        for user in late_users(ctx, value):
            yield value, user
            emitted += 1
            if emitted >= ctx.max_candidates:
                return


def _match_remat(ctx: RuleContext) -> Iterator[Rewrite]:
    graph = ctx.graph
    for value, user in hot_value_users(ctx, lambda v: recomputable(graph, v.node)):
        yield Rewrite(
            "remat",
            RuleKind.REMAT,
            f"recompute {graph.node(value.node).name} for {graph.node(user).name}",
            lambda v=value, u=user: recompute(graph, v, u),
        )


def _duplicate_key(graph: Graph, nid: int):
    node = graph.node(nid)
    try:
        return (node.op, node.args, node.kwargs)
    except TypeError:
        return None


def merge_duplicate(graph: Graph, keep: int, drop: int) -> Rewritten:
    """A new graph where every user of `drop` reads `keep` instead, and `drop` is gone."""
    g = graph.copy()
    changed = set()
    for i in range(len(g.node(drop).outputs)):
        changed.update(g.replace_uses(Ref(drop, i), Ref(keep, i)))
    g.remove_node(drop)
    return Rewritten(g, frozenset(), frozenset(changed), frozenset({drop}))


def _match_deremat(ctx: RuleContext) -> Iterator[Rewrite]:
    graph = ctx.graph
    first: dict = {}
    emitted = 0
    for nid in ctx.order:
        if nid in ctx.frozen or not recomputable(graph, nid) or graph.info(nid).is_view:
            continue
        key = _duplicate_key(graph, nid)
        try:
            keep = first.setdefault(key, nid)
        except TypeError:  # unhashable constants: never merged
            continue
        if keep == nid:
            continue
        yield Rewrite(
            "deremat",
            RuleKind.DEREMAT,
            f"merge {graph.node(nid).name} into {graph.node(keep).name}",
            lambda k=keep, d=nid: merge_duplicate(graph, k, d),
        )
        emitted += 1
        if emitted >= ctx.max_candidates:
            return


REMAT = Rule("remat", RuleKind.REMAT, _match_remat)
DEREMAT = Rule("deremat", RuleKind.DEREMAT, _match_deremat)
