"""Strides in the IR (issue 14): capture records them, plans keep them, and the meta check holds a
graph to them. The model is the issue's case: tokens viewed as a channels-last image for a
convolution, whose eager backward returns the input gradient channels-last, and a later `view`
of that gradient (the backward of the tokens-to-image view) that only works on those strides.
"""

import dataclasses
import json

import pytest
import torch
from torch import nn

from magis.backend import compile_program, verify
from magis.backend.meta_check import check_graph, check_nodes, nodes_to_check
from magis.capture import training_step
from magis.ir import Ref, TensorMeta
from magis.ir.serialize import graph_from_json, graph_to_json

CHANNELS_LAST = (128, 1, 32, 8)  # (2, 8, 4, 4) in NHWC order
CONTIGUOUS = (128, 16, 4, 1)


class TokensThroughConv(nn.Module):
    """(N, 16, 3) tokens -> linear -> a 4x4 image with 8 channels (a channels-last view) ->
    convolution -> mean -> linear: the token/image round trip of a diffusion U-Net's blocks."""

    def __init__(self, channels: int = 8, side: int = 4) -> None:
        super().__init__()
        self.side, self.channels = side, channels
        self.embed = nn.Linear(3, channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.head = nn.Linear(channels, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        image = self.embed(x).view(n, self.side, self.side, self.channels).permute(0, 3, 1, 2)
        return self.head(self.conv(image).mean((2, 3)))


@pytest.fixture
def step(float64):
    torch.manual_seed(0)
    x, y = torch.randn(2, 16, 3), torch.randint(0, 4, (2,))
    loss = lambda out, x, y: nn.functional.cross_entropy(out, y)  # noqa: E731
    return training_step(TokensThroughConv(), (x, y), loss_fn=loss)


def _only(graph, op):
    (nid,) = [n for n in graph.ops() if graph.node(n).op == op]
    return nid


def test_a_meta_without_strides_is_contiguous():
    meta = TensorMeta((2, 3, 4), "float32", 4)
    assert meta.strides == (12, 4, 1)
    assert TensorMeta((0, 5), "float32", 4).strides == (5, 1)
    assert TensorMeta((), "float32", 4).strides == ()


def test_capture_records_channels_last_strides_and_plans_keep_them(step):
    g = step.graph
    conv = _only(g, "aten.convolution.default")
    backward = _only(g, "aten.convolution_backward.default")
    assert g.meta(g.node(conv).inputs[0]).strides == CHANNELS_LAST  # the permuted tokens
    assert g.meta(Ref(backward, 0)).strides == CHANNELS_LAST  # eager's input gradient
    back = graph_from_json(json.loads(json.dumps(graph_to_json(g))))
    assert back.meta(Ref(backward, 0)).strides == CHANNELS_LAST
    assert all(back.node(n) == g.node(n) for n in g.nodes)


def test_the_captured_graph_passes_the_meta_check_and_verifies(step):
    g = step.graph
    report = check_graph(g)
    assert report.ok, report.mismatches
    assert report.checked == len(g.ops())
    program = compile_program(g, g.program_order())
    assert verify(step, program, step.make_inputs()).verified


def _split_dgrad_by_hand(graph):
    """What `split_conv_backward` did when issue 14 was filed: the input gradient as a transposed
    convolution of the output gradient, recorded with eager's (channels-last) meta. The output
    gradient here is contiguous, so the transposed convolution returns NCHW."""
    g = graph.copy()
    nid = _only(g, "aten.convolution_backward.default")
    gy, _, w, _, stride, padding, dilation, _, _, groups, _ = g.node(nid).args
    dgrad = g.add_op(
        "dgrad_transposed",
        "aten.convolution.default",
        (gy, w, None, stride, padding, dilation, True, [0, 0], groups),
        outputs=(g.meta(Ref(nid, 0)),),
    )
    g.replace_uses(Ref(nid, 0), Ref(dgrad, 0))
    return g, dgrad


def test_a_contiguous_dgrad_under_a_channels_last_view_is_reported(step):
    g, dgrad = _split_dgrad_by_hand(step.graph)
    report = check_nodes(g, nodes_to_check(g, [dgrad]))
    (mismatch,) = report.mismatches
    assert mismatch.node == dgrad and mismatch.output == 0
    assert mismatch.expected.strides == CHANNELS_LAST and mismatch.got.strides == CONTIGUOUS
    assert "strides (128, 16, 4, 1), the graph records (128, 1, 32, 8)" in str(mismatch)
    # The check predicts exactly the failure issue 14 met at run time.
    program = compile_program(g, g.topological_order())
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        program(*step.program_inputs(step.make_inputs()))


def test_a_hand_edited_stride_is_reported(step):
    g = step.graph.copy()
    nid = _only(g, "aten.convolution_backward.default")
    node = g.node(nid)
    flat = dataclasses.replace(node.outputs[0], strides=CONTIGUOUS)
    # As a hand-edited plan would have it (nodes are immutable: swap the record itself).
    g.nodes[nid] = dataclasses.replace(node, outputs=(flat, *node.outputs[1:]))
    report = check_graph(g)
    # The op makes channels-last, not what the record says; and the permute reading the
    # record makes other strides than its own record says.
    (permute,) = [u for u in g.users(nid) if g.node(u).op == "aten.permute.default"]
    assert [(m.node, m.output) for m in report.mismatches] == [(nid, 0), (permute, 0)]


def test_split_conv_backward_restores_eagers_layout_and_merges_back(step):
    """The rule's transposed-convolution dgrad returns NCHW; the split copies it back to the
    channels-last layout eager gave its readers, the derived metas pass the check, the program
    verifies, and the dual folds the copy away again."""
    from magis.backend.meta_check import MetaChecker
    from magis.rules.taso.conv import conv_backward_pairs, merge_conv_backward, split_conv_backward

    g = step.graph
    nid = _only(g, "aten.convolution_backward.default")
    split = split_conv_backward(g, [nid])
    derived = MetaChecker().derive(split.graph, split.touched)
    assert derived.ok, derived.mismatches
    assert check_graph(split.graph).ok
    (relayout,) = [n for n in split.added if split.graph.node(n).op == "aten.clone.default"]
    assert split.graph.meta(Ref(relayout, 0)).strides == CHANNELS_LAST
    program = compile_program(split.graph, split.graph.topological_order())
    assert verify(step, program, step.make_inputs()).verified

    (pair,) = conv_backward_pairs(split.graph, split.graph.topological_order())
    merged = merge_conv_backward(split.graph, [pair])
    assert not [n for n in merged.graph.ops() if merged.graph.node(n).op == "aten.clone.default"]
    assert check_graph(merged.graph).ok
    program = compile_program(merged.graph, merged.graph.topological_order())
    assert verify(step, program, step.make_inputs()).verified


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_every_plan_on_the_channels_last_model_verifies(step, seed):
    """Issue 14's case end to end: searches under a memory limit (several seeds) on the model
    whose eager backward returns a channels-last gradient under a later view; every plan runs
    and matches eager PyTorch."""
    from magis.cost import get_cost_model
    from magis.search import Mode, Objective, SearchOptions, optimize_graph
    from magis.sim import simulate

    cost = get_cost_model("rtx3090")
    base = simulate(step.graph, step.graph.program_order(), cost)
    objective = Objective(Mode.MEMORY_LIMIT, 0.5 * base.peak_bytes)
    options = SearchOptions(time_budget=30, max_states=25, seed=seed, fission=seed % 2 == 0)
    result = optimize_graph(step.graph, cost, objective, options)
    assert check_graph(result.best.graph).ok
    program = compile_program(result.best.graph, list(result.best.order))
    check = verify(step, program, step.make_inputs())
    assert check.verified, f"seed {seed}: {check.worst} differs by {check.max_rel_err:.2e}"


def test_an_update_kept_as_a_copy_runs_after_every_reader_of_the_old_weight(float64):
    """A channels-last weight gradient makes Adam's update a `copy_` into the weight (its
    strides differ, so capture cannot fold it into the producer). It overwrites the weight all
    the same: a reader a rewrite adds (the split's dgrad convolution reads the weight) must run
    before it under any order a scheduler picks (found by `magis bench fuzz`)."""
    from magis.rules.taso.conv import split_conv_backward
    from magis.schedule import schedule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 1))
    x = torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last)
    step = training_step(model, (x,), loss_fn=lambda out, x: out.square().mean(), optimizer="adam")
    g = step.graph
    copies = [n for n in g.ops() if g.node(n).op == "aten.copy_.default"]
    assert copies and all(g.overwritten_placeholder(n) is not None for n in copies)
    backward = [n for n in g.ops() if g.node(n).op == "aten.convolution_backward.default"]
    split = split_conv_backward(g, backward)
    inputs = step.make_inputs()
    for order in (schedule(split.graph, "dp").order, split.graph.topological_order()):
        program = compile_program(split.graph, list(order))
        check = verify(step, program, inputs)
        assert check.verified, f"{check.worst} differs by {check.max_rel_err:.2e}"
