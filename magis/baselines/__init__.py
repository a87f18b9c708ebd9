"""The methods magis is compared against, on the same graphs, simulator and cost model (§7.1).

Each module defines one or more `Baseline`s; `get_baseline(name)` finds one by name. Modules are
imported on first use so that a heavy dependency (AOTAutograd for min-cut) costs nothing unless
that baseline runs.
"""

from __future__ import annotations

import importlib

from magis.baselines.base import (
    Baseline,
    BaselinePoint,
    Failure,
    Outcome,
    Target,
    best_under_latency,
    best_under_memory,
    pareto_front,
    point,
)
from magis.errors import MagisError

# name -> "module:attribute" of its Baseline, in the order reports list them.
_REGISTRY = {
    "pytorch": "magis.baselines.simple:PYTORCH",
    "dp-reorder": "magis.baselines.simple:DP_REORDER",
    "checkpoint": "magis.baselines.checkpoint:CHECKPOINT",
    "min-cut": "magis.baselines.mincut:MIN_CUT",
    "min-cut-budget": "magis.baselines.mincut:MIN_CUT_BUDGET",
    "min-cut-ir": "magis.baselines.mincut_ir:MIN_CUT_IR",
    "dtr": "magis.baselines.dtr:DTR",
    "xla-remat": "magis.baselines.xla:XLA_REMAT",
    "pofo": "magis.baselines.pofo:POFO",
    "ilp": "magis.baselines.ilp:ILP",
}


class UnknownBaselineError(MagisError):
    """A baseline name that is not registered."""


def baseline_names() -> list[str]:
    return list(_REGISTRY)


def get_baseline(name: str) -> Baseline:
    if name not in _REGISTRY:
        raise UnknownBaselineError(
            f"unknown baseline {name!r}: choose one of {', '.join(_REGISTRY)}"
        )
    module, attr = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), attr)


__all__ = [
    "Baseline",
    "BaselinePoint",
    "Failure",
    "Outcome",
    "Target",
    "UnknownBaselineError",
    "baseline_names",
    "best_under_latency",
    "best_under_memory",
    "get_baseline",
    "pareto_front",
    "point",
]
