"""A rewritten graph's schedule, from its parent's (MAGIS Alg. 2 and the rules' placement hints).

Four kinds of rewrite need no re-solving, and Alg. 2 would cost a sub-problem rebuild per state
for an answer already known: one that only removes nodes (the duals: a merged copy's readers read
an earlier value, so the old order minus the removed nodes stays valid), one that knows where its
nodes belong (re-materialization and swapping: right before the first late reader), one that
replaces nodes by others in their place (an op split in two, or two merged), and one that gives
the whole order (the min cut's recomputations, placed as its trace runs them). Everything else
is re-ordered by incremental scheduling around the nodes the rewrite touched. The search's final
best is re-ordered in full (`Evaluator.polish`).
"""

from __future__ import annotations

import bisect
import math
from collections import ChainMap
from collections.abc import Iterable, Mapping, Sequence

from magis.cost import CostModel
from magis.ir import Graph, positions
from magis.ir.topological import rank_ahead_of_users, sorted_by_rank, stable_topological_order
from magis.rules import Rewritten
from magis.schedule import incremental_schedule
from magis.schedule.swaps import time_swaps
from magis.sim import tables


def reschedule(
    old: Graph,
    old_order: Sequence[int],
    result: Rewritten,
    cost: CostModel,
    old_pos: Mapping[int, int] | None = None,
) -> list[int]:
    """The order of `result.graph`: the rule's hint when it holds, else Alg. 2 around the old
    nodes the rewrite touched; then Store/Load timing (Store early, Load as late as hidden).
    `old_pos`: the old order's positions, if known (the children of one state share them)."""
    hinted = hinted_order(old_order, result, old_pos)
    order, pos = hinted if hinted is not None else (None, None)
    if order is None and _unplaced(result):
        # No place given (the TASO matmul merge and its dual): the old order kept where the
        # new dependencies allow. Alg. 2 took 0.13 s a child on a 1.1B decoder, 40% of a
        # search there; the winner is re-ordered in full at the end anyway (`polish`).
        placed = _stable_order_around(old_order, result, old_pos)
        order, pos = placed if placed is not None else (None, None)
        if order is None:
            order = stable_topological_order(result.graph, old_order)
    if order is None:
        touched = _touched_old_nodes(old, result)
        order = list(incremental_schedule(old, tuple(old_order), result.graph, touched).order)
    if tables(result.graph).copy_nodes:
        order = time_swaps(result.graph, order, cost, pos)
    return order


def _unplaced(result: Rewritten) -> bool:
    """Whether the rewrite added nodes and gave no hint of where they go."""
    hinted = result.order is not None or result.anchor is not None
    return bool(result.added) and not (hinted or result.placements or result.in_place_of)


def _stable_order_around(
    old_order: Sequence[int], result: Rewritten, pos: Mapping[int, int] | None
) -> tuple[list[int], Mapping[int, int]] | None:
    """`stable_topological_order(result.graph, old_order)`, sorting only the window of the old
    order it can change, and the new order's position keys; None when an added node has no
    user (that order puts it at the end: the whole sort gives it). The whole sort ranked the
    42,000 nodes of a split decoder for the few a matmul merge adds: 5% of a search there.

    The window: from the first old node that can follow an added or changed node, to the last
    that must come before one (a predecessor of one, or an old node ranked below one). The old
    nodes before it are ready first and rank lower, in their order; those after it rank higher
    and nothing in it waits for them; inside it, Kahn's algorithm by rank, as the whole sort."""
    graph, removed = result.graph, result.removed
    pos = positions(old_order) if pos is None else pos
    rank: dict[int, float] = {}
    ranked = ChainMap(rank, pos)  # the old nodes' ranks are their positions
    for n in sorted(result.added, reverse=True):
        ahead = rank_ahead_of_users(graph, n, ranked)
        if ahead is None:
            return None
        rank[n] = ahead
    changed = [n for n in result.changed if n in graph]
    # an added node ranked r follows the old nodes at indices <= r (its id is the larger)
    lo = min([*(math.floor(r) + 1 for r in rank.values()), *(pos[n] for n in changed)])
    hi = max([lo - 1, *(math.floor(r) for r in rank.values())])
    for n in [*rank, *changed]:
        hi = max([hi, *(pos[p] for p in graph.predecessors(n) if p in pos)])
    window = [*(n for n in old_order[lo : hi + 1] if n not in removed), *rank]
    sorted_window = sorted_by_rank(graph, ranked, window)
    order = [
        *_without(old_order[:lo], removed),
        *sorted_window,
        *_without(old_order[hi + 1 :], removed),
    ]
    # keys: the window's nodes spread over its old index range, the old indices taken out
    span = (hi - lo + 2) / (len(sorted_window) + 1)
    keys = {n: lo - 1 + (k + 1) * span for k, n in enumerate(sorted_window)}
    out = [pos[n] for n in removed if n in pos and not lo <= pos[n] <= hi]
    return order, _Ranks(_Keys(pos, keys, [*out, *range(lo, hi + 1)]))


