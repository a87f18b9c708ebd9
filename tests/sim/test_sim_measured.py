"""The simulated peak equals the dispatch tracker's on ops whose output storage is larger than the
output: losses that resize their elementwise buffer down to the reduced scalar (`RESIZED_LOSSES`;
PixArt's mse_loss was 32,760 B short, a 4,096-element float64 buffer counted as 8 B)."""

import pytest
import torch

from magis.backend import compile_program, measure, verify
from magis.capture import capture, training_step
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


# oneDNN's LSTM keeps a training workspace the meta function reports as 0 bytes (T, N, I, H):
# gates, states and their gradients, each array page-aligned, rows padded (`OpInfo.workspace`).
LSTM_SHAPES = [(6, 4, 8, 8), (6, 8, 8, 8), (10, 3, 5, 7), (64, 16, 256, 64), (64, 16, 64, 256)]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")
@pytest.mark.parametrize("shape", LSTM_SHAPES)
def test_onednn_lstm_workspace_is_the_kernels(shape):
    from magis.ir.ops import onednn_lstm_workspace_bytes

    t, n, i, h = shape
    x, hx = torch.randn(t, n, i), torch.zeros(n, h)
    weights = torch.randn(4 * h, i), torch.randn(4 * h, h), torch.randn(4 * h), torch.randn(4 * h)
    with torch.enable_grad():
        out = aten.mkldnn_rnn_layer(
            x, *weights, hx, hx, False, [], 2, h, 1, True, False, False, True
        )
    assert out[3].numel() * out[3].element_size() == onednn_lstm_workspace_bytes(t, n, i, h)


def test_a_fused_lstm_steps_simulated_peak_is_the_measured_one():
    """Two LSTM layers' workspaces (28 KiB each here) live from forward to backward: without
    them the simulated peak was 16,212 B of the measured 73,556."""
    from magis.capture.trace import training_step

    torch.manual_seed(0)
    model = torch.nn.LSTM(8, 8, num_layers=2, batch_first=True)
    step = training_step(model, (torch.randn(4, 6, 8),), loss_fn=lambda out, x: out[0].sum())
    g = step.graph
    assert any(g.node(v).op == "aten.mkldnn_rnn_layer.default" for v in g.ops())
    order = g.program_order()
    program = compile_program(g, order)
    inputs = step.make_inputs()
    assert verify(step, program, inputs, tolerance=1e-5).verified
    measured = measure(program, step.program_inputs(inputs), repeats=1).peak_bytes
    assert simulate(g, order, UnitCostModel()).peak_bytes == measured


def test_a_convolutions_scratch_is_in_the_simulated_peak_as_the_allocator_sees_it(tmp_path):
    """A CPU convolution allocates and frees buffers of its own (a stride-2 transposed one's
    backward pads its input and gradient): the profiled cost model measures them per op and
    the simulator adds them at the op's step, so the simulated peak is the allocator's, where
    the tensors alone were 10-25% short on unet:small's plans (issue 43)."""
    from magis.backend.memory import allocated_peak_bytes, storage_bytes
    from magis.cost import ProfiledCostModel
    from magis.sim import tensor_peak_bytes

    conv = torch.nn.ConvTranspose2d(16, 8, 2, stride=2)
    x = torch.randn(4, 16, 24, 24)
    step = training_step(conv, (x,), loss_fn=lambda out, x: out.square().sum(), optimizer=None)
    g = step.graph
    order = g.program_order()
    cost = ProfiledCostModel("cpu", cache_path=tmp_path / "ops.sqlite", warmup=1, repeats=2)
    scratch = cost.node_scratch(g)
    (backward,) = [n for n in g.ops() if g.node(n).op == "aten.convolution_backward.default"]
    assert scratch[backward] > 0
    simulated = simulate(g, order, cost).peak_bytes
    assert simulated > tensor_peak_bytes(g, order)
    program = compile_program(g, order)
    inputs = step.program_inputs(step.make_inputs())
    program(*inputs)  # warm: a first call allocates what later calls reuse
    measured = storage_bytes(inputs) + allocated_peak_bytes(lambda: program(*inputs))
    assert abs(measured / simulated - 1) <= 0.02, (measured, simulated)


def test_a_functional_copy_into_a_view_counts_the_storage_it_clones():
    """A functional `copy` into a strided view (Longformer's sliding-chunk attention) clones the
    view's whole storage and views the clone as the view (ATen's `clone_preserve_strides`): 7.5%
    of Longformer's peak when only its elements were counted. `span_bytes` is what
    `empty_strided` would allocate for the view's layout."""

    def copies_into_a_strided_view(x):
        base = torch.zeros(64, 256, dtype=x.dtype)
        view = base.as_strided((64, 64), (256, 2))
        return (aten.copy.default(view, x) * 2,)

    step = capture(copies_into_a_strided_view, _x(64, 64))
    copy = next(n for n in step.graph.ops() if step.graph.node(n).op == "aten.copy.default")
    meta = step.graph.node(copy).outputs[0]
    assert meta.strides == (256, 2) and meta.span_bytes == (63 * 256 + 63 * 2 + 1) * 8
    assert meta.nbytes == 64 * 64 * 8  # what an op reads of it
    simulated, measured = _peaks(copies_into_a_strided_view, _x(64, 64))
    assert simulated == measured
