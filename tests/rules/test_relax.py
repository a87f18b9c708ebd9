"""Relaxation (rules/relax.py): the recomputations and swaps a state has room to do without,
undone in one child. Its children run and match eager PyTorch, its estimate of the room is
kept, and it gives time back."""

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from magis.backend import compile_program, verify
from magis.baselines import BaselinePoint, get_baseline
from magis.capture import workload_step
from magis.cost import get_cost_model
from magis.ir import Ref
from magis.ir.graph import StorageMap, derive_storages
from magis.ir.ops import LOAD_OP
from magis.ir.trail import DecisionKind
from magis.rules import RELAX, REMAT, REMAT_TO_SWAP, SWAP, RuleContext
from magis.rules.duplicates import duplicate_key, recompute_call, recomputed_pairs
from magis.rules.relax import Undo, fitting, recomputed_copies
from magis.schedule.random_graphs import random_topological_order
from magis.schedule.swaps import time_swaps
from magis.search.decisions import rewrite_decision
from magis.search.reschedule import order_without_solving
from magis.sim import simulate

COST = get_cost_model("rtx3090")


@pytest.fixture(scope="module")
def bert_tiny():
    _, step = workload_step("bert-base:tiny", dtype=torch.float64)
    return step


def _context(graph, order, ceiling=None):
    sim = simulate(graph, order, COST)
    return RuleContext(graph, tuple(order), sim, ceiling=ceiling, cost=COST)


def _apply(graph, order, rewrite):
    res = rewrite.build()
    placed = order_without_solving(order, res)
    assert placed is not None and res.graph.is_valid_schedule(placed), rewrite.description
    return res, time_swaps(res.graph, placed, COST)


def _check(step, graph, order):
    check = verify(step, compile_program(graph, order), step.make_inputs())
    assert check.verified, f"{check.worst} differs by {check.max_rel_err:.2e}"


def _recomputed_and_swapped(step):
    """bert-base:tiny with its repeated hot kinds recomputed (whole segments), then swapped."""
    graph, order = step.graph, list(step.graph.program_order())
    for rule in (REMAT, REMAT, SWAP):
        group = next(rw for rw in rule.match(_context(graph, order)) if "like it" in rw.description)
        res, order = _apply(graph, order, group)
        graph = res.graph
    return graph, order


def test_relaxing_with_room_for_everything_undoes_every_recomputation_and_swap(bert_tiny):
    """With room for everything under the ceiling, one child merges
    every recomputed copy back (the whole segments, not only their first nodes), removes the
    copies and drops every swap; it runs as eager PyTorch does, its storage map derived from
    the parent's is the fresh one, and it gives back the time the rewrites cost."""
    graph, order = _recomputed_and_swapped(bert_tiny)
    ctx = _context(graph, order, ceiling=10 * simulate(graph, order, COST).peak_bytes)
    assert len(recomputed_copies(ctx)) > len(recomputed_pairs(ctx)) > 0  # segments: all of them
    everything = [
        rw
        for rw in RELAX.match(ctx)
        if "recomputed" in rw.description and "swaps" in rw.description
    ]
    assert everything, [rw.description for rw in RELAX.match(ctx)]
    res, placed = _apply(graph, order, everything[0])
    after = _context(res.graph, placed)
    assert recomputed_copies(after) == []
    assert not any(res.graph.node(n).op == LOAD_OP for n in res.graph.nodes)
    assert after.sim.latency_s < ctx.sim.latency_s
    assert len(res.graph) == len(bert_tiny.graph)
    _check(bert_tiny, res.graph, placed)
    derived = derive_storages(graph, res.graph, res.added, res.changed, res.removed)
    fresh = StorageMap.build(res.graph)
    assert derived.base == fresh.base and derived.nbytes == fresh.nbytes
    assert {s: set(r) for s, r in derived.readers.items()} == {
        s: set(r) for s, r in fresh.readers.items()
    }


def test_every_relaxation_at_the_states_own_peak_runs_exactly(bert_tiny):
    """Under the state's own peak (a latency limit's ceiling) each child offered runs as eager
    PyTorch does; the undos kept are fewer than with room to spare."""
    graph, order = _recomputed_and_swapped(bert_tiny)
    ctx = _context(graph, order)
    offered = list(RELAX.match(ctx))
    roomy = _context(graph, order, ceiling=2 * ctx.sim.peak_bytes)
    assert len(offered) <= len(list(RELAX.match(roomy)))
    for rw in offered:
        res, placed = _apply(graph, order, rw)
        _check(bert_tiny, res.graph, placed)