def _touched_old_nodes(old: Graph, result: Rewritten) -> set[int]:
    touched = set(result.changed) | set(result.removed)
    for n in result.added:
        touched.update(result.graph.predecessors(n))
        touched.update(result.graph.successors(n))
    return {n for n in touched if n in old}


def order_without_solving(
    old_order: Sequence[int], result: Rewritten, old_pos: Mapping[int, int] | None = None
) -> list[int] | None:
    """The order the rewrite's own hint gives, or None when it has none or it is not valid.
    `old_pos`: the old order's positions, if known."""
    hinted = hinted_order(old_order, result, old_pos)
    return None if hinted is None else hinted[0]


def hinted_order(
    old_order: Sequence[int], result: Rewritten, old_pos: Mapping[int, int] | None = None
) -> tuple[list[int], Mapping[int, int] | None] | None:
    """`order_without_solving`, with the new order's positions where they come without
    indexing it (from the old order's, `_Keys.rank`), else None beside the order."""
    if result.order is not None:
        order = list(result.order)
        return (order, None) if result.graph.is_valid_schedule(order) else None
    hinted = result.anchor is not None or result.placements or result.in_place_of
    if result.added and not hinted:
        return None
    pos = positions(old_order) if old_pos is None else old_pos
    if not hinted:
        order = _without(old_order, result.removed)
        # the old positions order what is left as the new order does: no new index needed
        if not _valid_around(result.graph, order, result.changed, pos):
            return None
        return order, _Ranks(_Keys(pos, {}, [pos[n] for n in result.removed if n in pos]))
    if result.anchor is not None:
        placements = ((result.anchor, sorted(result.added)),)
        return _place_at_anchors(old_order, result, placements, pos)
    if result.placements:
        return _place_at_anchors(old_order, result, result.placements, pos)
    return _place_in_place_of(old_order, result, pos)


def _without(order: Sequence[int], removed: frozenset[int]) -> list[int]:
    return [n for n in order if n not in removed] if removed else list(order)


class _Keys:
    """Position keys of an order made from another by insertions and removals: the old
    order's indices, and for each inserted node a key between its new neighbours'. They
    compare as the new order's indices would, without indexing the new order (2 ms on a
    42,000-node split decoder, once per child); `rank` is that index."""

    __slots__ = ("_old", "_new", "_removed", "_inserted")

    def __init__(self, old: Mapping[int, int], new: dict[int, float], removed: list[int]) -> None:
        self._old, self._new = old, new
        self._removed = sorted(removed)  # the old indices of the nodes taken out
        self._inserted: list[float] | None = None  # the inserted keys, sorted when first asked

    def __getitem__(self, nid: int) -> float:
        k = self._new.get(nid)
        return self._old[nid] if k is None else k

    def __contains__(self, nid: int) -> bool:
        return nid in self._new or nid in self._old

    def rank(self, nid: int) -> int:
        """`nid`'s index in the new order: the old indices below its key, less those taken
        out, plus the inserted keys below it."""
        if self._inserted is None:
            self._inserted = sorted(self._new.values())
        k = self[nid]
        below = math.ceil(k) - bisect.bisect_left(self._removed, k)
        return below + bisect.bisect_left(self._inserted, k)


class _Ranks(Mapping):
    """The new order's positions, as `_Keys.rank` gives them (Store/Load timing reads a few)."""

    def __init__(self, keys: _Keys) -> None:
        self._keys = keys

    def __getitem__(self, nid: int) -> int:
        if nid not in self._keys:
            raise KeyError(nid)
        return self._keys.rank(nid)

    def __iter__(self):
        raise TypeError("the positions of an order made by insertions are read one by one")

    def __len__(self) -> int:
        raise TypeError("the positions of an order made by insertions are read one by one")


