"""The worker side of parallel child evaluation (`magis.search.parallel`): what travels between
the main process and a worker, the worker (`ChildWorker`), and the two ways to run workers:
local processes and Ray actors.

A worker keeps every state it built (a child stays where it was made) and receives a state's
pickled bytes only when it must expand a state it does not hold. Its evaluator is the serial
search's (`Evaluator`), except that the hashes and F-Trees it has seen are the main process's
as of the task, only read: de-duplication is the main process's, in the serial order.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any

from magis.errors import MagisError
from magis.search.collector import worker_pace
from magis.search.evaluator import Evaluator
from magis.search.fission_moves import Lineage, analyze_timed, hotspot_key
from magis.search.initial import INITIAL_SID, search_start
from magis.search.main_guard import refuse_unguarded_main
from magis.search.pickling import dumps, loads
from magis.search.state import MState, Objective

Sid = tuple[int, int]  # a state's id: (the worker that built it, or -1 for the main, a count)
Call = tuple[int, str, Any]  # (worker, method, argument)


class RayMissingError(MagisError):
    """`--ray` asked for, Ray not installed."""


def import_ray():
    """The `ray` module, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RayMissingError("Ray is not installed: pip install 'magis[ray]'") from None
    return ray


def start_ray(ray, address: str | None, num_cpus: int | None) -> bool:
    """Connect to Ray unless this process already is (a local Ray of `num_cpus` CPUs when
    `address` is None); True when this call started it."""
    if ray.is_initialized():
        return False
    if address is None:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    return True


# --- what goes between the main process and a worker -------------------------------------------


@dataclass(frozen=True)
class Summary:
    """A child the main process does not hold: its figures (all the queue orders by) and where
    it lives. Stands for an MState in the queue."""

    sid: Sid
    memory: int
    latency: float
    hash: int  # its GraphHash's value (the labels stay in the worker: 100 KB and more)
    history: tuple[str, ...]
    nodes: int  # the graph's size (what the final re-ordering will cost)
    in_lineage: bool  # whether its F-Tree moves continue a lineage (`MState.fission`)


@dataclass(frozen=True)
class Task:
    """Evaluate move `index` of state `sid` (`blob`: the state, when the worker lacks it).
    `seen`/`trees`: hashes and F-Tree keys the main process recorded since this worker's last
    task; `drop`: states no longer needed.

    With a `batch`, the moves from `index` on, one after the other, until one is past the
    end, or builds a child better than the best, or `children` children are built, or the
    batch's moves or seconds run out: a worker expanding a state of its own
    (`magis.search.concurrent`) does not wait for the main process between two moves that
    take a millisecond each."""

    sid: Sid
    index: int
    blob: bytes | None
    seen: tuple[int, ...]
    trees: tuple
    drop: tuple[Sid, ...]
    batch: Batch | None = None


@dataclass(frozen=True)
class Batch:
    """Where a task of several moves stops (`Task`)."""

    objective: Objective
    best_key: tuple  # objective.key of the best state as the main process knows it
    children: int
    moves: int
    seconds: float


@dataclass(frozen=True)
class Outcome:
    """One move evaluated: `name` None when the state has no move `index`; `hash` None when
    the child could not be built (or failed the meta check); `child` None when it was not
    built or the worker already knew its hash or tree."""

    index: int
    name: str | None
    tree_key: tuple | None = None
    hash: int | None = None
    meta_rejected: bool = False
    child: Summary | None = None
    breakdown: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0  # the move's work in the worker: finding it, building the child
    load_seconds: float = 0.0  # unpickling the state, when it came with the task


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
            out = self._evaluate(task.sid, task.index + len(outcomes))
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

    def _evaluate(self, sid: Sid, index: int) -> Outcome:
        move = self._move(sid, index)
        if move is None:
            return Outcome(index, None)
        name, make_child = move
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

    def reanalyse(self, job: tuple[Sid, int, int]) -> tuple[bool, float]:
        """The re-analysis of a popped best state (`_Search.reanalysed`), where it lives;
        the main process has decided it is due. (a lineage was found, seconds it took)."""
        sid, max_level, epoch = job
        state = self.states[sid]
        found, took = analyze_timed(state.graph, state.order, max_level)
        if found is not None:
            lineage = Lineage(*found, epoch, state.frozen)
            self.states[sid] = replace(state, fission=lineage)
            self.streams.pop(sid, None)
        return found is not None, took


class OwnProcessWorker(ChildWorker):
    """A worker in a process of its own (a local worker, a Ray actor): the process is the
    search's, so it keeps the search's garbage-collection pace, its start-up heap frozen."""

    def __init__(self, wid: int, setup: bytes) -> None:
        super().__init__(wid, setup)
        self.settle = worker_pace()


