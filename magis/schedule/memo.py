"""Memoized DP results, keyed by what a segment is rather than where it sits.

Incremental scheduling (MAGIS §6.1) exists so that work on parts of the graph a rewrite did not
touch is not done again. Prefix and suffix keep their old order; a `DpMemo` also keeps the DP's
answers: a segment whose content is unchanged — the same dependencies, sizes, frees and live
bytes — gets the same answer, so a caller
that schedules one graph version after another (the search of Alg. 3, the §7.3 experiment)
passes one memo along. It is an explicit object, never a global.

The key is the segment's content alone — dependency masks, sizes, frees, live bytes, in local
indices — because that is all the DP reads; its answer is a local order, mapped back through
whichever units the segment has. So a hit is sound even for another graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from magis.schedule.dp import DpResult, dp_schedule
from magis.schedule.segment import SegmentProblem


@dataclass
class DpMemo:
    exact: dict[tuple, DpResult] = field(default_factory=dict)  # content -> the optimum
    inexact: dict[tuple, DpResult] = field(default_factory=dict)  # content, bound, budget -> ...
    hits: int = 0

    def copy(self) -> DpMemo:
        return DpMemo(dict(self.exact), dict(self.inexact), self.hits)

    def dp(
        self,
        seg: SegmentProblem,
        upper: tuple[tuple[int, ...], int],
        budget: int,
    ) -> DpResult:
        """`dp_schedule(seg, upper, budget)`, answered from the memo when seen before.

        An optimum does not depend on the bound or budget it was found with, so it is keyed by
        content alone. Bytes live throughout the segment (`fixed`) shift every step alike and
        change no decision of the DP, so keys and stored peaks are taken relative to them."""
        base = seg.fixed
        content = (
            seg.pred_mask,
            seg.alloc,
            seg.kept,
            seg.frees,
            seg.live_in - base,
            seg.storages,
        )
        best = self.exact.get(content)
        if best is not None:
            self.hits += 1
            if best.peak + base < upper[1]:
                return DpResult(best.order, best.peak + base, True, 0)
            return DpResult(tuple(upper[0]), upper[1], True, 0)
        key = (content, (upper[0], upper[1] - base), budget)
        found = self.inexact.get(key)
        if found is not None:
            self.hits += 1
            return DpResult(found.order, found.peak + base, False, 0)
        res = dp_schedule(seg, upper, budget)
        stored = DpResult(res.order, res.peak - base, res.exact, res.expanded)
        if res.exact:
            self.exact[content] = stored
        else:
            self.inexact[key] = stored
        return res


def run_dp(
    seg: SegmentProblem,
    upper: tuple[tuple[int, ...], int],
    budget: int,
    memo: DpMemo | None,
) -> DpResult:
    """The DP, through `memo` when one is given."""
    if memo is None:
        return dp_schedule(seg, upper, budget)
    return memo.dp(seg, upper, budget)
