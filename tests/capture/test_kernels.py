"""magis's fake kernels exist only while a step is captured: a CTC loss (tensor lengths) and a
float32 grouped matmul capture and verify against eager PyTorch; outside a capture torch's own
refusals are back. The activations' and regression losses' backward ops are laid out at capture
as their kernels lay them out, so a recorded view of their gradients runs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from magis.backend import compile_program, verify
from magis.capture import capture, training_step
from magis.capture.kernels import capture_kernels


class CTCHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x, labels):
        log_probs = self.proj(x).log_softmax(-1).transpose(0, 1)  # [T, B, C]
        steps, batch = log_probs.shape[:2]
        lengths = torch.full((batch,), steps, dtype=torch.long)
        target_lengths = torch.full((batch,), labels.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, labels, lengths, target_lengths)


def _fake_ctc() -> None:
    with FakeTensorMode():
        log_probs = torch.randn(10, 2, 6).log_softmax(-1)
        F.ctc_loss(log_probs, torch.ones(2, 3, dtype=torch.long), torch.full((2,), 10),
                   torch.full((2,), 3))  # fmt: skip


def test_ctc_loss_captures_and_verifies(float64):
    torch.manual_seed(0)
    labels = torch.randint(1, 6, (2, 3))
    step = training_step(CTCHead(), (torch.randn(2, 10, 8), labels))
    ops = {step.graph.node(n).op for n in step.graph.ops()}
    assert {"aten._ctc_loss.Tensor", "aten._ctc_loss_backward.Tensor"} <= ops
    program = compile_program(step.graph, step.graph.program_order())
    check = verify(step, program, step.make_inputs(), tolerance=1e-9)
    assert check.verified, (check.worst, check.max_rel_err)


def test_float32_grouped_matmul_captures_and_verifies():
    offs = torch.tensor([3, 5, 8], dtype=torch.int32)

    def experts(x, w):
        return F.grouped_mm(x, w, offs=offs).relu()

    step = capture(experts, torch.randn(8, 16), torch.randn(3, 16, 32))  # rows of 16 bytes
    assert tuple(step.graph.meta(step.graph.outputs[0]).shape) == (8, 32)
    program = compile_program(step.graph, step.graph.program_order())
    check = verify(step, program, step.make_inputs(), tolerance=1e-5)
    assert check.verified, (check.worst, check.max_rel_err)


def test_the_kernels_are_gone_after_the_capture():
    with capture_kernels():
        _fake_ctc()  # magis's kernel
    with pytest.raises(Exception, match="_ctc_loss"):
        _fake_ctc()  # torch's refusal, as before


A = torch.ops.aten
# each activation backward of POINTWISE_BACKWARD called on (gradient, forward input)
BACKWARDS = {
    "softplus_backward": lambda g, x: A.softplus_backward(g, x, 1.0, 20.0),
    "hardswish_backward": A.hardswish_backward,
    "elu_backward": lambda g, x: A.elu_backward(g, 1.0, 1, 1, False, x),
    "hardsigmoid_backward": A.hardsigmoid_backward,
    "logit_backward": lambda g, x: A.logit_backward(g, x.sigmoid()),
    "hardtanh_backward": lambda g, x: A.hardtanh_backward(g, x, -1.0, 1.0),
}
LOSSES = {
    "mse_loss_backward": lambda g, x, t: A.mse_loss_backward(g, x, t, 1),
    "smooth_l1_loss_backward": lambda g, x, t: A.smooth_l1_loss_backward(g, x, t, 1, 1.0),
    "huber_loss_backward": lambda g, x, t: A.huber_loss_backward(g, x, t, 1, 1.0),
}
LAYOUTS = {
    "contiguous": lambda: torch.randn(2, 4, 16),
    "transposed": lambda: torch.randn(2, 16, 4).transpose(1, 2),
    "permuted": lambda: torch.randn(4, 16, 2).permute(2, 0, 1),
    "expanded": lambda: torch.randn(1, 4, 16).expand(2, 4, 16),
}


def _fake_strides(op, grad, x):
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        return op(mode.from_tensor(grad), mode.from_tensor(x)).stride()


@pytest.mark.parametrize("name", sorted(BACKWARDS))
def test_activation_backwards_are_laid_out_as_their_kernels_lay_them_out(name):
    from magis.capture.kernels import POINTWISE_BACKWARD

    assert name in POINTWISE_BACKWARD
    op, differed = BACKWARDS[name], False
    for grad_layout in LAYOUTS.values():
        for input_layout in LAYOUTS.values():
            grad, x = grad_layout(), input_layout()
            real = op(grad, x).stride()
            differed |= _fake_strides(op, grad, x) != real  # torch's own decomposition
            with capture_kernels():
                assert _fake_strides(op, grad, x) == real
    assert differed  # the kernel is needed: torch's fake strides are wrong for some layout


class SoftplusOverTransposed(nn.Module):
    """Doge's gate: softplus over a transposed projection; the backward's `view` of its
    gradient is valid only in the kernel's layout."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x, y):
        gate = F.softplus(self.proj(x)).transpose(1, 2)  # [B, 4, T], its gradient transposed
        return (gate * y).sum()


def test_a_view_of_an_activation_gradient_verifies(float64):
    torch.manual_seed(0)
    step = training_step(SoftplusOverTransposed(), (torch.randn(2, 16, 8), torch.randn(2, 4, 16)))
    assert "aten.softplus_backward.default" in {step.graph.node(n).op for n in step.graph.ops()}
    program = compile_program(step.graph, step.graph.program_order())
    check = verify(step, program, step.make_inputs(), tolerance=1e-9)
    assert check.verified, (check.worst, check.max_rel_err)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_regression_loss_gradients_are_contiguous_as_their_kernels_make_them(name):
    from magis.capture.kernels import LOSS_BACKWARD

    assert name in LOSS_BACKWARD
    op, differed, grad = LOSSES[name], False, torch.ones(())
    for input_layout in LAYOUTS.values():
        for target_layout in LAYOUTS.values():
            x, t = input_layout(), target_layout()
            real = op(grad, x, t).stride()
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                differed |= op(*map(mode.from_tensor, (grad, x, t))).stride() != real
            with capture_kernels(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
                assert op(*map(mode.from_tensor, (grad, x, t))).stride() == real
    assert differed


@pytest.mark.parametrize("dim", [-1, 1])
def test_log_softmax_gradients_are_laid_out_as_the_kernel_lays_them_out(dim):
    from magis.capture.kernels import SOFTMAX_BACKWARD

    assert "_log_softmax_backward_data" in SOFTMAX_BACKWARD
    differed = False
    for grad_layout in LAYOUTS.values():
        for output_layout in LAYOUTS.values():
            grad, out = grad_layout(), output_layout().log_softmax(dim)
            args = (grad, out)
            real = A._log_softmax_backward_data(*args, dim, torch.float32).stride()
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fake = A._log_softmax_backward_data(
                    *map(mode.from_tensor, args), dim, torch.float32
                )
                differed |= fake.stride() != real
            with capture_kernels(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fake = A._log_softmax_backward_data(
                    *map(mode.from_tensor, args), dim, torch.float32
                )
                assert fake.stride() == real
    assert differed
