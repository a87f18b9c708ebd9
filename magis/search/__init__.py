"""M-State, the search of MAGIS Alg. 3, graph hashing, the two modes, the time budget (§6.2)."""

from magis.search.optimizer import (
    Improvement,
    MemoryFigure,
    SearchResult,
    SearchStats,
    default_rules,
    initial_state,
    optimize_graph,
)
from magis.search.state import Mode, MState, Objective

__all__ = [
    "Improvement",
    "MemoryFigure",
    "MState",
    "Mode",
    "Objective",
    "SearchResult",
    "SearchStats",
    "default_rules",
    "initial_state",
    "optimize_graph",
]
