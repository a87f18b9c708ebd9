"""The CNN substitutions of issue 42 — a zero pad folded into its input, an activation's
backward reading its output, a batch norm's backward over a concatenation split by its parts —
checked the TASO way (the rewritten step equals eager PyTorch) and by what they free: the
tensor the backward no longer reads dies in the forward."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from magis.capture import training_step, workload_step
from magis.cost import get_cost_model
from magis.ir import Graph, PlaceholderKind, Ref, TensorMeta
from magis.ir.topological import place_after_inputs
from magis.rules import RuleContext
from magis.rules.taso import FOLD_ZERO_PADS, READ_ACTIVATION_OUTPUTS, SPLIT_BN_BACKWARD_OF_CAT
from magis.rules.taso.activation import BACKWARDS
from magis.rules.taso.pad import zero_pads
from magis.sim import simulate
from tests.rules.test_taso import _apply_and_verify

PAD = "aten.constant_pad_nd.default"
CAT, BN_BACKWARD = "aten.cat.default", "aten.native_batch_norm_backward.default"


class InvertedResidual(nn.Module):
    """MobileNetV2's block as Hugging Face writes it: ReLU6, "TensorFlow" pads (a zero pad
    before a 1x1 convolution); a leaky ReLU in place of the second ReLU6."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.expand = nn.Conv2d(c, 3 * c, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(3 * c)
        self.depthwise = nn.Conv2d(3 * c, 3 * c, 3, stride=2, groups=3 * c, bias=False)
        self.bn2 = nn.BatchNorm2d(3 * c)
        self.project = nn.Conv2d(3 * c, c, 1)

    def forward(self, x):
        h = F.relu6(self.bn1(self.expand(F.pad(x, (0, 0, 0, 0)))))
        h = F.leaky_relu(self.bn2(self.depthwise(F.pad(h, (0, 1, 0, 1)))), 0.1)
        return self.project(F.pad(h, (0, 0, 0, 0))).mean((2, 3))


@pytest.fixture(scope="module")
def block_step():
    torch.manual_seed(0)
    model = InvertedResidual(4).double()
    x = torch.randn(3, 4, 9, 9, dtype=torch.float64)
    return training_step(model, (x,), loss_fn=lambda out, x: out.square().mean())


def test_activation_backwards_read_their_outputs_and_match_eager(block_step):
    ((res, order),) = _apply_and_verify(block_step, READ_ACTIVATION_OUTPUTS)
    g = res.graph
    rewritten = [n for n in res.added if g.node(n).op in BACKWARDS]
    assert len(rewritten) == 2  # the ReLU6 and the leaky ReLU
    for nid in rewritten:
        source = g.node(nid).args[1]
        assert g.node(source.node).op in {"aten.slice.Tensor", PAD, "aten.hardtanh.default"}
    leaky = next(n for n in rewritten if "leaky" in g.node(n).op)
    assert g.node(leaky).args[3] is True  # ATen's own self_is_result form
    # The ReLU6 is read through its padded copy's interior: two slices, no new storage.
    relu6 = next(n for n in rewritten if "hardtanh" in g.node(n).op)
    assert g.node(g.node(relu6).args[1].node).op == "aten.slice.Tensor"


def test_zero_pads_fold_into_their_inputs_and_match_eager(block_step):
    ((res, _),) = _apply_and_verify(block_step, FOLD_ZERO_PADS)
    g = res.graph
    zero = [n for n in g.ops() if g.node(n).op == PAD and not any(g.node(n).args[1])]
    assert len(res.removed) == 2  # the pad before the projection, and its backward (a zero pad)
    # The pad of the step's input stays: an input's storage may be written later in a step.
    assert [g.node(g.node(n).args[0].node).is_placeholder for n in zero] == [True]
    assert any(g.node(n).op == PAD and any(g.node(n).args[1]) for n in g.ops())  # (0, 1, 0, 1)


