"""Capture a function or a training step as a Graph; the workload zoo."""

from magis.capture.steps import workload_step
from magis.capture.trace import OptimizerSpec, Step, capture, training_step
from magis.capture.workloads import WORKLOAD_FAMILIES, Workload, get_workload, list_workloads

__all__ = [
    "WORKLOAD_FAMILIES",
    "OptimizerSpec",
    "Step",
    "Workload",
    "capture",
    "get_workload",
    "list_workloads",
    "training_step",
    "workload_step",
]