def _serve(conn: Connection, wid: int, setup: bytes) -> None:
    """A local worker process: answer the main process's calls until it hangs up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    try:
        worker = OwnProcessWorker(wid, setup)
    except Exception:  # noqa: BLE001 - the main process raises it as the worker's error
        conn.send(("error", traceback.format_exc()))
        return
    conn.send((_BOOTED, None))  # `LocalWorkers.booted` hears it
    while True:
        try:
            method, arg = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(worker, method)(arg)))
        except Exception:  # noqa: BLE001 - sent back and raised there, as the serial search would
            conn.send(("error", traceback.format_exc()))


_BOOTED = "booted"  # a local worker's first message: it is ready for calls


class WorkerError(RuntimeError):
    """A worker raised while evaluating a move (the traceback is in the message)."""


def start_local_workers(n: int, setup: bytes, first: Call | None = None) -> LocalWorkers:
    """`n` worker processes on this machine, forked from a clean forkserver process (forking
    one that has run torch is unsafe), or spawned where there is none. `first`: a call made
    as soon as they start, while the caller goes on (its answer is `LocalWorkers.answer`)."""
    refuse_unguarded_main()  # before any worker starts: each would run the script again
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if ctx.get_start_method() == "forkserver":
        # The server imports magis (and torch) once; each worker forks from it ready to go.
        # torch._dynamo too: the meta checker's FakeTensorMode imports it on first use, and
        # each worker spent 1.5 to 3 s of its start on that.
        ctx.set_forkserver_preload(["magis.search.workers", "torch._dynamo"])
    conns, ends, processes = [], [], []
    for wid in range(n):
        mine, theirs = ctx.Pipe()
        conns.append(mine)
        ends.append(theirs)
        processes.append(ctx.Process(target=_serve, args=(theirs, wid, setup), daemon=True))
    # Starting the first one waits for the server to import torch (about 1.3 s): a thread
    # does it while the caller goes on (the warm starts run meanwhile).
    workers = LocalWorkers(conns, processes)
    workers.starting = threading.Thread(target=_start_all, args=(workers, ends, first), daemon=True)
    workers.starting.start()
    return workers


def _start_all(workers: LocalWorkers, ends: list[Connection], first: Call | None) -> None:
    try:
        for p, theirs in zip(workers.processes, ends, strict=True):
            p.start()
            theirs.close()
        if first is not None:  # the worker reads it once booted
            wid, method, arg = first
            workers.conns[wid].send((method, arg))
    except Exception as exc:  # noqa: BLE001 - the main process raises it at its next call
        # A worker that ends as it starts (an unguarded script `main_guard` could not read
        # refuses in it) leaves the next start a broken pipe.
        workers.start_error = exc


@dataclass
class LocalWorkers:
    """Worker processes on this machine, one pipe each."""

    conns: list[Connection]
    processes: list
    starting: threading.Thread | None = None
    start_error: Exception | None = None  # what ended `starting`, if anything did
    ready: set[int] = field(default_factory=set)  # the workers that said they booted
    initial_from: int | None = None  # the worker building the initial state (`parallel`)

    def _started(self) -> None:
        if self.starting is not None:
            self.starting.join()
            self.starting = None
        if self.start_error is not None:
            raise WorkerError(
                f"the worker processes could not start ({self.start_error!r}); the error "
                "that ended them, if any, is above"
            )

    def booted(self) -> bool:
        """Whether every worker is ready for calls (without waiting)."""
        if self.starting is not None and not self.starting.is_alive():
            self._started()
        for wid, conn in enumerate(self.conns):
            if wid not in self.ready and conn.poll():
                self._receive(wid)
        return len(self.ready) == len(self.conns)

    def submit(self, wid: int, method: str, arg: Any) -> None:
        self._started()
        try:
            self.conns[wid].send((method, arg))
        except OSError:
            raise self._gone(wid) from None

    def _gone(self, wid: int) -> WorkerError:
        self.processes[wid].join(timeout=1)
        code = self.processes[wid].exitcode
        return WorkerError(f"worker {wid} exited (code {code}); its error, if any, is above")

    def answer(self, wid: int) -> Any:
        """The answer of worker `wid` to the one call it was given (the `first` call)."""
        self._started()
        return self.next_reply({wid})[1]

    def next_reply(self, busy: set[int]) -> tuple[int, Any]:
        while True:
            wid = self.conns.index(wait([self.conns[w] for w in sorted(busy)])[0])
            status, value = self._receive(wid)
            if status != _BOOTED:
                return wid, value

    def _receive(self, wid: int) -> tuple[str, Any]:
        try:
            status, value = self.conns[wid].recv()
        except (EOFError, OSError):
            raise self._gone(wid) from None
        if status == "error":
            raise WorkerError(f"worker {wid} failed:\n{value}")
        if status == _BOOTED:
            self.ready.add(wid)
        return status, value

    def close(self) -> None:
        if self.starting is not None:
            self.starting.join()
        for c in self.conns:
            c.close()
        for p in self.processes:
            if p.pid is not None:  # started
                p.terminate()


def start_ray_workers(n: int, setup: bytes, address: str) -> RayWorkers:
    """`n` Ray actors of one CPU each: on a local Ray of `n` CPUs when `address` is "local"
    (started here unless Ray already runs in this process), else on that cluster."""
    ray = import_ray()
    started = start_ray(ray, None if address == "local" else address, n)
    actor = ray.remote(num_cpus=1)(OwnProcessWorker)
    return RayWorkers(ray, [actor.remote(wid, setup) for wid in range(n)], started)


@dataclass
class RayWorkers:
    """Ray actors; a call's answer is an object reference until it is ready."""

    ray: Any
    actors: list
    started: bool
    pending: dict = field(default_factory=dict)  # object reference -> worker
    initial_from: int | None = None  # the worker building the initial state (`parallel`)

    def submit(self, wid: int, method: str, arg: Any) -> None:
        self.pending[getattr(self.actors[wid], method).remote(arg)] = wid

    def answer(self, wid: int) -> Any:
        """The answer of worker `wid` to the one call it was given."""
        return self.next_reply({wid})[1]

    def next_reply(self, busy: set[int]) -> tuple[int, Any]:
        ready, _ = self.ray.wait(list(self.pending), num_returns=1)
        wid = self.pending.pop(ready[0])
        try:
            return wid, self.ray.get(ready[0])
        except Exception as exc:
            raise WorkerError(f"worker {wid} failed: {exc}") from exc

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        if self.started:
            self.ray.shutdown()
