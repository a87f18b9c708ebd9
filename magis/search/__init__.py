"""M-State, the search of MAGIS Alg. 3, graph hashing, the two modes, the time budget (§6.2)."""

from magis.search.budget import Budget
from magis.search.collector import search_pace
from magis.search.evaluator import Evaluator, SearchStats, simulate_state
from magis.search.initial import initial_state
from magis.search.optimizer import (
    Improvement,
    SearchResult,
    WarmStart,
    default_rules,
    optimize_graph,
    start_search_workers,
)
from magis.search.options import TIME_BUDGET_S, MemoryFigure, SearchOptions
from magis.search.state import Mode, MState, Objective

__all__ = [
    "Budget",
    "Evaluator",
    "Improvement",
    "MemoryFigure",
    "MState",
    "Mode",
    "Objective",
    "SearchOptions",
    "SearchResult",
    "SearchStats",
    "TIME_BUDGET_S",
    "WarmStart",
    "default_rules",
    "initial_state",
    "optimize_graph",
    "search_pace",
    "start_search_workers",
    "simulate_state",
]
