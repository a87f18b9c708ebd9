"""Re-materialization and its dual (MAGIS §5.2, Fig. 8).

Re-materialization gives the late readers of a hot-spot tensor their own recomputed copy of its
producer, so the original can die after its early readers; de-re-materialization merges a
recomputed copy back into the original (it is common-subexpression elimination).

Memory is counted in storages, not tensors (DESIGN "core objects"): a transformer's backward
reads its saved activations mostly through views (the `view` in front of every linear layer's
`mm`). So the unit here is a hot storage: every reader of any of its aliases scheduled after the
peak is a late reader, and the views those readers go through are re-created on top of the copy.
MAGIS's Fig. 8 draws one user; giving every late reader the one copy is what frees the storage
through the peak, and one user is the special case.

Random ops are never recomputed: a second draw would differ (fusion-aware-checkpointing §3.4
bans them too).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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


_BATCH_NORM = "aten.native_batch_norm.default"


def recompute_call(graph: Graph, nid: int) -> tuple[tuple, dict] | None:
    """(args, kwargs) of a recomputation of `nid`, or None when it cannot be recomputed.

    A training-mode batch norm updates its running statistics in place (so `recomputable`
    refuses it), but its outputs depend on the batch alone: recomputed without the running
    statistics it gives the same outputs and updates nothing. Convolution nets are mostly
    batch norms; without this, nothing between two convolutions could be recomputed. DTR
    recomputes batch norms too (ResNet is one of its benchmarks).
    """
    node = graph.node(nid)
    if recomputable(graph, nid):
        return node.args, node.kwargs_dict
    if node.op == _BATCH_NORM and not node.kwargs and len(node.args) == 8 and node.args[5]:
        return (*node.args[:3], None, None, *node.args[5:]), {}
    return None


@dataclass(frozen=True)
class LateReads:
    """A hot storage and the nodes that read it after the peak (through any alias)."""

    storage: Ref  # the value that allocated it
    readers: tuple[int, ...]  # in schedule order
    aliases: tuple[Ref, ...]  # the values those readers read: the storage itself or its views


def late_reads(ctx: RuleContext, storage: Ref) -> LateReads | None:
    """The readers of `storage` scheduled after the peak, or None when nothing reads it late,
    a late reader is frozen (an enabled F-Tree region), or it must live to the end anyway."""
    graph, pos = ctx.graph, ctx.position
    smap = graph.storages()
    if storage in smap.outputs or storage in smap.resident:
        return None
    late = sorted(
        (r for r in set(smap.readers[storage]) if pos[r] > ctx.sim.peak_step),
        key=pos.__getitem__,
    )
    if not late or any(r in ctx.frozen for r in late):
        return None
    aliases = {
        ref
        for r in late
        for ref in graph.node(r).inputs
        if smap.base[ref] == storage and ref.node not in late
    }
    return LateReads(storage, tuple(late), tuple(sorted(aliases)))


def redirect_late_reads(g: Graph, reads: LateReads, source: Ref) -> set[int]:
    """Make the late readers read `source` (a copy of the storage) instead: views between the
    storage and those readers that ran early are re-created on top of `source`. Returns the
    readers changed; the re-created views are new nodes of `g`."""
    mapping = {reads.storage: source}
    for alias in sorted(reads.aliases, key=lambda r: r.node):
        _map_alias(g, alias, mapping)
    changed: set[int] = set()
    for reader in reads.readers:
        for old in g.node(reader).inputs:
            if old in mapping:
                changed.update(g.replace_uses(old, mapping[old], [reader]))
    return changed


def _map_alias(g: Graph, alias: Ref, mapping: dict[Ref, Ref]) -> Ref:
    """The copy of `alias` on top of the mapped storage, re-creating its view chain."""
    if alias in mapping:
        return mapping[alias]
    view = g.node(alias.node)
    parent = next(r for r in view.inputs)  # a view aliases its first tensor argument
    new_parent = _map_alias(g, parent, mapping)
    args = tuple(new_parent if a == parent else a for a in view.args)
    twin = g.add_op(f"{view.name}_re", view.op, args, view.kwargs_dict, view.outputs)
    for i in range(len(view.outputs)):
        mapping[Ref(alias.node, i)] = Ref(twin, i)
    return mapping[alias]


def recompute(graph: Graph, reads: LateReads) -> Rewritten:
    """A new graph where the late readers of `reads.storage` read a recomputed copy of its
    producer, placed right before the first of them."""
    g = graph.copy()
    node = g.node(reads.storage.node)
    args, kwargs = recompute_call(graph, node.id)
    twin = g.add_op(f"{node.name}_remat", node.op, args, kwargs, node.outputs)
    changed = redirect_late_reads(g, reads, Ref(twin, reads.storage.index))
    added = frozenset(n for n in g.nodes if n not in graph)
    return Rewritten(g, added, frozenset(changed), anchor=reads.readers[0])


def hot_storages(ctx: RuleContext) -> Iterator[Ref]:
    """The hot-spot storages, largest first (heuristic H2), or every non-resident storage when
    H2 is off."""
    if ctx.hotspots_only:
        for spot in ctx.sim.hotspots:
            yield spot.storage
        return
    smap = ctx.graph.storages()
    for s in sorted(smap.nbytes, key=lambda s: -smap.nbytes[s]):
        if s not in smap.resident:
            yield s


def hot_late_reads(ctx: RuleContext, eligible) -> Iterator[LateReads]:
    """The late reads of hot storages whose producer `eligible(storage)` accepts, at most
    `ctx.max_candidates`: the candidates of both re-materialization and swapping (H2)."""
    emitted = 0
    for storage in hot_storages(ctx):
        if storage.node in ctx.frozen or not eligible(storage):
            continue
        reads = late_reads(ctx, storage)
        if reads is None:
            continue
        yield reads
        emitted += 1
        if emitted >= ctx.max_candidates:
            return


def _match_remat(ctx: RuleContext) -> Iterator[Rewrite]:
    graph = ctx.graph
    for reads in hot_late_reads(ctx, lambda s: recompute_call(graph, s.node) is not None):
        yield Rewrite(
            "remat",
            RuleKind.REMAT,
            f"recompute {graph.node(reads.storage.node).name} for {len(reads.readers)} late readers",
            lambda r=reads: recompute(graph, r),
        )


def _duplicate_key(graph: Graph, nid: int):
    node = graph.node(nid)
    try:
        key = (node.op, _frozen(node.args), _frozen(node.kwargs))
        hash(key)
    except TypeError:  # unhashable constants: never merged
        return None
    return key


def _frozen(value):
    """`value` with lists as tuples (a view's shape argument is a list)."""
    if isinstance(value, list | tuple):
        return (type(value).__name__, *map(_frozen, value))
    return value


def merge_into(
    g: Graph, keep: int, drop: int, replacement: dict[int, Ref] | None = None
) -> tuple[set[int], set[int]]:
    """Every reader of `drop` reads `keep` instead and `drop` goes; views re-created on top of
    `drop` become duplicates of views of `keep` and merge too (the dual of
    `redirect_late_reads`). `replacement` maps an output index of `drop` to the value that
    replaces it (default: `keep`'s output of the same index). Edits `g`; returns (changed,
    removed) node ids."""
    changed: set[int] = set()
    removed: set[int] = set()
    work = [(keep, drop, replacement or {})]
    while work:
        k, d, repl = work.pop()
        readers_of_drop = set(g.users(d))  # only these can have become duplicates
        for i in range(len(g.node(d).outputs)):
            changed.update(g.replace_uses(Ref(d, i), repl.get(i, Ref(k, i))))
        g.remove_node(d)
        removed.add(d)
        work.extend((k2, d2, {}) for k2, d2 in _duplicate_views(g, k) if d2 in readers_of_drop)
    return changed - removed, removed


def _duplicate_views(g: Graph, nid: int) -> list[tuple[int, int]]:
    """(keep, drop) pairs among the views reading `nid` that compute the same thing."""
    first: dict = {}
    pairs = []
    for u in sorted(g.users(nid)):
        if not g.info(u).is_view:
            continue
        key = _duplicate_key(g, u)
        if key is None:
            continue
        keep = first.setdefault(key, u)
        if keep != u:
            pairs.append((keep, u))
    return pairs


def merge_duplicate(graph: Graph, keep: int, drop: int) -> Rewritten:
    """A new graph where every user of `drop` reads `keep` instead, and `drop` is gone."""
    g = graph.copy()
    changed, removed = merge_into(g, keep, drop)
    return Rewritten(g, frozenset(), frozenset(changed), frozenset(removed))


def _match_deremat(ctx: RuleContext) -> Iterator[Rewrite]:
    graph = ctx.graph
    first: dict = {}
    emitted = 0
    for nid in ctx.order:
        if nid in ctx.frozen or not recomputable(graph, nid) or graph.info(nid).is_view:
            continue
        key = _duplicate_key(graph, nid)
        if key is None:
            continue
        keep = first.setdefault(key, nid)
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
