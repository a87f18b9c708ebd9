"""The search's start (MAGIS Alg. 3, lines 1-3): the step scheduled by the DP scheduler, with its
F-Tree (Analyze, Alg. 1).

With worker processes, the first worker builds it as soon as it boots, while the main process
runs the peers' warm starts, and keeps it: the search then starts from the state that worker
holds instead of spending its first seconds on it (corpus:phi: the DP order and the analysis of
6,301 nodes took 1.5-2.5 s of a 60 s search, with the workers idle).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from magis.cost import CostModel
from magis.ir import Graph
from magis.schedule import schedule
from magis.search import fission_moves
from magis.search.evaluator import simulate_state
from magis.search.hashing import wl_hash
from magis.search.options import MemoryFigure, SearchOptions
from magis.search.state import MState

# The initial state's id in the worker that built it (`Sid`; the main process numbers the
# states it hands out from (-1, 1) on).
INITIAL_SID = (-1, 0)


@dataclass(frozen=True)
class SearchStart:
    """The initial state, and what the search's budget learns from building it."""

    state: MState
    dp_seconds: float  # the DP scheduler's time on the step: what a final re-ordering costs
    seconds: float  # the rest: the simulation, the hash and (mostly) the F-Tree analysis


def initial_state(
    graph: Graph,
    cost: CostModel,
    fission: bool = True,
    figure: MemoryFigure = MemoryFigure.THEORETICAL,
    max_level: int = 4,
    naive_fission_seed: int | None = None,
    order: Sequence[int] | None = None,
) -> MState:
    """The graph scheduled by the DP scheduler (re-ordering costs no time: MAGIS §5.2), or in
    `order` when given, with its F-Tree (Analyze, Alg. 1) when `fission` is on."""
    order = tuple(schedule(graph, "dp").order if order is None else order)
    state = MState(graph, order, simulate_state(graph, order, cost, figure), wl_hash(graph))
    analysis = (
        fission_moves.analyze(graph, list(order), max_level, naive_fission_seed)
        if fission
        else None
    )
    if analysis is None:
        return state
    base, base_order, tree = analysis
    return replace(state, fission=fission_moves.Lineage(base, base_order, tree, epoch=0))


def starting_order(
    graph: Graph, cost: CostModel, dp_order: Sequence[int], figure: MemoryFigure
) -> Sequence[int]:
    """The DP scheduler's order (MAGIS §6.1), unless the program order dominates it: a peak as
    low and a shorter step. Re-ordering costs no time on one stream (§5.2), but not where
    collectives run on a stream of their own: the DP order of a captured FSDP step (Qwen2, 8
    ranks) kept its peak and lost the all-gathers' prefetching (1.022 of the step), a latency
    cap one step above it then ranked every child that spent more time below the start, and
    the search kept materializing the start's F-Tree moves (1-5 s each, none within 1.10)."""
    program = graph.program_order()
    if list(dp_order) == program:
        return dp_order
    dp = simulate_state(graph, dp_order, cost, figure, detail=False)
    kept = simulate_state(graph, program, cost, figure, detail=False)
    if kept.peak_bytes <= dp.peak_bytes and kept.latency_s < dp.latency_s:
        return program
    return dp_order


def search_start(graph: Graph, cost: CostModel, options: SearchOptions) -> SearchStart:
    """The initial state of a search with these options, timed: from the DP scheduler's order,
    or the program order where it dominates that (`starting_order`)."""
    dp_start = time.perf_counter()
    dp_order = schedule(graph, "dp").order
    init_start = time.perf_counter()
    dp_order = starting_order(graph, cost, dp_order, options.memory_figure)
    state = initial_state(
        graph,
        cost,
        options.fission,
        options.memory_figure,
        options.max_level,
        options.naive_fission_seed,
        dp_order,
    )
    return SearchStart(state, init_start - dp_start, time.perf_counter() - init_start)
