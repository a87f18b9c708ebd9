"""The worker side of parallel child evaluation (`magis.search.parallel`): one worker
(`ChildWorker`), which answers the typed calls of `magis.search.messages`; how workers run
(local processes, Ray actors) is `magis.search.transport`.

A worker keeps every state it built (a child stays where it was made) and receives a state's
pickled bytes only when it must expand a state it does not hold. Its evaluator is the serial
search's (`Evaluator`), except that the hashes and F-Trees it has seen are the main process's
as of the task, only read: de-duplication is the main process's, in the serial order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from magis.search.collector import worker_pace
from magis.search.evaluator import FISSION_MOVE_PREFIX, Evaluator
from magis.search.fission_moves import Lineage, analyze_timed, hotspot_key
from magis.search.initial import INITIAL_SID, search_start
from magis.search.messages import Outcome, Reanalyse, Sid, Summary, Task, WorkerCall
from magis.search.pickling import dumps, loads
from magis.search.state import MState

# --- the worker side ---------------------------------------------------------------------------


class _TreeKeys(set):
    """The worker's copy of the F-Trees the main process has seen. The evaluator's checks are
    recorded, never added to: the main process decides, in the serial order."""

    probe: tuple | None = None

    def __contains__(self, key: object) -> bool:
        self.probe = key  # type: ignore[assignment]
        return super().__contains__(key)

    def add(self, key: object) -> None:
        self.probe = key  # type: ignore[assignment]


class _MirrorEvaluator(Evaluator):
    """An evaluator whose `seen` is the main process's, as of the task: a hash is only read."""

    probe: int | None = None

    def is_new(self, hash_value: int) -> bool:
        self.probe = hash_value
        return hash_value not in self.seen

    def failed(self, rule: str, exc: Exception) -> None:
        super().failed(rule, exc)
        self.probe = None  # not built: the main process records no hash for it


class ChildWorker:
    """One worker: the states it holds, each popped state's move stream, its evaluator."""

    def __init__(self, wid: int, setup: bytes) -> None:
        cost, options, rules, objective = loads(setup)  # the rules in the search's order
        self.wid = wid
        self.rules = rules
        self.objective = objective
        self.options = options
        self.hotspots_only = options.hotspots_only
        self.evaluator = _MirrorEvaluator(cost, options.memory_figure, seen_trees=_TreeKeys())
        self.states: dict[Sid, MState] = {}
        self.streams: dict[Sid, tuple[Iterator, int]] = {}
        self.count = 0
        # after each child: the collector's, in a process of the search's own (`collector`)
        self.settle: Callable[[], None] = lambda: None

    def evaluate(self, task: Task) -> list[Outcome]:
        """The outcomes of the task's move, or of its batch of moves, in order."""
        for sid in task.drop:
            self.states.pop(sid, None)
            self.streams.pop(sid, None)
        self.evaluator.seen.update(task.seen)
        set.update(self.evaluator.seen_trees, task.trees)
        start = time.perf_counter()
        if task.blob is not None:
            self.states[task.sid] = loads(task.blob, self.evaluator.cost)
        load_seconds = time.perf_counter() - start
        batch = task.batch
        outcomes: list[Outcome] = []
        children = 0
        while True:
            begun = time.perf_counter()
            out = self._evaluate(task.sid, task.index + len(outcomes), task.fission)
            outcomes.append(replace(out, seconds=time.perf_counter() - begun))
            children += out.child is not None
            if batch is None or out.name is None or len(outcomes) >= batch.moves:
                break
            if out.child is not None and batch.objective.key(out.child) < batch.best_key:
                break
            if children >= batch.children or time.perf_counter() - start >= batch.seconds:
                break
        outcomes[0] = replace(outcomes[0], load_seconds=load_seconds)
        return outcomes

    def _evaluate(self, sid: Sid, index: int, fission: bool) -> Outcome:
        move = self._move(sid, index)
        if move is None:
            return Outcome(index, None)
        name, make_child = move
        if not fission and name.startswith(FISSION_MOVE_PREFIX):
            return Outcome(index, name, unaffordable=True)
        ev, trees = self.evaluator, self.evaluator.seen_trees
        ev.probe, trees.probe = None, None
        rejected, before = ev.stats.meta_rejected, dict(ev.stats.breakdown)
        child = make_child()
        self.settle()
        summary = None
        if child is not None:
            self.count += 1
            sid = (self.wid, self.count)
            self.states[sid] = child
            summary = Summary(
                sid, child.memory, child.latency, child.hash.value, child.history, child.nodes,
                child.in_lineage,
            )  # fmt: skip
        spent = {k: v - before[k] for k, v in ev.stats.breakdown.items()}
        return Outcome(
            index,
            name,
            trees.probe,
            ev.probe if ev.stats.meta_rejected == rejected else None,
            ev.stats.meta_rejected != rejected,
            summary,
            spent,
        )

    def _move(self, sid: Sid, index: int):
        """Move `index` of the state's stream (the serial search's `Evaluator.moves`), which
        this worker walks forward only: the main process gives each worker rising indices."""
        stream, position = self.streams.get(sid) or (self._stream(sid), 0)
        move = None
        while position <= index:
            move = next(stream, None)
            position += 1
            if move is None:
                break
        self.streams[sid] = (stream, position)
        return move

    def _stream(self, sid: Sid) -> Iterator:
        state = self.states[sid]
        ctx = self.evaluator.context(state, self.hotspots_only, self.objective)
        wants = self.objective.wants_memory(state)
        return self.evaluator.moves(state, self.rules, ctx, wants, self.objective)

    def handle(self, call: WorkerCall) -> Any:
        """Answer one request of the main process."""
        return call.answer(self)

    def state(self, sid: Sid) -> bytes:
        return dumps(self.states[sid], cost=self.evaluator.cost)

    def initial(self, graph: bytes) -> bytes:
        """The search's initial state (`initial.search_start`), built here and kept as
        `INITIAL_SID`, pickled for the main process."""
        start = search_start(loads(graph), self.evaluator.cost, self.options)
        self.states[INITIAL_SID] = start.state
        return dumps(start, cost=self.evaluator.cost)

    def reorder(self, sid: Sid) -> bytes:
        """The final re-ordering of the best state where it lives (`Evaluator.reordered`),
        while the other workers go on exploring: (the better of the state and its
        re-ordering, whether the re-ordering won, seconds), pickled for the main process."""
        start = time.perf_counter()
        final, won = self.evaluator.reordered(self.states[sid], self.objective, True)
        return dumps((final, won, time.perf_counter() - start), cost=self.evaluator.cost)

    def hotspot_key(self, sid: Sid) -> frozenset:
        return hotspot_key(self.states[sid].sim.hotspots)

    def reanalyse(self, job: Reanalyse) -> tuple[bool, float]:
        """The re-analysis of a popped best state (`SearchCore.reanalysed`), where it lives;
        the main process has decided it is due. (a lineage was found, seconds it took)."""
        sid = job.sid
        state = self.states[sid]
        found, took = analyze_timed(state.graph, state.order, job.max_level)
        if found is not None:
            lineage = Lineage(*found, job.epoch, state.frozen)
            self.states[sid] = replace(state, fission=lineage)
            self.streams.pop(sid, None)
        return found is not None, took


class OwnProcessWorker(ChildWorker):
    """A worker in a process of its own (a local worker, a Ray actor): the process is the
    search's, so it keeps the search's garbage-collection pace, its start-up heap frozen."""

    def __init__(self, wid: int, setup: bytes) -> None:
        super().__init__(wid, setup)
        self.settle = worker_pace()
