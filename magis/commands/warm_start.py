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
deterministic. A point the meta check refuses is skipped, never handed over.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from magis.backend.meta_check import check_graph
from magis.baselines import BaselinePoint, get_baseline
from magis.commands.shared import Progress, silent
from magis.cost import CostModel
from magis.ir import Graph
from magis.search import Objective, WarmStart

# Cheapest first (bert-base, 2,500 nodes: checkpoint 0.6 s, dtr 1.1 s, pofo 1.5 s, xla 1.8 s);
# min-cut needs the model itself (it re-traces through AOTAutograd), not only the graph.
WARM_START_METHODS = ("checkpoint", "dtr", "pofo", "xla-remat")
WARM_START_SHARE = 0.25  # of the time budget, at most, before the search starts


def best_point(points: Sequence[BaselinePoint], objective: Objective) -> BaselinePoint | None:
    """The point the search's own BetterThan ranks first (within the limit first; else the
    nearest to it). Micro-batched points are not one program of the step: left out."""
    single = [p for p in points if p.repeats == 1 and p.extra_bytes == 0]
    return min(single, key=objective.key, default=None)  # BaselinePoint has memory, latency


def baseline_warm_starts(
    graph: Graph,
    cost: CostModel,
    objective: Objective,
    seconds: float | None,
    methods: Sequence[str] = WARM_START_METHODS,
    progress: Progress = silent,
) -> list[WarmStart]:
    """Each method's best point under `objective`, as warm starts, within `seconds` (None: no
    clock, every method)."""
    start = time.perf_counter()
    warm = []
    for name in methods:
        if seconds is not None and time.perf_counter() - start >= seconds:
            break
        progress(f"warm start: {name}")
        try:
            points = [
                o for o in get_baseline(name).points(graph, cost) if isinstance(o, BaselinePoint)
            ]
        except Exception:  # noqa: BLE001 - a peer that cannot handle this graph is no start
            continue
        chosen = best_point(points, objective)
        if chosen is not None and check_graph(chosen.graph).ok:
            warm.append(WarmStart(name, chosen.graph, chosen.order))
    return warm
