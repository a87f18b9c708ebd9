"""The simulated peak equals the dispatch tracker's on ops whose output storage is larger than the
output: losses that resize their elementwise buffer down to the reduced scalar (`RESIZED_LOSSES`;
PixArt's mse_loss was 32,760 B short, a 4,096-element float64 buffer counted as 8 B)."""

import pytest
import torch

from magis.backend import compile_program, measure, verify
from magis.capture import capture
from magis.cost import UnitCostModel
from magis.ir import Ref
from magis.ir.ops import DEFAULT_REGISTRY, RESIZED_LOSSES
from magis.sim import simulate

aten = torch.ops.aten


def _peaks(fn, *inputs: torch.Tensor) -> tuple[int, int]:
    """(simulated, measured) peak of `fn` captured and run as generated code in program order."""
    step = capture(fn, *inputs)
    g = step.graph
    order = g.program_order()
    program = compile_program(g, order)
    run_in = step.make_inputs()
    assert verify(step, program, run_in).verified
    measured = measure(program, step.program_inputs(run_in), repeats=1)
    return simulate(g, order, UnitCostModel()).peak_bytes, measured.peak_bytes


def _x(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, dtype=torch.float64)


LOSSES = {
    "mse_loss": lambda a, b: aten.mse_loss(a, b),
    "mse_loss_sum": lambda a, b: aten.mse_loss(a, b, 2),
    "mse_loss_broadcast": lambda a, b: aten.mse_loss(a, b[:1]),
    "smooth_l1_loss": lambda a, b: aten.smooth_l1_loss(a, b),
    "soft_margin_loss": lambda a, b: aten.soft_margin_loss(a, b),
    "binary_cross_entropy": lambda a, b: aten.binary_cross_entropy(a, b),
    "mse_loss_unreduced": lambda a, b: aten.mse_loss(a, b, 0).sum(),
    "huber_loss": lambda a, b: aten.huber_loss(a, b),  # reduces into a fresh scalar
}


@pytest.mark.parametrize("name", LOSSES)
def test_reduced_loss_peak_equals_measured(name):
    # The scalar loss, a graph output, keeps its kernel's 8x16 float64 buffer (1,024 B).
    loss = LOSSES[name]
    simulated, measured = _peaks(lambda a, b: loss(a * 1.0, b), _x(8, 16), _x(8, 16))
    assert simulated == measured


def test_resized_storage_is_the_broadcast_of_input_and_target():
    step = capture(lambda a, b: aten.mse_loss(a, b), _x(8, 16), _x(1, 16))
    g = step.graph
    (loss,) = [n for n in g.ops() if g.node(n).op == "aten.mse_loss.default"]
    assert g.storages().nbytes[Ref(loss)] == 8 * 16 * 8


def test_every_resized_loss_is_flagged():
    for name in RESIZED_LOSSES:
        assert DEFAULT_REGISTRY.lookup(f"aten.{name}.default").keeps_elementwise_storage
    assert not DEFAULT_REGISTRY.lookup("aten.huber_loss.default").keeps_elementwise_storage
