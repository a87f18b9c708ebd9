"""The scheduling problem a graph poses, in the simulator's memory model (MAGIS §2.1).

`magis.sim.memory_timeline` is the contract: a storage is live from its producer's step to the
last reader of any of its aliases, placeholders are resident, graph outputs live to the end, and
the memory of step i is every storage live at i plus the resident bytes. For a set S of nodes that
have run and a node v that runs next, that is

    step(S, v) = live(S) + alloc(v),   live(S) = bytes of storages made in S still needed after S

(storages in host memory, made by a Store, hold no device bytes), so the peak of an order
depends only on the sequence of sets it passes through — what makes the
dynamic program over sets exact (Serenity, MAGIS ref. [3]).

Two reductions keep the problem small without changing any optimum:

* **Prologue.** Placeholders, and nodes that allocate nothing and depend only on the prologue
  (views of weights, a batch-norm step counter), run first: their steps hold only resident bytes.
* **Units.** A view allocates nothing and never frees a storage its own readers still need, so
  running it right after its producer never raises any step (exchange argument: every later
  step's live set can only shrink). Each view whose non-prologue predecessors all lie in one unit
  joins that unit; a unit runs its members back to back, and its step is its head's step.

Everything else works on units: `Problem` holds their dependencies, allocations and the
storages they make and read, computed once per graph version (`Graph.derived`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from magis.ir import DerivedKey, Graph


@dataclass(frozen=True)
class Problem:
    """Units of one graph version, in a topological order (unit index order is topological)."""

    graph: Graph
    prologue: tuple[int, ...]  # node ids that run first, in topological order
    members: tuple[tuple[int, ...], ...]  # unit -> node ids, head first
    unit_of: dict[int, int]  # node id -> unit (prologue nodes absent)
    preds: tuple[tuple[int, ...], ...]  # unit -> units that must run before it
    succs: tuple[tuple[int, ...], ...]
    alloc: tuple[int, ...]  # unit -> bytes its step allocates
    resident: int  # bytes of placeholder storages, live at every step
    # Non-resident storages of nonzero size, by index:
    sbytes: tuple[int, ...]
    sprod: tuple[int, ...]  # producer unit
    sreaders: tuple[tuple[int, ...], ...]  # units reading an alias, producer excluded, sorted
    soutput: tuple[bool, ...]  # a graph output: live to the end
    makes: tuple[tuple[int, ...], ...]  # unit -> storages it allocates
    reads: tuple[tuple[int, ...], ...]  # unit -> storages it reads (not its own)

    @property
    def n(self) -> int:
        return len(self.members)

    def nodes_of(self, units) -> list[int]:
        """The node-level order of a unit order."""
        return [nid for u in units for nid in self.members[u]]

    def full_order(self, units) -> list[int]:
        """Prologue, then the units' members: a complete node order of the graph."""
        return [*self.prologue, *self.nodes_of(units)]

    def kept(self, u: int) -> int:
        """Bytes unit `u` allocates that outlive its step (read later or a graph output)."""
        return self._kept[u]

    @cached_property
    def _kept(self) -> tuple[int, ...]:
        """`kept` of every unit: the partition asks it of every floater at every cut."""
        sbytes, sreaders, soutput = self.sbytes, self.sreaders, self.soutput
        return tuple(
            sum(sbytes[s] for s in made if sreaders[s] or soutput[s]) for made in self.makes
        )


_PROBLEM: DerivedKey[Problem] = DerivedKey("schedule.problem")


def problem_of(graph: Graph) -> Problem:
    """The scheduling problem of this graph version (cached until the graph changes)."""
    return graph.derived(_PROBLEM, lambda: _build(graph))


