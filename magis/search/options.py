"""The search's knobs in one frozen object (MAGIS §6.2, Alg. 3; heuristics H1-H3 of §7.2.5).

Variants are made with `dataclasses.replace`, as the AOTAutograd partitioner's options are: a
benchmark's ablation setting is `replace(options, max_level=2)`, never a new keyword threaded
through every call.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from magis.rules import Rule

DELTA = 1.1  # Alg. 3's relaxation coefficient
EXPANSION_WIDTH = 8  # children evaluated per pop before the state goes back (partial expansion)
# The paper's 3 minutes a search (§7.1). The one default of every entry that runs the search
# (`magis optimize --time-budget`, `magis.optimize`, `find_plan`): they read it from here.
TIME_BUDGET_S = 180.0


class MemoryFigure(enum.Enum):
    """What a state's memory is: the simulator's theoretical peak (MAGIS), or the arena a
    long-lived-first best-fit layout needs for it (ROAM §IV-B: what an allocator can reach)."""

    THEORETICAL = "theoretical"
    ARENA = "arena"


@dataclass(frozen=True)
class SearchOptions:
    """How one search runs.

    `max_level` is the F-Tree's L (heuristic H3); `hotspots_only` is H2; `naive_fission_seed`
    turns H1 off (the §7.2.5 ablation's naive-fission). `seed` shuffles the order in which the
    rules are tried: the search is deterministic for one seed and `max_states`, and different
    seeds explore different plans (tests verify plans from several). `rules` None means
    `default_rules()`.

    `workers` > 1 builds children in that many worker processes (or Ray actors: `ray` is
    "local" or a cluster's address). With `max_states`, a popped state's children are built in
    parallel and recorded in the serial order: the same plan as one worker for a seed
    (`magis.search.parallel`). Under a time budget alone, each worker expands a popped state of
    its own and outcomes are recorded as they arrive (`magis.search.concurrent`).
    """

    time_budget: float = TIME_BUDGET_S
    max_states: int | None = None
    seed: int | None = None
    rules: Sequence[Rule] | None = None
    delta: float = DELTA
    hotspots_only: bool = True
    fission: bool = True
    max_level: int = 4
    naive_fission_seed: int | None = None
    memory_figure: MemoryFigure = MemoryFigure.THEORETICAL
    expansion_width: int = EXPANSION_WIDTH
    workers: int = 1
    ray: str | None = None

    @property
    def reanalyse(self) -> bool:
        """Re-analysis (Alg. 3's Analyze on reached states) belongs to H1's guided fission."""
        return self.fission and self.naive_fission_seed is None
