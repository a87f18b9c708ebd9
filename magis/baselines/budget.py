"""Running a program under a memory budget by evicting storages and recomputing them on demand.

This is the machinery DTR (Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021) and
XLA's HloRematerialization pass share; they differ only in which storage they drop when an
allocation does not fit (`Policy`). `BudgetRun` walks the captured program order, one op at a
time:

1. every input of the op that is not available is recomputed first, recursively (its producer's
   inputs may be gone too), each recomputation being an op run like any other;
2. before an op allocates its outputs, storages are evicted, chosen by the policy, until the live
   bytes (resident placeholders, live storages, the op's outputs) fit the budget; storages in use
   by the op, or by a recomputation under way, are locked;
3. after it, every storage no later op reads is freed (as PyTorch frees after the last use).

Memory is counted in storages, not tensors (DESIGN: a view shares its base's storage): evicting
a storage drops every alias of it, and a view read later is re-made (for free) from the
recomputed base. Never evicted: placeholders (weights, optimizer state, data), graph outputs,
outputs of random ops (a second draw would differ: fusion-aware-checkpointing §3.4), of ops that
mutate or write into a placeholder (`magis.rules.remat.recomputable`; a training-mode batch
norm is recomputed without its running statistics: `recompute_call`), and storages read after
an in-place update of a weight they are computed from (our SGD updates run inside the backward
pass; recomputing them would read the new value). A storage that cannot be recomputed is kept
past its last read while a storage made from it is evicted, or is smaller than those that could
be; otherwise, once it is freed, those become unevictable too.

The ops run form an execution trace; `magis.rules.recompute_trace.trace_graph` turns it into the real
program whose simulation gives a point's figures. The run's own count of live bytes at every step
is an upper bound of what the simulator finds (an evicted storage is dead from its last reader
on, before the eviction), so a run that succeeds has a simulated peak within the budget;
`budget_sweep` checks it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from magis.baselines.base import Failure, Outcome, point, size_text
from magis.cost import CostModel
from magis.errors import MagisError
from magis.ir import Graph, Ref
from magis.rules import recompute_call
from magis.rules.recompute_trace import trace_graph
from magis.sim import simulate

DEFAULT_RATIOS = tuple(float(r) for r in np.round(np.linspace(0.05, 1.0, 20), 4))
# A run that recomputes more than this many ops per op of the program is thrashing: reported as
# a failure (DTR §5 reports the same blow-up near its lowest budgets).
MAX_RECOMPUTE_FACTOR = 50


class BudgetFailure(Exception):
    """The run cannot keep within its budget (internal: becomes a `Failure`)."""


class BudgetTimeout(BudgetFailure):
    """The run passed its deadline (internal: ends the sweep with a `Failure`)."""


class BudgetMismatchError(MagisError):
    """The simulated program needs more than the run counted: a bug in the bookkeeping."""


@dataclass(frozen=True)
class BudgetTables:
    """Facts of one graph the runs at every budget share: storages as indices into arrays.

    Only storages that are not resident get an index; `value_storage` maps each value to its
    storage's index, or -1 for a value in a resident (placeholder) storage.
    """

    graph: Graph
    order: tuple[int, ...]  # program order
    times: np.ndarray  # node id -> seconds
    storages: tuple[Ref, ...]
    nbytes: np.ndarray
    cost: np.ndarray  # seconds of the op that makes each storage
    readers: np.ndarray  # number of nodes that read each storage (any alias)
    evictable: np.ndarray  # the static rules of the module docstring
    is_output: np.ndarray
    value_storage: dict[Ref, int]
    node_reads: dict[int, tuple[int, ...]]  # distinct storage indices a node reads
    node_makes: dict[int, tuple[int, ...]]  # storage indices a node allocates
    parents: tuple[tuple[int, ...], ...]  # storages the producer of each storage reads
    children: tuple[tuple[int, ...], ...]  # storages made by readers of each storage
    stale_reads: dict[int, frozenset[Ref]]  # node -> updated-in-place storages it reads
    resident_bytes: int
    program_ops: int

    @staticmethod
    def build(graph: Graph, cost: CostModel) -> BudgetTables:
        smap = graph.storages()
        storages = tuple(s for s in smap.nbytes if s not in smap.resident)
        index = {s: i for i, s in enumerate(storages)}
        value_storage = {v: index.get(s, -1) for v, s in smap.base.items()}
        times = cost.node_times(graph)
        order = tuple(graph.program_order())
        node_reads, node_makes = _node_storages(graph, value_storage)
        parents = tuple(node_reads[s.node] for s in storages)
        children: list[list[int]] = [[] for _ in storages]
        for i, s in enumerate(storages):
            for reader in smap.readers[s]:
                children[i].extend(node_makes.get(reader, ()))
        stale_reads = _in_place_reads(graph, smap)
        return BudgetTables(
            graph=graph,
            order=order,
            times=times,
            storages=storages,
            nbytes=np.array([smap.nbytes[s] for s in storages], dtype=np.int64),
            cost=np.array([times[s.node] for s in storages], dtype=np.float64),
            readers=np.array([len(smap.readers[s]) for s in storages], dtype=np.int64),
            evictable=_evictable(graph, storages, smap)
            & _read_before_stale(graph, storages, smap, parents, stale_reads),
            is_output=np.array([s in smap.outputs for s in storages], dtype=bool),
            value_storage=value_storage,
            node_reads=node_reads,
            node_makes=node_makes,
            parents=parents,
            children=tuple(tuple(dict.fromkeys(c)) for c in children),
            stale_reads=stale_reads,
            resident_bytes=sum(smap.nbytes[s] for s in smap.resident),
            program_ops=len(graph.ops()),
        )


def _node_storages(graph: Graph, value_storage: dict[Ref, int]):
    reads: dict[int, tuple[int, ...]] = {}
    makes: dict[int, tuple[int, ...]] = {}
    smap = graph.storages()
    for nid, node in graph.nodes.items():
        got = (value_storage[r] for r in node.inputs)
        reads[nid] = tuple(dict.fromkeys(i for i in got if i >= 0))
        outs = (Ref(nid, k) for k in range(len(node.outputs)))
        made = (value_storage[r] for r in outs if smap.base[r] == r and r in smap.nbytes)
        makes[nid] = tuple(i for i in made if i >= 0)
    return reads, makes


def _evictable(graph: Graph, storages: tuple[Ref, ...], smap) -> np.ndarray:
    """A storage may be dropped when its producer can run again without changing anything:
    `recompute_call` has a call for it, and none of its outputs is a graph output (a re-run would replace it)."""
    ok = np.zeros(len(storages), dtype=bool)
    for i, s in enumerate(storages):
        node = graph.node(s.node)
        outs = [smap.base[Ref(s.node, k)] for k in range(len(node.outputs))]
        ok[i] = (
            recompute_call(graph, s.node) is not None
            and not any(o in smap.outputs for o in outs)
            and smap.nbytes[s] > 0
        )
    return ok


def _in_place_reads(graph: Graph, smap) -> dict[int, frozenset[Ref]]:
    """node -> the placeholder storages it reads that an op updates in place."""
    written = {smap.base[n.writes_into] for n in graph.nodes.values() if n.writes_into is not None}
    stale: dict[int, frozenset[Ref]] = {}
    for nid, node in graph.nodes.items():
        hit = frozenset(smap.base[r] for r in node.inputs if smap.base[r] in written)
        if hit and node.writes_into is None:
            stale[nid] = hit
    return stale


def _read_before_stale(graph: Graph, storages, smap, parents, stale_reads) -> np.ndarray:
    """Storages whose every read comes before any in-place update of a placeholder that they,
    or anything they are recomputed from, read (SGD updates run inside the backward pass here).

    A recomputation of s runs before a read of s or of a descendant d of s that is itself
    evictable, so before stale_at(d) <= stale_at(s): it never sees an updated weight.
    """
    pos = {nid: i for i, nid in enumerate(graph.program_order())}
    writer = {
        smap.base[n.writes_into]: pos[n.id]
        for n in graph.nodes.values()
        if n.writes_into is not None
    }
    inf = len(pos)
    stale_at = np.full(len(storages), inf, dtype=np.int64)
    for i in sorted(range(len(storages)), key=lambda i: pos[storages[i].node]):
        own = [writer[r] for r in stale_reads.get(storages[i].node, ())]
        stale_at[i] = min([*own, *(stale_at[p] for p in parents[i])], default=inf)
    last = np.array([max((pos[r] for r in smap.readers[s]), default=-1) for s in storages])
    return last < stale_at


class Policy(Protocol):
    """Which storage a run drops when an allocation does not fit."""

    def choose(self, run: BudgetRun) -> int | None:
        """A storage index among `run.candidates()`, or None when none helps."""

    def on_evict(self, run: BudgetRun, s: int) -> None: ...

    def on_materialize(self, run: BudgetRun, s: int, recompute: bool) -> None: ...


class BudgetRun:
    """One run of the program under `budget` bytes (see the module docstring)."""

    def __init__(
        self,
        tables: BudgetTables,
        budget: int,
        policy: Policy,
        max_factor: int,
        deadline: float | None = None,
    ) -> None:
        n = len(tables.storages)
        self.t = tables
        self.budget = budget
        self.policy = policy
        self.deadline = deadline  # time.perf_counter() at which the run gives up
        self.max_recomputes = max_factor * max(tables.program_ops, 1)
        self.live = np.zeros(n, dtype=bool)
        self.remaining = tables.readers.copy()  # reads still to come in the program
        self.pins = np.zeros(n, dtype=np.int64)  # reads still to come from recomputations
        self.locks = np.zeros(n, dtype=np.int64)
        self.blocked = np.zeros(n, dtype=bool)  # producer reads an updated placeholder
        self.epoch = np.full(n, -1, dtype=np.int64)  # event of the current materialization
        self.ended = np.zeros(n, dtype=np.int64)  # first event at which it was no longer live
        self.by_recompute = np.zeros(n, dtype=bool)
        self.last_access = np.zeros(n, dtype=np.float64)
        self.exec_at: dict[int, int] = {}
        self.updated: set[Ref] = set()
        self.events: list[int] = []
        self.step_mem = np.zeros(max(2 * len(tables.order), 16), dtype=np.int64)
        self.mem = tables.resident_bytes
        self.now = 0.0
        self.recomputes = 0

    # --- the walk -------------------------------------------------------------------------

    def run(self) -> BudgetRun:
        if self.t.resident_bytes > self.budget:
            raise BudgetFailure(
                f"the resident placeholders alone need {size_text(self.t.resident_bytes)}"
            )
        for nid in self.t.order:
            self._run_node(nid)
        return self

    @property
    def peak(self) -> int:
        n = len(self.events)
        return int(self.step_mem[:n].max()) if n else self.t.resident_bytes

    def available(self, ref: Ref) -> bool:
        at = self.exec_at.get(ref.node)
        if at is None:
            return False
        s = self.t.value_storage[ref]
        return s < 0 or (bool(self.live[s]) and at >= self.epoch[s])

    def candidates(self) -> np.ndarray:
        """Storages that may be evicted now."""
        ok = self.live & self.t.evictable & ~self.blocked & (self.locks == 0)
        return np.flatnonzero(ok)

    def _run_node(self, target: int) -> None:
        """Run `target` (a node of the program), recomputing what it needs first."""
        nodes = self.t.graph.nodes
        stack = [target]
        locked: dict[int, set[int]] = {}
        while stack:
            nid = stack[-1]
            mine = locked.setdefault(nid, set())
            missing = []
            for ref in nodes[nid].inputs:
                if self.available(ref):
                    s = self.t.value_storage[ref]
                    if s >= 0 and s not in mine:
                        mine.add(s)
                        self.locks[s] += 1
                elif ref.node not in missing:
                    missing.append(ref.node)
            if missing:
                # One at a time: what is recomputed is locked by this frame before the next
                # input's recomputation may evict it (siblings evicting each other livelock).
                self._check_recomputable(missing[0], nodes[nid].name)
                stack.append(missing[0])
                continue
            stack.pop()
            self._execute(nid, recompute=nid != target)
            for s in locked.pop(nid):
                self.locks[s] -= 1
            self._free_after(nid, stack[-1] if stack else None)

    def _free_after(self, nid: int, waiting: int | None) -> None:
        """Free what `nid` read or made and nobody needs; what the op `waiting` on it reads
        stays until that op runs."""
        t = self.t
        keep = () if waiting is None else t.node_reads[waiting]
        for s in (*t.node_reads[nid], *t.node_makes[nid]):
            if s not in keep:
                self._free_if_dead(s)

    def _check_recomputable(self, nid: int, reader: str) -> None:
        if nid not in self.exec_at:
            raise BudgetFailure(
                f"{reader} runs before its input (program order is not topological)"
            )
        if self.t.graph.node(nid).is_placeholder:
            raise BudgetFailure(f"placeholder {self.t.graph.node(nid).name} is not available")
        if self.recomputes >= self.max_recomputes:
            raise BudgetFailure(
                f"thrashing: more than {self.max_recomputes} recomputations "
                f"({self.max_recomputes // max(self.t.program_ops, 1)}x the program's ops)"
            )
        stale = self.t.stale_reads.get(nid, frozenset()) & self.updated
        if stale:
            raise BudgetFailure(
                f"recomputing {self.t.graph.node(nid).name} would read a placeholder already "
                "updated in place"
            )

    def _execute(self, nid: int, recompute: bool) -> None:
        # Checked at every op run, recomputations included: one budget of a 100,000-node
        # program takes XLA's policy a minute (a thrashing DTR run, more).
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise BudgetTimeout(f"out of time at {self.t.graph.node(nid).name}")
        t = self.t
        makes = t.node_makes[nid]
        for s in makes:
            self.locks[s] += 1
        new = int(sum(t.nbytes[s] for s in makes if not self.live[s]))
        while self.mem + new > self.budget:
            s = self.policy.choose(self)
            if s is None:
                raise BudgetFailure(
                    f"{t.graph.node(nid).name} needs {size_text(self.mem + new)} live "
                    f"(budget {size_text(self.budget)}) and nothing more can be evicted"
                )
            self.evict(s)
        for s in makes:
            self.locks[s] -= 1
        self._record(nid, makes, new, recompute)
        self._count_reads(nid, recompute)

    def _record(self, nid: int, makes: tuple[int, ...], new: int, recompute: bool) -> None:
        step = len(self.events)
        self.events.append(nid)
        self.exec_at[nid] = step
        self.mem += new
        if step >= len(self.step_mem):
            self.step_mem = np.concatenate([self.step_mem, np.zeros_like(self.step_mem)])
        self.step_mem[step] = self.mem
        self.now += float(self.t.times[nid])
        reads = self.t.node_reads[nid]
        if reads:
            self.last_access[list(reads)] = self.now
        for s in makes:
            self.live[s] = True
            self.epoch[s] = step
            self.by_recompute[s] = recompute
            self.last_access[s] = self.now
            self.policy.on_materialize(self, s, recompute)

    def _count_reads(self, nid: int, recompute: bool) -> None:
        t = self.t
        node = t.graph.node(nid)
        if recompute:
            self.recomputes += 1
            return
        reads = t.node_reads[nid]
        if reads:
            self.remaining[list(reads)] -= 1
        if node.writes_into is not None:
            self.updated.add(t.graph.storages().base[node.writes_into])

    def _free_if_dead(self, s: int) -> None:
        """Free `s` when nothing will read it: no op of the program, no pending recomputation,
        and, when `s` cannot itself be recomputed, no recomputation of a storage made from it."""
        if not self.live[s] or self.remaining[s] or self.pins[s] or self.locks[s]:
            return
        if self.t.is_output[s]:
            return
        if self.fixed(s):
            # Children that may be recomputed later would need `s`, which cannot be: keep it
            # while one of them is evicted, or while it is smaller than they are (the loss's
            # 8-byte total_weight heads all of the backward pass); otherwise they can no longer
            # be evicted either.
            needy = self._needy_children(s)
            if needy and (
                not self.live[needy].all() or self.t.nbytes[s] < self.t.nbytes[needy].sum()
            ):
                return
            self.blocked[needy] = True
        self._drop(s)
        for p in self.t.parents[s]:
            if self.live[p] and self.fixed(p):
                self._free_if_dead(p)

    def fixed(self, s: int) -> bool:
        """`s` cannot be recomputed (any more)."""
        return not self.t.evictable[s] or bool(self.blocked[s])

    def _needy_children(self, s: int) -> list[int]:
        """Children of `s` that a later op may read and that could still be recomputed."""
        return [
            c
            for c in self.t.children[s]
            if (self.remaining[c] or self.pins[c]) and not self.fixed(c)
        ]

    def _drop(self, s: int) -> None:
        self.live[s] = False
        self.ended[s] = len(self.events)
        self.mem -= int(self.t.nbytes[s])

    # --- what policies use ----------------------------------------------------------------

    def evict(self, s: int) -> None:
        self._drop(s)
        self.policy.on_evict(self, s)

    def release(self, s: int) -> None:
        """A pending recomputation no longer needs `s`."""
        self.pins[s] -= 1
        self._free_if_dead(s)

    def revive_bytes(self, storages: Sequence[int]) -> int | None:
        """Bytes that keeping the last materializations of `storages` (dead now) alive up to
        here adds, or None when some step already run would then exceed the budget."""
        # The extra is a staircase: it rises by a storage's bytes where that storage ended.
        # One maximum per stair, on the run's memory alone (XLA calls this for every
        # candidate it weighs: no array the length of the run is built).
        if not storages:
            return 0
        n = len(self.events)
        stairs = sorted((int(self.ended[s]), int(self.t.nbytes[s])) for s in storages)
        extra = 0
        for k, (end, nbytes) in enumerate(stairs):
            extra += nbytes
            stop = stairs[k + 1][0] if k + 1 < len(stairs) else n
            if stop > end and int(self.step_mem[end:stop].max()) + extra > self.budget:
                return None
        return extra

    def revive(self, storages: Sequence[int]) -> None:
        """Keep the last materializations of `storages` alive from their end up to here (XLA
        extends an operand's live range instead of recomputing it)."""
        n = len(self.events)
        for s in storages:
            self.step_mem[self.ended[s] : n] += self.t.nbytes[s]
            self.live[s] = True
            self.mem += int(self.t.nbytes[s])


def budget_sweep(
    method: str,
    graph: Graph,
    cost: CostModel,
    make_policy: Callable[[BudgetTables], Policy],
    ratios: Sequence[float] = DEFAULT_RATIOS,
    max_factor: int = MAX_RECOMPUTE_FACTOR,
    deadline: float | None = None,
) -> Iterator[Outcome]:
    """One point (or `Failure`) per budget, a fraction of the program-order peak; a run still
    going at `deadline` (`time.perf_counter()`) is a `Failure` and ends the sweep."""
    base = simulate(graph, graph.program_order(), cost)
    tables = BudgetTables.build(graph, cost)
    for ratio in ratios:
        budget = int(ratio * base.peak_bytes)
        params = {"budget": ratio}
        try:
            run = BudgetRun(tables, budget, make_policy(tables), max_factor, deadline).run()
        except BudgetFailure as why:
            yield Failure(method, f"budget {ratio:g} ({size_text(budget)}): {why}", params)
            if isinstance(why, BudgetTimeout):
                return
            continue
        yield run_point(method, graph, cost, run, ratio)


def run_point(method: str, graph: Graph, cost: CostModel, run: BudgetRun, ratio: float):
    """The program a successful run executed, simulated; its peak checked against the run's."""
    g, order = trace_graph(graph, run.events)
    p = point(
        method,
        g,
        order,
        cost,
        budget=ratio,
        budget_bytes=run.budget,
        recomputations=run.recomputes,
    )
    if p.sim.peak_bytes > run.peak or p.sim.peak_bytes > run.budget:
        raise BudgetMismatchError(
            f"{method} at budget {ratio:g}: simulated peak {p.sim.peak_bytes} B exceeds the "
            f"run's count {run.peak} B or the budget {run.budget} B"
        )
    return p
