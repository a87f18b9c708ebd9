"""What the commands share: progress callbacks, the cost model prepared for a graph, the one
verify-and-measure sequence by which a program is checked against eager PyTorch (MAGIS §7.1),
and the deferral of Ctrl-C while a result is being handed over or written."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from magis.backend import Measurement, Program, Verification, measure, verify
from magis.capture import Step
from magis.cost import CostModel, get_cost_model
from magis.ir import Graph, PlaceholderKind

Progress = Callable[[str], None]  # told the name of each stage as it starts


def silent(stage: str) -> None:
    """The progress callback of a caller who shows nothing."""
    return None


def cost_model(hardware: str | CostModel) -> CostModel:
    """`hardware` as a cost model: a preset's name (`magis.cost.get_cost_model`) or a model."""
    return get_cost_model(hardware) if isinstance(hardware, str) else hardware


def prepare_cost(hardware: str | CostModel, graph: Graph, progress: Progress = silent) -> CostModel:
    """The cost model `hardware`, ready to cost `graph`: a profiled one measures the graph's
    distinct ops now, so that no later step (a search's time budget) pays for it."""
    cost = cost_model(hardware)
    profile = getattr(cost, "profile_graph", None)
    if profile is not None:
        progress("profiling operators")
        profile(graph)
    return cost


def float_dtype(step: Step) -> torch.dtype:
    """The floating dtype the step computes in (its weights' first)."""
    g = step.graph
    for p in g.placeholders(PlaceholderKind.WEIGHT) or g.placeholders():
        dt = g.node(p).outputs[0].torch_dtype
        if dt.is_floating_point:
            return dt
    return torch.get_default_dtype()


def narrowest_float_dtype(step: Step) -> torch.dtype:
    """The least precise floating dtype the step computes in: an autocast step's bfloat16
    (`magis.capture.StepKind`), though its weights are float32."""
    g = step.graph
    dtypes = {m.torch_dtype for n in g.nodes.values() for m in n.outputs}
    floating = [d for d in dtypes if d.is_floating_point]
    return max(floating, key=lambda d: torch.finfo(d).eps, default=float_dtype(step))


# A 16-bit float rounds to 2**-8 (bfloat16) or 2**-10 (float16) of a value: a plan that splits a
# sum (fission) or re-associates it rounds differently from eager in a few places, each some
# units of that, before AdamW normalizes the update.
REDUCED_PRECISION_TOLERANCE = 2e-2


def default_tolerance(dtype: torch.dtype) -> float:
    """Relative error allowed against eager PyTorch: float64 steps differ only by the order of
    their sums, float32 ones by 1e-4 after a whole training step, a step computing in a 16-bit
    float by `REDUCED_PRECISION_TOLERANCE`."""
    if dtype == torch.float64:
        return 1e-9
    return 1e-4 if torch.finfo(dtype).bits >= 32 else REDUCED_PRECISION_TOLERANCE


@dataclass(frozen=True)
class Execution:
    """A program run against eager PyTorch on the same seeded inputs, then measured."""

    dtype: torch.dtype
    tolerance: float
    verification: Verification
    measurement: Measurement
    program_inputs: list  # what the program was measured on (the step's inputs, plus extras)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def verify_and_measure(
    step: Step,
    program: Program,
    progress: Progress = silent,
    tolerance: float | None = None,
    repeats: int = 10,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Execution:
    """Verify `program` against `step` run eagerly (TASO's random testing, see
    `magis.backend.executor`), then measure its peak and wall time on the same inputs, all on
    `device` (the program must be compiled for it)."""
    device = torch.device(device)
    if device.type != "cpu":  # the step's tensor constants go where its inputs go
        constants = tuple(
            c.to(device) if isinstance(c, torch.Tensor) else c for c in step.constants
        )
        step = replace(step, constants=constants)
    inputs = [t.to(device) for t in step.make_inputs(seed=seed)]
    dtype = float_dtype(step)
    tol = tolerance if tolerance is not None else default_tolerance(narrowest_float_dtype(step))
    progress("verifying against eager PyTorch")
    check = verify(step, program, inputs, tolerance=tol, seed=seed)
    progress("measuring")
    program_inputs = step.program_inputs(inputs)
    measured = measure(program, program_inputs, repeats=repeats, seed=seed)
    return Execution(dtype, tol, check, measured, program_inputs)
