"""Relaxation: the memory rewrites a state has room to do without, undone together in one child.

MAGIS §5.2's duals undo one recomputation or one swap per state, and the repeated-kind duals
(repeated.py) one kind at once. A plan below its memory ceiling still pays for rewrites whose
bytes it no longer needs: pofo's warm start recomputes a (cat, batch norm, ReLU, convolution)
segment in every DenseNet layer, each layer's of another shape (126 copies), and a 60 s search
under a 0.4 memory limit undid some 25 of them one state at a time (1.155 of the latency at
0.392 of the peak).

The state's simulation says where there is room: M_i at every step. Merging a recomputed copy
back keeps the original's storage live from its last reader before the copy to the copy's
step; dropping a swap keeps the stored tensor on the device from its last reader before the
Load to the Load. Each undo adds its bytes over those steps. Taken greedily, the most time
given back per byte first, an undo is kept when the profile with every undo kept so far stays
at or under the ceiling (`RuleContext.memory_ceiling`: the memory limit, or under a latency
limit the state's own peak), and every undo kept is made in one rewrite. The estimate ignores
the re-scheduling that follows and the copies' own intermediates that go away; the child is
simulated exactly as any other, so a wrong estimate costs one state. Half the room is offered
too, for when the full estimate is too tight. (The greedy fill of a memory profile is ours.)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from magis.ir import DerivedKey, Graph, Ref
from magis.ir.ops import LOAD_OP
from magis.ir.storage import StorageMap
from magis.rules.base import Rewrite, Rewritten, Rule, RuleContext, RuleKind
from magis.rules.duplicates import copies_in_order, recompute_call
from magis.rules.remat import merge_into
from magis.rules.swap import is_swap_load, unswap_all_into
from magis.rules.unread import remove_unread
from magis.sim.tables import node_times, tables

MIN_UNDOS = 2  # one undo alone is the plain duals' move
# A context's (original, copy) pairs (`recomputed_copies`): the relaxation's and the trade's.
RECOMPUTED_COPIES: DerivedKey[list[tuple[int, int]]] = DerivedKey("rules.recomputed_copies")


@dataclass(frozen=True)
class Undo:
    """One recomputed copy merged back (`copy`) or one swap dropped (`load`), the steps where
    it keeps bytes live that the state does not, and the seconds it gives back."""

    copy: tuple[int, int] | None  # (original, copy) of a recomputation
    load: int | None  # the Load of a dropped swap
    spans: tuple[tuple[int, int, int], ...]  # (first step, end step exclusive, bytes)
    seconds: float

    @property
    def nbytes(self) -> int:
        return sum(b for _, _, b in self.spans)


def _span(
    smap: StorageMap, pos: dict[int, int], storage: Ref, until: int, since: int
) -> tuple[int, int, int] | None:
    """The steps `storage` would stay live for that it does not now: after its last reader
    before step `until` (or step `since`, its producer's) up to `until`."""
    early = [pos[r] for r in smap.readers.get(storage, ()) if pos.get(r, until) < until]
    start = max(early, default=since) + 1
    return (start, until, smap.nbytes[storage]) if until > start else None


def recomputed_copies(ctx: RuleContext) -> list[tuple[int, int]]:
    """(original, copy) for every node outside frozen regions that computes what an earlier
    one does, its inputs taken up to copies: a recomputed segment's every node, not only its
    first (`duplicates.recomputed_pairs` sees the first; the rest become duplicates only once it
    is merged). In the copies' schedule order; found once per context (`RuleContext.derived`)."""
    return ctx.derived(RECOMPUTED_COPIES, lambda: _recomputed_copies(ctx))


def _recomputed_copies(ctx: RuleContext) -> list[tuple[int, int]]:
    return copies_in_order(ctx.graph, ctx.position, ctx.frozen, _recomputable)


def recompute_undos(
    ctx: RuleContext, times: np.ndarray, pairs: Sequence[tuple[int, int]] | None = None
) -> list[Undo]:
    """One `Undo` per recomputed copy (`pairs`, default `recomputed_copies`): its readers read
    the original again."""
    graph, pos = ctx.graph, ctx.position
    smap = graph.storages()
    lasting = smap.outputs | smap.host  # live to the end, or not on the device
    undos = []
    for keep, drop in recomputed_copies(ctx) if pairs is None else pairs:
        spans = []
        for i in range(len(graph.node(keep).outputs)):
            original = Ref(keep, i)
            if original not in smap.nbytes or original in lasting:
                continue
            span = _span(smap, pos, original, pos[drop], pos[keep])
            if span is not None:
                spans.append(span)
        undos.append(Undo((keep, drop), None, tuple(spans), float(times[drop])))
    return undos


def swap_undos(ctx: RuleContext, times: np.ndarray) -> list[Undo]:
    """One `Undo` per swap (its Load) outside frozen regions."""
    graph, pos = ctx.graph, ctx.position
    smap = graph.storages()
    undos = []
    loads = (n for n in tables(graph).copy_nodes if graph.node(n).op == LOAD_OP)
    for load in sorted(loads, key=pos.__getitem__):  # the tables' set: no scan of the order
        if load in ctx.frozen or not is_swap_load(graph, load):
            continue
        store = graph.node(load).inputs[0].node
        storage = smap.base[graph.node(store).inputs[0]]
        if storage in smap.resident or storage in smap.host:
            continue
        span = _span(smap, pos, storage, pos[load], pos[storage.node])
        seconds = float(times[store] + times[load])
        undos.append(Undo(None, load, (span,) if span is not None else (), seconds))
    return undos


def fitting(timeline: np.ndarray, undos: Sequence[Undo], ceiling: int) -> list[Undo]:
    """The undos kept greedily, the most seconds per byte first: each one whose spans, added to
    `timeline` and to the undos kept before it, stay at or under `ceiling` at every step."""
    extra = np.zeros(len(timeline), dtype=np.int64)
    kept = []
    for undo in sorted(undos, key=lambda u: -u.seconds / (1 + u.nbytes)):
        if undo.seconds <= 0:
            continue
        if not undo.spans:
            kept.append(undo)
            continue
        lo = min(a for a, _, _ in undo.spans)
        hi = max(b for _, b, _ in undo.spans)
        for a, b, nbytes in undo.spans:
            extra[a:b] += nbytes
        if int((timeline[lo:hi] + extra[lo:hi]).max()) <= ceiling:
            kept.append(undo)
        else:
            for a, b, nbytes in undo.spans:
                extra[a:b] -= nbytes
    return kept


def undo_all(graph: Graph, undos: Sequence[Undo]) -> Rewritten:
    """A new graph with every undo made: each copy's readers read its original (a copy that
    reads another copy then reads that copy's original: the same values), the copies left
    without readers removed, and the swaps dropped."""
    g = graph.copy()
    changed: set[int] = set()
    removed: set[int] = set()
    copies = [u.copy for u in undos if u.copy is not None]
    for keep, drop in copies:
        if keep in g and drop in g:
            c, r = merge_into(g, keep, drop)
            changed, removed = (changed | c) - r, removed | r
    removed |= remove_unread(g, {r.node for _, d in copies for r in graph.node(d).inputs})
    loads = [u.load for u in undos if u.load is not None and u.load in g]
    if loads:
        c, r = unswap_all_into(g, loads)
        changed, removed = (changed | c) - r, removed | r
    return Rewritten(g, frozenset(), frozenset(changed - removed), frozenset(removed))


def _describe(undos: Sequence[Undo], room: str) -> str:
    copies = sum(1 for u in undos if u.copy is not None)
    swaps = len(undos) - copies
    parts = [f"{copies} recomputed copies merged back"] if copies else []
    parts += [f"{swaps} swaps dropped"] if swaps else []
    return f"relax: {' and '.join(parts)} ({room})"


def _undos(
    ctx: RuleContext, pairs: Sequence[tuple[int, int]] | None = None
) -> tuple[list[Undo], list[Undo]] | None:
    """The state's recomputation and swap undos, or None when there are too few to batch."""
    if ctx.cost is None:
        return None
    times = node_times(ctx.graph, ctx.cost)
    remats, swaps = recompute_undos(ctx, times, pairs), swap_undos(ctx, times)
    return (remats, swaps) if len(remats) + len(swaps) >= MIN_UNDOS else None


def _relaxation(ctx: RuleContext, kept: list[Undo], what: str) -> Rewrite:
    return Rewrite(
        "relax", RuleKind.DEREMAT, _describe(kept, what), lambda: undo_all(ctx.graph, kept)
    )


def _match_relax(ctx: RuleContext) -> Iterator[Rewrite]:
    """Recomputations, swaps, and both, undone as far as the room under the ceiling allows (and
    as far as half of it allows, when there is room above the peak); each distinct choice of
    at least `MIN_UNDOS` undos once."""
    undos = _undos(ctx)
    if undos is None:
        return
    remats, swaps = undos
    sim = ctx.sim
    top = int(sim.timeline.max())
    room = ctx.memory_ceiling - sim.peak_bytes  # in the state's memory figure
    ceilings = [(top + room, "the room under the ceiling")]
    if room > 0:
        ceilings.append((top + room // 2, "half the room under the ceiling"))
    offered: set[frozenset] = set()
    for ceiling, what in ceilings:
        for pool in (remats, swaps, remats + swaps):
            kept = fitting(sim.timeline, pool, ceiling)
            key = frozenset((u.copy, u.load) for u in kept)
            if len(kept) < MIN_UNDOS or key in offered:
                continue
            offered.add(key)
            yield _relaxation(ctx, kept, what)


def relaxation_at_peak(
    ctx: RuleContext, wanted_seconds: float, parent: RuleContext | None = None
) -> Rewrite | None:
    """Every recomputation and swap undo that fits under the state's own peak, in one rewrite,
    when their time adds up to `wanted_seconds` at least (what a child over a latency limit
    needs back: `Evaluator.repaired`); else None. `parent`: the context of the state the
    child's rewrite was made on (it keeps node ids): its recomputed copies, found once, stand
    for the child's (a copy the rewrite just made is not one to undo)."""
    pairs = None
    if parent is not None:
        graph = ctx.graph
        pairs = [(k, d) for k, d in recomputed_copies(parent) if k in graph and d in graph]
    undos = _undos(ctx, pairs)
    if undos is None:
        return None
    kept = fitting(ctx.sim.timeline, undos[0] + undos[1], int(ctx.sim.timeline.max()))
    if len(kept) < MIN_UNDOS or sum(u.seconds for u in kept) < wanted_seconds:
        return None
    return _relaxation(ctx, kept, "the room under its peak")


# A dual: it gives time back, so it leads when time is wanted and is tried only then (as the
# recomputation-swap trade: on a state that meets a latency limit, a child with the same peak
# and less time would rank first by time alone).
RELAX = Rule("relax", RuleKind.DEREMAT, _match_relax, only_when_wanted=True)


def _recomputable(graph: Graph, nid: int) -> bool:
    return recompute_call(graph, nid) is not None
