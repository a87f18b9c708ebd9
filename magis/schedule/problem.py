"""The scheduling problem a graph poses, in the simulator's memory model (MAGIS §2.1).

`magis.sim.memory_timeline` is the contract: a storage is live from its producer's step to the
last reader of any of its aliases, placeholders are resident, graph outputs live to the end, and
the memory of step i is every storage live at i plus the resident bytes. For a set S of nodes that
have run and a node v that runs next, that is

    step(S, v) = live(S) + alloc(v),   live(S) = bytes of storages made in S still needed after S

so the peak of an order depends only on the sequence of sets it passes through — what makes the
dynamic program over sets exact (Serenity, MAGIS ref. [3]).

Two reductions keep the problem small without changing any optimum:

* **Prologue.** Placeholders, and nodes that allocate nothing and depend only on the prologue
  (views of weights, a batch-norm step counter), run first: their steps hold only resident bytes.
* **Units.** A view allocates nothing and never frees a storage its own readers still need, so
  running it right after its producer never raises any step (exchange argument: every later
  step's live set can only shrink). Each view whose non-prologue predecessors all lie in one unit
  joins that unit; a unit runs its members back to back, and its step is its head's step.

Everything else works on units: `Problem` holds their dependency masks, allocations and the
storages they make and read, computed once per graph version (`Graph.derived`).
"""

from __future__ import annotations

from dataclasses import dataclass

from magis.ir import Graph, Ref


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
        return sum(self.sbytes[s] for s in self.makes[u] if self.sreaders[s] or self.soutput[s])

    def peak_of(self, units) -> int:
        """Peak bytes (resident included) of running the prologue then `units` in order."""
        done = set()
        pending = {s: len(r) for s, r in enumerate(self.sreaders)}
        live = peak = 0
        for u in units:
            peak = max(peak, live + self.alloc[u])
            live += self.kept(u)
            for s in self.reads[u]:
                pending[s] -= 1
                if pending[s] == 0 and not self.soutput[s]:
                    live -= self.sbytes[s]
            done.add(u)
        return self.resident + peak


def problem_of(graph: Graph) -> Problem:
    """The scheduling problem of this graph version (cached until the graph changes)."""
    return graph.derived("schedule.problem", lambda: _build(graph))


def _build(graph: Graph) -> Problem:
    smap = graph.storages()
    topo = graph.topological_order()
    prologue, heads = _prologue_and_units(graph, topo, smap)
    unit_of = {nid: heads.index_of(nid) for nid in topo if nid not in prologue}
    members: list[list[int]] = [[] for _ in heads.heads]
    for nid in topo:
        if nid not in prologue:
            members[unit_of[nid]].append(nid)
    preds = _unit_preds(graph, members, unit_of)
    succs: list[list[int]] = [[] for _ in members]
    for u, ps in enumerate(preds):
        for p in ps:
            succs[p].append(u)
    index: dict[Ref, int] = {}
    sbytes, sprod, sreaders, soutput = [], [], [], []
    makes: list[list[int]] = [[] for _ in members]
    for store, nbytes in smap.nbytes.items():
        if store in smap.resident or nbytes == 0 or store.node in prologue:
            continue
        prod = unit_of[store.node]
        index[store] = len(sbytes)
        sbytes.append(nbytes)
        sprod.append(prod)
        sreaders.append(tuple(sorted({unit_of[r] for r in smap.readers[store]} - {prod})))
        soutput.append(store in smap.outputs)
        makes[prod].append(index[store])
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


@dataclass
class _Heads:
    """Unit heads in creation (topological) order and the head each node joined."""

    heads: list[int]
    head_of: dict[int, int]
    _index: dict[int, int]

    def index_of(self, nid: int) -> int:
        return self._index[self.head_of[nid]]


def _prologue_and_units(graph: Graph, topo: list[int], smap) -> tuple[list[int], _Heads]:
    prologue: list[int] = []
    in_prologue: set[int] = set()
    heads: list[int] = []
    head_of: dict[int, int] = {}
    for nid in topo:
        node = graph.node(nid)
        preds = [p for p in graph.predecessors(nid) if p not in in_prologue]
        allocates = any(
            smap.nbytes[r] > 0 and r not in smap.resident for r in smap.allocations(nid, graph)
        )
        if node.is_placeholder or (not preds and not allocates):
            prologue.append(nid)
            in_prologue.add(nid)
            continue
        owners = {head_of[p] for p in preds}
        if graph.info(nid).is_view and len(owners) == 1:
            head_of[nid] = owners.pop()  # a view runs right after what it views
        else:
            head_of[nid] = nid
            heads.append(nid)
    return prologue, _Heads(heads, head_of, {h: i for i, h in enumerate(heads)})


def _unit_preds(graph: Graph, members: list[list[int]], unit_of: dict[int, int]) -> list[list[int]]:
    preds = []
    for u, nodes in enumerate(members):
        ps = {unit_of[p] for nid in nodes for p in graph.predecessors(nid) if p in unit_of}
        ps.discard(u)
        preds.append(sorted(ps))
    return preds
