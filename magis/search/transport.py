"""How a search's workers run: local processes (forked from a clean forkserver) or Ray actors,
each answering the typed calls of `magis.search.messages` (`SearchWorkers`: the started set)."""

from __future__ import annotations

import multiprocessing
import signal
import threading
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from magis.cost import CostModel
from magis.errors import MagisError
from magis.search.initial import SearchStart
from magis.search.main_guard import refuse_unguarded_main
from magis.search.messages import Call, WorkerCall
from magis.search.pickling import loads
from magis.search.workers import OwnProcessWorker


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


def _serve(conn: Connection, wid: int, setup: bytes) -> None:
    """A local worker process: answer the main process's calls until it hangs up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    try:
        worker = OwnProcessWorker(wid, setup)
    except Exception:  # noqa: BLE001 - the main process raises it as the worker's error
        conn.send(("error", traceback.format_exc()))
        return
    conn.send((_BOOTED, None))  # `LocalWorkers.booted` hears it
    # The main process hangs up when the search ends, at times in the middle of a call (its
    # budget ran out): a reset or broken pipe then is the end, not an error to print.
    hung_up = (EOFError, ConnectionResetError, BrokenPipeError)
    try:
        while True:
            call = conn.recv()
            try:
                conn.send(("ok", worker.handle(call)))
            except hung_up:
                raise
            except Exception:  # noqa: BLE001 - sent back and raised there, as the serial search
                conn.send(("error", traceback.format_exc()))
    except hung_up:
        return


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
            wid, call = first
            workers.conns[wid].send(call)
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

    def submit(self, wid: int, call: WorkerCall) -> None:
        self._started()
        try:
            self.conns[wid].send(call)
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

    def booted(self) -> bool:
        """Always: an actor queues the calls it receives before it is up."""
        return True

    def submit(self, wid: int, call: WorkerCall) -> None:
        self.pending[self.actors[wid].handle.remote(call)] = wid

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


@dataclass
class SearchWorkers:
    """A search's started workers (`magis.search.parallel.start_workers`): how they run, and
    the one building the search's initial state until its answer is taken."""

    transport: LocalWorkers | RayWorkers
    initial_from: int | None = None

    def booted(self) -> bool:
        """Whether every worker is ready for calls (without waiting)."""
        return self.transport.booted()

    def take_initial(self, cost: CostModel) -> SearchStart | None:
        """The initial state the first worker built, once (None if none was asked for, or
        it was taken already)."""
        wid, self.initial_from = self.initial_from, None
        if wid is None:
            return None
        return loads(self.transport.answer(wid), cost)

    def close(self) -> None:
        self.transport.close()
