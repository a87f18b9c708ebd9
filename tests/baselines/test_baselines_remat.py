"""DTR and XLA-style re-materialization: the programs they emit run on real tensors, compute what
eager PyTorch computes, and peak where the simulator says, within their budgets."""

import time

import pytest
import torch
from torch import nn

from magis.baselines import BaselinePoint, Failure, get_baseline
from magis.baselines.dtr import DTROptions, dtr_points
from magis.baselines.xla import XLAOptions, xla_points
from magis.capture import training_step
from magis.capture.steps import workload_step
from magis.commands.run import run_step
from magis.cost import get_cost_model
from magis.ir import Ref
from magis.rules.recompute_trace import trace_graph
from magis.sim import simulate

METHODS = {
    "dtr": lambda g, c, r, **kw: dtr_points(g, c, DTROptions(ratios=r), **kw),
    "xla-remat": lambda g, c, r, **kw: xla_points(g, c, XLAOptions(ratios=r), **kw),
}


def _deep_mlp_step():
    """Activations dominate (unlike the :tiny zoo, where weights and logits do), with a dropout
    whose mask must never be redrawn and batch norms whose running statistics must be updated
    once."""
    torch.manual_seed(0)
    layers = [nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2)]
    for i in range(16):
        layers += [nn.Linear(64, 64), *([nn.BatchNorm1d(64)] if i % 4 == 0 else []), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(64, 4))
    x, y = torch.randn(1024, 16), torch.randint(0, 4, (1024,))
    loss = lambda out, x, y: nn.functional.cross_entropy(out, y)  # noqa: E731
    return training_step(model, (x, y), loss_fn=loss)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Executed programs are a few hundred small ops: intra-op threads only spin on the shared
    CI cores (40 s instead of 1.4 s per run here)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def deep_mlp():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield _deep_mlp_step()
    finally:
        torch.set_default_dtype(old)


@pytest.fixture(scope="module")
def bert_tiny():
    return workload_step("bert-base:tiny", dtype=torch.float64)[1]


def _points(method, step, ratios):
    cost = get_cost_model("rtx3090")
    graph = step.graph
    base = simulate(graph, graph.program_order(), cost)
    return base, list(METHODS[method](graph, cost, tuple(ratios)))


def _check_runs(step, name, base, p: BaselinePoint):
    budget = p.params["budget_bytes"]
    p.graph.verify()
    assert p.graph.is_valid_schedule(list(p.order))
    assert p.sim.peak_bytes <= budget < base.peak_bytes
    report = run_step(step, name, hardware="rtx3090", graph=p.graph, order=list(p.order))
    assert report.verified, (p.method, p.params, report.worst_value)
    assert report.peak_error <= 0.05, (p.method, p.params, report)
    random = [n for n in p.graph.ops() if p.graph.info(n).is_random]
    assert random and not any("_remat" in p.graph.node(n).name for n in random)


@pytest.mark.parametrize("method", METHODS)
def test_half_budget_program_runs_and_fits(method, deep_mlp):
    base, outs = _points(method, deep_mlp, [0.5, 0.7])
    for p in outs:
        assert isinstance(p, BaselinePoint), p
        assert p.params["recomputations"] > 0
        assert p.sim.peak_bytes < base.peak_bytes
        assert p.sim.latency_s > base.latency_s  # recomputation is not free
        _check_runs(deep_mlp, "deep-mlp", base, p)


def test_batch_norm_is_recomputed_without_its_running_statistics(deep_mlp):
    """Running statistics are step outputs: a second update would fail verification above."""
    _, (p,) = _points("dtr", deep_mlp, [0.4])
    clones = [
        p.graph.node(n)
        for n in p.graph.ops()
        if "_remat" in p.graph.node(n).name and "batch_norm" in p.graph.node(n).op
    ]
    assert clones and all(c.args[3] is None and c.args[4] is None for c in clones)
    _check_runs(
        deep_mlp,
        "deep-mlp",
        simulate(deep_mlp.graph, deep_mlp.graph.program_order(), get_cost_model("rtx3090")),
        p,
    )


@pytest.mark.parametrize("method", METHODS)
def test_bert_tiny_program_runs_and_fits(method, bert_tiny):
    """Views, multi-output layer norms, dropout masks and in-place weight updates."""
    base, (p,) = _points(method, bert_tiny, [0.85])
    assert isinstance(p, BaselinePoint), p
    assert p.params["recomputations"] > 0
    _check_runs(bert_tiny, "bert-base:tiny", base, p)


@pytest.mark.parametrize("method", METHODS)
def test_unreachable_budget_is_a_failure(method, deep_mlp):
    _, (out,) = _points(method, deep_mlp, [0.02])
    assert isinstance(out, Failure)
    assert out.method == method and out.params == {"budget": 0.02}
    assert "budget 0.02" in out.reason


@pytest.mark.parametrize("method", METHODS)
def test_a_run_past_its_deadline_stops_within_its_point_and_ends_the_sweep(method, deep_mlp):
    """A budget of a 100,000-node program takes a minute: the warm starts' share must hold."""
    cost = get_cost_model("rtx3090")
    past = time.perf_counter() - 1.0
    outs = list(METHODS[method](deep_mlp.graph, cost, (0.5, 0.7), deadline=past))
    assert len(outs) == 1 and isinstance(outs[0], Failure), outs
    assert outs[0].params == {"budget": 0.5} and "out of time" in outs[0].reason
    # `Baseline.sweep` hands the deadline over; far enough, the sweep is the whole one.
    assert get_baseline(method).stops_within_points
    later = time.perf_counter() + 600.0
    swept = get_baseline(method).sweep(deep_mlp.graph, cost, deadline=later)
    whole = get_baseline(method).points(deep_mlp.graph, cost)
    assert [type(o) for o in swept] == [type(o) for o in whole]


@pytest.mark.parametrize("method", METHODS)
def test_full_budget_is_the_program_order(method, deep_mlp):
    base, (p,) = _points(method, deep_mlp, [1.0])
    assert p.params["recomputations"] == 0
    assert p.sim.peak_bytes == base.peak_bytes and p.sim.latency_s == pytest.approx(base.latency_s)


def test_registered_with_a_default_sweep():
    assert get_baseline("dtr").name == "dtr"
    assert get_baseline("xla-remat").name == "xla-remat"
    assert len(DTROptions().ratios) == 20 and DTROptions().ratios[-1] == 1.0


def test_trace_graph_clones_a_repeat_and_later_uses_read_it(deep_mlp):
    graph = deep_mlp.graph
    order = graph.program_order()
    # Recompute the first tanh right before its last reader.
    tanh = next(n for n in order if graph.node(n).op.startswith("aten.tanh"))
    last = max(graph.users(tanh), key=order.index)
    events = [*order[: order.index(last)], tanh, *order[order.index(last) :]]
    g, new_order = trace_graph(graph, events)
    clone = new_order[order.index(last)]
    assert g.node(clone).name == graph.node(tanh).name + "_remat1"
    assert Ref(clone) in g.node(last).inputs and Ref(tanh) not in g.node(last).inputs
    assert g.is_valid_schedule(new_order)
    with pytest.raises(ValueError, match="never runs"):
        trace_graph(graph, order[:-1])
