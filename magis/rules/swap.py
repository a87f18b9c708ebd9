"""Swapping and its dual (MAGIS §5.2, Fig. 8).

Swapping puts a Store after a hot-spot storage's producer and a Load before its late readers,
which then read the loaded copy (through re-created views, as re-materialization does: see
remat.py): the device copy can die after its early readers while the host holds the bytes.
De-swapping removes a Store/Load pair. A recomputation can also be traded for a swap
(`remat_to_swap`): its copies merged back and the original swapped out for the readers the copy
fed. Where Store and Load finally sit (Store as early as possible, Load as late as its transfer
can still be hidden, §6.2) is decided by the scheduler's Store/Load timing, not here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from magis.ir import Graph, Ref
from magis.ir.ops import LOAD_OP, STORE_OP
from magis.rules.base import Rewrite, Rewritten, Rule, RuleContext, RuleKind
from magis.rules.duplicates import recomputed_pairs
from magis.rules.remat import (
    GROUP_CANDIDATES,
    LateReads,
    hot_late_reads,
    merge_all_duplicates,
    merge_into,
    redirect_late_reads,
    segment_heads,
)
from magis.rules.repeated import kind_rewrites, repeated_rewrites


def swap(graph: Graph, reads: LateReads) -> Rewritten:
    g = graph.copy()
    changed = swap_into(g, reads)
    added = g.added_since(graph)
    return Rewritten(g, added, frozenset(changed), anchor=reads.readers[0])


def swap_into(g: Graph, reads: LateReads) -> set[int]:
    """`swap`'s edit, made on `g` itself; returns the readers changed."""
    value = reads.storage
    meta = g.meta(value)
    name = g.node(value.node).name
    store = g.add_op(f"{name}_store", STORE_OP, (value,), outputs=(meta,))
    load = g.add_op(f"{name}_load", LOAD_OP, (Ref(store),), outputs=(meta,))
    return redirect_late_reads(g, reads, Ref(load))


def unswap(graph: Graph, load: int) -> Rewritten:
    """Readers of the Load read the original tensor again; the Store goes when nothing needs it."""
    return unswap_all(graph, [load])


def unswap_all(graph: Graph, loads: list[int]) -> Rewritten:
    """`unswap` of every Load of `loads`, on one copy of the graph."""
    g = graph.copy()
    changed, removed = unswap_all_into(g, loads)
    return Rewritten(g, frozenset(), frozenset(changed), frozenset(removed))


def unswap_all_into(g: Graph, loads: list[int]) -> tuple[set[int], set[int]]:
    """`unswap_all`'s edit, made on `g` itself; returns (changed, removed) node ids."""
    changed: set[int] = set()
    removed: set[int] = set()
    for load in loads:
        store = g.node(load).inputs[0].node
        original = g.node(store).inputs[0]
        c, r = merge_into(g, original.node, load, {0: original})
        changed |= c
        removed |= r
        if not g.users(store):
            g.remove_node(store)
            removed.add(store)
    return changed - removed, removed


def is_swap_load(graph: Graph, load: int) -> bool:
    """Whether `load` brings back a tensor a Store swapped out (not offloaded optimizer state,
    which a Load reads from its placeholder: `magis.rules.offload`)."""
    return graph.node(graph.node(load).inputs[0].node).op == STORE_OP


def _stored_value(graph: Graph, load: int) -> Ref:
    """The tensor a Load brings back: what its Store reads."""
    return graph.node(graph.node(load).inputs[0].node).inputs[0]


def _match_deswap(ctx: RuleContext) -> Iterator[Rewrite]:
    """For each repeated kind of swapped tensor, every swap of that kind dropped at once;
    then one rewrite per Load."""
    graph = ctx.graph
    loads = [n for n in ctx.nodes_of(LOAD_OP) if n not in ctx.frozen and is_swap_load(graph, n)]
    yield from kind_rewrites(
        graph, loads, lambda n: _stored_value(graph, n), "deswap", RuleKind.DESWAP,
        lambda grp: f"drop the {len(grp)} swaps like "
        f"{graph.node(_stored_value(graph, grp[0]).node).name}'s",
        lambda grp: unswap_all(graph, grp),
    )  # fmt: skip
    for load in loads[: ctx.max_candidates]:
        yield Rewrite(
            "deswap",
            RuleKind.DESWAP,
            f"drop the swap of {graph.node(load).name}",
            lambda n=load: unswap(graph, n),
        )


def swappable(graph: Graph, value: Ref) -> bool:
    """Not an input, not a Store/Load's copy, and not a collective's buffer: the collective
    fills it on the communication stream until its `wait_tensor`, so a Store placed after the
    collective would copy it half filled, and a wait on the Loaded copy waits for nothing
    (c10d's work registry knows the original). Nor a workspace whose metadata is smaller than
    its storage (`OpInfo.workspace`, oneDNN's LSTM): the Load's copy would be simulated at the
    metadata's size, 0 bytes, while the real one holds the whole buffer."""
    info = graph.info(value.node)
    if graph.node(value.node).is_placeholder or info.copy_stream or info.comm_stream:
        return False
    return info.workspace is None or graph.storages().nbytes[value] == graph.meta(value).nbytes


def _swappable_late_reads(ctx: RuleContext) -> Iterator[LateReads]:
    graph = ctx.graph
    return hot_late_reads(ctx, lambda v: swappable(graph, v))