def _build(graph: Graph) -> Problem:
    smap = graph.storages()
    topo = graph.topological_order()
    prologue, unit_of, members, preds = _units(graph, topo, _device_bytes(smap))
    succs: list[list[int]] = [[] for _ in members]
    for u, ps in enumerate(preds):
        for p in ps:
            succs[p].append(u)
    sbytes, sprod, sreaders, soutput = [], [], [], []
    makes: list[list[int]] = [[] for _ in members]
    in_prologue = set(prologue)
    out_nodes = {r.node for r in smap.outputs}
    # Refs hash slowly: test node ids first (resident storages are made by placeholders, which
    # are in the prologue).
    for store, readers in smap.readers.items():
        nbytes = smap.nbytes[store]
        if not nbytes or store.node in in_prologue or (smap.host and store in smap.host):
            continue  # device bytes only: a stored (swapped-out) tensor lives in host memory
        prod = unit_of[store.node]
        makes[prod].append(len(sbytes))
        sbytes.append(nbytes)
        sprod.append(prod)
        sreaders.append(tuple(sorted({unit_of[r] for r in readers} - {prod})))
        soutput.append(store.node in out_nodes and store in smap.outputs)
    reads: list[list[int]] = [[] for _ in members]
    for s, readers in enumerate(sreaders):
        for r in readers:
            reads[r].append(s)
    alloc = [sum(sbytes[s] for s in ss) for ss in makes]
    return Problem(
        graph=graph,
        prologue=tuple(prologue),
        members=tuple(tuple(m) for m in members),
        unit_of=unit_of,
        preds=tuple(tuple(p) for p in preds),
        succs=tuple(tuple(s) for s in succs),
        alloc=tuple(alloc),
        resident=sum(smap.nbytes[s] for s in smap.resident),
        sbytes=tuple(sbytes),
        sprod=tuple(sprod),
        sreaders=tuple(sreaders),
        soutput=tuple(soutput),
        makes=tuple(tuple(m) for m in makes),
        reads=tuple(tuple(sorted(r)) for r in reads),
    )


def _device_bytes(smap) -> dict[int, int]:
    """Bytes of device memory each node allocates (placeholders' and Stores' excluded)."""
    resident = {r.node for r in smap.resident}
    out: dict[int, int] = {}
    for ref, nbytes in smap.nbytes.items():
        if nbytes and ref.node not in resident and not (smap.host and ref in smap.host):
            out[ref.node] = out.get(ref.node, 0) + nbytes
    return out


def _units(
    graph: Graph, topo: list[int], device: dict[int, int]
) -> tuple[list[int], dict[int, int], list[list[int]], list[list[int]]]:
    """(prologue, unit of each other node, members of each unit, unit predecessors).

    Only a unit's head can depend on another unit: a view joins a unit only when all its
    non-prologue predecessors are in it. Ops that draw from the random generator (dropout's
    `bernoulli`) are chained in their program order: the graph has no edge between two of them,
    but swapping them swaps the numbers each one draws, and the step no longer computes what
    eager PyTorch does."""
    prologue: list[int] = []
    unit_of: dict[int, int] = {}
    members: list[list[int]] = []
    preds: list[list[int]] = []
    flags: dict[str, tuple[bool, bool]] = {}  # op -> (is_view, is_random)
    last_random: int | None = None  # unit of the latest random op so far
    for nid in topo:
        node = graph.node(nid)
        owners = {unit_of[p] for p in graph.predecessors(nid) if p in unit_of}
        if not node.is_placeholder and node.op not in flags:
            info = graph.registry.lookup(node.op)
            flags[node.op] = (info.is_view, info.is_random)
        view, rand = flags.get(node.op, (False, False))
        if node.is_placeholder or (not owners and not device.get(nid) and not rand):
            prologue.append(nid)
            continue
        if view and len(owners) == 1:
            u = owners.pop()  # a view runs right after what it views
            unit_of[nid] = u
            members[u].append(nid)
            continue
        if rand and last_random is not None:
            owners.add(last_random)
        unit_of[nid] = len(members)
        members.append([nid])
        preds.append(sorted(owners))
        if rand:
            last_random = unit_of[nid]
    return prologue, unit_of, members, preds
