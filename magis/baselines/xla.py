"""XLA-style greedy re-materialization under a memory budget (XLA's HloRematerialization pass).

XLA walks a sequential HLO program tracking the bytes live at each instruction. Where they
exceed the limit, it repeatedly picks, among the values already computed that the current
instruction does not use, the one with the lowest cost per byte saved,

    cost(v) = compute(v) / memory_reduced(v),

and rematerializes it: the value dies after its last use so far, and a clone of its instruction
is inserted right before its next use. `memory_reduced` is the value's size minus the sizes of
its operands that are already dead here: the clone reads them later, so their live ranges are
extended across this point rather than recomputed. A clone is never rematerialized again
(XLA's guard against remat loops). XLA's compute term is flops plus elements accessed from
`HloCostAnalysis`; ours is the op's time under the cost model, the same roofline idea.

Blocks: when no single instruction helps, XLA escalates to blocks of 2, 4, ... instructions up
to `block_size_limit`, rematerialized together. Our block is a dropped value together with the
dead producers it needs (nearest first), recomputed instead of kept alive; the cost is the
block's compute over the bytes freed. XLA's GPU pipeline uses a limit of 1; we default to 16
(with 1, bert-base reaches only budgets >= 0.75 of the program-order peak, with 16, 0.45).

What we leave out: XLA's compression and host-offload modes (offloading is POFO's baseline),
and XLA's zero-cost "move" of an instruction none of whose users has run yet, which is
not modelled: in a captured ATen program the first reader of almost every value runs right after
it (often a view), so such candidates barely exist. XLA clones one copy per remaining use in old
versions, one shared copy at the first remaining use in current ones; we do the latter.

The walk, the storage (not tensor) bookkeeping, the rule against recomputing random ops, and the
turning of the executed trace into a real program are shared with DTR (`magis.baselines.budget`,
`magis.rules.recompute_trace`). Where XLA would extend the live range of a dead operand, we do so only
if every step already walked still fits the budget with it, so that a run that succeeds has a
simulated peak within its budget (XLA itself can overshoot there); a clone whose operand was
dropped meanwhile recomputes it recursively, as DTR does. When no candidate helps, XLA gives up
and reports the limit missed: that budget is a `Failure`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np

from magis.baselines.base import Baseline, Outcome
from magis.baselines.budget import (
    DEFAULT_RATIOS,
    MAX_RECOMPUTE_FACTOR,
    BudgetRun,
    BudgetTables,
    budget_sweep,
)
from magis.cost import CostModel
from magis.ir import Graph


@dataclass(frozen=True)
class XLAOptions:
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    max_recompute_factor: int = MAX_RECOMPUTE_FACTOR
    max_exact: int = 64  # candidates checked per choice once one that helps is found
    # Most instructions recomputed as one block, tried only when smaller blocks free nothing
    # (see the module docstring).
    block_size_limit: int = 16


@dataclass(frozen=True)
class _Choice:
    storage: int
    revive: tuple[int, ...]  # dead operands whose live ranges are extended to here
    keep: tuple[int, ...]  # live operands kept until the clone runs


class XLAPolicy:
    """Lowest compute-per-byte-saved first; operands of a dropped value are kept live."""

    def __init__(self, tables: BudgetTables, max_exact: int, block_size_limit: int) -> None:
        self.t = tables
        self.max_exact = max_exact
        self.block_size_limit = block_size_limit
        self.pending: dict[int, tuple[int, ...]] = {}  # dropped storage -> operands kept for it
        self.chosen: _Choice | None = None

    def choose(self, run: BudgetRun) -> int | None:
        """XLA's escalation: single instructions first; only when none helps, blocks of up to
        2, 4, ... instructions (up to `block_size_limit`)."""
        cand = run.candidates()
        cand = cand[~run.by_recompute[cand]]
        size = 1
        while len(cand):
            self.chosen = self._best(run, cand, size)
            if self.chosen is not None:
                return self.chosen.storage
            if size >= self.block_size_limit:
                break
            size = min(2 * size, self.block_size_limit)
        return None

    def _best(self, run: BudgetRun, cand: np.ndarray, size: int) -> _Choice | None:
        t = self.t
        bound = t.cost[cand] / t.nbytes[cand]  # a block costs more and frees no more
        best, best_cost = None, np.inf
        for k, i in enumerate(np.argsort(bound, kind="stable")):
            if bound[i] >= best_cost or (k >= self.max_exact and best is not None):
                break
            choice, cost = self._evaluate(run, int(cand[i]), size)
            if cost < best_cost:
                best, best_cost = choice, cost
        return best

    def _evaluate(self, run: BudgetRun, s: int, size: int) -> tuple[_Choice | None, float]:
        """The choice of dropping `s`, and its cost per byte freed here (XLA's
        compute / memory_reduced), or (None, inf) when it frees nothing."""
        block, revive = self._block(run, s, size)
        extra = run.revive_bytes(revive)
        if extra is None:
            return None, np.inf
        reduced = int(self.t.nbytes[s]) - extra
        if reduced <= 0:
            return None, np.inf
        keep = {p for b in block for p in self.t.parents[b] if p not in block and p not in revive}
        compute = float(self.t.cost[list(block)].sum())
        return _Choice(s, tuple(revive), tuple(sorted(keep))), compute / reduced

    def _block(self, run: BudgetRun, s: int, size: int) -> tuple[list[int], list[int]]:
        """`s` and the dead producers recomputed with it (up to `size` in all,
        nearest first), and the dead operands whose live ranges are extended instead."""
        live = run.live
        dead = [p for p in self.t.parents[s] if not live[p]]
        if not dead:  # most candidates: every operand still live
            return [s], []
        block, revive = [s], []
        seen = {s}
        frontier = deque(dead)
        while frontier:
            p = frontier.popleft()
            if p in seen:
                continue
            seen.add(p)
            if len(block) < size and not run.fixed(p):
                block.append(p)
                frontier.extend(q for q in self.t.parents[p] if not live[q])
            else:
                revive.append(p)
        return block, revive

    def on_evict(self, run: BudgetRun, s: int) -> None:
        choice = self.chosen
        if choice is None or choice.storage != s:
            raise RuntimeError(f"storage {s} evicted without being chosen")
        self.chosen = None
        run.revive(choice.revive)
        for p in choice.revive:
            self._cancel(run, p)  # a revived operand's own pending recomputation is moot
        run.pins[list(choice.keep)] += 1
        self.pending[s] = choice.keep

    def on_materialize(self, run: BudgetRun, s: int, recompute: bool) -> None:
        self._cancel(run, s)

    def _cancel(self, run: BudgetRun, s: int) -> None:
        for p in self.pending.pop(s, ()):
            run.release(p)


def xla_points(
    graph: Graph,
    cost: CostModel,
    options: XLAOptions = XLAOptions(),
    deadline: float | None = None,
) -> Iterator[Outcome]:
    """XLA-style re-materialization at every budget of `options.ratios` (fractions of the
    program-order peak), until `deadline` (`time.perf_counter()`, None: none)."""
    make = partial(
        XLAPolicy, max_exact=options.max_exact, block_size_limit=options.block_size_limit
    )
    yield from budget_sweep(
        "xla-remat", graph, cost, make, options.ratios, options.max_recompute_factor, deadline
    )


XLA_REMAT = Baseline(
    "xla-remat",
    "XLA HloRematerialization: greedy cheapest-per-byte remat under a memory limit",
    xla_points,
    stops_within_points=True,
)
