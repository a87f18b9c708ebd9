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

from collections.abc import Iterable, Sequence
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


class Sweep:
    """Segments built left to right: what has run so far decides each next segment's problem.

    `done` holds the units already placed (the untouched prefix of an incremental schedule and
    the segments solved so far); everything else runs later. `live` is the bytes live after
    `done`, which the next segment starts with.
    """

    def __init__(self, problem: Problem, before: Iterable[int] = ()) -> None:
        self.problem = problem
        self.done: set[int] = set()
        self.pending = [len(r) for r in problem.sreaders]
        self.live = 0
        self.advance(sorted(before))

    @staticmethod
    def at(problem: Problem, done: set[int], live: int) -> Sweep:
        """A sweep positioned after `done`, with `live` bytes live, known from elsewhere (a
        step-memory pass): enough to build the next segment, not to advance."""
        sweep = Sweep(problem)
        sweep.done, sweep.live, sweep.pending = done, live, []
        return sweep

    def advance(self, units: Iterable[int]) -> None:
        """Record `units` (in a topological order) as run."""
        p = self.problem
        for u in units:
            for s in p.makes[u]:
                if p.sreaders[s] or p.soutput[s]:
                    self.live += p.sbytes[s]
            for s in p.reads[u]:
                self.pending[s] -= 1
                if not self.pending[s] and not p.soutput[s]:
                    self.live -= p.sbytes[s]
            self.done.add(u)

    def segment(self, units: Iterable[int]) -> SegmentProblem:
        """The problem of running `units` next (none of them run yet)."""
        p = self.problem
        units = tuple(sorted(units))
        local = {u: i for i, u in enumerate(units)}
        pred_mask = []
        succ: list[list[int]] = [[] for _ in units]
        touched: set[int] = set()
        for i, u in enumerate(units):
            mask = 0
            for q in p.preds[u]:
                j = local.get(q)
                if j is not None:
                    mask |= 1 << j
                    succ[j].append(i)
            pred_mask.append(mask)
            touched.update(p.makes[u])
            touched.update(p.reads[u])
        frees: list[list[tuple[int, int]]] = [[] for _ in units]
        storages = []
        freeable_in = 0
        for s in sorted(touched):
            nbytes = p.sbytes[s]
            prod = local.get(p.sprod[s], -1)
            readers = 0
            escapes = p.soutput[s]
            for r in p.sreaders[s]:
                j = local.get(r)
                if j is not None:
                    readers |= 1 << j
                elif r not in self.done:
                    escapes = True  # read by a later segment
            storages.append((nbytes, prod, readers, escapes))
            if escapes or not readers:
                continue
            if prod < 0:
                freeable_in += nbytes
            bits = readers
            while bits:
                low = bits & -bits
                frees[low.bit_length() - 1].append((readers & ~low, nbytes))
                bits ^= low
        return SegmentProblem(
            units=units,
            pred_mask=tuple(pred_mask),
            succ=tuple(tuple(x) for x in succ),
            alloc=tuple(p.alloc[u] for u in units),
            kept=tuple(p.kept(u) for u in units),
            frees=tuple(tuple(f) for f in frees),
            live_in=self.live,
            fixed=self.live - freeable_in,
            storages=tuple(storages),
        )


def segment_problems(
    problem: Problem, segments: Sequence[Sequence[int]], before: Iterable[int] = ()
) -> list[SegmentProblem]:
    """The segment problems of running `before`, then `segments` in turn, then everything else
    (units in none of them run after all segments: their reads escape)."""
    sweep = Sweep(problem, before)
    out = []
    for units in segments:
        out.append(sweep.segment(units))
        sweep.advance(sorted(units))
    return out
