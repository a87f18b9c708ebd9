"""Narrow-waist values and the partition of a scheduling problem into segments (MAGIS §6.1).

nw(v) = |V| - |anc(v)| - |des(v)| - 1 counts the nodes independent of v: in every topological
order v's position lies in a window of nw(v) + 1 places. A node with nw = 0 has a fixed place and
splits the problem into two independent ones (ROAM's memory-insensitive operators); MAGIS's
GraphPartition also cuts at nw = 1.

Taken literally on a training graph almost no node has nw <= 1 (NOTES.md): a weight gradient or
update hangs off the backward chain, a recomputation in a backward formula (GELU's pow) hangs
between the forward and the backward, and each such *floater* is independent of everything in
its long window. We work on units (placeholders and views folded away, see `problem`) and peel
floaters off before cutting: nodes whose window is wider than a threshold leave the core, the
threshold halves from |V|/2 down to `min_window`, and nw is recomputed after each round, so a few
long floaters do not drag their neighbours along. The core is cut at nw <= 1; each floater then
joins a segment that its dependencies allow (`placement`). `partition` does this only as far as
needed to bring segments within reach of the DP.

Ancestor and descendant sets are Python-int bitsets over a topological order: one OR per edge
and a popcount per node, about 10 ms for 2,000 units.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from magis.schedule.problem import Problem


@dataclass(frozen=True)
class Closure:
    """Ancestor and descendant bitsets of units (bit i = units[i]) within a unit subset."""

    units: tuple[int, ...]  # topological order
    anc: tuple[int, ...]
    des: tuple[int, ...]

    @functools.cached_property
    def index(self) -> dict[int, int]:
        """unit -> its bit."""
        return {u: i for i, u in enumerate(self.units)}

    def nw(self) -> list[int]:
        """nw(v) = |V| - |anc(v)| - |des(v)| - 1 for each unit, aligned with `units`."""
        n = len(self.units)
        return [
            n - a.bit_count() - d.bit_count() - 1 for a, d in zip(self.anc, self.des, strict=True)
        ]


def closure(problem: Problem, units: Sequence[int]) -> Closure:
    """Bitset closures of the sub-DAG induced by `units` (given in topological order)."""
    local = {u: i for i, u in enumerate(units)}
    anc: list[int] = [0] * len(units)
    for i, u in enumerate(units):
        a = 0
        for p in problem.preds[u]:
            j = local.get(p)
            if j is not None:
                a |= anc[j] | (1 << j)
        anc[i] = a
    des: list[int] = [0] * len(units)
    for i in range(len(units) - 1, -1, -1):
        d = 0
        for s in problem.succs[units[i]]:
            j = local.get(s)
            if j is not None:
                d |= des[j] | (1 << j)
        des[i] = d
    return Closure(tuple(units), tuple(anc), tuple(des))


def nw_values(problem: Problem, units: Sequence[int]) -> dict[int, int]:
    """nw of every unit of the sub-DAG induced by `units` (MAGIS §6.1)."""
    c = closure(problem, units)
    return dict(zip(c.units, c.nw(), strict=True))


def window_above(clo: Closure, core: int, tau: int) -> int:
    """Bit mask of the units of `core` whose nw among `core` exceeds `tau` (floaters at tau).
    Reachability is the whole set's, so two core units joined through a floater stay ordered."""
    size = core.bit_count()
    drop = 0
    for i in bits(core):
        if size - (clo.anc[i] & core).bit_count() - (clo.des[i] & core).bit_count() - 1 > tau:
            drop |= 1 << i
    return drop


def cut_segments(clo: Closure, core: int) -> tuple[dict[int, int], list[int]]:
    """(segment of each core unit, cut units): cut at nw <= 1 among the core (GraphPartition).

    A cut unit starts a segment; any other core unit joins the segment of its latest cut
    ancestor, so every path goes from a segment to the same or a later one (cuts are totally
    ordered by reachability, up to an nw = 1 pair, and are numbered by position). With nw = 0
    cuts this loses nothing; an nw = 1 cut fixes which side its one independent unit runs on.
    """
    size = core.bit_count()
    cut_local = [
        i
        for i in bits(core)
        if size - (clo.anc[i] & core).bit_count() - (clo.des[i] & core).bit_count() - 1 <= 1
    ]
    cut_rank = {i: k + 1 for k, i in enumerate(cut_local)}
    cut_mask = 0
    for i in cut_local:
        cut_mask |= 1 << i
    seg = {}
    for i in bits(core):
        if i in cut_rank:
            seg[clo.units[i]] = cut_rank[i]
        else:
            last = clo.anc[i] & cut_mask
            seg[clo.units[i]] = cut_rank[last.bit_length() - 1] if last else 0
    return seg, [clo.units[i] for i in cut_local]


def bits(mask: int) -> list[int]:
    """Indices of the set bits of `mask`, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
