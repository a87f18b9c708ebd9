"""In-place ops made out of place in one pass: the same graph as the second trace through
`functionalize`, and that trace wherever the pass declines."""

import pytest
import torch

import magis.capture.trace as trace
from magis.backend import compile_program
from magis.capture import capture
from magis.capture.steps import workload_step
from magis.ir.serialize import graph_to_json


def _fast_path_taken(monkeypatch) -> list[bool]:
    """Records, per trace, whether `functionalized` rewrote it (True) or declined (False)."""
    taken: list[bool] = []
    real = trace.functionalized

    def recording(gm):
        out = real(gm)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(trace, "functionalized", recording)
    return taken


def _graph_document(step) -> dict:
    doc = graph_to_json(step.graph)
    doc.pop("digest", None)
    return doc


# The optimizer's in-place updates of weights and state (both step kinds), batch norm's running
# statistics updated in place on one output of a multi-output op (resnet50), dropout's
# `bernoulli_` (bert-base), and AdamW state whose out-of-place update takes other strides in its
# size-1 dimensions than the state (segformer's 1x1 convolutions): the nodes reading it change.
@pytest.mark.parametrize(
    ("workload", "kind"),
    [
        ("resnet50:tiny", "sgd"),
        ("bert-base:tiny", "sgd"),
        ("corpus:segformer:tiny", "adamw-bf16"),
    ],
)
def test_one_pass_gives_the_second_traces_graph(monkeypatch, workload, kind):
    taken = _fast_path_taken(monkeypatch)
    _, fast = workload_step(workload, step=kind)
    assert taken == [True]
    monkeypatch.setattr(trace, "functionalized", lambda gm: None)
    _, traced = workload_step(workload, step=kind)
    assert _graph_document(fast) == _graph_document(traced)


def _run(step, *args):
    program = compile_program(step.graph, step.graph.program_order())
    return program(*step.program_inputs(list(args)))


def test_in_place_op_on_a_fresh_tensor_and_on_an_input_runs_as_eager(monkeypatch):
    def fn(x, w):
        h = (x @ w).relu_()
        w.mul_(0.5).add_(h.sum(0, keepdim=True).t())
        return h * 2

    taken = _fast_path_taken(monkeypatch)
    x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 1, dtype=torch.float64)
    step = capture(fn, x, w)
    assert taken == [True]
    ops = [step.graph.node(n).op for n in step.graph.ops()]
    assert "aten.relu.default" in ops and "aten.relu_.default" not in ops
    w_eager, w_graph = w.clone(), w.clone()
    expected = fn(x, w_eager)
    (out,) = _run(step, x, w_graph)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(w_graph, w_eager, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: (lambda z: (z[:, 0].add_(x[:, 0]), z * 1)[1])(torch.zeros(4, 3)),
        lambda x: (lambda v: (x.mul_(2), v * 1)[1])(x.t()),  # a view of x read after x's write
    ],
    ids=["write-into-a-view", "view-read-after-write"],
)
def test_what_the_pass_declines_is_traced_again(monkeypatch, fn):
    taken = _fast_path_taken(monkeypatch)
    x = torch.randn(4, 3)
    step = capture(fn, x.clone())
    assert taken == [False]
    eager_in, graph_in = x.clone(), x.clone()
    expected = fn(eager_in)
    (out,) = _run(step, graph_in)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(graph_in, eager_in)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.empty_like(x).bernoulli_() * x,  # p left to its default
        lambda x: torch.empty_like(x).bernoulli_(0.25) * x,
        lambda x: (x * 2).sub_(x, alpha=3).relu_(),
    ],
    ids=["bernoulli-default-p", "bernoulli-p", "sub-alpha-relu"],
)
def test_small_steps_give_the_second_traces_graph(monkeypatch, fn):
    x = torch.randn(4, 3)
    taken = _fast_path_taken(monkeypatch)
    fast = capture(fn, x)
    assert taken == [True]
    monkeypatch.setattr(trace, "functionalized", lambda gm: None)
    assert _graph_document(fast) == _graph_document(capture(fn, x))
