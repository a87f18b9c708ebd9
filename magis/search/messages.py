"""What travels between a search's main process and its workers (`magis.search.parallel`,
`magis.search.concurrent`): a state a worker holds (`Summary`), a move to evaluate (`Task`) and
its outcome (`Outcome`), and every other request a worker answers, each a typed call
(`WorkerCall`: the worker runs `call.answer(worker)`; no request is chosen by a method's
name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from magis.search.state import Objective

Sid = tuple[int, int]  # a state's id: (the worker that built it, or -1 for the main, a count)


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
    take a millisecond each.

    `fission`: whether the state's F-Tree moves may be built (`SearchCore.fission_affordable`,
    decided by the main process, which holds the budget and the measured cost of a split);
    when False, such a move is answered unbuilt, as `unaffordable`."""

    sid: Sid
    index: int
    blob: bytes | None
    seen: tuple[int, ...]
    trees: tuple
    drop: tuple[Sid, ...]
    batch: Batch | None = None
    fission: bool = True

    def answer(self, worker: Worker) -> list[Outcome]:
        return worker.evaluate(self)


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
    unaffordable: bool = False  # an F-Tree move left unbuilt: the task forbade fission


# --- the calls a worker answers (each a typed request: nothing is chosen by a method's name) --


class Worker(Protocol):
    """What a worker answers (`magis.search.workers.ChildWorker`)."""

    def evaluate(self, task: Task) -> list[Outcome]: ...

    def state(self, sid: Sid) -> bytes: ...

    def initial(self, graph: bytes) -> bytes: ...

    def reorder(self, sid: Sid) -> bytes: ...

    def hotspot_key(self, sid: Sid) -> frozenset: ...

    def reanalyse(self, job: Reanalyse) -> tuple[bool, float]: ...


class WorkerCall(Protocol):
    """A request to one worker; `answer` runs it there (`magis.search.workers.ChildWorker.handle`)."""

    def answer(self, worker: Worker) -> Any: ...


@dataclass(frozen=True)
class FetchState:
    """The pickled bytes of a state the worker holds (to move it to another worker)."""

    sid: Sid

    def answer(self, worker: Worker) -> bytes:
        return worker.state(self.sid)


@dataclass(frozen=True)
class BuildInitial:
    """The search's initial state, built from the pickled step and kept as `INITIAL_SID`."""

    graph: bytes

    def answer(self, worker: Worker) -> bytes:
        return worker.initial(self.graph)


@dataclass(frozen=True)
class ReorderBest:
    """The final re-ordering of the best state, which the worker holds."""

    sid: Sid

    def answer(self, worker: Worker) -> bytes:
        return worker.reorder(self.sid)


@dataclass(frozen=True)
class HotspotKey:
    """The key of a held state's hot-spots (whether its re-analysis would be new)."""

    sid: Sid

    def answer(self, worker: Worker) -> frozenset:
        return worker.hotspot_key(self.sid)


@dataclass(frozen=True)
class Reanalyse:
    """A new F-Tree for a held state: the main process has decided it is due."""

    sid: Sid
    max_level: int
    epoch: int

    def answer(self, worker: Worker) -> tuple[bool, float]:
        return worker.reanalyse(self)


Call = tuple[int, WorkerCall]  # (worker, request)
