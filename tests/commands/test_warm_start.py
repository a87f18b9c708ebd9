"""The peers' plans as warm starts (issue #16): the search is never behind the best baseline
point on the same step, and what it hands over still runs and verifies."""

import pytest
import torch

from magis.backend import compile_program, verify
from magis.baselines import BaselinePoint, get_baseline
from magis.capture import workload_step
from magis.commands.optimize import find_plan, setup_search
from magis.commands.warm_start import WARM_START_METHODS, baseline_warm_starts, best_point
from magis.search import SearchOptions


@pytest.fixture(scope="module")
def bert_step():
    return workload_step("bert-base:tiny", dtype=torch.float64)[1]


@pytest.mark.parametrize("limit", [{"lat_limit": 1.10}, {"mem_limit": 0.4}])
def test_the_plan_is_never_behind_a_baseline_and_verifies(bert_step, limit):
    setup = setup_search(bert_step, **limit)
    warm = baseline_warm_starts(bert_step.graph, setup.cost, setup.objective, None)
    assert warm, "no baseline gave a warm start"
    plan = find_plan(setup, SearchOptions(max_states=5))  # too few states for the search alone
    best_key = setup.objective.key(_figures(plan))
    for method in WARM_START_METHODS:
        points = [
            p
            for p in get_baseline(method).points(bert_step.graph, setup.cost)
            if isinstance(p, BaselinePoint)
        ]
        single = [p for p in points if p.repeats == 1]  # the whole sweep, no early stop
        if single:
            assert best_key <= min(setup.objective.key(p) for p in single), method
    program = compile_program(plan.graph, list(plan.order))
    assert verify(bert_step, program, bert_step.make_inputs()).verified


def test_without_warm_start_the_history_has_none(bert_step):
    setup = setup_search(bert_step, lat_limit=1.10)
    plan = find_plan(setup, SearchOptions(max_states=5), warm_start=False)
    assert not any(h.startswith("warm-start") for h in plan.summary.history)


def test_micro_batched_points_are_not_warm_starts(bert_step):
    setup = setup_search(bert_step, mem_limit=0.5)
    points = [
        p
        for p in get_baseline("pofo").points(bert_step.graph, setup.cost)
        if isinstance(p, BaselinePoint)
    ]
    assert best_point(points, setup.objective) is not None
    from dataclasses import replace

    repeated = [replace(p, repeats=2) for p in points]
    assert best_point(repeated, setup.objective) is None


class _Figures:
    def __init__(self, memory, latency):
        self.memory, self.latency = memory, latency


def _figures(plan):
    return _Figures(plan.summary.peak_bytes, plan.summary.latency_s)


def test_a_sweep_past_the_deadline_stops_with_its_best_point_so_far(bert_step):
    setup = setup_search(bert_step, lat_limit=1.10)
    drawn = []

    def sweep():  # a peer's points, computed one at a time as the warm start asks for them
        for p in get_baseline("xla-remat").points(bert_step.graph, setup.cost):
            drawn.append(p)
            yield p

    assert best_point(sweep(), setup.objective) is not None
    assert len(drawn) > 2  # bert-base:tiny's first budgets break the latency limit
    drawn.clear()
    late = best_point(sweep(), setup.objective, deadline=0.0)  # long past
    assert len(drawn) == 1
    assert late is (drawn[0] if isinstance(drawn[0], BaselinePoint) else None)
