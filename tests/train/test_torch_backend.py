"""torch.compile(model, backend=magis.torch_backend(...)): AOTAutograd's joint graph planned by
magis, its partition (saved vs recomputed) and order handed back and compiled by Inductor; the
user's own AdamW step outside the graph trains as eager PyTorch does (float64, relative error
<= 1e-9 over five steps), and bad input is a one-line error naming it (issue 43)."""

from __future__ import annotations

import pytest
import torch
from train_helpers import (
    STATE_SEARCH,
    TOL,
    mlp,
    mlp_loss,
    one_thread,
    train_adamw,
)

import magis
from magis.backend.fx_export import InductorUnsupportedError
from magis.capture.workloads import get_workload
from magis.errors import LimitError


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    with one_thread():
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()


def train_through_backend(model, batch, loss_fn, backend):
    """Five steps of the user's loop on `torch.compile(model, backend=backend)` beside eager."""

    def make(m, opt):
        compiled = torch.compile(m, backend=backend)

        def step(*xs):
            opt.zero_grad()
            loss = loss_fn(compiled, *xs)
            loss.backward()
            opt.step()  # the user's own, outside the graph
            return loss.detach()

        return step

    return train_adamw(model, batch, loss_fn, make)


def test_an_mlp_trains_as_eager_through_the_backend(float64):
    model, batch = mlp()
    backend = magis.torch_backend(mem_limit=0.8, **STATE_SEARCH)
    loss_err, (err, where), _ = train_through_backend(model, batch, mlp_loss, backend)
    assert loss_err <= TOL and err <= TOL, (loss_err, err, where)
    (plan,), (split,) = backend.plans, backend.partitions
    assert plan.summary.satisfied, plan.summary
    assert split.recomputed, "the plan recomputes nothing in the backward"
    assert not set(split.saved) & set(split.recomputed)


def test_a_zoo_workload_with_batch_norm_trains_as_eager_through_the_backend(float64):
    """unet:tiny: its batch norms' running statistics are inputs AOTAutograd writes after the
    forward; a plan that recomputes a batch norm in the backward reads them there, from a copy
    the forward saves (`aot.cut_at_backward`)."""
    wl = get_workload("unet:tiny")
    torch.manual_seed(0)
    model = wl.build(torch.float64)
    batch = wl.make_inputs(wl.batch)

    def loss_fn(m, *xs):
        return wl.loss_fn(m(xs[0]), *xs)

    backend = magis.torch_backend(mem_limit=0.5, **STATE_SEARCH)
    loss_err, (err, where), _ = train_through_backend(model, batch, loss_fn, backend)
    assert loss_err <= TOL and err <= TOL, (loss_err, err, where)
    assert any(split.recomputed for split in backend.partitions)


@pytest.mark.parametrize(
    ("limit", "words"), [("lots", "cannot read memory limit 'lots'"), (1.5, "1.5")]
)
def test_a_limit_that_is_not_a_ratio_or_size_is_one_line(limit, words):
    with pytest.raises(LimitError) as info:
        magis.torch_backend(mem_limit=limit)
    assert "\n" not in str(info.value) and words in str(info.value), info.value
    assert isinstance(info.value, magis.MagisError)


def test_an_op_inductor_cannot_compile_is_one_line_naming_it(float64, monkeypatch):
    from magis.backend import fx_export

    model, (x, y) = mlp()
    compiled = torch.compile(model, backend=magis.torch_backend(mem_limit=0.9, **STATE_SEARCH))
    # Inductor without implicit fallbacks refuses an op it has no lowering for (here, the
    # linear layers' addmm, which the forward compiles first).
    monkeypatch.setitem(fx_export.INDUCTOR_CONFIG, "implicit_fallbacks", False)
    from torch._inductor import lowering

    monkeypatch.delitem(lowering.lowerings, torch.ops.aten.addmm.default)
    with pytest.raises(InductorUnsupportedError) as info:
        compiled(x)
    message = str(info.value)
    assert "\n" not in message and "aten.addmm.default" in message, message
