"""Fusion-aware min-cut re-materialization on the captured step (baselines/mincut_ir.py)."""

import pytest
import torch

from magis.backend import compile_program, verify
from magis.baselines import BaselinePoint, get_baseline
from magis.baselines.chain import forward_backward
from magis.baselines.mincut_ir import min_cut, recompute_events
from magis.capture import workload_step
from magis.cost import get_cost_model
from magis.sim import simulate


@pytest.fixture(scope="module", params=["bert-base:tiny", "resnet50:tiny"])
def step(request):
    return workload_step(request.param, dtype=torch.float64)[1]


def test_the_cut_saves_or_recomputes_everything_the_backward_reads(step):
    graph = step.graph
    cut = min_cut(graph, "runtime")
    assert cut is not None and not cut.saved & cut.recomputed
    forward, backward, aliases = forward_backward(graph)
    fwd = set(forward) | set(aliases)
    for b in backward:
        for p in {r.node for r in graph.node(b).inputs}:  # what it reads (not control edges)
            if p in fwd:
                assert p in cut.saved or p in cut.recomputed, graph.node(p).name
    # the runtime variant never recomputes a matmul or a convolution (the paper's ban)
    assert not any(graph.info(n).compute_bound for n in cut.recomputed)
    events = recompute_events(graph, cut)
    # every node once, and every recomputed one once more, before its first backward reader
    assert len(events) == len(graph.program_order()) + len(cut.recomputed)


def test_its_plan_runs_verifies_and_costs_little_time(step):
    cost = get_cost_model("rtx3090")
    base = simulate(step.graph, step.graph.program_order(), cost)
    (p,) = [o for o in get_baseline("min-cut-ir").points(step.graph, cost)]
    assert isinstance(p, BaselinePoint)
    assert p.memory < base.peak_bytes
    assert p.latency <= 1.2 * base.latency_s
    program = compile_program(p.graph, list(p.order))
    assert verify(step, program, step.make_inputs()).verified
