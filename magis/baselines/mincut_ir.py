"""Fusion-aware min-cut re-materialization on magis's own graph (He & Yu, "Transcending
runtime-memory tradeoffs in checkpointing by being fusion aware", MLSys 2023, Alg. 1 and 2).

`min-cut` (`baselines/mincut.py`) runs PyTorch's own partitioner, which re-traces the model
through AOTAutograd: it needs the model, and its program is another capture than the step magis
searches, so it can be compared with but not continued. This is the same algorithm on the
captured step itself, for any step (a user's own model too): its plan is a graph of the step,
so the search takes it as a warm start (`magis.commands.warm_start`) and improves on it.

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
is left out.

Banned from recomputation (§3.1): random ops, in-place writes and what else cannot run twice
(`recompute_call`), and, in the `runtime` variant, compute-bound ops (matmul, convolution: the
paper's rule, so the plan costs little time). The `memory` variant bans only what cannot run
twice: the least memory a min-cut reaches, at more recomputation.

The plan: the forward as captured; before each backward node, every recomputed forward value it
reads, with the recomputed values they read first (`trace_graph` turns that trace into the
graph with clones).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from magis.baselines.base import Baseline, Failure, Outcome, point
from magis.baselines.chain import forward_backward
from magis.baselines.trace import remat_call, trace_graph
from magis.cost import CostModel
from magis.ir import Graph

# "memory" is kept for the analysis (`min_cut(graph, "memory")`), not swept: with nothing
# saved but the inputs, each backward reader recomputes its whole chain from them at once, and
# the peak stays where it was (bert-base:tiny 1.000 of the peak at 1.32 of the time).
VARIANTS = ("runtime",)


@dataclass(frozen=True)
class MinCut:
    """The cut: forward nodes saved for the backward, and those recomputed in it."""

    saved: frozenset[int]
    recomputed: frozenset[int]
    backward: frozenset[int]  # the step's backward nodes (`forward_backward`), found once


def _banned(graph: Graph, nid: int, variant: str) -> bool:
    if remat_call(graph, nid) is None:
        return True
    return variant == "runtime" and graph.info(nid).compute_bound


def _bytes(graph: Graph, nid: int) -> int:
    return sum(m.nbytes for m in graph.node(nid).outputs)


def min_cut(graph: Graph, variant: str = "runtime") -> MinCut | None:
    """Alg. 1 on `graph` (None when it has no backward to save for)."""
    from ortools.graph.python import max_flow  # heavy; only this baseline needs it

    forward, backward, aliases = forward_backward(graph)
    if not forward or not backward:
        return None
    fwd = [*forward, *aliases]
    fwd_set = set(fwd)
    inputs = sorted(
        {
            p
            for n in (*fwd, *backward)
            for p in graph.predecessors(n)
            if graph.node(p).is_placeholder
        }
    )
    index: dict[int, int] = {}  # node -> its in-vertex; out-vertex = in + 1 (forward, inputs)
    for n in (*inputs, *fwd):
        index[n] = 2 + 2 * len(index)
    base = 2 + 2 * len(index)
    for k, n in enumerate(sorted(backward)):
        index[n] = base + k
    source, sink = 0, 1
    tails, heads, caps = [], [], []
    total = sum(_bytes(graph, n) for n in fwd) + 1  # "infinite": more than any cut

    def arc(u: int, v: int, c: int) -> None:
        tails.append(u)
        heads.append(v)
        caps.append(c)

    for p in inputs:
        arc(source, index[p], total)
        arc(index[p], index[p] + 1, 0)  # resident: saving it costs nothing
    for n in fwd:
        arc(index[n], index[n] + 1, _bytes(graph, n))
        if _banned(graph, n, variant):
            arc(source, index[n], total)
    for n in backward:
        arc(index[n], sink, total)
    for u in (*inputs, *fwd):
        for v in graph.users(u):
            if v in fwd_set or v in backward:
                arc(index[u] + 1, index[v], total)
    flow = max_flow.SimpleMaxFlow()
    flow.add_arcs_with_capacity(
        np.array(tails, dtype=np.int32), np.array(heads, dtype=np.int32), np.array(caps)
    )
    if flow.solve(source, sink) != flow.OPTIMAL:
        return None
    src_side = set(int(v) for v in flow.get_source_side_min_cut())
    saved = {n for n in fwd if index[n] in src_side and index[n] + 1 not in src_side}
    sink_side = {n for n in fwd if index[n] not in src_side}
    return MinCut(frozenset(saved), _needed(graph, sink_side, backward), frozenset(backward))


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


def recompute_events(graph: Graph, cut: MinCut) -> list[int]:
    """The program order with each recomputed value run again right before its first backward
    reader (after the recomputed values it reads)."""
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

    for n in graph.program_order():
        if n in cut.backward:
            for p in graph.predecessors(n):
                if p in cut.recomputed:
                    rerun(p)
        events.append(n)
    return events


def mincut_ir_points(graph: Graph, cost: CostModel) -> Iterator[Outcome]:
    """One point per swept variant."""
    for variant in VARIANTS:
        cut = min_cut(graph, variant)
        if cut is None:
            yield Failure(
                "min-cut-ir", "the step has no backward to save for", {"variant": variant}
            )
            continue
        try:
            g, order = trace_graph(graph, recompute_events(graph, cut))
        except ValueError as exc:
            yield Failure("min-cut-ir", str(exc), {"variant": variant})
            continue
        yield point(
            "min-cut-ir",
            g,
            order,
            cost,
            variant=variant,
            saved=len(cut.saved),
            recomputed=len(cut.recomputed),
        )


MIN_CUT_IR = Baseline(
    "min-cut-ir",
    "fusion-aware min-cut re-materialization on the captured step itself (any step)",
    mincut_ir_points,
)
