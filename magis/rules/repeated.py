"""One memory rewrite applied to every hot storage of a repeated layer at once.

A model is mostly a stack of identical layers, so the tensors at its peak come in kinds: T5's
peak holds twelve (8, 12, 512, 512) softmax outputs and twelve (16, 512, 3072) ReLU outputs,
one of each per layer. Re-materializing or swapping them one per search state takes a popped
state, a child's schedule and a simulation for each, and on a graph of 7,000 nodes the search
affords a few states per second. So re-materialization and swapping also offer, for each kind
of hot storage several of them share (the producer's op, shape and dtype), the rewrite of all
of them in one child; the one-storage rewrites stay, for when the whole group is too slow for
a latency limit. Each kind is also offered by its first half: under a latency limit the
whole kind is often too slow where half of it fits, and the half's child offers the rest's
halves in turn, so a kind is taken in a few steps instead of one tensor per state (the
one-at-a-time descent took corpus:regnet's search 1.5 s per 37 MiB). (MAGIS §5.2 defines the
rewrites on one tensor; grouping them is ours.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from magis.ir import Graph, Ref
from magis.rules.base import Rewrite, Rewritten, RuleContext, RuleKind
from magis.rules.unread import remove_unread_upstream

MIN_GROUP = 3  # fewer repeats than this are left to the one-storage rewrites
MAX_GROUPS = 2  # kinds offered per state, largest total first
MIN_HALF = 2  # a smaller half is left to the one-storage rewrites


def signature(graph: Graph, storage: Ref) -> tuple:
    """What makes two hot storages the same kind: their producer's op, shape and dtype."""
    meta = graph.meta(storage)
    return (graph.node(storage.node).op, tuple(meta.shape), meta.dtype)


def repeated_groups(graph: Graph, reads: Iterable[Any]) -> list[list[Any]]:
    """The late reads (`remat.LateReads`) grouped by their storage's kind, in the order
    given within a group; groups of at least `MIN_GROUP`, the largest total first."""
    return grouped_by_kind(graph, reads, lambda r: r.storage)


def grouped_by_kind(graph: Graph, items: Iterable[Any], value: Callable[[Any], Ref]) -> list[list]:
    """`items` grouped by the kind (`signature`) of the value `value(item)` names, in the order
    given within a group; groups of at least `MIN_GROUP`, the most bytes first, at most
    `MAX_GROUPS`. The duals group their undos this way: the recomputed copies (or the loads)
    of one repeated kind go back in one rewrite, as they came."""
    groups: dict[tuple, list[Any]] = {}
    for item in items:
        groups.setdefault(signature(graph, value(item)), []).append(item)
    found = [g for g in groups.values() if len(g) >= MIN_GROUP]
    nbytes = graph.storages().nbytes
    return sorted(found, key=lambda g: -sum(nbytes.get(value(i), 0) for i in g))[:MAX_GROUPS]


def kind_rewrites(
    graph: Graph,
    items: Iterable[Any],
    value: Callable[[Any], Ref],
    rule: str,
    kind: RuleKind,
    describe: Callable[[list], str],
    build: Callable[[list], Rewritten],
) -> Iterator[Rewrite]:
    """One rewrite per repeated kind among `items` (`grouped_by_kind` of `value(item)`), built
    by `build(group)`: the duals' undo of a whole kind, and the swap trade of one."""
    for group in with_halves(grouped_by_kind(graph, items, value)):
        yield Rewrite(rule, kind, describe(group), lambda g=group: build(g))


def with_halves(groups: list[list[Any]]) -> Iterator[list[Any]]:
    """Each group, then its first half (in the group's order: the hottest first) when that
    half has `MIN_HALF` members (a half under `MIN_GROUP` is taken back one at a time)."""
    for group in groups:
        yield group
    for group in groups:
        if len(group) // 2 >= MIN_HALF:
            yield group[: len(group) // 2]


def apply_to_all(
    graph: Graph, reads: list[Any], edit: Callable[[Graph, Any], set[int]]
) -> Rewritten:
    """`edit` (a one-storage rewrite made in place) applied to each of `reads` on one copy of
    `graph`; each storage's new nodes are placed right before its first late reader."""
    g = graph.copy()
    changed: set[int] = set()
    placements = []
    for r in reads:
        before = g.next_id
        changed |= edit(g, r)
        placements.append((r.readers[0], range(before, g.next_id)))
    removed = remove_unread_upstream(graph, g, changed)  # after every edit: they share nodes
    added = g.added_since(graph)
    placed = tuple((at, tuple(n for n in ids if n in g)) for at, ids in placements)
    return Rewritten(g, added, frozenset(changed - added - removed), removed, placements=placed)


def repeated_rewrites(
    ctx: RuleContext,
    rule: str,
    kind: RuleKind,
    verb: str,
    reads: Iterable[Any],
    edit: Callable[[Graph, Any], set[int]],
) -> Iterator[Rewrite]:
    """One rewrite per repeated kind of hot storage among `reads` (every hot storage's late
    reads the rule accepts, uncapped), applying `edit` to all of that kind."""
    graph = ctx.graph
    for group in with_halves(repeated_groups(graph, reads)):
        first = graph.node(group[0].storage.node).name
        yield Rewrite(
            rule,
            kind,
            f"{verb} {first} and the {len(group) - 1} hot tensors like it (same op and shape)",
            lambda g=group: apply_to_all(graph, g, edit),
        )