def _every_key_built(graph, order, same=None, views=True, frozen=frozenset()):
    """(original, copy) by building every node's key: what `copies_in_order` must find."""
    first, pairs = {}, []
    for nid in order:
        if nid in frozen:
            continue
        if recompute_call(graph, nid) is None or (not views and graph.info(nid).is_view):
            continue
        key = duplicate_key(graph, nid, same)
        if key is None:
            continue
        original = first.setdefault(key, nid)
        if original != nid:
            if same is not None:
                same.update(
                    {Ref(nid, i): Ref(original, i) for i in range(len(graph.node(nid).outputs))}
                )
            if not graph.info(nid).is_view:
                pairs.append((original, nid))
    return pairs


def test_the_scan_that_keys_only_alike_nodes_finds_every_pair(bert_tiny):
    """Recomputed segments (copies whose inputs are copies, which relaxation's scan names by
    the originals) and swaps on bert-base:tiny: the pairs both scans find are the ones
    building every node's key finds, in the same order."""
    graph, order = _recomputed_and_swapped(bert_tiny)
    ctx = _context(graph, order)
    assert recomputed_pairs(ctx) == _every_key_built(graph, order, views=False)
    assert recomputed_copies(ctx) == _every_key_built(graph, order, same={})
    assert len(recomputed_copies(ctx)) > len(recomputed_pairs(ctx)) > 0


def test_the_copies_read_from_the_index_are_the_whole_scans_in_any_schedule(bert_tiny):
    """Relaxation's recomputed copies read from the duplicate index (only the nodes that can
    be copies or originals given to the scan) are the ones building every node's key finds,
    in the same order: down a line of rewrites that make, merge and swap copies, in the
    line's schedules and in shuffled ones, with and without frozen nodes."""
    from magis.rules import DEREMAT

    graph, order = bert_tiny.graph, list(bert_tiny.graph.program_order())
    found = 0
    for step, rule in enumerate((REMAT, REMAT, SWAP, REMAT, DEREMAT, REMAT)):
        rewrite = next(rw for rw in rule.match(_context(graph, order)))
        res, order = _apply(graph, order, rewrite)
        graph = res.graph
        frozen = frozenset(order[len(order) // 3 : len(order) // 2])
        for schedule in (order, random_topological_order(graph, random.Random(step))):
            for held in (frozenset(), frozen):
                ctx = replace(_context(graph, schedule), frozen=held)
                want = _every_key_built(graph, schedule, same={}, frozen=held)
                assert recomputed_copies(ctx) == want
                found += len(want)
    assert found > 0


def test_a_childs_duplicate_index_derived_from_its_parents_is_the_one_built_afresh(bert_tiny):
    """Down a line of rewrites that make, merge, swap and unswap copies (each child derives
    its index from its parent's), the derived index has the groups of a fresh build, its
    inherited keys are the nodes' keys, and the recomputed pairs read from it are the ones
    building every node's key finds."""
    from magis.rules import DEREMAT, DESWAP
    from magis.rules.duplicates import _INDEX, _build_index, derive_duplicate_index

    def groups(index):
        return {g: sorted(m) for g, m in index.groups.items()}, index.shared

    graph, order = bert_tiny.graph, list(bert_tiny.graph.program_order())
    seen = set()
    for rule in (REMAT, REMAT, SWAP, DEREMAT, REMAT, DESWAP, DEREMAT):
        ctx = _context(graph, order)
        assert recomputed_pairs(ctx) == _every_key_built(graph, order, views=False)
        rewrite = next(iter(rule.match(ctx)))
        res, order = _apply(graph, order, rewrite)
        derive_duplicate_index(graph, res.graph, res.added | res.changed, res.removed)
        graph = res.graph
        derived = graph.known(_INDEX)
        assert derived is not None and groups(derived) == groups(_build_index(graph))
        # those inherited, against a fresh index numbering views as the derived one does
        fresh = replace(_build_index(graph), names=derived.names.next_version())
        for nid, key in derived.keys.items():
            assert key == fresh.key(graph, nid)
        seen.add(rule.name)
    assert recomputed_pairs(_context(graph, order)) == _every_key_built(graph, order, views=False)
    assert seen == {"remat", "swap", "deremat", "deswap"}


def test_explain_names_a_relaxation_by_what_it_undid(bert_tiny):
    """A relaxation shares re-materialization's dual kind; its decision says undo-swap when
    it dropped swaps alone, and undo-recompute when it merged copies back."""
    graph, order = _recomputed_and_swapped(bert_tiny)
    ctx = _context(graph, order, ceiling=10 * simulate(graph, order, COST).peak_bytes)
    kinds = {}
    for rw in RELAX.match(ctx):
        res, placed = _apply(graph, order, rw)
        after = simulate(res.graph, placed, COST)
        decision = rewrite_decision(rw, graph, ctx.sim, res.graph, res.added, res.removed, after)
        swaps_only = "recomputed" not in rw.description
        kinds[rw.description] = decision.kind
        assert decision.kind is (
            DecisionKind.UNDO_SWAP if swaps_only else DecisionKind.UNDO_RECOMPUTE
        ), rw.description
    assert set(kinds.values()) == {DecisionKind.UNDO_SWAP, DecisionKind.UNDO_RECOMPUTE}, kinds
    trade = next(iter(REMAT_TO_SWAP.match(ctx)))  # swaps a recomputed copy's original instead
    res, placed = _apply(graph, order, trade)
    after = simulate(res.graph, placed, COST)
    decision = rewrite_decision(trade, graph, ctx.sim, res.graph, res.added, res.removed, after)
    assert decision.kind is DecisionKind.SWAP, trade.description


def test_relaxing_a_peers_swaps_on_a_concatenating_cnn_runs_exactly():
    """pofo's plan of a DenseNet (its swaps of concatenations) relaxed under the program
    order's peak: the swaps dropped, the program exact."""
    _, step = workload_step("corpus:densenet121:tiny", dtype=torch.float64)
    point = next(
        p for p in get_baseline("pofo").points(step.graph, COST) if isinstance(p, BaselinePoint)
    )
    ceiling = simulate(step.graph, step.graph.program_order(), COST).peak_bytes
    ctx = _context(point.graph, point.order, ceiling=ceiling)
    (first, *_) = RELAX.match(ctx)
    assert "swaps dropped" in first.description
    res, placed = _apply(point.graph, point.order, first)
    assert sum(res.graph.node(n).op == LOAD_OP for n in res.graph.nodes) < sum(
        point.graph.node(n).op == LOAD_OP for n in point.graph.nodes
    )
    _check(step, res.graph, placed)


spans = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 20), st.integers(1, 50)).map(
        lambda t: (t[0], t[0] + t[1], t[2])
    ),
    min_size=0,
    max_size=3,
)


