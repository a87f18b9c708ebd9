"""The order of Alg. 3's priority queue: BetterThan under a rising latency cap.

Alg. 3 orders the queue by BetterThan. With re-materialization and swapping, that order is
greedy in a way that traps the search:

- In memory-limit mode, a state over the limit ranks by its memory alone. Every recompute
  lowers the peak a little at a latency cost, so the greedy line of them is always popped first.
  It reaches the limit at a high latency, and from then on every state that meets the limit
  ranks first, so the cheaper lines are never expanded again. resnet50 under 0.4 met the limit
  at 1.98x in 4 s and ended at 1.42x, where the latency-limit search at 1.10 finds 0.39 of the
  peak at 1.096x with the same rules.
- In latency-limit mode, a state within the limit ranks by memory alone. The first moves
  spend the whole latency budget on whatever saves the most memory, however dearly. unet
  under 1.10 reached the limit in 4 s and then spent 170 s without finding anything better.

So the search works under a latency cap. States within the cap rank by memory, ahead of every
state above it, and the cap rises in steps. Cheap savings are found first, and dear ones are
only tried after them. Each step raises the cap by CAP_STEP of the initial latency. It starts
one step above the initial latency.

- Memory-limit mode: the cap rises whenever the lowest memory reached within it ("the
  frontier") is not falling fast enough to reach the limit in the time that is left, at its
  pace over the last CAP_WINDOW of the budget. Once a state meets the limit, the cap drops to
  one step below that state's latency and stays there ("tightening"): states under it rank by
  memory, ahead of the others, which rank by BetterThan; the next state to meet the limit
  under the cap is a faster plan, and the cap drops below it in turn. The plain BetterThan
  order only explores around the best plan (lines that undo a dear recomputation must pass
  over the limit, and Alg. 3 never keeps those), and stalled: resnet50 under 0.4 met the limit
  at 1.18x and ended at 1.153x, unchanged over the last 100 s; with tightening, 1.085x. The
  search still polishes the plans it has: while tightening, every other pop takes the best
  state by BetterThan (`SearchQueue`). A plan that meets the limit above the cap is the best
  to beat, but neither ranks first nor tightens the cap until the cap reaches it (every other
  pop still takes it, by BetterThan, so it is polished meanwhile): tightening from xla-remat's
  plan of OPT-125M (1.20x) ended the 60 s search at 1.204x, the search without it at 1.051x
  (0.255 of the peak); and the search's own whole-step split of Qwen2's FSDP step in 8, met
  at 1.83x and tightened at once, kept the search below 1.36x for its last 45 s, where the
  cheap line (the loss block in 8, a min cut, a swap) meets the limit at 1.19x. Before a plan
  meets the limit, too, every other pop takes the best by BetterThan (the least memory):
  a peer's plan above the cap otherwise waited for the cap, and its line with it. States
  above the cap's lookahead are parked, not dropped (`QueueOrder.parks`). Once a plan meets
  the limit above the cap, though, the least memory anywhere is the line that met it dearly:
  a user's BLOOM under memory 0.3 met it at 4.2x in 1 s and polished that to 3.9x for the
  rest of 20 s, while its cap rose to 1.2x with the frontier at 0.42 (the latency-limit
  search at 1.10 reaches 0.252). So the other pops then probe (`QueueOrder.probe`): the
  states within a latency between the cap and the fastest plan met above it (the geometric
  mean of their overheads) first, by BetterThan; each faster plan met lowers the probe, each
  raise lifts it, a bisection of the latency at which the limit is met.
- Latency-limit mode: the cap sweeps up to the limit in even steps over the first
  LATENCY_SWEEP of the budget. After that the cap is the limit itself. While it sweeps, every
  other pop takes the best state by BetterThan, as while tightening: the best state (a
  baseline's plan handed over as a warm start, near the limit) and the line from it go on
  beside the sweep instead of after it.

Progress is the fraction of the time budget used, or of `max_states` when that is given, so a
search bounded by states stays deterministic.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field

from magis.search.state import Mode, MState, Objective

CAP_STEP = 0.025  # of the initial latency, per raise
CAP_WINDOW = 0.1  # of the progress: how far back the frontier's pace is measured
CAP_LOOKAHEAD = 2  # steps above the cap whose states are still kept (a later raise expands them)
LATENCY_SWEEP = 0.5  # of the progress: when the latency-limit search's cap reaches the limit
# States parked above a memory-limit search's cap, at most (each holds a graph, or a worker
# holds it: 60 s of corpus:bart parked 472).
PARKED_LIMIT = 5000
WARM_START_PREFIX = "warm-start:"  # a warm start's history: this and the method's name


@dataclass
class QueueOrder:
    """Sort keys and the relaxed push test of Alg. 3's queue (smaller keys pop first)."""

    objective: Objective
    initial_latency: float
    delta: float
    cap: float = field(init=False)
    _done: bool = field(default=False, init=False)  # the cap no longer orders the queue
    _tightening: bool = field(default=False, init=False)  # memory mode, the limit met
    _raises: int = field(default=0, init=False)
    _last_raise: float = field(default=0.0, init=False)
    _frontier: float = field(default=math.inf, init=False)  # lowest memory within the cap
    _pace: list[tuple[float, float]] = field(
        default_factory=list, init=False
    )  # (progress, frontier)
    _seen: list[tuple[float, int]] = field(default_factory=list, init=False)  # (latency, memory)
    _met_above: float = field(default=math.inf, init=False)  # a warm start above the cap

    def __post_init__(self) -> None:
        self.cap = self.initial_latency * (1 + CAP_STEP)
        if self._latency_mode and self.cap >= self.objective.limit * (1 - 1e-9):
            self._done = True  # a limit this tight leaves nothing to sweep

    @property
    def _latency_mode(self) -> bool:
        return self.objective.mode is Mode.LATENCY_LIMIT

    @property
    def capped(self) -> bool:
        """Whether the latency cap orders the queue."""
        return not self._done

    def key(self, s: MState) -> tuple:
        if not self.capped:
            return self.objective.key(s)
        if self._latency_mode:
            if not self.objective.satisfied(s):
                return self.objective.key(s)
            return (0, s.latency > self.cap, s.memory, s.latency)
        if self._tightening:
            if s.latency <= self.cap:
                return (0, s.memory, s.latency)
            return (1, *self.objective.key(s))
        if self.objective.satisfied(s) and s.latency <= self.cap:
            return self.objective.key(s)
        return (1, s.latency > self.cap, s.memory, s.latency)

    def worth_pushing(self, s: MState, best: MState) -> bool:
        within_limit = self.objective.satisfied(s)
        if self._tightening and not within_limit:
            return s.latency <= self.cap and s.memory <= self.delta * self._frontier
        if not self.capped or within_limit != self._latency_mode:
            return self.objective.worth_pushing(s, best, self.delta)
        if s.latency > self.reach:
            # a latency-limit search keeps what Alg. 3 keeps (it is within the limit)
            return self._latency_mode and self.objective.worth_pushing(s, best, self.delta)
        return s.memory <= self.delta * self._frontier

    def parks(self, s: MState) -> bool:
        """Whether `s`, not worth pushing, is kept aside until the cap nears it: in memory-limit
        mode before tightening, a state over the limit above the cap's lookahead. Its hash is
        seen, so it would never come back: corpus:bart under memory 0.25 dropped 472 such
        states in 60 s and ended at 0.298 of the peak, where the latency-limit search at 1.10
        (which keeps its states above the cap) reached 0.262."""
        return (
            not self._latency_mode  # whose cap never ends (`capped`)
            and not self._tightening
            and not self.objective.satisfied(s)
            and s.latency > self.reach
        )

    @property
    def reach(self) -> float:
        """The latency up to which a state above the cap is still kept (`CAP_LOOKAHEAD`), and
        every state within the probe."""
        return max(self.cap + CAP_LOOKAHEAD * self._step, self.probe)

    @property
    def probe(self) -> float:
        """In memory-limit mode, between the cap and the least latency a plan met the limit at
        above it (before tightening): their overheads' geometric mean, a bisection of the
        latency at which the limit is met. 0 when there is no such plan."""
        if self._latency_mode or self._tightening or self._met_above == math.inf:
            return 0.0
        low = self.cap / self.initial_latency - 1
        high = self._met_above / self.initial_latency - 1
        return self.initial_latency * (1 + math.sqrt(max(low, 0.0) * high))

    def alternate_key(self, s: MState) -> tuple:
        """The order of the queue's other pops (`alternating`): BetterThan, except while a
        memory-limit search probes (`probe`): then the states within the probe first, by
        BetterThan among them."""
        probe = self.probe
        if probe == 0.0:
            return self.objective.key(s)
        return (s.latency > probe, *self.objective.key(s))

    def lowers_frontier(self, s: MState) -> bool:
        """Whether `s` has less memory than any state seen within the cap: the state the
        capped order pops first (the frontier), which the objective does not rank first
        while a plan above the cap is the best (`SearchCore.leader`)."""
        if not self.capped or (self._latency_mode and not self.objective.satisfied(s)):
            return False
        return s.latency <= self.cap and s.memory < self._frontier

    def leads(self, s: MState) -> bool:
        """Whether `s` becomes a memory-limit search's leader (`SearchCore.leader`): it lowers
        the frontier. Under a latency limit the best already ranks by memory, as the frontier
        does, and differs from it only while the cap sweeps; analysing the frontier there too
        moved the corpus's median memory under 1.10 from 0.263 to 0.271 (one 60 s run each)."""
        return not self._latency_mode and self.lowers_frontier(s)

    def observe(self, s: MState, progress: float) -> bool:
        """Record an evaluated state; True when the order changed (re-key the queue)."""
        if not self.capped:
            return False
        lowered = False  # the least latency met above the cap: the probe moves down
        if not self._latency_mode and self.objective.satisfied(s):
            if self._tightening and s.latency > self.cap:
                return False  # not faster than the plan the cap is below
            if s.latency <= self.cap:
                self._tighten(s.latency)
                return True
            lowered = s.latency < self._met_above
            self._met_above = min(self._met_above, s.latency)  # tightens when the cap is there
        if self._latency_mode and not self.objective.satisfied(s):
            return False
        bisect.insort(self._seen, (s.latency, s.memory))
        if self.lowers_frontier(s):
            self._frontier = s.memory
            self._pace.append((progress, s.memory))
        if self._tightening or not self._raise_due(progress):
            return lowered
        self._raise(progress)
        return True

    @property
    def tightening(self) -> bool:
        """Memory-limit mode after a plan met the limit (module docstring)."""
        return self._tightening

    @property
    def alternating(self) -> bool:
        """Whether every other pop takes the best state by BetterThan: always in memory-limit
        mode, and while a latency-limit search's cap sweeps. Without it the cap kept the best
        state waiting whenever that state was above it: corpus:regnet under 1.10 popped dtr's
        plan (1.09x, 0.60 of the peak, the best from the start) after 12 s of a 60 s search,
        and corpus:bart under memory 0.25, meeting it nowhere, left dtr's plan (0.347 of the
        peak at 1.256x) for 50 s, then took its line to 0.276 in 2 s."""
        return self.capped  # a memory-limit search's cap never ends

    def _raise_due(self, progress: float) -> bool:
        if self._latency_mode:
            left = math.ceil((self.objective.limit - self.cap) / self._step - 1e-9)
            steps = left + self._raises
            return progress >= LATENCY_SWEEP * (self._raises + 1) / max(steps, 1)
        if progress - self._last_raise < CAP_WINDOW:
            return False
        if self._frontier == math.inf:  # nothing within the cap yet
            return True
        then = self._frontier_at(progress - CAP_WINDOW)
        pace = (then - self._frontier) / CAP_WINDOW  # bytes per unit of progress
        needed = self._frontier - self.objective.limit
        return pace * (1 - progress) < needed

    @property
    def _step(self) -> float:
        return CAP_STEP * self.initial_latency

    def _frontier_at(self, progress: float) -> float:
        value = math.inf
        for p, memory in self._pace:
            if p > progress:
                break
            value = memory
        return value

    def _raise(self, progress: float) -> None:
        self._raises += 1
        self.cap = self.initial_latency * (1 + CAP_STEP * (self._raises + 1))
        self._last_raise = progress
        if self._latency_mode and self.cap >= self.objective.limit * (1 - 1e-9):
            self._done = True  # the cap is the limit: the objective's own order
            return
        if self._met_above <= self.cap:
            self._tighten(self._met_above)
            return
        reachable = self._seen[: bisect.bisect_right(self._seen, (self.cap, math.inf))]
        self._frontier = min((m for _, m in reachable), default=math.inf)
        self._pace.append((progress, self._frontier))

    def _tighten(self, latency: float) -> None:
        """The cap one step below a plan that meets the memory limit; the frontier is the
        lowest memory seen under it."""
        self._tightening = True
        self.cap = latency - self._step
        reachable = self._seen[: bisect.bisect_right(self._seen, (self.cap, math.inf))]
        self._frontier = min((m for _, m in reachable), default=math.inf)


