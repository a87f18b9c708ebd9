"""Which segment each floater runs in: weight updates, weight gradients, backward recomputations.

ROAM §IV-A shows that where a weight update runs — right after its gradient or later — changes
the peak: early, its temporaries may land on the forward/backward peak; late, its gradient lives
longer. The same choice arises for every unit peeled off as a floater (`narrow_waist`): a weight
gradient (it frees a saved activation), a backward formula's recomputation from a saved input
(GELU's pow: it allocates and frees nothing), a running-statistics update.

The rule decides by what a floater does to live memory when it runs, counting only what it
frees for sure (storages whose other readers are all its ancestors):

* it frees at least what it keeps — an SGD update frees its gradient, an in-place update
  allocates nothing, a ReLU frees its input: **early**, in the segment of its latest
  dependency. An update then runs right after the last reader of the old weight. What a late
  floater made does not count as freed: a NASNet block's add over two branch results of the
  next cell would otherwise pull the whole branch into the current cell's peak;
* it adds memory — a weight or bias gradient (the activation it reads has other readers), a
  recomputation in a backward formula (GELU's pow), a scalar or a weight concatenation with no
  inputs: **late**, in the segment where its first user runs, so its result is not held across
  a peak and, when the user is early (an update), it follows the user there.

Early floaters are placed first, in topological order (after the segments of their fixed and
early predecessors, and after the earliest place of their late ones); late floaters then, in
reverse topological order (in the least segment among their users). Every edge then goes
forward: an early unit's segment is at least each predecessor's, and a late unit's is at most
each user's and at least its own earliest place. Within the chosen segment the DP picks the
exact step, which is where an update's order against the backward ops around it is settled.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from magis.schedule.narrow_waist import Closure
from magis.schedule.problem import Problem


def frees_for_sure(
    problem: Problem,
    clo: Closure,
    u: int,
    before: Container[int],
    movable: Container[int] = frozenset(),
) -> int:
    """Bytes `u` frees whatever the order: storages it reads whose other readers must precede it
    (its ancestors in `clo`, or units in `before`, which run before the sub-problem). Storages
    made by `movable` units do not count: they would move along with `u`."""
    local = clo.index
    anc = clo.anc[local[u]]
    freed = 0
    for s in problem.reads[u]:
        if problem.soutput[s] or problem.sprod[s] in movable:
            continue
        if all(
            r == u or r in before or (r in local and anc >> local[r] & 1)
            for r in problem.sreaders[s]
        ):
            freed += problem.sbytes[s]
    return freed


def place_floaters(
    problem: Problem,
    clo: Closure,
    fixed: dict[int, int],
    floaters: Sequence[int],
    nsegs: int,
    before: Container[int] = frozenset(),
) -> dict[int, int]:
    """Segment of each floater, given the segments of the `fixed` units (the cuts); see the
    module docstring. Dependencies outside `fixed` and `floaters` lie in earlier or later parts
    of the schedule and do not constrain."""
    order = sorted(floaters, key=clo.index.__getitem__)
    late: set[int] = set()
    kept = problem.kept
    for f in order:  # what a late floater makes does not count as freed: it moves along
        keeps = kept(f)
        if keeps and keeps > frees_for_sure(problem, clo, f, before, late):
            late.add(f)
    # Plain loops below: this runs for every floater at every cut the partition tries.
    seg: dict[int, int] = {}
    earliest: dict[int, int] = {}
    preds, succs = problem.preds, problem.succs
    for f in order:  # early floaters, in topological order
        at = 0
        for p in preds[f]:
            k = fixed[p] if p in fixed else seg.get(p, earliest.get(p, 0))
            if k > at:
                at = k
        earliest[f] = at
        if f not in late:
            seg[f] = at
    for f in reversed(order):  # late floaters, next to their first user
        if f in late:
            at = nsegs - 1
            for s in succs[f]:
                k = fixed.get(s, seg.get(s, at))
                if k < at:
                    at = k
            seg[f] = at
    return seg
