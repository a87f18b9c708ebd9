"""Generated code matches eager PyTorch exactly, and the simulator's peak matches the measured one."""

import pytest
import torch

from magis.backend import compile_program, generate, measure, verify
from magis.capture import WORKLOAD_FAMILIES, capture, workload_step
from magis.cost import UnitCostModel
from magis.sim import simulate


def _run_and_check(step, tolerance=1e-9):
    g = step.graph
    order = g.program_order()
    program = compile_program(g, order)
    inputs = step.make_inputs()
    check = verify(step, program, inputs, tolerance=tolerance)
    assert check.verified, f"{check.worst} differs by {check.max_rel_err:.2e}"
    measured = measure(program, step.program_inputs(inputs), repeats=1)
    simulated = simulate(g, order, UnitCostModel())
    return measured, simulated


@pytest.mark.parametrize("optimizer", ["sgd", "adam", None])
def test_mlp_step_verifies_and_peak_is_exact(mlp_step_factory, optimizer):
    measured, simulated = _run_and_check(mlp_step_factory(optimizer))
    assert simulated.peak_bytes == measured.peak_bytes


@pytest.mark.parametrize("family", WORKLOAD_FAMILIES)
def test_tiny_workload_verifies_and_peak_within_5_percent(family):
    _, step = workload_step(f"{family}:tiny", dtype=torch.float64)
    measured, simulated = _run_and_check(step)
    assert abs(simulated.peak_bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes


def test_opaque_op_is_simulated_and_executed():
    # aten.logaddexp has no registry entry: generic costs, still scheduled and run.
    step = capture(lambda a, b: torch.logaddexp(a, b).sum(), torch.randn(5, 3), torch.randn(5, 3))
    g = step.graph
    opaque = [n for n in g.ops() if g.info(n).opaque]
    assert [g.node(n).op for n in opaque] == ["aten.logaddexp.default"]
    assert simulate(g, g.program_order(), UnitCostModel()).latency_s > 0
    _run_and_check(step)


def test_generated_source_frees_values_after_last_use():
    step = capture(lambda a, b: ((a @ b).relu() + a).sum(), torch.randn(3, 3), torch.randn(3, 3))
    source = generate(step.graph, step.graph.program_order())
    assert source == (
        "def program(arg0, arg1):\n"
        "    mm = aten.mm.default(arg0, arg1)\n"
        "    relu = aten.relu.default(mm);  mm = None\n"
        "    add = aten.add.Tensor(relu, arg0);  relu = None\n"
        "    sum_1 = aten.sum.default(add);  add = None\n"
        "    return (sum_1,)\n"
    )


def test_sgd_update_writes_into_the_parameter(mlp_step_factory):
    step = mlp_step_factory("sgd")
    source = generate(step.graph, step.graph.program_order())
    assert "aten.sub.out(net_0_weight, " in source and "out=net_0_weight)" in source


def test_relative_error_never_lets_a_nan_pass():
    """NaN where eager has a number (or the reverse) is a difference, wherever it falls; NaN
    in the same places as eager is compared on the rest (found by `magis bench fuzz`: NaN
    compared false and a NaN-only difference verified)."""
    from magis.backend.executor import relative_error

    x = torch.tensor([1.0, 2.0, float("nan")], dtype=torch.float64)
    assert relative_error(x, x.clone()) == 0.0
    assert relative_error(
        torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1.0, 2.0, 3.0])
    ) == float("inf")
    assert relative_error(torch.tensor([float("nan"), 2.0]), torch.tensor([1.0, 2.0])) == float(
        "inf"
    )
    assert relative_error(torch.tensor([1.0, 2.5, float("nan")]), x) > 0.1
    inf = torch.tensor([float("inf"), 1.0])
    assert relative_error(inf, inf.clone()) == 0.0
    assert relative_error(-inf, inf) == float("inf")


def test_optimizer_state_inputs_are_non_negative(mlp_step_factory):
    """Adam's second moment as drawn for verification is never negative (its square root would
    be NaN in eager and program alike)."""
    from magis.ir import PlaceholderKind

    step = mlp_step_factory("adam")
    inputs = step.make_inputs()
    kinds = [step.graph.node(p).placeholder_kind for p in step.graph.placeholders()]
    states = [t for t, k in zip(inputs, kinds, strict=False) if k is PlaceholderKind.OPT_STATE]
    assert states and all(bool((t >= 0).all()) for t in states)


@pytest.mark.parametrize(
    "layout",
    [lambda x: x.t(), lambda x: x.view(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)],
)
def test_dropout_draws_its_mask_in_the_memory_order_eager_draws_it(layout):
    """Eager's dropout fills `empty_like(x)` in place, in the memory order of a transposed or
    channels-last `x`; the captured `bernoulli.p` would draw row-major: another mask."""

    def step(x):
        y = layout(x).relu()
        return (torch.nn.functional.dropout(y, 0.5, training=True) * y).sum()

    captured = capture(step, torch.randn(24, 5))
    g = captured.graph
    assert any(g.node(n).op == "aten.bernoulli.p" for n in g.ops())
    _run_and_check(captured)