class SearchQueue:
    """Alg. 3's priority queue of (state, remaining moves) entries, popped in `order`; while
    the order is tightening, every other pop takes the best entry by BetterThan instead.
    Entries sit in two heaps (one per order); an entry popped from one is skipped in the
    other."""

    def __init__(self, order: QueueOrder) -> None:
        self.order = order
        self._heaps: tuple[list, list] = ([], [])
        self._tie = itertools.count()
        self._taken: set[int] = set()
        self._pops = 0
        self._live = 0
        self._first: list[MState] = []  # `push_first`: popped before the order
        self._parked: list[tuple[float, int, MState]] = []  # `park`: by latency

    def __bool__(self) -> bool:
        return self._live > 0

    def push(self, state: MState, moves=None) -> None:
        tie = next(self._tie)
        heapq.heappush(self._heaps[0], (self.order.key(state), tie, state, moves))
        heapq.heappush(self._heaps[1], (self.order.alternate_key(state), tie, state, moves))
        self._live += 1

    def push_first(self, state: MState) -> None:
        """Queue `state` to be popped before any other entry (once; when it is pushed back
        with its remaining moves, it takes its place in the order)."""
        self._first.append(state)
        self._live += 1

    def pop(self):
        """(state, moves) of the next entry."""
        if self._first:
            self._live -= 1
            return self._first.pop(0), None
        self._pops += 1
        plain = self.order.alternating and self._pops % 2 == 0
        heap = self._heaps[1 if plain else 0]
        while True:
            _, tie, state, moves = heapq.heappop(heap)
            if tie not in self._taken:
                self._taken.add(tie)
                self._live -= 1
                return state, moves

    def park(self, state: MState) -> bool:
        """Keep `state` aside (`QueueOrder.parks`) until `unpark` reaches its latency; False
        when PARKED_LIMIT states are parked already (it is dropped then)."""
        if len(self._parked) >= PARKED_LIMIT:
            return False
        heapq.heappush(self._parked, (state.latency, next(self._tie), state))
        return True

    def unpark(self, reach: float) -> list[MState]:
        """The parked states whose latency is now within `reach`, lowest first."""
        out = []
        while self._parked and self._parked[0][0] <= reach:
            out.append(heapq.heappop(self._parked)[2])
        return out

    def rekey(self) -> None:
        """Re-sort by the order's keys after it changed (a raised or tightened cap, a moved
        probe)."""
        live = [(s, t, m) for _, t, s, m in self._heaps[0] if t not in self._taken]
        keyed = (
            [(self.order.key(s), t, s, m) for s, t, m in live],
            [(self.order.alternate_key(s), t, s, m) for s, t, m in live],
        )
        for heap in keyed:
            heapq.heapify(heap)
        self._heaps = keyed
        self._taken.clear()
