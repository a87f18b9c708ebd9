"""A search outlives its bugs: a move, a relaxation or a re-analysis that raises is dropped,
counted and warned about, and the search goes on ("nothing is lost": a crashed worker once
ended corpus:lstm_lm's whole memory-0.4 search)."""

from __future__ import annotations

import functools

import pytest

from magis.capture import workload_step
from magis.cost import get_cost_model
from magis.errors import MagisWarning
from magis.rules import RuleContext
from magis.search import (
    Evaluator,
    Mode,
    Objective,
    SearchOptions,
    fission_moves,
    initial_state,
    optimize_graph,
)
from magis.search.optimizer import default_rules


@functools.cache
def _graph(workload: str):
    _, step = workload_step(workload, float64_when_tiny=True)
    return step.graph


def _raise(*args, **kwargs):
    raise ValueError("max() arg is an empty sequence")


def test_a_fission_child_that_raises_is_dropped_counted_and_warned_about(monkeypatch):
    graph, cost = _graph("bert-base:tiny"), get_cost_model("rtx3090")
    state = initial_state(graph, cost)
    assert state.fission is not None  # the tiny BERT offers splits
    evaluator = Evaluator(cost, SearchOptions().memory_figure)
    ctx = RuleContext(state.graph, state.order, state.sim, state.frozen, True)
    name, make_child = next(evaluator.moves(state, default_rules(), ctx))
    assert name.startswith("fission:")  # F-Tree mutations lead (`Evaluator.moves`)
    monkeypatch.setattr(fission_moves, "apply", _raise)
    with pytest.warns(MagisWarning, match=f"a {name} child could not be built"):
        assert make_child() is None
    assert evaluator.stats.failed_children[name] == 1


def test_a_relaxation_that_raises_keeps_the_child_as_built(monkeypatch):
    graph, cost = _graph("bert-base:tiny"), get_cost_model("rtx3090")
    state = initial_state(graph, cost, fission=False)
    evaluator = Evaluator(cost, SearchOptions().memory_figure)
    missed = Objective(Mode.LATENCY_LIMIT, 0.5 * state.latency)
    monkeypatch.setattr("magis.search.evaluator.relaxation_at_peak", _raise)
    with pytest.warns(MagisWarning, match="a relax child could not be built"):
        assert evaluator.repaired(state, missed) is state
    assert evaluator.stats.failed_children["relax"] == 1


def test_a_reanalysis_that_raises_finds_nothing_and_the_search_goes_on(monkeypatch):
    graph, cost = _graph("bert-base:tiny"), get_cost_model("rtx3090")
    analyze, calls = fission_moves.analyze, []

    def failing_reanalysis(*args, reanalysis=False, **kwargs):
        if reanalysis:
            calls.append(len(args[0]))
            _raise()
        return analyze(*args, reanalysis=reanalysis, **kwargs)

    monkeypatch.setattr(fission_moves, "analyze", failing_reanalysis)
    with pytest.warns(MagisWarning, match="a re-analysis .* failed .*ValueError"):
        found, took = fission_moves.analyze_timed(graph, graph.program_order(), 4)
    assert found is None and took >= 0

    # A whole search: re-analyses are asked for and fail, and it ends with a plan.
    base = initial_state(graph, cost, fission=False)
    options = SearchOptions(time_budget=600, max_states=60, seed=0)
    objective = Objective(Mode.MEMORY_LIMIT, int(0.3 * base.memory))
    calls.clear()
    with pytest.warns(MagisWarning, match="a re-analysis"):
        result = optimize_graph(graph, cost, objective, options)
    assert len(calls) >= 1
    assert result.stats.states_explored == 60
    assert result.best.memory < base.memory
