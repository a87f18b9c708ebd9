"""The two step kinds (issue 42): `sgd` and `adamw-bf16` (autocast forward, float32 master
weights, AdamW state resident and updated in place)."""

import copy

import pytest
import torch
from torch import nn

from magis.capture import StepKind, read_step_kind, training_step, workload_step
from magis.capture.step_kinds import StepKindError
from magis.ir import PlaceholderKind


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _loss(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def _eager_adamw(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.optim.AdamW:
    """One step as people train: autocast forward and loss, backward, torch's AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(model(x), x, y)
    loss.backward()
    opt.step()
    return opt


def test_read_step_kind_names_the_kinds():
    assert read_step_kind("adamw-bf16") is StepKind.ADAMW_BF16
    assert read_step_kind(StepKind.SGD) is StepKind.SGD
    with pytest.raises(StepKindError, match="sgd, adamw-bf16"):
        read_step_kind("adam")


def test_adamw_bf16_step_equals_torch_adamw():
    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    kind = StepKind.ADAMW_BF16
    step = training_step(
        model, (x, y), loss_fn=_loss, optimizer=kind.optimizer, autocast=kind.autocast
    )
    eager = copy.deepcopy(model)
    opt = _eager_adamw(eager, x, y)
    params = [p.detach().clone() for p in model.parameters()]
    state = [torch.zeros_like(p) for p in params for _ in range(2)]  # torch's first step's
    inputs = [*params, *state, x, y]
    step.fn(*inputs)
    names = [n for n, _ in model.named_parameters()]
    for i, (name, p) in enumerate(eager.named_parameters()):
        torch.testing.assert_close(inputs[i], p.detach(), rtol=0, atol=0, msg=name)
        s = opt.state[p]
        got_avg, got_sq = state[2 * i], state[2 * i + 1]
        torch.testing.assert_close(got_avg, s["exp_avg"], rtol=0, atol=0, msg=names[i])
        torch.testing.assert_close(got_sq, s["exp_avg_sq"], rtol=0, atol=0, msg=names[i])


def test_adamw_bf16_graph_holds_casts_and_two_states_per_weight():
    _, step = workload_step("bert-base:tiny", step="adamw-bf16", float64_when_tiny=True)
    g = step.graph
    weights = g.placeholders(PlaceholderKind.WEIGHT)
    states = g.placeholders(PlaceholderKind.OPT_STATE)
    assert len(states) == 2 * len(weights)
    assert all(g.node(p).outputs[0].torch_dtype == torch.float32 for p in weights + states)
    casts = [n for n in g.ops() if any(m.torch_dtype == torch.bfloat16 for m in g.node(n).outputs)]
    assert casts  # float64 master weights would have left autocast nothing to cast
    writes = {g.node(n).writes_into.node for n in g.ops() if g.node(n).writes_into is not None}
    assert set(states) <= writes  # the state is updated in place


def test_adamw_bf16_plan_verifies_against_eager():
    from magis import optimize
    from magis.commands.run import run_step

    _, step = workload_step("bert-base:tiny", step="adamw-bf16", float64_when_tiny=True)
    plan = optimize(step, lat_limit=1.1, max_states=8)
    assert plan.summary.memory_ratio < 1.0
    rep = run_step(step, "bert-base:tiny", "rtx3090", graph=plan.graph, order=plan.order)
    assert rep.verified, (rep.worst_value, rep.max_rel_err)
    assert rep.tolerance == pytest.approx(2e-2)  # a bfloat16 step's (commands.shared)
