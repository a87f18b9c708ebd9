"""Running a sweep's cells side by side: in this process, in a local process pool, or on Ray.

A sweep (`bench compare`, `bench ablation`, `bench corpus`) is a list of independent cells
(workload x method x constraint x hardware). A cell is small and picklable: the workload's NAME
and the settings, never its graph; the worker captures the workload itself, once per worker
process (`magis.bench.compare.workload_memo`), so the cells of one workload share a capture
wherever they run. `run_cells` yields each cell's result as it completes, in completion order;
the caller writes it into the same rows and files as a serial run would.

- A cell that raises is a `CellFailure` with its reason (so a FAILURE row), never a lost run:
  the worker catches what the cell raised; a worker that dies (killed, out of memory) fails the
  cells it held, with that reason.
- Ctrl-C cancels the cells not yet finished (pool workers are terminated, Ray tasks cancelled)
  and re-raises `KeyboardInterrupt` to the caller, which still writes what finished. Workers
  ignore SIGINT themselves: the terminal sends it to the whole process group, and only the
  driver decides what happens.

Backends: `SerialRunner` (in this process, the default), `PoolRunner(jobs)`
(`concurrent.futures` with the forkserver context: forking a process that has run torch is
unsafe), `RayRunner(address, num_cpus)` (`ray.init(address=...)`, or a local Ray with
`num_cpus`; Ray is the optional extra `pip install 'magis[ray]'`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from magis.search.transport import import_ray, start_ray

C = TypeVar("C")


@dataclass(frozen=True)
class CellFailure:
    """A cell that raised (or whose worker died): the reason, for its FAILURE row."""

    reason: str


@dataclass(frozen=True)
class Finished:
    """One cell's outcome: its index in the list given to `run_cells`, its result (or a
    `CellFailure`), and the worker's process time for it (CPU seconds, not wall time: the
    machine may be shared)."""

    index: int
    result: Any
    cpu_seconds: float = 0.0


class CellRunner(Protocol):
    """Runs `fn` on every cell and yields each `Finished` as it completes."""

    name: str

    def run(self, cells: Sequence[C], fn: Callable[[C], Any]) -> Iterator[Finished]: ...


def run_cells(
    cells: Sequence[C], fn: Callable[[C], Any], runner: CellRunner | None = None
) -> Iterator[Finished]:
    """`fn(cell)` for every cell on `runner` (serial when None), yielded as each completes.
    `fn` must be a module-level function (it is pickled by name) and each cell picklable."""
    return (runner or SerialRunner()).run(cells, fn)


def call_cell(fn: Callable[[C], Any], cell: C) -> Finished:
    """Run one cell where it is (the worker side of every backend): a cell that raises is a
    `CellFailure`; Ctrl-C is not caught (in the serial runner it ends the run)."""
    start = time.process_time()
    try:
        result = fn(cell)
    except Exception as exc:  # noqa: BLE001 - any failure of one cell is that cell's FAILURE row
        result = CellFailure(f"crashed: {type(exc).__name__}: {exc}")
    return Finished(-1, result, time.process_time() - start)


@dataclass
class SerialRunner:
    """Every cell in this process, in order (the serial run); `on_start(i)` before each."""

    on_start: Callable[[int], None] | None = None
    name: str = "serial"

    def run(self, cells: Sequence[C], fn: Callable[[C], Any]) -> Iterator[Finished]:
        for i, cell in enumerate(cells):
            if self.on_start is not None:
                self.on_start(i)
            done = call_cell(fn, cell)
            yield Finished(i, done.result, done.cpu_seconds)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _mp_context(preload: Sequence[str] = ("magis.bench.compare",)):
    # forkserver: workers are forked from a clean server process, not from this one (which may
    # have run torch: forking its thread pools is unsafe); spawn where forkserver is missing.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if ctx.get_start_method() == "forkserver":
        # the server imports magis (torch, the baselines) once; each worker forks from it
        ctx.set_forkserver_preload(list(preload) or ["magis.bench.compare"])
    return ctx


@dataclass
class PoolRunner:
    """A local pool of `jobs` worker processes; each keeps its captures between cells."""

    jobs: int
    name: str = "pool"

    def run(self, cells: Sequence[C], fn: Callable[[C], Any]) -> Iterator[Finished]:
        pool = ProcessPoolExecutor(
            max_workers=self.jobs, mp_context=_mp_context(), initializer=_ignore_sigint
        )
        pending: dict[Future, int] = {pool.submit(call_cell, fn, c): i for i, c in enumerate(cells)}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in sorted(done, key=pending.__getitem__):
                    yield self._finished(pending.pop(future), future)
        finally:
            if pending:  # Ctrl-C, or the caller stopped reading: end the workers now
                _terminate(pool)
            pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _finished(index: int, future: Future) -> Finished:
        try:
            done = future.result()
        except BrokenProcessPool as exc:
            return Finished(index, CellFailure(f"worker process died: {exc}"))
        except Exception as exc:  # noqa: BLE001 - e.g. a result that could not be pickled
            return Finished(index, CellFailure(f"crashed: {type(exc).__name__}: {exc}"))
        return Finished(index, done.result, done.cpu_seconds)


def _terminate(pool: ProcessPoolExecutor) -> None:
    # concurrent.futures has no public way to stop a running task; its processes are the way.
    for process in list(getattr(pool, "_processes", {}).values()):
        process.terminate()


@dataclass
class RayRunner:
    """Each cell a Ray task (one CPU). `address` None starts a local Ray with `num_cpus`;
    otherwise `ray.init(address=address)` joins that cluster ("auto": the one `ray start`
    started on this machine). Ray is shut down after the run if this runner started it."""

    address: str | None = None
    num_cpus: int | None = None
    name: str = "ray"

    def run(self, cells: Sequence[C], fn: Callable[[C], Any]) -> Iterator[Finished]:
        ray = import_ray()
        started = start_ray(ray, self.address, self.num_cpus)
        try:
            task = ray.remote(num_cpus=1, max_retries=0)(_ray_cell)
            pending = {task.remote(fn, c): i for i, c in enumerate(cells)}
            try:
                while pending:
                    ready, _ = ray.wait(list(pending), num_returns=1)
                    for ref in ready:
                        yield _ray_finished(ray, pending.pop(ref), ref)
            finally:
                for ref in pending:  # Ctrl-C, or the caller stopped reading
                    ray.cancel(ref, force=True)
        finally:
            if started:
                ray.shutdown()


def _ray_cell(fn: Callable[[C], Any], cell: C) -> Finished:
    _ignore_sigint()
    return call_cell(fn, cell)


def _ray_finished(ray, index: int, ref) -> Finished:
    try:
        done = ray.get(ref)
    except Exception as exc:  # noqa: BLE001 - a task error or a dead worker: this cell's FAILURE
        return Finished(index, CellFailure(f"Ray task failed: {type(exc).__name__}: {exc}"))
    return Finished(index, done.result, done.cpu_seconds)


@dataclass
class IsolatedRunner:
    """Each cell in a process of its own (forked from a forkserver that has imported
    `preload`), at most `jobs` at once, each stopped after `timeout_s`: a cell that hangs, or
    crashes its process (a segfault in a library's kernel), is that cell's `CellFailure` and the
    sweep goes on. `on_start(i)` is told each cell as its process starts."""

    jobs: int
    timeout_s: float
    preload: tuple[str, ...] = ()
    on_start: Callable[[int], None] | None = None
    name: str = "isolated"

    def run(self, cells: Sequence[C], fn: Callable[[C], Any]) -> Iterator[Finished]:
        ctx = _mp_context(self.preload)
        waiting = list(enumerate(cells))
        running: dict[int, _Running] = {}
        try:
            while waiting or running:
                while waiting and len(running) < self.jobs:
                    index, cell = waiting.pop(0)
                    if self.on_start is not None:
                        self.on_start(index)
                    running[index] = _Running.start(ctx, fn, cell, self.timeout_s)
                ready = multiprocessing.connection.wait(
                    [r.process.sentinel for r in running.values()], timeout=0.5
                )
                for index, job in sorted(running.items()):
                    if job.process.sentinel in ready or job.overdue():
                        yield Finished(index, *job.finish(self.timeout_s))
                        del running[index]
        finally:
            for job in running.values():  # Ctrl-C, or the caller stopped reading
                job.process.kill()


@dataclass
class _Running:
    """One isolated cell's process, the end of its pipe, and its deadline."""

    process: Any
    reader: Any
    deadline: float

    @classmethod
    def start(cls, ctx, fn: Callable, cell: Any, timeout_s: float) -> _Running:
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_isolated_cell, args=(fn, cell, writer), daemon=True)
        process.start()
        writer.close()  # the child holds its own copy: EOF here when it dies
        return cls(process, reader, time.monotonic() + timeout_s)

    def overdue(self) -> bool:
        return time.monotonic() > self.deadline

    def finish(self, timeout_s: float) -> tuple[Any, float]:
        """(result, cpu seconds) of the cell: what it sent, or why it sent nothing."""
        try:
            if self.reader.poll(0 if self.process.is_alive() else 1.0):
                done = self.reader.recv()
                return done.result, done.cpu_seconds
        except (EOFError, OSError):
            pass
        finally:
            if self.process.is_alive():
                self.process.kill()
            self.process.join(5)
            self.reader.close()
        if self.overdue():
            return CellFailure(f"timed out after {timeout_s:g} s"), 0.0
        return CellFailure(f"its process died (exit code {self.process.exitcode})"), 0.0


def _isolated_cell(fn: Callable, cell: Any, writer) -> None:
    _ignore_sigint()
    done = call_cell(fn, cell)
    try:
        writer.send(done)
    except Exception as exc:  # noqa: BLE001 - a result that cannot be pickled is a failure
        writer.send(Finished(-1, CellFailure(f"crashed: {type(exc).__name__}: {exc}")))
    writer.close()


def make_runner(jobs: int = 1, ray: str | None = None) -> CellRunner:
    """The backend the CLI's `--jobs N` / `--ray [ADDRESS]` ask for: Ray when `ray` is given
    ("local" for a local Ray of `jobs` CPUs, else a cluster address), a pool of `jobs`
    processes when jobs > 1, else serial."""
    if ray is not None:
        import_ray()  # a missing Ray is a one-line error now, not after the capture
        if ray == "local":
            return RayRunner(None, jobs if jobs > 1 else os.cpu_count())
        return RayRunner(ray)
    if jobs > 1:
        return PoolRunner(jobs)
    return SerialRunner()
