"""Fusion-aware min-cut re-materialization on magis's own graph (He & Yu, "Transcending
runtime-memory tradeoffs in checkpointing by being fusion aware", MLSys 2023, Alg. 1 and 2), as
a baseline.

`min-cut` (`baselines/mincut.py`) runs PyTorch's own partitioner, which re-traces the model
through AOTAutograd: it needs the model, and its program is another capture than the step magis
searches, so it can be compared with but not continued. This is the same algorithm on the
captured step itself, for any step (a user's own model too): its plan is a graph of the step,
so the search takes it as a warm start (`magis.commands.warm_start`) and improves on it. The
algorithm (the auxiliary graph, its capacities, what is banned from recomputation) lives with
the search's rules (`magis.rules.mincut_remat`), which also apply it to the states the search
makes; here it runs once, on the captured step in its program order.
"""

from __future__ import annotations

from collections.abc import Iterator

from magis.baselines.base import Baseline, Failure, Outcome, point
from magis.cost import CostModel
from magis.ir import Graph
from magis.rules.mincut_remat import TAG, min_cut, recompute_events
from magis.rules.recompute_trace import trace_graph

# "memory" is kept for the analysis (`min_cut(graph, "memory")`), not swept: with nothing
# saved but the inputs, each backward reader recomputes its whole chain from them at once, and
# the peak stays where it was (bert-base:tiny 1.000 of the peak at 1.32 of the time).
VARIANTS = ("runtime",)


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
            g, order = trace_graph(graph, recompute_events(graph, cut), TAG)
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
