"""The pool of a search's workers (`magis.search.parallel`, `magis.search.concurrent`): which
worker holds which state, what each was sent of the seen hashes, the moves handed out and their
outcomes, moving a state from one worker to another (pickled once, by whoever holds it), and the
final re-ordering of the best run by the worker that holds it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from magis.cost import CostModel
from magis.errors import deferred_interrupt
from magis.search.evaluator import Evaluator
from magis.search.holdings import StateHoldings
from magis.search.messages import (
    Batch,
    FetchState,
    Outcome,
    Reanalyse,
    ReorderBest,
    Sid,
    Summary,
    Task,
    WorkerCall,
)
from magis.search.pickling import dumps, loads
from magis.search.state import MState
from magis.search.transport import LocalWorkers, RayWorkers, WorkerError


@dataclass
class PendingMoves:
    """A popped state's moves as the parallel search sees them: the next one the serial
    search would take (`cursor`), the next to hand a worker, outcomes evaluated ahead of the
    cursor, and the end of the moves once a worker found it."""

    sid: Sid
    nodes: int  # the state's size: what moving it to another worker costs
    cursor: int = 0
    next_index: int = 0
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    end: int | None = None
    work: float = 0.0  # seconds its evaluated moves took, in the workers
    done: int = 0  # how many moves were evaluated

    def average_move(self) -> float:
        return self.work / max(self.done, 1)


@dataclass
class _TransferCost:
    """What moving a state to another worker costs, per node of its graph: pickling it (in
    its worker, or here) and unpickling it, as measured (moving averages)."""

    dump_per_node: float | None = None
    load_per_node: float | None = None

    def observe_dump(self, seconds: float, nodes: int) -> None:
        self.dump_per_node = _averaged(self.dump_per_node, seconds / max(nodes, 1))

    def observe_load(self, seconds: float, nodes: int) -> None:
        self.load_per_node = _averaged(self.load_per_node, seconds / max(nodes, 1))

    def estimate(self, nodes: int) -> float | None:
        if self.dump_per_node is None or self.load_per_node is None:
            return None
        return (self.dump_per_node + self.load_per_node) * nodes


def _averaged(average: float | None, value: float, weight: float = 0.3) -> float:
    return value if average is None else (1 - weight) * average + weight * value


_SYNC = None  # `busy` value of a worker answering a direct call
_REORDER = "reorder"  # ... of the worker re-ordering the best


@dataclass
class _Reordering:
    """The final full re-ordering of the best state, run by the worker holding it while the
    others go on exploring (`ParallelChildren.reorder`): its answer once back."""

    sid: Sid
    wid: int
    answer: bytes | None = None  # submitted while `busy[wid]` is `_REORDER`


@dataclass
class ParallelChildren:
    """The workers of one search, the states they hold, what they know of the seen hashes."""

    transport: LocalWorkers | RayWorkers
    n: int
    seen_log: list[int]
    tree_log: list
    cursors: list[tuple[int, int]]  # per worker: how much of each log it was sent
    states: StateHoldings
    busy: dict[int, tuple[PendingMoves, int] | None] = field(default_factory=dict)
    transfer: _TransferCost = field(default_factory=lambda: _TransferCost())
    cost: CostModel | None = None  # the search's: states travel with it by name
    reordering: _Reordering | None = None
    # Whether a state of so many nodes may have its F-Tree moves built now
    # (`SearchCore.fission_affordable`): told to the workers with each task.
    fission_affordable: Callable[[int], bool] = lambda nodes: True

    @staticmethod
    def start(transport: LocalWorkers | RayWorkers, n: int, ev: Evaluator) -> ParallelChildren:
        """The pool of started workers, which know the seen hashes as of now."""
        return ParallelChildren(
            transport, n, list(ev.seen), list(ev.seen_trees), [(0, 0)] * n,
            StateHoldings(n), cost=ev.cost,
        )  # fmt: skip

    # --- states ----------------------------------------------------------------------------

    def materialize(self, summary: Summary) -> MState:
        """The child itself, fetched from the worker that built it."""
        entry = self.states[summary.sid]
        if entry.state is None:
            self.states.fetched(
                summary.sid, loads(self._blob(summary.sid, summary.nodes), self.cost)
            )
        return entry.state

    def _blob(self, sid: Sid, nodes: int) -> bytes:
        entry = self.states[sid]
        if entry.blob is None:
            holder = None if entry.state is not None else self._free_holder(entry.holders)
            while holder in self.busy:  # not timed: the holder finishes a move first
                self.collect()
            start = time.perf_counter()
            if holder is None:
                entry.blob = dumps(entry.state, cost=self.cost)
            else:
                entry.blob = self._call(holder, FetchState(sid))
            self.transfer.observe_dump(time.perf_counter() - start, nodes)
        return entry.blob

    def _free_holder(self, holders: set[int]) -> int:
        """The holder to ask for a state's bytes: one not busy re-ordering the best if any."""
        free = holders - {self.reordering_worker()}
        return min(free or holders)

    def reordering_worker(self) -> int | None:
        """The worker re-ordering the best, until its answer is back."""
        r = self.reordering
        return r.wid if r is not None and r.answer is None else None

    def reachable(self, sid: Sid) -> bool:
        """Whether a worker can take state `sid` now: the main process has it, or a worker
        that is not re-ordering the best holds it."""
        holders = self.states.holders(sid)
        busy = self.reordering_worker()
        return busy is None or busy not in holders or len(holders) > 1

    def reorder(self, sid: Sid, wid: int) -> None:
        """Re-order state `sid` in full (`Evaluator.reordered`) in worker `wid`, which holds it,
        as soon as that worker is done with the moves it is evaluating; the answer is
        `reordered()`."""
        self.reordering = _Reordering(sid, wid)
        self._submit_reordering()

    def _submit_reordering(self) -> None:
        r = self.reordering
        if r is None or r.answer is not None or r.wid in self.busy:
            return  # none asked, answered, or its worker is busy (with it, or with a batch)
        with deferred_interrupt():
            self.transport.submit(r.wid, ReorderBest(r.sid))
            self.busy[r.wid] = _REORDER

    def wait_for_reordering(self) -> None:
        """Until the worker re-ordering the best has answered (others' outcomes are kept)."""
        while self.reordering is not None and self.reordering.answer is None:
            self.collect()

    def reordered(self) -> tuple[MState, bool, float]:
        """The re-ordering's answer (the better of the state and its re-ordering, simulated
        in detail; whether the re-ordering won; its seconds in the worker)."""
        self.wait_for_reordering()
        return loads(self.reordering.answer, self.cost)

    def call_holder(self, sid: Sid, call: WorkerCall) -> Any:
        """Call a worker that holds state `sid`."""
        return self._call(min(self.states[sid].holders), call)

    def reanalysed_in_worker(self, sid: Sid, max_level: int, epoch: int) -> tuple[bool, float]:
        """Re-analyse state `sid` where it lives: (a lineage was found, seconds). The other
        workers' copies, if any, are now stale: they are dropped."""
        holder = min(self.states[sid].holders)
        found, took = self._call(holder, Reanalyse(sid, max_level, epoch))
        if found:
            self.states.drop_copies(sid, holder)
        return found, took

    # --- moves -----------------------------------------------------------------------------

    def outcome(self, moves: PendingMoves, ahead: int, spread: bool) -> Outcome:
        """The outcome of the move at the cursor, with idle workers on the moves after it
        (`ahead` moves from the cursor at most); workers that lack the state get moves only
        when `spread`, or when none holds it."""
        while moves.cursor not in moves.outcomes:
            self._fill(moves, ahead, spread)
            self.collect()
        return moves.outcomes.pop(moves.cursor)

    def worth_spreading(self, moves: PendingMoves, remaining: int) -> bool:
        """Whether the `remaining` moves of this pop, at the average cost of its moves so
        far, pay for moving the state to another worker. Most moves (a recomputation, a
        swap) take milliseconds, and pickling a vit-base state takes 0.1 s or more: those
        are left to the worker holding the state; F-Tree moves take a second and are
        spread."""
        cost = self.transfer.estimate(moves.nodes)
        if cost is None:  # not measured yet: measure it
            return True
        return moves.average_move() * remaining / self.n > cost

    def _fill(self, moves: PendingMoves, ahead: int, spread: bool) -> None:
        """Hand the next moves to idle workers, those holding the state first (no bytes to
        send)."""
        holders = self.states.holders(moves.sid)
        for wid in sorted(range(self.n), key=lambda w: w not in holders):
            if wid in self.busy:
                continue
            if holders and wid not in holders and not spread:
                return
            within = moves.next_index < moves.cursor + ahead
            if not within or (moves.end is not None and moves.next_index >= moves.end):
                return
            self.submit(wid, moves, moves.next_index)
            moves.next_index += 1

    def submit(self, wid: int, moves: PendingMoves, index: int, batch: Batch | None = None) -> None:
        """Hand move `index` of a popped state (or a `batch` of moves from there) to worker
        `wid`, with the state if it lacks it."""
        entry = self.states[moves.sid]
        blob = None
        if wid not in entry.holders:
            blob = self._blob(moves.sid, moves.nodes)
            entry.holders.add(wid)
            if len(entry.holders) == self.n and entry.state is None:
                entry.blob = None  # every worker holds it now: no need to keep its bytes here
        seen_at, trees_at = self.cursors[wid]
        task = Task(
            moves.sid,
            index,
            blob,
            tuple(self.seen_log[seen_at:]),
            tuple(self.tree_log[trees_at:]),
            self.states.take_drops(wid),
            batch,
            self.fission_affordable(moves.nodes),
        )
        self.cursors[wid] = (len(self.seen_log), len(self.tree_log))
        with deferred_interrupt():
            self.transport.submit(wid, task)
            self.busy[wid] = (moves, index)

    def collect(self) -> tuple[int, Any]:
        """Wait for one worker's answer; moves' outcomes go to their state's moves."""
        with deferred_interrupt():
            wid, value = self.transport.next_reply(set(self.busy))
            job = self.busy.pop(wid)
            if job is _REORDER:  # kept before a deferred Ctrl-C is raised
                self.reordering.answer = value
        if job is not _SYNC and job is not _REORDER:
            moves, _ = job
            for out in value:
                self._keep(moves, out)
        self._submit_reordering()  # its worker may have just finished a batch
        return wid, value

    def _keep(self, moves: PendingMoves, out: Outcome) -> None:
        moves.work += out.seconds
        moves.done += 1
        if out.load_seconds > 0:
            self.transfer.observe_load(out.load_seconds, moves.nodes)
        moves.outcomes[out.index] = out
        if out.name is None:
            moves.end = out.index if moves.end is None else min(moves.end, out.index)

    def _call(self, wid: int, call: WorkerCall) -> Any:
        """Call one worker and wait for its answer (others' outcomes are kept meanwhile)."""
        while wid in self.busy:
            self.collect()
        with deferred_interrupt():
            self.transport.submit(wid, call)
            self.busy[wid] = _SYNC
        while True:
            who, value = self.collect()
            if who == wid:
                return value

    def replay(self, ev: Evaluator, out: Outcome) -> Summary | None:
        """The serial evaluator's de-duplication of this outcome, here and now: the child, or
        None (counted as the serial search counts it)."""
        for part, seconds in out.breakdown.items():
            ev.stats.breakdown[part] += seconds
        ev.stats.meta_rejected += out.meta_rejected
        if out.unaffordable:
            ev.stats.unaffordable += 1
            return None
        if out.tree_key is not None:
            if out.tree_key in ev.seen_trees:
                ev.stats.duplicates += 1
                return self._discard(out)
            ev.seen_trees.add(out.tree_key)
            self.tree_log.append(out.tree_key)
        if out.hash is None or not ev.is_new(out.hash):
            return self._discard(out)
        self.seen_log.append(out.hash)
        if out.child is None:  # the worker's copy of the seen hashes is older than ours
            raise WorkerError(f"a worker skipped a hash the search had not seen: {out.hash}")
        self.states.built(out.child)
        return out.child

    def _discard(self, out: Outcome) -> None:
        if out.child is not None:
            self.states.discard(out.child.sid)

    def close(self) -> None:
        self.transport.close()
