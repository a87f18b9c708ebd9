"""The peers' plans as the search's starting points (issue #16).

On graphs it has never seen, the search may spend its budget on moves that do not reach the
peak while the simplest peer (XLA's greedy re-materialization, POFO's offloading chain) already
has a good program: on a 1.1B decoder the search stayed at 0.993 of the peak in 60 s where
`xla-remat` reached 0.499 in a few seconds. Each baseline here turns the captured step into
a graph and an order in our IR (the same simulator and cost model judge it), so its best point
under the objective is a state like any other: the search queues it beside its own initial
state, keeps it when nothing better is found, and applies its rules to it.

Baselines run cheapest first, until `share` of the time budget is spent (each one is 1-12 s
on 3,500-node graphs); a search bounded by `max_states` runs them all, so that it stays
deterministic. A method that solves for one constraint (`Baseline.solve`: the exact `ilp`)
is asked for the search's own constraint, with the share's time left (with no clock, on its
deterministic one), instead of sweeping its knobs. A point the meta check refuses is skipped,
never handed over.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from magis.backend.meta_check import check_graph
from magis.baselines import Baseline, BaselinePoint, Outcome, Target, get_baseline
from magis.commands.shared import Progress, silent
from magis.cost import CostModel
from magis.ir import Graph
from magis.search import Mode, Objective, WarmStart

# The peers that most often hold the best point first (issue #16's table: xla-remat on the
# decoders and DenseNet, pofo on T5). PyTorch's own min-cut needs the model (it re-traces it
# through AOTAutograd) and makes another capture; min-cut-ir is the same algorithm on the step.
# The exact ILP last: it takes whatever the share has left.
WARM_START_METHODS = ("xla-remat", "pofo", "min-cut-ir", "dtr", "checkpoint", "ilp")
MIN_SOLVE_S = 1.0  # an exact method is not started with less of the share left
WARM_START_SHARE = 0.25  # of the time budget, at most, before the search starts


def best_point(
    points: Iterable[Outcome], objective: Objective, deadline: float | None = None
) -> BaselinePoint | None:
    """The point the search's own BetterThan ranks first (within the limit first; else the
    nearest to it). Micro-batched points are not one program of the step: left out.

    Budget sweeps yield their points by rising budget (more memory, less time): under a
    latency limit the first point within it is the least memory any later one could beat
    only by breaking it, and under a memory limit the first point above it ends the useful
    ones; the scan stops there (a sweep of 20 budgets on 6,800 nodes is seconds a point).
    It stops at `deadline` (`time.perf_counter()`) too, with the best point so far: DTR
    failing at seven low budgets in turn took 29 s on a 1.1B decoder, of a 15 s share."""
    latency_mode = objective.mode is Mode.LATENCY_LIMIT
    best = None
    for p in points:
        if isinstance(p, BaselinePoint) and p.repeats == 1 and p.extra_bytes == 0:
            met = objective.satisfied(p)  # BaselinePoint has memory and latency, as a state
            if best is None or objective.key(p) < objective.key(best):
                best = p
            if (latency_mode and met) or (not latency_mode and not met and best is not p):
                break
        if deadline is not None and time.perf_counter() > deadline:
            break
    return best


def baseline_warm_starts(
    graph: Graph,
    cost: CostModel,
    objective: Objective,
    seconds: float | None,
    methods: Sequence[str] = WARM_START_METHODS,
    progress: Progress = silent,
) -> list[WarmStart]:
    """Each method's best point under `objective`, as warm starts, within `seconds` (None: no
    clock, every method): a method is not started when the longest one so far would overrun."""
    start = time.perf_counter()
    deadline = None if seconds is None else start + seconds
    longest = 0.0
    warm = []
    for name in methods:
        began = time.perf_counter()
        if seconds is not None and began - start + longest > seconds:
            break
        progress(f"warm start: {name}")
        try:
            chosen = _chosen(get_baseline(name), graph, cost, objective, deadline)
        except Exception:  # noqa: BLE001 - a peer that cannot handle this graph is no start
            chosen = None
        if chosen is not None and check_graph(chosen.graph).ok:
            warm.append(WarmStart(name, chosen.graph, chosen.order))
        longest = max(longest, time.perf_counter() - began)
    return warm


def _chosen(
    baseline: Baseline,
    graph: Graph,
    cost: CostModel,
    objective: Objective,
    deadline: float | None,
) -> BaselinePoint | None:
    """The method's best point under `objective`: solved for it where the method can
    (`Baseline.solve`), else the best of its sweep (`best_point`)."""
    if baseline.solve is None:
        return best_point(baseline.sweep(graph, cost, deadline), objective, deadline)
    seconds = None if deadline is None else deadline - time.perf_counter()
    if seconds is not None and seconds < MIN_SOLVE_S:
        return None
    if objective.mode is Mode.LATENCY_LIMIT:
        target = Target(latency_s=float(objective.limit))
    else:
        target = Target(memory_bytes=int(objective.limit))
    found = baseline.solve(graph, cost, target, seconds)
    return best_point([found], objective)
