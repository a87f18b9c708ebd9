"""Compaction and its dual: the late part of a hot storage copied out early.

A storage whose late readers read only a slice of it stays live, all of it, until the last of
them. A backward pass makes this common. The gradient of a `cat` is one buffer, and its slices
go to each input's gradient. U-Net's skip connections take theirs at the very end, when the
encoder's backward runs. So the decoder's whole concatenated gradient (1 GiB per level at
paper size) is live through the rest of the backward, for the half of it the skip needs.
Re-materialization cannot help: the buffer is a gradient, and nothing recomputes it more
cheaply. Swapping would move all of it over the host link.

Compaction copies each slice the late readers use (a `clone` of the view, placed right after
the storage's last early reader) and lets them read the copy. The buffer dies with its early
readers, and only the slices stay live. It costs one device-side copy of the slices. It is
heuristic H2's kind of rule, offered for hot-spot storages only. The dual drops such a copy
and reads the view again.
"""

from __future__ import annotations

from collections.abc import Iterator

from magis.ir import Graph, Ref
from magis.rules.base import Rewrite, Rewritten, Rule, RuleContext, RuleKind, node_rule
from magis.rules.remat import LateReads, hot_late_reads, merge_into

CLONE = "aten.clone.default"
MAX_KEPT = 0.75  # compact only when the late readers use at most this share of the storage


def compactable(ctx: RuleContext, reads: LateReads) -> bool:
    """Whether the late readers read only views of the storage, covering at most MAX_KEPT of
    it, and its early readers run before the first late one."""
    graph = ctx.graph
    if not reads.aliases or reads.storage in reads.aliases:
        return False
    kept = sum(graph.meta(a).nbytes for a in reads.aliases)
    return kept <= MAX_KEPT * graph.storages().nbytes[reads.storage]


def compact(ctx: RuleContext, reads: LateReads) -> Rewritten:
    """A new graph where the late readers read clones of the views they read, made right
    after the storage's last early reader (or the views, if they come later)."""
    graph, pos = ctx.graph, ctx.position
    g = graph.copy()
    changed: set[int] = set()
    for alias in reads.aliases:
        name = g.node(alias.node).name
        copy = g.add_op(f"{name}_compact", CLONE, (alias,), outputs=(g.meta(alias),))
        changed.update(g.replace_uses(alias, Ref(copy), reads.readers))
    added = g.added_since(graph)
    late = set(reads.readers)
    early = [r for r in graph.storages().readers[reads.storage] if r not in late]
    after = max([pos[r] for r in early] + [pos[a.node] for a in reads.aliases])
    return Rewritten(g, added, frozenset(changed), anchor=ctx.order[after + 1])


def _match_compact(ctx: RuleContext) -> Iterator[Rewrite]:
    graph = ctx.graph
    for reads in hot_late_reads(ctx, lambda s: True):
        if compactable(ctx, reads):
            yield Rewrite(
                "compact",
                RuleKind.COMPACT,
                f"copy out {len(reads.aliases)} views of {graph.node(reads.storage.node).name} "
                f"for {len(reads.readers)} late readers",
                lambda r=reads: compact(ctx, r),
            )


def _is_compaction(graph: Graph, nid: int) -> bool:
    node = graph.node(nid)
    if node.op != CLONE or node.kwargs or len(node.args) != 1:
        return False
    source = node.args[0]
    writes = any(
        graph.info(u).mutates or graph.node(u).writes_into is not None for u in graph.users(nid)
    )
    return graph.info(source.node).is_view and not writes


def decompact(graph: Graph, nid: int) -> Rewritten:
    """The dual: the clone's readers read the view again."""
    g = graph.copy()
    view = g.node(nid).args[0]
    changed, removed = merge_into(g, view.node, nid, {0: view})
    return Rewritten(g, frozenset(), frozenset(changed), frozenset(removed))


COMPACT = Rule("compact", RuleKind.COMPACT, _match_compact)
DECOMPACT = node_rule(
    "decompact",
    RuleKind.DECOMPACT,
    accepts=_is_compaction,
    build=decompact,
    describe=lambda graph, n: f"read {graph.node(n).name}'s view again",
    ops=(CLONE,),
)