def _valid_around(
    graph: Graph, order: list[int], nodes: Iterable[int], pos: Mapping[int, float] | None = None
) -> bool:
    """Whether `order` runs each of `nodes` after its predecessors and before its successors
    (enough when only these nodes' edges changed); `pos` is the order's positions, or keys
    that compare as they do, if known."""
    pos = positions(order) if pos is None else pos
    return all(
        all(pos[p] < pos[n] for p in graph.predecessors(n))
        and all(pos[x] > pos[n] for x in graph.successors(n))
        for n in nodes
        if n in pos
    )


def _place_in_place_of(
    old_order: Sequence[int], result: Rewritten, pos: Mapping[int, int]
) -> tuple[list[int], Mapping[int, int]] | None:
    """The old order with each group of new nodes where the first of the nodes it replaces
    ran (then `_defer_writers`); None when that order is not valid. `pos`: the old order's
    positions."""
    spots = {min(olds, key=pos.__getitem__): list(news) for olds, news in result.in_place_of}
    order, keys = _inserted(old_order, spots, result.removed, pos)
    return _deferred_if_valid(result.graph, order, result.added, result.touched, keys)


def _place_at_anchors(
    old_order: Sequence[int],
    result: Rewritten,
    placements: Iterable[tuple[int, Sequence[int]]],
    pos: Mapping[int, int],
) -> tuple[list[int], Mapping[int, int]] | None:
    """The old order with each group of added nodes right before its anchor (then
    `_defer_writers`); None when that order is not valid. `pos`: the old order's positions."""
    before: dict[int, list[int]] = {}
    for anchor, nodes in placements:
        before.setdefault(anchor, []).extend(nodes)
    order, keys = _inserted(old_order, before, result.removed, pos)
    added = sorted(result.added)
    return _deferred_if_valid(result.graph, order, added, added, keys)


def _inserted(
    old_order: Sequence[int], before: dict[int, list[int]], removed, pos: Mapping[int, int]
) -> tuple[list[int], _Keys]:
    """The old order without `removed`, with `before[n]` inserted right before each n, and
    its position keys; `pos` is the old order's positions. Copied in slices between the few
    places that change (a loop over a split decoder's 49,000 steps took 15 ms per child)."""
    cuts = sorted({pos[n] for n in before if n in pos} | {pos[n] for n in removed if n in pos})
    order: list[int] = []
    keys: dict[int, float] = {}
    start = 0
    for at in cuts:
        order.extend(old_order[start:at])
        n = old_order[at]
        inserted = before.get(n, ())
        order.extend(inserted)
        for k, m in enumerate(inserted):  # between the old index at - 1 and at
            keys[m] = at - 1 + (k + 1) / (len(inserted) + 1)
        if n not in removed:
            order.append(n)
        start = at + 1
    order.extend(old_order[start:])
    return order, _Keys(pos, keys, [pos[n] for n in removed if n in pos])


def _deferred_if_valid(
    graph: Graph, order: list[int], added, check, keys: _Keys
) -> tuple[list[int], Mapping[int, int]] | None:
    """`order` after `_defer_writers`, if it is valid around `check` and the nodes moved,
    with its positions; `keys`: the order's position keys."""
    order, moved = _defer_writers(graph, order, added, keys)
    if moved:
        pos = positions(order)
        return (order, pos) if _valid_around(graph, order, [*check, *moved], pos) else None
    return (order, _Ranks(keys)) if _valid_around(graph, order, check, keys) else None


def _defer_writers(
    graph: Graph, order: list[int], added, pos: Mapping[int, float]
) -> tuple[list[int], list[int]]:
    """`order` with each node that must follow an added node but runs before it moved to
    right after the last such added node, and the nodes moved. These are in-place updates: a
    recomputed op, or a convolution by a weight's slice, reads the weight, and the scheduler
    had put the weight's update right after its gradient. `pos`: the order's position keys."""
    after: dict[int, int] = {}  # node -> the last added node it must follow
    for a in added:
        for s in graph.successors(a):
            if pos[s] < pos[a] and (s not in after or pos[after[s]] < pos[a]):
                after[s] = a
    if not after:
        return order, []
    follow: dict[int, list[int]] = {}
    for s in sorted(after, key=pos.__getitem__):
        follow.setdefault(after[s], []).append(s)
    out = []
    for n in order:
        if n not in after:
            out.append(n)
            out.extend(follow.get(n, ()))
    return out, list(after)
