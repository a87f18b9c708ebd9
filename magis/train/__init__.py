"""Training with magis: `magis.compile(model, optimizer, batch, ...)` returns a `TrainStep` that
runs a plan's generated program as the user's training step (issue #15)."""

from magis.train.compile import (
    CompileError,
    PreparedStep,
    ProgramOrder,
    check_plan_fits,
    compile,
    compile_program_order,
    prepare_step,
)
from magis.train.optimizers import SUPPORTED, GraphOptimizer, OptimizerError
from magis.train.step import BatchError, TrainStep

__all__ = [
    "SUPPORTED",
    "BatchError",
    "CompileError",
    "GraphOptimizer",
    "OptimizerError",
    "PreparedStep",
    "ProgramOrder",
    "TrainStep",
    "check_plan_fits",
    "compile",
    "compile_program_order",
    "prepare_step",
]
