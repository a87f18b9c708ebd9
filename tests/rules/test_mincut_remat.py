"""Fusion-aware min-cut re-materialization as a rule of the search (rules/mincut_remat.py):
its rewrite runs and matches eager PyTorch exactly on the captured step and on states other
moves made (re-materialization, fission), lowers the peak, leaves frozen regions alone, is
offered once per line of states and never on a step without a backward."""

import pytest
import torch

from magis.backend import compile_program, measure, verify
from magis.bench.fuzz import run_fuzz
from magis.capture import capture, workload_step
from magis.cost import get_cost_model
from magis.rules import MINCUT_REMAT, REMAT, SWAP, RuleContext, RuleKind
from magis.rules.mincut_remat import PENALTIES, TAG, min_cut
from magis.schedule import schedule
from magis.schedule.swaps import time_swaps
from magis.search import (
    Mode,
    Objective,
    SearchOptions,
    default_rules,
    fission_moves,
    initial_state,
    optimize_graph,
)
from magis.search.hashing import wl_hash, wl_hash_incremental
from magis.search.reschedule import order_without_solving
from magis.sim import simulate

COST = get_cost_model("rtx3090")


@pytest.fixture(scope="module", params=["bert-base:tiny", "resnet50:tiny"])
def step(request):
    return workload_step(request.param, dtype=torch.float64)[1]


def _ctx(graph, order, frozen=frozenset()):
    return RuleContext(graph, tuple(order), simulate(graph, order, COST), frozen)


def _apply(graph, order, frozen=frozenset()):
    """The rule's one rewrite built, its order (the search's placement), and both sims."""
    ctx = _ctx(graph, order, frozen)
    rewrites = list(MINCUT_REMAT.match(ctx))
    assert len(rewrites) == len(PENALTIES)
    rewrite = rewrites[0]  # the tie-break price: the most memory saved
    assert rewrite.kind is RuleKind.REMAT
    result = rewrite.build()
    result.graph.verify()
    new_order = order_without_solving(order, result)
    assert new_order is not None and result.graph.is_valid_schedule(new_order)
    return result, new_order, ctx.sim, simulate(result.graph, new_order, COST)


def _check(step, graph, order):
    program = compile_program(graph, list(order))
    inputs = step.make_inputs()
    check = verify(step, program, inputs)
    assert check.verified, f"{check.worst} differs by {check.max_rel_err:.2e}"
    measured = measure(program, step.program_inputs(inputs), repeats=1, warmup=0)
    assert simulate(graph, order, get_cost_model("unit")).peak_bytes == measured.peak_bytes


def test_the_cut_on_the_scheduled_step_lowers_the_peak_and_matches_eager(step):
    graph = step.graph
    order = schedule(graph, "dp").order
    result, new_order, before, after = _apply(graph, order)
    assert result.added and result.changed
    assert after.peak_bytes < before.peak_bytes
    assert all(TAG in result.graph.node(n).name for n in result.added)
    _check(step, result.graph, new_order)
    hashed = wl_hash_incremental(
        wl_hash(graph), graph, result.graph, result.touched, result.removed
    )
    assert hashed.value == wl_hash(result.graph).value
    # once per line of states: a graph the cut made is not offered it again
    assert not list(MINCUT_REMAT.match(_ctx(result.graph, new_order)))


def test_the_cut_after_a_rematerialization_matches_eager():
    _, step = workload_step("bert-base:tiny", dtype=torch.float64)
    graph = step.graph
    order = schedule(graph, "dp").order
    remat = next(iter(REMAT.match(_ctx(graph, order)))).build()
    remat_order = order_without_solving(order, remat)
    result, new_order, before, after = _apply(remat.graph, remat_order)
    assert result.added and after.peak_bytes < before.peak_bytes
    _check(step, result.graph, new_order)


def test_the_cut_after_fission_leaves_the_frozen_regions_alone_and_matches_eager():
    _, step = workload_step("bert-base:tiny", dtype=torch.float64)
    state = initial_state(step.graph, COST)
    lineage = state.fission
    build = next(iter(fission_moves.moves(lineage.tree))).build
    done = fission_moves.apply(lineage, build())
    assert done.frozen
    result, new_order, _, _ = _apply(done.graph, done.order, done.frozen)
    assert result.added and not result.changed & done.frozen
    cut = min_cut(done.graph, "runtime", done.order, done.frozen)
    assert not cut.recomputed & done.frozen
    _check(step, result.graph, new_order)


def test_nothing_is_offered_on_a_forward_only_graph():
    w = torch.randn(8, 8, dtype=torch.float64)
    x = torch.randn(4, 8, dtype=torch.float64)
    graph = capture(lambda a, b: torch.tanh(torch.relu(a @ b) * 2.0).sum(), x, w).graph
    order = graph.program_order()
    assert min_cut(graph, "runtime", order) is None
    assert not list(MINCUT_REMAT.match(_ctx(graph, order)))


def test_the_rule_is_a_default_rule_and_the_search_takes_it():
    assert MINCUT_REMAT in default_rules()
    _, step = workload_step("bert-base:tiny", dtype=torch.float64)
    base = simulate(step.graph, step.graph.program_order(), COST)
    objective = Objective(Mode.LATENCY_LIMIT, 1.10 * base.latency_s)
    options = SearchOptions(rules=(MINCUT_REMAT,), fission=False, max_states=3, seed=0)
    result = optimize_graph(step.graph, COST, objective, options)
    assert result.best.history == ("min-cut-remat",)
    assert result.best.memory < result.initial.memory
    _check(step, result.best.graph, result.best.order)


def test_random_testing_applies_the_cut_and_finds_no_mismatch():
    report = run_fuzz(40, seed=0)
    assert report.rules_covered["min-cut-remat"] > 0
    assert not report.mismatches, [m.error for m in report.mismatches]


def test_not_offered_where_the_peak_holds_nothing_it_may_recompute():
    _, step = workload_step("bert-base:tiny", dtype=torch.float64)
    graph = step.graph
    order = schedule(graph, "dp").order
    everything = frozenset(graph.nodes)  # as if one F-Tree region held the whole step
    assert not list(MINCUT_REMAT.match(_ctx(graph, order, everything)))
    # without H2 it is offered, and its cut, with everything banned, changes nothing
    ctx = RuleContext(graph, tuple(order), simulate(graph, order, COST), everything, False)
    for rewrite in MINCUT_REMAT.match(ctx):
        assert not rewrite.build().added


def test_the_cut_at_the_end_of_a_line_of_swaps_on_gpt2_matches_eager():
    """The search offers the cut along a line of local rewrites at depths 1, 2, 4, ...
    (`after_local_move`): on corpus:gpt2:tiny after four swaps it lowers the peak and runs as
    eager PyTorch does (float64)."""
    tiny = workload_step("corpus:gpt2:tiny", float64_when_tiny=True)[1]
    graph, order = tiny.graph, schedule(tiny.graph, "dp").order
    for _ in range(4):
        swaps = SWAP.match(_ctx(graph, order))
        res = next(rw for rw in swaps if "like it" not in rw.description).build()
        graph, order = res.graph, time_swaps(res.graph, order_without_solving(order, res), COST)
    result, new_order, before, after = _apply(graph, order)
    assert result.added and after.peak_bytes < before.peak_bytes
    _check(tiny, result.graph, new_order)
