"""Checkpointing, POFO-style and micro-batching baselines: their plans run on real tensors
(float64) and match eager PyTorch, the simulated peak matches the measured one, and
checkpointing and POFO lower the peak (DESIGN principle 1)."""

import dataclasses
import functools

import pytest
import torch

from magis.baselines import BaselinePoint, Failure, get_baseline
from magis.baselines.chain import Mode, Segment, build_plan, find_chain
from magis.baselines.checkpoint import equal_segments
from magis.baselines.microbatch import microbatch_points
from magis.baselines.pofo import PofoOptions, pofo_points
from magis.capture.steps import workload_step
from magis.commands.run import run_step
from magis.cost import get_cost_model
from magis.sim import simulate

WORKLOADS = ("bert-base:tiny", "resnet50:tiny")


@functools.cache
def _step(name: str):
    return workload_step(name, dtype=torch.float64)[1]


@pytest.fixture(scope="module")
def cost():
    return get_cost_model("rtx3090")


def _check(step, name: str, point: BaselinePoint) -> None:
    assert point.graph.is_valid_schedule(list(point.order))
    report = run_step(
        step, name, hardware="rtx3090", graph=point.graph, order=point.order, repeats=1
    )
    assert report.verified, (point.method, point.params, report.worst_value, report.max_rel_err)
    assert report.peak_error < 0.05, (point.method, point.params, report.peak_error)


def _base_peak(step, cost) -> int:
    return simulate(step.graph, step.graph.program_order(), cost).peak_bytes


@pytest.mark.parametrize("name", WORKLOADS)
def test_chain_has_few_tensor_boundaries(name):
    chain = find_chain(_step(name).graph)
    assert chain.n_blocks >= 4
    assert all(chain.crossing), "every boundary is crossed by the values the next block reads"
    assert sum(chain.block_sizes()) == len(chain.forward)


@pytest.mark.parametrize("name", ["bert-base:tiny"])
def test_checkpoint_points_verify_and_lower_the_peak(name, cost):
    step = _step(name)
    points = list(get_baseline("checkpoint").points(step.graph, cost))
    assert points and all(isinstance(p, BaselinePoint) for p in points)
    best = min(points, key=lambda p: p.memory)
    assert best.memory < _base_peak(step, cost)
    assert best.latency > simulate(step.graph, step.graph.program_order(), cost).latency_s
    _check(step, name, best)


# the tiny ResNet's peak is mostly weights and their gradients: little for a plan to take
@pytest.mark.parametrize("name, budget", [("bert-base:tiny", 0.8), ("resnet50:tiny", 0.95)])
def test_pofo_points_verify_and_lower_the_peak(name, budget, cost):
    step = _step(name)
    outcomes = list(pofo_points(step.graph, cost, PofoOptions(budgets=(0.05, budget))))
    assert isinstance(outcomes[0], Failure) and outcomes[0].params == {"budget": 0.05}
    point = outcomes[1]
    assert isinstance(point, BaselinePoint)
    assert point.memory <= budget * _base_peak(step, cost)
    _check(step, name, point)


def test_offloaded_and_recomputed_blocks_verify(cost):
    """Every mode at once: offload, recompute (random draws kept), keep."""
    name = "bert-base:tiny"
    step = _step(name)
    chain = find_chain(step.graph)
    n = chain.n_blocks
    segments = (
        Segment(0, n // 3, Mode.OFFLOAD),
        Segment(n // 3, 2 * n // 3, Mode.RECOMPUTE),
        Segment(2 * n // 3, n, Mode.KEEP),
    )
    graph, order = build_plan(chain, segments, cost)
    ops = {graph.node(nid).op for nid in graph.nodes}
    assert {"magis.store", "magis.load"} <= ops
    assert any(graph.node(nid).name.endswith("_recompute") for nid in graph.nodes)
    randoms = [nid for nid in graph.nodes if graph.info(nid).is_random]
    assert len(randoms) == len([n for n in step.graph.nodes if step.graph.info(n).is_random])
    sim = simulate(graph, order, cost)
    _check(step, name, BaselinePoint("mixed", graph, tuple(order), sim))


def test_checkpoint_keeps_every_block_when_one_segment(cost):
    chain = find_chain(_step("resnet50:tiny").graph)
    assert equal_segments(chain, 1) == (Segment(0, chain.n_blocks, Mode.KEEP),)
    segs = equal_segments(chain, chain.n_blocks)
    assert [s.mode for s in segs] == [Mode.RECOMPUTE] * (chain.n_blocks - 1) + [Mode.KEEP]


def test_microbatch_wraps_inner_points(cost):
    name = "bert-base:tiny"
    outcomes = list(
        microbatch_points(name, get_baseline("pytorch"), cost, factors=(2, 3), dtype=torch.float64)
    )
    point, failure = outcomes
    assert isinstance(failure, Failure) and failure.params["factor"] == 3
    assert point.repeats == 2 and point.method == "microbatch+pytorch"
    assert point.extra_bytes > 0 and point.extra_latency_s > 0
    assert point.latency == pytest.approx(2 * point.sim.latency_s + point.extra_latency_s)
    micro = workload_step(name, batch=1, dtype=torch.float64)[1]
    _check(micro, name, dataclasses.replace(point, repeats=1))
