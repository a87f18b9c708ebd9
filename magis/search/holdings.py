"""Which of a search's workers holds which state (`magis.search.pool`): a state's id, the
workers holding it and its bytes once pickled, the states each worker may drop at its next
task, and the best state pinned in its worker until another is best."""

from __future__ import annotations

from dataclasses import dataclass, field

from magis.search.messages import Sid, Summary
from magis.search.state import MState


@dataclass
class Holding:
    """A state some worker may need: which workers hold it, and its bytes once pickled."""

    holders: set[int]
    blob: bytes | None = None
    state: MState | None = None  # the main process's copy, when it has one


@dataclass
class StateHoldings:
    """The states the workers hold, by id; the main process's own states are numbered
    (-1, 1), (-1, 2), ... as they are handed out."""

    n: int  # workers
    entries: dict[Sid, Holding] = field(default_factory=dict)
    sid_of: dict[int, Sid] = field(default_factory=dict)  # id() of a main-process state
    drops: dict[int, list[Sid]] = field(default_factory=dict)  # per worker, for its next task
    count: int = 0
    pinned: Sid | None = None  # the best state's: kept in its worker until another is best
    pinned_released: bool = False

    def __post_init__(self) -> None:
        for w in range(self.n):
            self.drops.setdefault(w, [])

    def __getitem__(self, sid: Sid) -> Holding:
        return self.entries[sid]

    def __contains__(self, sid: Sid) -> bool:
        return sid in self.entries

    def sid_for(self, state: MState | Summary) -> Sid:
        """The state's id, numbering a main-process state the first time it is handed out."""
        if isinstance(state, Summary):
            return state.sid
        sid = self.sid_of.get(id(state))
        if sid is None or self.entries.get(sid) is None or self.entries[sid].state is not state:
            self.count += 1
            sid = (-1, self.count)
            self.entries[sid] = Holding(set(), state=state)
            self.sid_of[id(state)] = sid
        return sid

    def held(self, sid: Sid, state: MState, wid: int) -> None:
        """Worker `wid` holds `state` (the main process's copy) as `sid`."""
        self.entries[sid] = Holding({wid}, state=state)
        self.sid_of[id(state)] = sid

    def fetched(self, sid: Sid, state: MState) -> None:
        """The main process now has its own copy of state `sid`."""
        self.entries[sid].state = state
        self.sid_of[id(state)] = sid

    def built(self, child: Summary) -> None:
        """A worker built `child` and holds it."""
        self.entries[child.sid] = Holding({child.sid[0]})

    def holders(self, sid: Sid) -> set[int]:
        """The workers that hold state `sid`."""
        entry = self.entries.get(sid)
        return set() if entry is None else entry.holders

    def pin(self, sid: Sid) -> None:
        """`sid` is the best state now: its worker keeps it until the search ends or another
        is best (the state it replaces is released if the search was done with it)."""
        previous, released = self.pinned, self.pinned_released
        self.pinned, self.pinned_released = sid, False
        if previous is not None and released:
            self.release(previous)

    def release(self, sid: Sid) -> None:
        """No worker needs this state any more."""
        if sid == self.pinned:
            self.pinned_released = True
            return
        entry = self.entries.pop(sid, None)
        if entry is None:
            return
        if entry.state is not None:
            self.sid_of.pop(id(entry.state), None)
        for w in entry.holders:
            self.drops[w].append(sid)

    def drop_copies(self, sid: Sid, keeper: int) -> None:
        """Only `keeper` holds state `sid` now (the others' copies are stale)."""
        entry = self.entries[sid]
        for w in entry.holders - {keeper}:
            self.drops[w].append(sid)
        entry.holders, entry.blob = {keeper}, None

    def discard(self, sid: Sid) -> None:
        """A child the search does not keep: its worker drops it."""
        self.drops[sid[0]].append(sid)

    def take_drops(self, wid: int) -> tuple[Sid, ...]:
        """The states worker `wid` may drop, sent with its next task."""
        dropped, self.drops[wid] = tuple(self.drops[wid]), []
        return dropped
