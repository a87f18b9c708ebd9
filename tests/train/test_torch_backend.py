"""torch.compile(model, backend=magis.torch_backend(...)): AOTAutograd's joint graph planned by
magis, its partition (saved vs recomputed) and order handed back and compiled by Inductor; the
user's own AdamW step outside the graph trains as eager PyTorch does (float64, relative error
<= 1e-9 over five steps), and bad input is a one-line error naming it (issue 43)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from train_helpers import TOL, one_thread, train_both

import magis
from magis.backend.fx_export import InductorUnsupportedError
from magis.errors import LimitError

# Ended by states, not seconds: the same plan on a loaded machine.
SEARCH = {"time_budget": 120.0, "max_states": 20, "hardware": "rtx3090"}
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    with one_thread():
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()


def mlp() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )
    gen = torch.Generator().manual_seed(0)
    return model, (torch.randn(64, 16, generator=gen), torch.randint(0, 4, (64,), generator=gen))


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

    return train_both(
        model,
        lambda m: torch.optim.AdamW(m.parameters(), **ADAMW),
        loss_fn,
        batch,
        make,
        steps=5,
        clip=None,
    )


def mlp_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def test_an_mlp_trains_as_eager_through_the_backend(float64):
    model, batch = mlp()
    backend = magis.torch_backend(mem_limit=0.8, **SEARCH)
    loss_err, (err, where), _ = train_through_backend(model, batch, mlp_loss, backend)
    assert loss_err <= TOL and err <= TOL, (loss_err, err, where)
    (plan,), (split,) = backend.plans, backend.partitions
    assert plan.summary.satisfied, plan.summary
    assert split.recomputed, "the plan recomputes nothing in the backward"
    assert not set(split.saved) & set(split.recomputed)


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
    compiled = torch.compile(model, backend=magis.torch_backend(mem_limit=0.9, **SEARCH))
    # Inductor without implicit fallbacks refuses an op it has no lowering for (here, the
    # linear layers' addmm, which the forward compiles first).
    monkeypatch.setitem(fx_export.INDUCTOR_CONFIG, "implicit_fallbacks", False)
    from torch._inductor import lowering

    monkeypatch.delitem(lowering.lowerings, torch.ops.aten.addmm.default)
    with pytest.raises(InductorUnsupportedError) as info:
        compiled(x)
    message = str(info.value)
    assert "\n" not in message and "aten.addmm.default" in message, message
