"""magis's fake kernels exist only while a step is captured: a CTC loss (tensor lengths) and a
float32 grouped matmul capture and verify against eager PyTorch; outside a capture torch's own
refusals are back."""

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
