"""Capture a function or a training step as a Graph; the workload zoo."""

import sys
import types

from magis.capture.step_kinds import (
    DEFAULT_STEP,
    STEP_NAMES,
    OptimizerSpec,
    StepKind,
    read_step_kind,
)
from magis.capture.steps import workload_step
from magis.capture.trace import Step, capture, training_step
from magis.capture.workloads import WORKLOAD_FAMILIES, Workload, get_workload, list_workloads

__all__ = [
    "DEFAULT_STEP",
    "STEP_NAMES",
    "WORKLOAD_FAMILIES",
    "OptimizerSpec",
    "Step",
    "StepKind",
    "Workload",
    "capture",
    "get_workload",
    "list_workloads",
    "read_step_kind",
    "training_step",
    "workload_step",
]


class _CallablePackage(types.ModuleType):
    """`magis.capture(fn, *args)` is the API the users asked for, and `magis.capture` is also
    this package (DESIGN.md): calling the package captures. Module `__class__` assignment is
    supported by Python for exactly this (PEP 549's rejected alternative, Python >= 3.5)."""

    def __call__(self, fn, *example_args):
        return capture(fn, *example_args)


sys.modules[__name__].__class__ = _CallablePackage