@settings(max_examples=200, deadline=None)
@given(
    timeline=st.lists(st.integers(0, 100), min_size=60, max_size=60),
    undos=st.lists(st.tuples(spans, st.floats(0.001, 1.0)), max_size=12),
    room=st.integers(0, 120),
)
def test_the_undos_kept_fit_under_the_ceiling_at_every_step(timeline, undos, room):
    """`fitting`'s promise: the timeline plus every kept undo's spans stays at or under the
    ceiling at every step, and an undo that fits alone after those kept is never refused."""
    line = np.array(timeline, dtype=np.int64)
    ceiling = int(line.max()) + room
    offered = [Undo(None, None, tuple(s), sec) for s, sec in undos]
    kept = fitting(line, offered, ceiling)
    extra = np.zeros_like(line)
    for u in kept:
        for a, b, n in u.spans:
            extra[a:b] += n
    assert int((line + extra).max()) <= ceiling
    for u in offered:
        if u in kept or not u.spans:
            continue
        trial = extra.copy()
        for a, b, n in u.spans:
            trial[a:b] += n
        assert int((line + trial).max()) > ceiling  # refused only when it does not fit


def _recomputed_off_the_peak(step, count=4):
    """bert-base:tiny with its `count` smallest recomputable tensors recomputed: rewrites that
    lower no peak, which a state's own peak leaves room to undo."""
    graph, order = step.graph, list(step.graph.program_order())

    def singles(graph, order):
        ctx = RuleContext(
            graph, tuple(order), simulate(graph, order, COST), hotspots_only=False,
            max_candidates=60, cost=COST,
        )  # fmt: skip
        return [rw for rw in REMAT.match(ctx) if "like it" not in rw.description]

    done = 0
    for what in [rw.description.split(" for ")[0] for rw in singles(graph, order)[::-1]]:
        rewrite = next(
            (rw for rw in singles(graph, order) if rw.description.startswith(what)), None
        )
        if rewrite is not None:
            res, order = _apply(graph, order, rewrite)
            graph, done = res.graph, done + 1
        if done == count:
            return graph, order
    raise AssertionError(f"fewer than {count} tensors to recompute")


def test_a_child_over_a_latency_limit_is_relaxed_at_its_own_peak(bert_tiny):
    """The search's repair (`Evaluator.repaired`): a state over a latency limit gets back the
    time of the rewrites its own peak leaves room to undo; a state within its limit, or under
    a memory limit, is left as it is."""
    from magis.search.evaluator import Evaluator
    from magis.search.hashing import wl_hash
    from magis.search.state import Mode, MState, Objective

    graph, order = _recomputed_off_the_peak(bert_tiny)
    state = MState(graph, tuple(order), simulate(graph, order, COST), wl_hash(graph))
    evaluator = Evaluator(COST)
    over = Objective(Mode.LATENCY_LIMIT, 0.999 * state.latency)
    repaired = evaluator.repaired(state, over)
    assert repaired is not state and repaired.history[-1:] == ("relax",)
    assert repaired.latency < state.latency
    _check(bert_tiny, repaired.graph, repaired.order)
    assert evaluator.repaired(state, Objective(Mode.LATENCY_LIMIT, 2 * state.latency)) is state
    assert evaluator.repaired(state, Objective(Mode.MEMORY_LIMIT, state.memory)) is state