def _describe_swap(graph: Graph, reads: LateReads) -> str:
    name, until = graph.node(reads.storage.node).name, graph.node(reads.readers[0]).name
    return f"swap {name} out until {until}"


def _match_swap(ctx: RuleContext) -> Iterator[Rewrite]:
    """Each kind of hot storage a repeated layer holds many of, swapped at once
    (`repeated.py`), then one rewrite per hot storage."""
    graph = ctx.graph
    every = hot_late_reads(ctx, lambda v: swappable(graph, v), GROUP_CANDIDATES)
    yield from repeated_rewrites(ctx, "swap", RuleKind.SWAP, "swap", every, swap_into)
    for reads in _swappable_late_reads(ctx):
        yield Rewrite(
            "swap", RuleKind.SWAP, _describe_swap(graph, reads), lambda r=reads: swap(graph, r)
        )


def swap_instead_of_recompute(
    graph: Graph, heads: list[tuple[int, int]], pos: Mapping[int, int]
) -> Rewritten:
    """A new graph where the recomputed segments starting at `heads` ((original, copy)
    pairs) are merged back, and every storage their late readers then read again is swapped
    out for those readers instead: the same tensors leave the device through the peak, for a
    transfer the scheduler may hide rather than a recomputation that costs its time."""
    merged = merge_all_duplicates(graph, heads, pos)
    g = merged.graph  # a copy of its own already
    changed = set(merged.changed)
    placements = []
    for reads in _reads_redirected_by_merge(graph, g, merged.changed, pos):
        before = g.next_id
        changed |= swap_into(g, reads)
        placements.append((reads.readers[0], tuple(n for n in range(before, g.next_id) if n in g)))
    added = g.added_since(graph)
    return Rewritten(
        g, added, frozenset(changed - added), merged.removed, placements=tuple(placements)
    )


def _reads_redirected_by_merge(
    old: Graph, g: Graph, readers: frozenset[int], pos: Mapping[int, int]
) -> list[LateReads]:
    """Per storage that a merge made `readers` read (an input of `g` that differs from what
    they read in `old`: an original value, which `old` has too): those readers, in schedule
    order, and the values they read of it."""
    smap = old.storages()  # the parent's, built already: which storages live to the end
    found: dict[Ref, tuple[set[int], set[Ref]]] = {}
    for r in readers:
        # A node's inputs are its distinct values: a merge that made two of them one makes
        # the tuple shorter, so what changed is what `old` did not read.
        read_before = set(old.node(r).inputs)
        for now in g.node(r).inputs:
            storage = _viewed(g, now)
            if now in read_before or storage in smap.outputs or storage in smap.resident:
                continue
            if not swappable(g, storage):
                continue
            who, aliases = found.setdefault(storage, (set(), set()))
            who.add(r)
            aliases.add(now)
    return [
        LateReads(s, tuple(sorted(who, key=pos.__getitem__)), tuple(sorted(aliases)))
        for s, (who, aliases) in found.items()
    ]


def _viewed(g: Graph, ref: Ref) -> Ref:
    """The value `ref` is a view of, in `g` (a merge re-wires views, so the parent's storage
    map no longer knows their base)."""
    while g.info(ref.node).is_view:
        ref = g.node(ref.node).inputs[0]  # a view aliases its first tensor argument
    return ref


def _match_remat_to_swap(ctx: RuleContext) -> Iterator[Rewrite]:
    """For each repeated kind of recomputed segment, all of them traded for swaps at once;
    then one rewrite per segment. Under a latency limit this gives back a recomputation's
    time at the same peak (the search otherwise keeps whichever of the two came first: an
    SD U-Net search that recomputed a 4 GiB softmax had no time left for the others)."""
    graph = ctx.graph
    heads = segment_heads(graph, recomputed_pairs(ctx))
    yield from kind_rewrites(
        graph, heads, lambda p: Ref(p[1], 0), "remat_to_swap", RuleKind.DEREMAT,
        lambda grp: f"swap the {len(grp)} tensors recomputed like {graph.node(grp[0][0]).name} "
        "instead",
        lambda grp: swap_instead_of_recompute(graph, grp, ctx.position),
    )  # fmt: skip
    for keep, drop in heads[: ctx.max_candidates]:
        yield Rewrite(
            "remat_to_swap",
            RuleKind.DEREMAT,
            f"swap {graph.node(keep).name} instead of recomputing it as {graph.node(drop).name}",
            lambda p=(keep, drop): swap_instead_of_recompute(graph, [p], ctx.position),
        )


SWAP = Rule("swap", RuleKind.SWAP, _match_swap)
DESWAP = Rule("deswap", RuleKind.DESWAP, _match_deswap)
# A dual (it gives time back), so it is of the duals' kind: it leads when time is wanted, and
# is tried only then. On a state that meets its latency limit its child (the same peak, less
# time) ranked best by time alone, and the search followed swaps instead of saving memory
# (60 s under latency 1.10, --workers 2: EfficientNet-B0 0.474 -> 0.400 of the peak,
# DenseNet-121 0.510 -> 0.480; SD U-Net, which needs the trade, 0.436 -> 0.437).
REMAT_TO_SWAP = Rule("remat_to_swap", RuleKind.DEREMAT, _match_remat_to_swap, only_when_wanted=True)
