"""Which segment each floater runs in: weight updates, weight gradients, backward recomputations.

ROAM §IV-A shows that where a weight update runs — right after its gradient or later — changes
the peak: early, its temporaries may land on the forward/backward peak; late, its gradient lives
longer. The same choice arises for every unit peeled off as a floater (`narrow_waist`): a weight
gradient (it frees a saved activation), a backward formula's recomputation from a saved input
(GELU's pow: it allocates and frees nothing), a running-statistics update.

The rule decides by what a floater does to live memory when it runs, counting only what it
frees for sure (storages whose other readers are all its ancestors):

* it frees at least what it keeps (an SGD update frees its gradient, a weight gradient frees the
  activation saved for it): **as soon as possible**, in the segment of its latest dependency —
  an update then runs right after the last reader of the old weight and frees the gradient;
* it adds memory (a recomputation): **as late as possible**, in the segment of its first user,
  so its result is not held across the peak.

Within the chosen segment the DP picks the exact step, which is where the optimizer's ordering
against the surrounding backward ops is settled exactly. Dependencies stay satisfied: lo(f) and
hi(f), the segments of f's latest core ancestor and earliest core descendant, are monotone along
edges, and floaters are assigned in topological order.
"""

from __future__ import annotations

from collections.abc import Sequence

from magis.schedule.narrow_waist import Closure
from magis.schedule.problem import Problem


def frees_for_sure(problem: Problem, clo: Closure, u: int, before: frozenset[int]) -> int:
    """Bytes `u` frees whatever the order: storages it reads whose other readers must precede it
    (its ancestors in `clo`, or units in `before`, which run before the sub-problem)."""
    local = clo.index
    anc = clo.anc[local[u]]
    freed = 0
    for s in problem.reads[u]:
        if problem.soutput[s]:
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
    core_seg: dict[int, int],
    floaters: Sequence[int],
    nsegs: int,
    before: frozenset[int] = frozenset(),
) -> dict[int, int]:
    """Segment of each floater (see the module docstring); `clo` covers core and floaters."""
    local = clo.index
    is_floater = set(floaters)
    lo: dict[int, int] = {}
    hi: dict[int, int] = {}
    order = sorted(floaters, key=local.__getitem__)
    for f in order:
        lo[f] = max(
            (core_seg[p] if p in core_seg else lo[p] for p in problem.preds[f] if p in local),
            default=0,
        )
    for f in reversed(order):
        hi[f] = min(
            (core_seg[s] if s in core_seg else hi[s] for s in problem.succs[f] if s in local),
            default=nsegs - 1,
        )
    seg: dict[int, int] = {}
    for f in order:
        if problem.kept(f) > frees_for_sure(problem, clo, f, before):
            seg[f] = hi[f]  # adds memory: run it late, next to its first user
        else:
            after_preds = [seg[p] for p in problem.preds[f] if p in is_floater and p in seg]
            seg[f] = max([lo[f], *after_preds])
    return seg
