"""PyTorch's min-cut partitioner as a baseline: its plan simulated, run and verified."""

from __future__ import annotations

import pytest
import torch

from magis.backend.codegen import compile_program
from magis.backend.executor import clone_all, relative_error, verify
from magis.backend.memory import LiveBytesTracker
from magis.baselines import BaselinePoint, Failure, get_baseline
from magis.baselines.joint import (
    NeedsWorkloadError,
    Partitioner,
    PartitionSpec,
    RandomRecomputeError,
    partition,
)
from magis.baselines.mincut import (
    min_cut_baseline,
    mincut_points,
    partition_point,
    run_partitioned,
    saved_bytes_simulated,
    to_graph,
    trace_workload,
)
from magis.cost import get_cost_model
from magis.ir import PlaceholderKind
from magis.sim import simulate

MIN_CUT = PartitionSpec(Partitioner.MIN_CUT, 1.0)


@pytest.fixture(scope="module")
def bert():
    """bert-base:tiny (with dropout) in float64, traced through AOTAutograd and by magis."""
    return trace_workload("bert-base:tiny", dtype=torch.float64, with_step=True)


@pytest.mark.parametrize("spec", [MIN_CUT, PartitionSpec(Partitioner.MIN_CUT, 0.2)], ids=str)
def test_simulated_peak_matches_torch_running_its_graphs(bert, spec):
    part = partition(bert.joint, spec)
    graph, _ = to_graph(part)
    predicted = simulate(graph, graph.program_order(), get_cost_model("rtx3090")).peak_bytes
    inputs = bert.step.make_inputs(torch.float64)
    tracker = LiveBytesTracker(inputs)
    with tracker:
        run_partitioned(part, inputs)
    assert tracker.peak_bytes > tracker.resident_bytes  # activations were counted at all
    assert abs(predicted - tracker.peak_bytes) <= 0.10 * tracker.peak_bytes


@pytest.mark.parametrize(
    "spec",
    [
        PartitionSpec(Partitioner.DEFAULT),
        MIN_CUT,
        PartitionSpec(Partitioner.MIN_CUT, 0.2),
        PartitionSpec(Partitioner.MIN_CUT, 0.0),
    ],
    ids=str,
)
def test_partitioned_step_computes_the_eager_step(bert, spec):
    """Loss and every updated weight, float64, same dropout masks: torch's graphs and ours."""
    part = partition(bert.joint, spec)
    inputs = bert.step.make_inputs(torch.float64)
    expected, ran = clone_all(inputs), clone_all(inputs)
    torch.manual_seed(0)
    (loss_ref,) = bert.step.fn(*expected)
    torch.manual_seed(0)
    loss = run_partitioned(part, ran)
    assert relative_error(loss, loss_ref) <= 1e-12
    worst = max(relative_error(a, e) for a, e in zip(ran, expected, strict=True))
    assert worst <= 1e-9


def test_our_graph_of_the_partition_computes_the_eager_step(bert):
    """The magis graph the simulator costs, run by our executor, verified against eager."""
    program = bert.program(partition(bert.joint, PartitionSpec(Partitioner.MIN_CUT, 0.2)))
    inputs = bert.step.make_inputs(torch.float64)
    check = verify(program, compile_program(program.graph, program.graph.program_order()), inputs)
    assert check.verified, check


def test_torch_as_is_redraws_dropout_in_the_backward(bert):
    """Without our guard the budget mode recomputes dropout (pytorch/pytorch#190758)."""
    with pytest.raises(RandomRecomputeError, match="190758"):
        partition(bert.joint, PartitionSpec(Partitioner.MIN_CUT, 0.2, save_random=False))


def test_lower_budgets_save_less(bert):
    cost = get_cost_model("rtx3090")
    budgets = (1.0, 0.5, 0.2, 0.05)
    pts = [
        partition_point(bert.joint, PartitionSpec(Partitioner.MIN_CUT, b), cost) for b in budgets
    ]
    assert all(isinstance(p, BaselinePoint) for p in pts)
    simulated = [saved_bytes_simulated(p) for p in pts]
    torch_says = [p.params["saved_activation_bytes"] for p in pts]
    storages = [p.params["saved_storage_bytes"] for p in pts]
    for saved in (simulated, torch_says, storages):
        assert all(a >= b for a, b in zip(saved, saved[1:], strict=False)), saved
        assert saved[-1] < 0.6 * saved[0], saved
    # More recomputation, more time.
    assert pts[-1].latency > pts[0].latency


def test_min_cut_baseline_of_a_workload_with_batch_norm():
    """resnet50:tiny: the forward updates running statistics, written back in place."""
    cost = get_cost_model("rtx3090")
    bound = min_cut_baseline("resnet50:tiny", budgets=(1.0, 0.1))
    outs = list(bound.points(None, cost))
    assert [o.method for o in outs] == ["min-cut-budget", "min-cut-budget"], outs
    assert outs[1].params["budget"] == 0.1
    assert outs[1].params["saved_activation_bytes"] < outs[0].params["saved_activation_bytes"]
    writes = [n for n in outs[0].graph.nodes.values() if n.writes_into is not None]
    assert len(writes) > len(outs[0].graph.placeholders(PlaceholderKind.WEIGHT))


def test_a_workload_that_does_not_trace_is_a_failure():
    outs = list(mincut_points("no-such-model", get_cost_model("rtx3090"), budgets=(1.0, 0.5)))
    assert len(outs) == 2 and all(isinstance(o, Failure) for o in outs)
    assert "no-such-model" in outs[0].reason


def test_registered_baselines_need_a_workload(bert):
    for name in ("min-cut", "min-cut-budget"):
        with pytest.raises(NeedsWorkloadError, match="mincut_points"):
            list(get_baseline(name).points(bert.step.graph, get_cost_model("rtx3090")))