def test_a_pad_whose_layout_differs_from_its_input_is_kept():
    """A zero pad that returns a row-major copy of a transposed tensor: its readers were
    traced on the copy's layout, so it is not folded; the same pad of a row-major one is."""
    g = Graph()
    x = g.add_placeholder("x", TensorMeta((4, 6), "float32", 4), PlaceholderKind.DATA)
    row_major = TensorMeta((4, 6), "float32", 4)
    transposed = TensorMeta((4, 6), "float32", 4, (1, 4))
    for name, meta in (("kept", transposed), ("folded", row_major)):
        y = g.add_op(f"relu_{name}", "aten.relu.default", (Ref(x),), outputs=(meta,))
        pad = g.add_op(name, PAD, (Ref(y), [0, 0]), outputs=(row_major,))
        g.add_op(f"exp_{name}", "aten.exp.default", (Ref(pad),), outputs=(row_major,))
    ctx = RuleContext(g, tuple(g.program_order()), None)
    ((group,),) = [zero_pads(ctx)]
    assert [g.node(n).name for n in group] == ["folded"]


def test_mobilenet_keeps_less_in_its_program_order():
    """On MobileNetV2 (Hugging Face, tiny) the batch norm outputs its ReLU6 backwards read are
    freed in the forward: the program order's peak drops, and the step still equals eager."""
    _, step = workload_step("corpus:mobilenet_v2:tiny", dtype=torch.float64)
    cost = get_cost_model("rtx3090")
    graph, order = step.graph, step.graph.program_order()
    before = simulate(graph, order, cost).peak_bytes
    ((res, new_order),) = _apply_and_verify(step, READ_ACTIVATION_OUTPUTS)
    assert simulate(res.graph, new_order, cost).peak_bytes < 0.9 * before
    ctx = RuleContext(res.graph, tuple(new_order), None)
    (fold,) = FOLD_ZERO_PADS.match(ctx)
    folded = fold.build()
    assert len(folded.removed) > 30  # Hugging Face's "TensorFlow padding" of 1x1 convolutions
    kept = [n for n in new_order if n not in folded.removed]
    assert folded.graph.is_valid_schedule(place_after_inputs(folded.graph, kept, folded.added))


class DenseBlock(nn.Module):
    """DenseNet's block: each layer batch-normalizes the concatenation of every map before it
    (the first layer's concatenation of one map is a copy)."""

    def __init__(self, c: int, growth: int, layers: int) -> None:
        super().__init__()
        widths = [c + k * growth for k in range(layers)]
        self.norms = nn.ModuleList(nn.BatchNorm2d(w) for w in widths)
        self.convs = nn.ModuleList(nn.Conv2d(w, growth, 3, padding=1) for w in widths)

    def forward(self, x):
        maps = [x]
        for norm, conv in zip(self.norms, self.convs, strict=True):
            maps.append(conv(F.relu(norm(torch.cat(maps, 1)))))
        return torch.cat(maps, 1).mean((2, 3))


def test_batch_norm_backwards_over_concatenations_read_the_parts_and_match_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), DenseBlock(4, 3, 3)).double()
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    step = training_step(model, (x,), loss_fn=lambda out, x: out.square().mean())
    ((res, _),) = _apply_and_verify(step, SPLIT_BN_BACKWARD_OF_CAT)
    g = res.graph
    backwards = [n for n in g.ops() if g.node(n).op == BN_BACKWARD]
    assert len(backwards) == 1 + 2 + 3  # one per part of each layer's concatenation
    assert not any(g.node(g.node(n).args[1].node).op == CAT for n in backwards)
    for n in g.ops():  # each concatenation is read by its batch norm's forward alone
        if g.node(n).op == CAT and g.node(n).name.startswith("cat"):
            readers = {g.node(u).op for u in g.users(n)}
            assert BN_BACKWARD not in readers


def test_densenet_keeps_less_in_its_program_order():
    _, step = workload_step("corpus:densenet121:tiny", dtype=torch.float64)
    cost = get_cost_model("rtx3090")
    before = simulate(step.graph, step.graph.program_order(), cost).peak_bytes
    ((res, order),) = _apply_and_verify(step, SPLIT_BN_BACKWARD_OF_CAT)
    assert simulate(res.graph, order, cost).peak_bytes < 0.97 * before
