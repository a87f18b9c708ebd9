"""POFO-style re-materialization plus offloading on the chain of blocks (Beaumont et al. 2021,
"Efficient Combination of Rematerialization and Offloading for Training DNNs", MAGIS ref. [5]).

For a memory budget, a dynamic program over the chain of `magis.baselines.chain` decides for
each block whether its saved activations are kept, offloaded (Store after the forward, Load
before the backward, on the copy stream) or recomputed as part of a segment that starts from a
kept checkpoint, minimizing the added time. The chosen plan is built as a graph (`build_plan`)
and its figures come from `simulate`, never from the DP's own estimate.

The DP's model (Beaumont et al. §3-4, simplified):

- state: the block p where the next decision starts and the bytes P held on the device for the
  backward of the blocks before p (kept activations, checkpoints, random draws);
- keep block p: P += saved(p); offload block p: P += its saved random draws (dropout masks are
  never moved), cost = the part of its Store and Load that one block's compute cannot hide
  (`BlockCosts.offload_overhead`); recompute blocks p..q-1 as one segment: P += checkpoint(p) +
  their random draws (kept, never recomputed), cost = their forward time;
- memory: when the backward of the blocks of a decision runs, P plus what that decision brings
  back (saved(p..q-1), plus the checkpoint for a segment) plus other(b), the bytes the model
  does not see (weights, gradients, the backward's temporaries: calibrated per block on the
  program-order simulation, `block_costs`), must fit the budget;
- bytes are counted in 1/`units` of the budget, rounded to the nearest unit.

If the built plan's simulated peak exceeds the budget, the DP is run again with the overshoot
(doubled at each try) taken off its budget (at most `retries` times); a budget still not met is a `Failure`.

What is simpler than POFO: decisions are persistent per block (a block is kept, offloaded or
recomputed as a whole, once), where POFO schedules each activation's store, prefetch and
recomputation in a full forward/backward sequence and may recompute a block several times;
offload overlap is estimated per block, and the copy stream's contention is left to the
simulator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from magis.baselines.base import Baseline, BaselinePoint, Failure, Outcome, point
from magis.baselines.chain import Chain, Mode, Segment, build_plan, find_chain
from magis.cost import CostModel
from magis.ir import Graph
from magis.sim import simulate

BUDGETS = tuple(float(r) for r in np.linspace(0.05, 1.0, 20))


@dataclass(frozen=True)
class BlockCosts:
    """What the DP knows of each block (arrays indexed by block)."""

    saved: np.ndarray  # bytes its backward reads
    pinned: np.ndarray  # bytes never recomputed (random draws), held while it is recomputed
    pinned_saved: np.ndarray  # of `saved`, bytes never moved to the host (random draws)
    checkpoint: np.ndarray  # bytes a segment starting here is recomputed from
    forward_s: np.ndarray  # seconds to recompute it
    transfer_s: np.ndarray  # seconds to copy its movable saved bytes one way
    other: np.ndarray  # bytes outside the model while its backward runs (see `block_costs`)

    @property
    def n(self) -> int:
        return len(self.saved)

    def offload_overhead(self, b: int) -> float:
        """Store and Load time that compute does not hide. One copy stream serves every
        block, so each block's copies may hide behind the time of one block's forward and
        backward only (the backward taken as twice the forward): 2 x - 3 f, if positive."""
        return max(0.0, 2 * self.transfer_s[b] - 3 * self.forward_s[b])


def block_costs(chain: Chain, cost: CostModel) -> BlockCosts:
    """Each block's bytes and seconds. `other` calibrates the memory model on the program
    order: while block b's backward runs (from the first to the last backward node reading its
    saved activations) the simulated memory peaks at M_b, of which the model accounts for the
    saved bytes of blocks 0..b; the rest (weights, gradients, the backward's temporaries) is
    `other[b]`, so that keeping every block reproduces the program-order peak."""
    graph = chain.graph
    smap = graph.storages()
    n = chain.n_blocks
    saved, pinned, pinned_saved, transfer = (np.zeros(n) for _ in range(4))
    for s in chain.saved:
        b = chain.block_of[s.node]
        saved[b] += smap.nbytes[s]
        if s in chain.pinned:
            pinned_saved[b] += smap.nbytes[s]
        else:
            transfer[b] += cost.transfer_time(smap.nbytes[s])
    for s in chain.pinned:
        pinned[chain.block_of[s.node]] += smap.nbytes[s]
    times = cost.node_times(graph)
    fwd = np.zeros(n)
    for nid in chain.forward:
        if not graph.info(nid).is_view:
            fwd[chain.block_of[nid]] += times[nid]
    ckpt = np.array([sum(smap.nbytes[s] for s in chain.checkpoint(b)) for b in range(n)])
    other = _other_bytes(chain, cost, saved)
    return BlockCosts(saved, pinned, pinned_saved, ckpt.astype(float), fwd, transfer, other)


def _other_bytes(chain: Chain, cost: CostModel, saved: np.ndarray) -> np.ndarray:
    graph = chain.graph
    timeline = simulate(graph, graph.program_order(), cost).timeline
    pos = {n: i for i, n in enumerate(graph.program_order())}
    lo = np.full(chain.n_blocks, len(timeline))
    for s, reads in chain.saved.items():
        b = chain.block_of[s.node]
        lo[b] = min([lo[b], *(pos[user] for user, _ in reads)])
    # a block's backward runs until the next block's starts (autograd goes block by block)
    starts = np.unique(lo[lo < len(timeline)])
    held = np.cumsum(saved)
    other = np.zeros(chain.n_blocks)
    for b in range(chain.n_blocks):
        if lo[b] < len(timeline):
            later = starts[starts > lo[b]]
            hi = int(later[0]) if len(later) else len(timeline)
            other[b] = max(0.0, float(timeline[lo[b] : hi].max()) - held[b])
    return other


@dataclass(frozen=True)
class _Tables:
    """The DP's tables: best cost to reach (block, units held) and how it was reached."""

    cost: np.ndarray  # (n + 1, units + 1)
    from_block: np.ndarray
    from_units: np.ndarray
    mode: np.ndarray  # index into MODES


MODES = (Mode.KEEP, Mode.OFFLOAD, Mode.RECOMPUTE)


def _relax(t: _Tables, p: int, q: int, mode: int, need: int, add: int, extra: float) -> None:
    """Reach block q from every state at block p that fits `need` more units; hold `add` more."""
    units = t.cost.shape[1] - 1
    top = units - max(need, add)
    if top < 0:
        return
    src = np.arange(top + 1)
    cand = t.cost[p, : top + 1] + extra
    dst = src + add
    better = cand < t.cost[q, dst]
    if not better.any():
        return
    dst, src = dst[better], src[better]
    t.cost[q, dst] = cand[better]
    t.from_block[q, dst] = p
    t.from_units[q, dst] = src
    t.mode[q, dst] = mode


def solve(c: BlockCosts, budget_bytes: float, units: int = 1000) -> tuple[Segment, ...] | None:
    """The cheapest decisions whose estimated peak fits `budget_bytes`, or None."""
    if budget_bytes <= 0:
        return None
    unit = budget_bytes / units
    u = lambda x: int(round(x / unit))  # noqa: E731
    n = c.n
    t = _Tables(
        np.full((n + 1, units + 1), np.inf),
        np.full((n + 1, units + 1), -1),
        np.full((n + 1, units + 1), -1),
        np.full((n + 1, units + 1), -1),
    )
    t.cost[0, 0] = 0.0
    saved_u = [u(x) + u(o) for x, o in zip(c.saved, c.other, strict=True)]
    kept_u = [u(x) for x in c.pinned_saved]
    # a recomputed segment brings back its saved bytes and holds its random draws throughout
    back = c.saved + c.pinned - c.pinned_saved
    for p in range(n):
        if not np.isfinite(t.cost[p]).any():
            continue
        _relax(t, p, p + 1, 0, saved_u[p], u(c.saved[p]), 0.0)
        _relax(t, p, p + 1, 1, saved_u[p], kept_u[p], c.offload_overhead(p))
        ck = u(c.checkpoint[p])
        for q in range(p + 1, n + 1):
            need = ck + u(back[p:q].sum()) + u(c.other[p:q].max())
            if need > units:
                break
            hold = ck + u(c.pinned[p:q].sum())
            _relax(t, p, q, 2, need, hold, float(c.forward_s[p:q].sum()))
    return _segments(t, n)


def _segments(t: _Tables, n: int) -> tuple[Segment, ...] | None:
    if not np.isfinite(t.cost[n]).any():
        return None
    q, held = n, int(np.argmin(t.cost[n]))
    out: list[Segment] = []
    while q > 0:
        p, mode = int(t.from_block[q, held]), MODES[int(t.mode[q, held])]
        out.append(Segment(p, q, mode))
        q, held = p, int(t.from_units[q, held])
    return tuple(reversed(out))


@dataclass(frozen=True)
class PofoOptions:
    budgets: Sequence[float] = BUDGETS  # fractions of the program-order peak
    units: int = 1000
    retries: int = 4


def pofo_points(
    graph: Graph, cost: CostModel, options: PofoOptions | None = None
) -> Iterator[Outcome]:
    """One point (or Failure) per budget (module docstring); a plan is simulated once."""
    opts = options or PofoOptions()
    chain = find_chain(graph)
    costs = block_costs(chain, cost)
    base_peak = simulate(graph, graph.program_order(), cost).peak_bytes
    built: dict[tuple[Segment, ...], BaselinePoint] = {}
    # keeping every block is the program order: it needs no DP where the budget allows it
    built_keep = (Segment(0, chain.n_blocks, Mode.KEEP),)
    if any(r >= 1.0 for r in opts.budgets):
        g, order = build_plan(chain, built_keep, cost)
        built[built_keep] = point("pofo", g, order, cost, **_describe(built_keep))
    for ratio in opts.budgets:
        yield _budget_point(chain, costs, cost, ratio, ratio * base_peak, opts, built)


def _budget_point(
    chain: Chain,
    costs: BlockCosts,
    cost: CostModel,
    ratio: float,
    limit: float,
    opts: PofoOptions,
    built: dict[tuple[Segment, ...], BaselinePoint],
) -> Outcome:
    """The DP's plan for `limit` bytes, re-solved with less while its simulation overshoots."""
    keep_all = built.get((Segment(0, chain.n_blocks, Mode.KEEP),))
    if keep_all is not None and keep_all.memory <= limit:
        return dataclasses.replace(keep_all, params={**keep_all.params, "budget": ratio})
    target = limit
    for attempt in range(opts.retries + 1):
        segments = solve(costs, target, opts.units)
        if segments is None:
            why = f"no keep/offload/recompute plan fits {limit / 2**30:.3f} GiB"
            return Failure("pofo", why, {"budget": ratio})
        if segments not in built:
            g, order = build_plan(chain, segments, cost)
            built[segments] = point("pofo", g, order, cost, **_describe(segments))
        found = built[segments]
        if found.memory <= limit:
            return dataclasses.replace(found, params={**found.params, "budget": ratio})
        over = max(found.memory - limit, limit / opts.units)
        target -= over * 2**attempt
    why = (
        f"the plan simulates at {found.memory / 2**30:.3f} GiB, over the budget of "
        f"{limit / 2**30:.3f} GiB"
    )
    return Failure("pofo", why, {"budget": ratio})


def _describe(segments: Sequence[Segment]) -> dict[str, int]:
    """How many blocks the plan keeps, offloads and recomputes, and in how many segments."""
    count = {m.value: 0 for m in Mode}
    for seg in segments:
        count[seg.mode.value] += seg.stop - seg.start
    count["recompute_segments"] = sum(seg.mode is Mode.RECOMPUTE for seg in segments)
    return count


POFO = Baseline(
    "pofo",
    "POFO-style DP over the chain of blocks: keep, offload or recompute each (Beaumont et al.)",
    pofo_points,
)
