"""One segment of a partitioned problem, as the DP and the list scheduler see it.

Segments run one after another, so what a segment's internal order changes is only its own
steps: the storages live when it starts (`live_in`: made earlier, read here or later) are fixed by
the partition, and a storage is freed inside the segment only when all its readers are local and
it is not a graph output (otherwise it *escapes*: read by a later segment, or live to the end).
The whole order's peak is then resident + max over segments of the segment's peak, which is why
segments can be solved independently and merged (ROAM §IV-A eq. 2, MAGIS Alg. 2 line 11).

Local index i is the i-th unit of the segment in topological order; masks are Python ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from magis.schedule.problem import Problem


@dataclass(frozen=True)
class SegmentProblem:
    units: tuple[int, ...]  # problem units, topological order; local index = position
    pred_mask: tuple[int, ...]  # local predecessors
    succ: tuple[tuple[int, ...], ...]  # local successors
    alloc: tuple[int, ...]  # bytes the unit's step allocates
    kept: tuple[int, ...]  # bytes it allocates that outlive its step
    frees: tuple[tuple[tuple[int, int], ...], ...]  # (other local readers mask, bytes) it may free
    live_in: int  # bytes live when the segment starts
    fixed: int  # part of live_in never freed inside the segment
    storages: tuple[tuple[int, int, int, bool], ...]  # (bytes, producer or -1, readers, escapes)

    @property
    def m(self) -> int:
        return len(self.units)

    def ready0(self) -> int:
        """Units with no local predecessor."""
        mask = 0
        for i, p in enumerate(self.pred_mask):
            if not p:
                mask |= 1 << i
        return mask

    def freed(self, i: int, done: int) -> int:
        """Bytes freed by running local unit `i` after the units in mask `done`."""
        return sum(b for mask, b in self.frees[i] if not mask & ~done)

    def peak_of(self, order: Sequence[int]) -> int:
        """Peak bytes (resident excluded) of the segment's steps in local `order`."""
        live, peak, done = self.live_in, self.live_in, 0
        for i in order:
            peak = max(peak, live + self.alloc[i])
            live += self.kept[i] - self.freed(i, done)
            done |= 1 << i
        return peak

    def is_valid(self, order: Sequence[int]) -> bool:
        done = 0
        for i in order:
            if self.pred_mask[i] & ~done:
                return False
            done |= 1 << i
        return sorted(order) == list(range(self.m))


def segment_problems(
    problem: Problem, segments: Sequence[Sequence[int]], before: frozenset[int] = frozenset()
) -> list[SegmentProblem]:
    """The segment problems of running `before`, then `segments` in turn, then everything else.

    Units outside `before` and the segments run after all segments (the untouched suffix of an
    incremental schedule); storages they read escape.
    """
    seg_of = {u: k for k, units in enumerate(segments) for u in units}
    n = len(segments)  # the segment index of units that run after all segments
    diff = [0] * (n + 1)
    touched: list[set[int]] = [set() for _ in segments]
    for s, nbytes in enumerate(problem.sbytes):
        prod = problem.sprod[s]
        ps = -1 if prod in before else seg_of.get(prod, n)
        if ps >= n:
            continue
        rsegs = [-1 if r in before else seg_of.get(r, n) for r in problem.sreaders[s]]
        end = min(n if problem.soutput[s] else max(rsegs, default=ps), n - 1)
        if end > ps:  # live when segments ps+1 .. end start
            diff[ps + 1] += nbytes
            diff[end + 1] -= nbytes
        for k in (ps, *rsegs):
            if 0 <= k < n:
                touched[k].add(s)
    live_at, live = [], 0
    for k in range(n):
        live += diff[k]
        live_at.append(live)
    return [
        _segment(problem, units, k, seg_of, before, touched[k], live_at[k])
        for k, units in enumerate(segments)
    ]


def _segment(
    problem: Problem,
    units: Sequence[int],
    k: int,
    seg_of: dict[int, int],
    before: frozenset[int],
    touched: set[int],
    live_in: int,
) -> SegmentProblem:
    units = tuple(sorted(units))
    local = {u: i for i, u in enumerate(units)}
    pred_mask = []
    succ: list[list[int]] = [[] for _ in units]
    for i, u in enumerate(units):
        mask = 0
        for p in problem.preds[u]:
            j = local.get(p)
            if j is not None:
                mask |= 1 << j
                succ[j].append(i)
        pred_mask.append(mask)
    frees: list[list[tuple[int, int]]] = [[] for _ in units]
    storages = []
    freeable_in = 0
    for s in sorted(touched):
        nbytes = problem.sbytes[s]
        prod = local.get(problem.sprod[s], -1)
        readers = 0
        escapes = problem.soutput[s]
        for r in problem.sreaders[s]:
            j = local.get(r)
            if j is not None:
                readers |= 1 << j
            elif r not in before and seg_of.get(r, k + 1) > k:
                escapes = True
        if not readers and prod < 0:
            continue  # read only elsewhere: a constant part of live_in, or dead already
        storages.append((nbytes, prod, readers, escapes))
        if escapes or not readers:
            continue
        if prod < 0:
            freeable_in += nbytes
        bits = readers
        while bits:
            low = bits & -bits
            j = low.bit_length() - 1
            frees[j].append((readers & ~low, nbytes))
            bits ^= low
    return SegmentProblem(
        units=units,
        pred_mask=tuple(pred_mask),
        succ=tuple(tuple(s) for s in succ),
        alloc=tuple(problem.alloc[u] for u in units),
        kept=tuple(problem.kept(u) for u in units),
        frees=tuple(tuple(f) for f in frees),
        live_in=live_in,
        fixed=live_in - freeable_in,
        storages=tuple(storages),
    )
