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

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from magis.ir import DerivedKey, Graph, Ref
from magis.rules.base import Rewrite, Rewritten, Rule, RuleContext, RuleKind
from magis.rules.duplicates import (
    duplicate_key,
    mapped,
    mergeable,
    recompute_call,
    recomputed_pairs,
)
from magis.rules.repeated import kind_rewrites, repeated_rewrites
from magis.rules.unread import remove_unread_upstream


@dataclass(frozen=True)
class LateReads:
    """A hot storage and the nodes that read it after the peak (through any alias)."""

    storage: Ref  # the value that allocated it
    readers: tuple[int, ...]  # in schedule order
    aliases: tuple[Ref, ...]  # the values those readers read: the storage itself or its views


def late_reads(ctx: RuleContext, storage: Ref) -> LateReads | None:
    """The readers of `storage` scheduled after the peak, or None when nothing reads it late,
    a late reader is frozen (an enabled F-Tree region), or it must live to the end anyway."""
    smap = ctx.graph.storages()
    if storage in smap.outputs or storage in smap.resident:
        return None
    reads = reads_from(ctx.graph, ctx.position, storage, ctx.sim.peak_step + 1)
    if reads is None or any(r in ctx.frozen for r in reads.readers):
        return None
    return reads


def reads_from(graph: Graph, pos: Mapping[int, int], storage: Ref, start: int) -> LateReads | None:
    """The readers of `storage` at schedule position `start` or later, in schedule order, and
    the values (the storage or its views made before then) they read of it; None when none."""
    smap = graph.storages()
    late = sorted((r for r in set(smap.readers[storage]) if pos[r] >= start), key=pos.__getitem__)
    if not late:
        return None
    mine = set(late)
    aliases = {
        ref
        for r in late
        for ref in graph.node(r).inputs
        if smap.base[ref] == storage and ref.node not in mine
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
    producer, placed right before the first of them (a segment of one node)."""
    return recompute_segment(graph, reads, (reads.storage.node,))


MAX_CHAIN = 4  # nodes a segment recomputation may re-run
# A context's late reads by hot storage (None: none to rewrite), filled as the rules ask.
LATE_READS: DerivedKey[dict[Ref, LateReads | None]] = DerivedKey("rules.late_reads")
GROUP_CANDIDATES = 512  # candidates read for the repeated kinds' groups (which need every member)


def recompute_chain(ctx: RuleContext, reads: LateReads) -> tuple[int, ...]:
    """The producers a late copy of `reads.storage` needs re-run, in topological order: its own
    producer, and, walking back, the producer of every input whose storage would otherwise
    have to live until the first late reader (at most MAX_CHAIN nodes).

    One-node re-materialization keeps the producer's inputs alive until the copy runs, which
    saves nothing when they were dead by then. A training ReLU after a batch norm is the
    common case: its output is saved for the backward, the batch norm's output is not, and
    only re-running both (from the convolution's output, which the backward keeps anyway)
    frees anything. That is the segment re-computation of checkpointing, in one rewrite.
    Inputs that cannot be recomputed (random ops, in-place updates) stay as inputs."""
    graph, pos, smap = ctx.graph, ctx.position, ctx.graph.storages()
    first_late = pos[reads.readers[0]]

    def live_anyway(ref: Ref) -> bool:
        base = smap.base[ref]
        if base in smap.resident or base in smap.outputs:
            return True
        return any(pos[r] >= first_late for r in smap.readers[base])

    chain: set[int] = set()
    frontier = [reads.storage.node]
    while frontier and len(chain) < MAX_CHAIN:
        nid = frontier.pop(0)
        if nid in chain or nid in ctx.frozen or recompute_call(graph, nid) is None:
            continue
        chain.add(nid)
        frontier.extend(r.node for r in graph.node(nid).inputs if not live_anyway(r))
    return tuple(sorted(_without_view_roots(graph, chain), key=pos.__getitem__))


def _without_view_roots(graph: Graph, chain: set[int]) -> set[int]:
    """`chain` without views whose input it does not recompute (the walk stopped at them):
    a copied view of the original is no saving, and the dual never merges views."""
    chain = set(chain)
    while True:
        roots = {
            n
            for n in chain
            if graph.info(n).is_view and any(r.node not in chain for r in graph.node(n).inputs)
        }
        if not roots:
            return chain
        chain -= roots


def recompute_segment(graph: Graph, reads: LateReads, chain: tuple[int, ...]) -> Rewritten:
    """A new graph where the late readers of `reads.storage` read the last of fresh copies of
    `chain`'s nodes (each copy reading the copies before it), placed right before the first
    late reader."""
    g = graph.copy()
    changed = recompute_segment_into(g, reads, chain)
    removed = remove_unread_upstream(graph, g, changed)
    added = g.added_since(graph)
    return Rewritten(g, added, frozenset(changed - removed), removed, anchor=reads.readers[0])


def recompute_segment_into(g: Graph, reads: LateReads, chain: tuple[int, ...]) -> set[int]:
    """`recompute_segment`'s edit, made on `g` itself; returns the readers changed."""
    mapping: dict[Ref, Ref] = {}
    for nid in chain:
        node = g.node(nid)
        args, kwargs = recompute_call(g, nid)
        args = tuple(mapped(a, mapping) for a in args)
        twin = g.add_op(f"{node.name}_remat", node.op, args, kwargs, node.outputs)
        for i in range(len(node.outputs)):
            mapping[Ref(nid, i)] = Ref(twin, i)
    return redirect_late_reads(g, reads, mapping[reads.storage])


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


def hot_late_reads(ctx: RuleContext, eligible, limit: int | None = None) -> Iterator[LateReads]:
    """The late reads of hot storages whose producer `eligible(storage)` accepts, at most
    `limit` (`ctx.max_candidates`): the candidates of re-materialization and swapping (H2).
    Each storage's are found once per context (on a 42,000-node split graph the rules asked
    for the same 500 hot storages' readers twice a popped state)."""
    limit = ctx.max_candidates if limit is None else limit
    known = ctx.derived(LATE_READS, dict)  # re-materialization and swapping share them
    emitted = 0
    for storage in hot_storages(ctx):
        if storage.node in ctx.frozen or not eligible(storage):
            continue
        if storage not in known:
            known[storage] = late_reads(ctx, storage)
        reads = known[storage]
        if reads is None:
            continue
        yield reads
        emitted += 1
        if emitted >= limit:
            return


def _match_remat(ctx: RuleContext) -> Iterator[Rewrite]:
    """Per hot storage: its producer re-run for the late readers, and, when that would keep
    dead inputs alive, the segment behind it too (`recompute_chain`); first, for each kind
    of hot storage a repeated layer holds many of, all of them at once (`repeated.py`)."""
    graph = ctx.graph

    def eligible(s: Ref) -> bool:
        return recompute_call(graph, s.node) is not None

    yield from repeated_rewrites(
        ctx, "remat", RuleKind.REMAT, "recompute", hot_late_reads(ctx, eligible, GROUP_CANDIDATES),
        lambda g, reads: recompute_segment_into(g, reads, recompute_chain(ctx, reads)),
    )  # fmt: skip
    for reads in hot_late_reads(ctx, eligible):
        name = graph.node(reads.storage.node).name
        chain = recompute_chain(ctx, reads)
        if len(chain) > 1:
            yield Rewrite(
                "remat",
                RuleKind.REMAT,
                f"recompute {name} and {len(chain) - 1} producers behind it for "
                f"{len(reads.readers)} late readers",
                lambda r=reads, c=chain: recompute_segment(graph, r, c),
            )
        yield Rewrite(
            "remat",
            RuleKind.REMAT,
            f"recompute {name} for {len(reads.readers)} late readers",
            lambda r=reads: recompute(graph, r),
        )


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
        key = duplicate_key(g, u)
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


def segment_heads(graph: Graph, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pairs whose copy reads no other copy: the first node of each recomputed segment
    (`merge_all_duplicates` of it merges the whole segment back)."""
    drops = {d for _, d in pairs}
    return [(k, d) for k, d in pairs if not any(r.node in drops for r in graph.node(d).inputs)]


def merge_all_duplicates(
    graph: Graph, pairs: list[tuple[int, int]], pos: Mapping[int, int]
) -> Rewritten:
    """A new graph with every (keep, drop) of `pairs` merged, and then every node that became
    a duplicate of another by those merges (the rest of a recomputed segment, whose copies
    read the merged copy) merged too, the earlier in the schedule (`pos`: node -> step; the
    context's, indexed once per state, not once per child) kept."""
    g = graph.copy()
    changed: set[int] = set()
    removed: set[int] = set()
    work = list(pairs)
    while work:
        keep, drop = work.pop()
        if keep not in g or drop not in g:
            continue
        c, r = merge_into(g, keep, drop)
        changed |= c
        removed |= r
        work.extend(p for u in c if u in g and (p := _duplicate_of(g, u, pos)) is not None)
    return Rewritten(g, frozenset(), frozenset(changed - removed), frozenset(removed))


def _duplicate_of(g: Graph, nid: int, pos: Mapping[int, int]) -> tuple[int, int] | None:
    """(keep, drop) for `nid` and a node reading the same inputs that computes the same thing,
    the earlier kept; None when there is none."""
    if not _merges(g, nid):
        return None
    key = duplicate_key(g, nid)
    if key is None:
        return None
    siblings = {u for r in g.node(nid).inputs for u in g.users(r.node)} - {nid}
    for u in sorted(siblings, key=lambda n: pos.get(n, len(pos) + n)):
        if _merges(g, u) and duplicate_key(g, u) == key:
            return (u, nid) if pos.get(u, len(pos) + u) < pos.get(nid, len(pos) + nid) else (nid, u)
    return None


def _merges(g: Graph, nid: int) -> bool:
    """What a segment's merge follows: a node that may be dropped for an earlier one
    (`mergeable`) or a view of one."""
    return mergeable(g, nid) or (g.info(nid).is_view and recompute_call(g, nid) is not None)


def _match_deremat(ctx: RuleContext) -> Iterator[Rewrite]:
    """For each repeated kind of recomputed copy, every copy of that kind merged back at once
    (with the rest of its segment); then one rewrite per copy."""
    graph = ctx.graph
    pairs = recomputed_pairs(ctx)
    yield from kind_rewrites(
        graph, pairs, lambda p: Ref(p[1], 0), "deremat", RuleKind.DEREMAT,
        lambda grp: f"merge the {len(grp)} recomputed copies like {graph.node(grp[0][0]).name}'s "
        "back",
        lambda grp: merge_all_duplicates(graph, grp, ctx.position),
    )  # fmt: skip
    for keep, drop in pairs[: ctx.max_candidates]:
        name, into = graph.node(drop).name, graph.node(keep).name
        if _readers_alike(graph, keep, drop):  # a recomputed segment: all of it back first
            yield Rewrite(
                "deremat",
                RuleKind.DEREMAT,
                f"merge {name} and the segment it feeds into {into}'s",
                lambda k=keep, d=drop: merge_all_duplicates(graph, [(k, d)], ctx.position),
            )
        yield Rewrite(
            "deremat",
            RuleKind.DEREMAT,
            f"merge {name} into {into}",
            lambda k=keep, d=drop: merge_duplicate(graph, k, d),
        )


def _readers_alike(graph: Graph, a: int, b: int) -> bool:
    """Whether a non-view reader of `b` (through views) runs an op a reader of `a` does: then
    merging b into a may make it a duplicate too (the next node of a recomputed segment).
    A segment's copies are undone in one rewrite instead of one state each: a warm start
    from pofo holds DenseNet's recomputed (cat, batch norm, ReLU, convolution) segments."""
    return bool(_reader_ops(graph, a) & _reader_ops(graph, b))


def _reader_ops(graph: Graph, nid: int) -> set[str]:
    ops: set[str] = set()
    frontier = list(graph.users(nid))
    while frontier:
        u = frontier.pop()
        if graph.info(u).is_view:
            frontier.extend(graph.users(u))
        else:
            ops.add(graph.node(u).op)
    return ops


REMAT = Rule("remat", RuleKind.REMAT, _match_remat)
DEREMAT = Rule("deremat", RuleKind.DEREMAT, _match_deremat)
