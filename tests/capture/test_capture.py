"""Capture: structure of captured graphs, in-place updates, and the errors for bad steps."""

import pytest
import torch

from magis.capture import capture
from magis.errors import CaptureError
from magis.ir import PlaceholderKind, Ref


def test_capture_folds_getitem_into_output_indices():
    step = capture(lambda x: torch.ops.aten.var_mean.correction(x, [0])[1] * 2, torch.randn(4, 3))
    g = step.graph
    ops = [g.node(n).op for n in g.ops()]
    assert "aten.var_mean.correction" in ops
    assert not any("getitem" in op for op in ops)
    mul = next(n for n in g.ops() if g.node(n).op == "aten.mul.Tensor")
    assert g.node(mul).inputs[0].index == 1


@pytest.mark.parametrize("optimizer", ["sgd", "adam", None])
def test_training_step_structure(mlp_step_factory, optimizer):
    step = mlp_step_factory(optimizer)
    g = step.graph
    g.verify()
    weights = g.placeholders(PlaceholderKind.WEIGHT)
    assert len(weights) == 6
    assert len(g.placeholders(PlaceholderKind.OPT_STATE)) == (12 if optimizer == "adam" else 0)
    written = {g.node(n).writes_into for n in g.ops() if g.node(n).writes_into is not None}
    if optimizer is None:
        assert len(g.outputs) == 1 + len(weights)
        assert not any(r.node in weights for r in written)
    else:
        assert {Ref(w) for w in weights} <= written
    assert g.is_valid_schedule(g.program_order())
    assert any(g.info(n).is_random for n in g.ops()), "dropout is a random op"


def test_updates_run_after_every_reader_of_the_old_weight(mlp_step_factory):
    g = mlp_step_factory("sgd").graph
    storages = g.storages()
    for nid in g.ops():
        target = g.node(nid).writes_into
        if target is None:
            continue
        readers = [r for r in storages.readers[storages.storage_of(target)] if r != nid]
        order = g.topological_order()
        pos = {n: i for i, n in enumerate(order)}
        assert all(pos[r] < pos[nid] for r in readers)


def _fake_randn(*shape: int) -> torch.Tensor:
    """A tensor with no values (a fake mode's): a value read cannot be specialized to."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.randn(*shape)


def test_item_in_step_is_a_clear_capture_error():
    def step(x):
        return x * x.sum().item()

    with pytest.raises(CaptureError, match="reads a tensor's value"):
        capture(step, _fake_randn(3))


def test_data_dependent_branch_is_a_clear_capture_error():
    def step(x):
        return x * 2 if x.sum() > 0 else x - 1

    with pytest.raises(CaptureError, match="data-dependent"):
        capture(step, _fake_randn(3))


def test_training_step_traces_under_fake_mode_without_allocating():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from magis.capture import training_step

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = torch.nn.Sequential(
            torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 8)
        )
        x, y = torch.randn(64, 4096), torch.randint(0, 8, (64,))
    step = training_step(
        model, (x, y), loss_fn=lambda o, x, y: torch.nn.functional.cross_entropy(o, y)
    )
    assert len(step.graph.placeholders(PlaceholderKind.WEIGHT)) == 4


def test_top_level_api_names():
    import magis

    step = magis.capture(lambda a: a.relu().sum(), torch.randn(3))
    assert [step.graph.node(n).op for n in step.graph.ops()] == [
        "aten.relu.default",
        "aten.sum.default",
    ]
    model = torch.nn.Linear(3, 1)
    step = magis.training_step(model, (torch.randn(2, 3),), loss_fn=lambda o, x: o.sum())
    assert len(step.graph.placeholders(PlaceholderKind.WEIGHT)) == 2


def test_training_step_refuses_an_input_that_is_not_a_tensor_in_one_line():
    from magis.capture import training_step

    model = torch.nn.Linear(3, 1)
    batch = ({"x": torch.randn(2, 3)},)
    with pytest.raises(CaptureError, match="example input 0 is a dict, not a tensor"):
        training_step(model, batch, loss_fn=lambda o, x: o.sum())
