"""Fusion-aware min-cut re-materialization (He & Yu, "Transcending runtime-memory tradeoffs in
checkpointing by being fusion aware", MLSys 2023, Alg. 1 and 2), as a rule of the search.

The auxiliary graph (Alg. 1): a source s and a sink t; every forward node i gets an in- and an
out-vertex joined by an edge whose capacity is what saving i costs; every edge i -> j of the
step becomes an infinite edge i_out -> j_in; backward nodes have only an in-vertex, tied to t
by an infinite edge; the step's inputs and the nodes banned from recomputation are tied to s.
A minimum s-t cut (OR-Tools' max-flow) cuts only in/out edges: the cut nodes are saved for the
backward, the forward nodes on the sink side are recomputed there, the rest is freed after the
forward. Saving an input costs nothing (it stays resident anyway).

Capacities (Alg. 2): the paper charges w for a node the forward materializes anyway and 2w for
one that fusion would have kept in registers. Our simulator runs every op as its own kernel, so
every node is materialized and its capacity is its bytes, w. The paper's re-weighting heuristic
(§3.4, a tie-break among cuts that save as much) is replaced by a price on recomputation: an
edge s -> i_in of capacity `penalty` times the bytes i reads and writes (its memory traffic, the
paper's measure of a memory-bound op's time; a view costs nothing). Every forward node on the
sink side pays it, so among cuts that save about as much the cut recomputes least: on
bert-base, a price of 0.01 keeps the cut's 0.73 of the peak and takes the recomputation's time
from 13.6% of the step to 4.3% (443 recomputed nodes instead of 820). Higher prices trade
memory for time (0.5: 0.88 of the peak at 1.4%).

Banned from recomputation (§3.1): random ops, in-place writes and what else cannot run twice
(`recompute_call`), and, in the `runtime` variant, compute-bound ops (matmul, convolution: the
paper's rule, so the plan costs little time). The `memory` variant bans only what cannot run
twice. In a state the search has transformed, the nodes of enabled F-Tree regions are banned
too, and so is every forward value a frozen backward node reads: no recomputation re-wires a
region (MAGIS §3). Backward nodes the state's schedule runs before the loss (a swap's Store,
an optimizer's work that needs no gradient, autograd's detach of a saved value) run with the
forward: they join its side of the cut and read the originals.

The plan: the forward as scheduled; before each backward node, every recomputed forward value
it reads, with the recomputed values they read first (`trace_graph` turns that trace into the
graph with clones, named `<node>_mincut<k>`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import rustworkx as rx

from magis.analyze.forward_backward import forward_backward
from magis.ir import DerivedKey, Graph, PlaceholderKind, positions
from magis.ir.topological import stable_topological_order
from magis.rules.base import Rewrite, Rewritten, Rule, RuleContext, RuleKind
from magis.rules.duplicates import recompute_call
from magis.rules.recompute_trace import trace_graph

TAG = "mincut"  # the name tag of the cut's recomputations: `<node>_mincut<k>`
# What a recomputation costs, per byte it reads and writes, in bytes saved (module docstring).
TIE_BREAK = 0.01  # among cuts that save about as much, the one that recomputes least
PENALTIES = (TIE_BREAK, 0.1, 0.5)  # the rule's rewrites: less memory, or less time


@dataclass(frozen=True)
class MinCut:
    """The cut: forward nodes saved for the backward, and those recomputed in it."""

    saved: frozenset[int]
    recomputed: frozenset[int]
    backward: frozenset[int]  # the backward nodes that read them (`forward_backward`)


def _banned(graph: Graph, nid: int, variant: str) -> bool:
    if recompute_call(graph, nid) is None:
        return True
    return variant == "runtime" and graph.info(nid).compute_bound


def _bytes(graph: Graph, nid: int) -> int:
    return sum(m.nbytes for m in graph.node(nid).outputs)


def _traffic(graph: Graph, nid: int, written: int) -> int:
    """Bytes a recomputation of `nid` reads and writes (`written`: its outputs'; none for a
    view)."""
    if graph.info(nid).is_view:
        return 0
    return written + sum(graph.meta(r).nbytes for r in graph.node(nid).inputs)


@dataclass(frozen=True)
class _Sides:
    """The step split for Alg. 1: forward side (with the inputs), backward, banned nodes."""

    inputs: list[int]
    fwd: list[int]
    backward: frozenset[int]
    banned: frozenset[int]


def _sides(
    graph: Graph, variant: str, order: Sequence[int] | None, frozen: frozenset[int]
) -> _Sides | None:
    forward, backward, aliases = forward_backward(graph, order)
    if not forward or not backward:
        return None
    pos = positions(graph.program_order() if order is None else order)
    loss_at = pos[_loss(graph)]
    early = tuple(n for n in sorted(backward, key=pos.__getitem__) if pos[n] < loss_at)
    backward = backward - frozenset(early)
    if not backward:
        return None
    fwd = [*forward, *aliases, *early]
    inputs = sorted(
        {
            p
            for n in (*fwd, *backward)
            for p in graph.predecessors(n)
            if graph.node(p).is_placeholder
        }
    )
    frozen_readers = {p for b in backward & frozen for p in graph.predecessors(b)}
    banned = frozenset(
        n for n in fwd if n in frozen or n in frozen_readers or _banned(graph, n, variant)
    )
    return _Sides(inputs, fwd, backward, banned)


def _loss(graph: Graph) -> int:
    """The node that computes the loss: the step's first output, through the views (a detach)
    the capture put on it."""
    nid = graph.outputs[0].node
    while graph.info(nid).is_view and graph.node(nid).inputs:
        nid = graph.node(nid).inputs[0].node
    return nid


def min_cut(
    graph: Graph,
    variant: str = "runtime",
    order: Sequence[int] | None = None,
    frozen: frozenset[int] = frozenset(),
    penalty: float = TIE_BREAK,
) -> MinCut | None:
    """Alg. 1 on `graph` run in `order` (default: the program order), with the nodes of
    `frozen` never recomputed nor re-wired; None when it has no backward to save for.
    `penalty` > 0 charges a recomputation `penalty` times the bytes it reads and writes."""
    sides = _sides(graph, variant, order, frozen)
    return None if sides is None else _cut(graph, sides, penalty)


_INFINITE = -1  # an arc no cut crosses: its capacity is set per price, above any cut's value


@dataclass(frozen=True)
class _Network:
    """Alg. 1's auxiliary graph for one split of the step, but for the prices: built once and
    cut at every price (the three cuts of a state share it)."""

    index: dict[int, int]  # node -> its in-vertex; out-vertex = in + 1 (forward, inputs)
    tails: np.ndarray
    heads: np.ndarray
    caps: np.ndarray  # _INFINITE where no cut may cross
    priced: np.ndarray  # in-vertices of the forward nodes that may be recomputed
    traffic: np.ndarray  # the bytes each of them reads and writes
    forward_bytes: int


def _network(graph: Graph, sides: _Sides) -> _Network:
    """The arcs as arrays: a 42,000-node split decoder has 100,000 of them, and one Python call
    per arc cost 0.15 s per cut."""
    fwd, backward = sides.fwd, sorted(sides.backward)
    heads = [*sides.inputs, *fwd]  # the nodes with an in- and an out-vertex
    bound = graph.next_id
    vertex = np.full(bound, -1, dtype=np.int64)  # node -> its (in-)vertex
    vertex[heads] = 2 + 2 * np.arange(len(heads))
    vertex[backward] = 2 + 2 * len(heads) + np.arange(len(backward))
    named = heads + backward
    index = dict(zip(named, vertex[named].tolist(), strict=True))
    sink = 1  # the source is vertex 0
    inputs_in = vertex[sides.inputs]
    fwd_in = vertex[fwd]
    size_of = {n: _bytes(graph, n) for n in fwd}
    sizes = np.fromiter(size_of.values(), dtype=np.int64, count=len(fwd))
    banned_in = vertex[[n for n in fwd if n in sides.banned]]
    back_in = vertex[backward]
    # data edges u -> v with u on the forward side (an input or a forward node) and v a
    # forward or backward node, each once (a node may read one value twice)
    nodes = graph.nodes
    edges = np.unique(
        np.array([r.node * bound + v for v in (*fwd, *backward) for r in nodes[v].inputs], np.int64)
    )
    tail_in = vertex[edges // bound]
    from_forward = (tail_in >= 0) & (tail_in < 2 + 2 * len(heads))
    edge_tails, edge_heads = tail_in[from_forward] + 1, vertex[edges[from_forward] % bound]
    parts = [
        (np.zeros_like(inputs_in), inputs_in, _INFINITE),
        (inputs_in, inputs_in + 1, 0),  # resident: saving it costs nothing
        (fwd_in, fwd_in + 1, sizes),
        (np.zeros_like(banned_in), banned_in, _INFINITE),
        (back_in, np.full_like(back_in, sink), _INFINITE),
        (edge_tails, edge_heads, _INFINITE),
    ]
    free = [n for n in fwd if n not in sides.banned]
    return _Network(
        index,
        np.concatenate([t for t, _, _ in parts]).astype(np.int32),
        np.concatenate([h for _, h, _ in parts]).astype(np.int32),
        np.concatenate([np.broadcast_to(c, len(t)) for t, _, c in parts]).astype(np.int64),
        vertex[free].astype(np.int32),
        np.array([_traffic(graph, n, size_of[n]) for n in free], dtype=np.float64),
        int(sizes.sum()),
    )


def _cut(
    graph: Graph, sides: _Sides, penalty: float, network: _Network | None = None
) -> MinCut | None:
    """The minimum cut of Alg. 1's auxiliary graph for `sides` (`network`, if built), with an
    arc s -> i_in of `penalty` times its traffic for each node i that may be recomputed.
    (Which maximum flow the solver finds does not matter: the vertices the source reaches in
    its residual graph are the same for all of them.)"""
    from ortools.graph.python import max_flow  # heavy; only the cut needs it

    net = _network(graph, sides) if network is None else network
    price = (penalty * net.traffic).astype(np.int64)
    total = net.forward_bytes + int(price.sum()) + 1  # more than any cut
    charged = price > 0
    flow = max_flow.SimpleMaxFlow()
    flow.add_arcs_with_capacity(
        np.concatenate([net.tails, np.zeros(int(charged.sum()), dtype=np.int32)]),
        np.concatenate([net.heads, net.priced[charged]]),
        np.concatenate([np.where(net.caps == _INFINITE, total, net.caps), price[charged]]),
    )
    if flow.solve(0, 1) != flow.OPTIMAL:
        return None
    src_side = set(flow.get_source_side_min_cut())
    index = net.index
    saved = {n for n in sides.fwd if index[n] in src_side and index[n] + 1 not in src_side}
    sink_side = {n for n in sides.fwd if index[n] not in src_side}
    return MinCut(frozenset(saved), _needed(graph, sink_side, sides.backward), sides.backward)


def _needed(graph: Graph, sink_side: set[int], backward) -> frozenset[int]:
    """The sink-side forward nodes the backward reads, directly or through each other (a
    forward node nothing reads later may sit on either side of the cut: it is not recomputed)."""
    stack = [p for b in backward for p in graph.predecessors(b) if p in sink_side]
    needed: set[int] = set()
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(p for p in graph.predecessors(n) if p in sink_side)
    return frozenset(needed)


def recompute_events(graph: Graph, cut: MinCut, order: Sequence[int] | None = None) -> list[int]:
    """`order` (default: the program order) with each recomputed value run again right before
    its first backward reader (after the recomputed values it reads)."""
    done: set[int] = set()
    events: list[int] = []

    def rerun(n: int) -> None:
        if n in done:
            return
        done.add(n)
        for p in graph.predecessors(n):
            if p in cut.recomputed:
                rerun(p)
        events.append(n)

    for n in graph.program_order() if order is None else order:
        if n in cut.backward:
            for p in graph.predecessors(n):
                if p in cut.recomputed:
                    rerun(p)
        events.append(n)
    return events


# --- the rule ---------------------------------------------------------------------------------


def remat_min_cut(
    graph: Graph,
    order: Sequence[int],
    frozen: frozenset[int] = frozenset(),
    variant: str = "runtime",
    penalty: float = TIE_BREAK,
) -> Rewritten | None:
    """`graph` with the min cut's recomputations, scheduled as the trace runs them (`order`
    with each recomputation before its first backward reader); None when the step has no
    backward, the cut recomputes nothing, or the trace would re-wire a frozen node."""
    cut = min_cut(graph, variant, order, frozen, penalty)
    return None if cut is None else _traced(graph, order, frozen, cut)


def _traced(
    graph: Graph, order: Sequence[int], frozen: frozenset[int], cut: MinCut
) -> Rewritten | None:
    if not cut.recomputed:
        return None
    try:
        g, new_order = trace_graph(graph, recompute_events(graph, cut, order), TAG)
    except ValueError:
        return None
    added = g.added_since(graph)
    changed = frozenset(u for c in added for u in g.users(c) if u in graph)
    if changed & frozen:
        return None
    if not g.is_valid_schedule(new_order):  # an in-place update the schedule ran early
        new_order = stable_topological_order(g, new_order)
    return Rewritten(g, added, changed, order=tuple(new_order))


_OFFERED: DerivedKey[bool] = DerivedKey("rules.mincut_offered")


def _offered(graph: Graph) -> bool:
    """Whether the cut may apply to `graph` (cached per graph version): a training step (it
    updates weights or optimizer state, or returns gradients beside the loss: a backward to
    save for) whose graph runs no min-cut recomputations yet."""

    def compute() -> bool:
        if not graph.outputs:
            return False
        marker = f"_{TAG}"
        trained = (PlaceholderKind.WEIGHT, PlaceholderKind.OPT_STATE)
        updates = False
        for n in graph.nodes.values():
            if marker in n.name:
                return False
            if n.writes_into is not None:
                updates |= graph.node(n.writes_into.node).placeholder_kind in trained
        return updates or len(graph.outputs) > 1

    return graph.derived(_OFFERED, compute)


def _peak_holds_what_the_cut_frees(ctx: RuleContext) -> bool:
    """Whether a hot-spot storage (heuristic H2) is one the cut may free: made by a forward
    node it may recompute (not banned, not frozen, read by no frozen node). The cut frees only
    what it recomputes; after fission most hot-spots lie in frozen regions (bert-base: 10,470
    of 12,700 nodes), where a 0.4 s cut lowered the peak by 0.7%."""
    graph, frozen = ctx.graph, ctx.frozen
    if not graph.outputs:
        return False
    loss = graph.outputs[0].node
    forward = {graph.dag[i] for i in rx.ancestors(graph.dag, graph.rx_index(loss))}
    for spot in ctx.sim.hotspots:
        n = spot.storage.node
        if n not in forward or n in frozen or graph.node(n).is_placeholder:
            continue
        if not _banned(graph, n, "runtime") and not any(u in frozen for u in graph.users(n)):
            return True
    return False


@dataclass
class _SharedCut:
    """What the three prices of one state's cut share: the split into forward and backward
    and its flow network (made by the first `build` the search calls), and the recomputed
    sets already traced."""

    split: bool = False
    sides: _Sides | None = None
    network: _Network | None = None
    traced: set[frozenset[int]] = field(default_factory=set)


def _match(ctx: RuleContext) -> Iterator[Rewrite]:
    """One lazy rewrite per recomputation price (`PENALTIES`), each the whole min cut at once.

    Policy (the max-flow on a 3,000-7,000-node step costs 0.1-0.3 s with the trace, ten times a
    re-materialization's child): offered only on a training step whose graph has no min-cut
    recomputations yet (once per line of states: the cut of a graph already cut recomputes
    nothing new, and its child would be a duplicate; a min-cut warm start counts as cut; the
    search offers it along a line of local rewrites at doubling depths, `Rule.once_per_line`), and,
    under H2, only when the peak holds a value the cut may recompute. Both checks cost a scan
    of the graph. The cut itself is computed in `build`, which the search calls only when it
    evaluates the child; where it finds nothing to do, `build` gives the graph unchanged,
    which the search drops as a duplicate. Three prices, because the rule does not know the
    search's limit: under a latency limit, a cut that saves less in less time may be the one
    that fits. The three share the split into forward and backward, and a price whose cut
    recomputes what a cheaper one's did is not traced again."""
    graph = ctx.graph
    if not _offered(graph) or (ctx.hotspots_only and not _peak_holds_what_the_cut_frees(ctx)):
        return
    order, frozen = ctx.order, ctx.frozen
    shared = _SharedCut()

    def build(penalty: float) -> Rewritten:
        if not shared.split:
            shared.split = True
            shared.sides = _sides(graph, "runtime", order, frozen)
            shared.network = None if shared.sides is None else _network(graph, shared.sides)
        sides = shared.sides
        cut = None if sides is None else _cut(graph, sides, penalty, shared.network)
        result = None
        if cut is not None and cut.recomputed not in shared.traced:
            shared.traced.add(cut.recomputed)
            result = _traced(graph, order, frozen, cut)
        return result if result is not None else Rewritten(graph.copy(), frozenset())

    for penalty in PENALTIES:
        yield Rewrite(
            "min-cut-remat",
            RuleKind.REMAT,
            f"recompute what a fusion-aware min cut does not save, a recomputed byte "
            f"costing {penalty:g} of a saved one (He & Yu Alg. 1)",
            lambda p=penalty: build(p),
        )


MINCUT_REMAT = Rule("min-cut-remat", RuleKind.REMAT, _match, once_per_line=True)
