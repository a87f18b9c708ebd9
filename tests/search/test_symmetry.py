"""Moves skipped as mirrors of a move already tried on the same state (search/symmetry.py)."""

import pytest
import torch
from torch import nn

import magis
from magis.backend.meta_check import MetaChecker
from magis.capture import workload_step
from magis.cost import get_cost_model
from magis.rules import RuleContext
from magis.search import Evaluator, default_rules, initial_state
from magis.search.hashing import wl_hash_incremental
from magis.search.symmetry import MoveSignatures


def _block_stack_state(cost):
    """Ten identical MLP blocks: the middle ones repeat one another."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(10) for m in (nn.Linear(64, 64), nn.GELU())])
    step = magis.training_step(
        model, (torch.randn(32, 64),), loss_fn=lambda out, x: out.square().mean()
    )
    return initial_state(step.graph, cost, fission=False)


def _split_state(cost, workload: str = "bert-base:tiny"):
    """A state of `workload` with its first F-Tree move materialized (parts of a split)."""
    _, step = workload_step(workload)
    state = initial_state(step.graph, cost)
    evaluator = Evaluator(cost, seen={state.hash.value})
    ctx = RuleContext(state.graph, state.order, state.sim, state.frozen)
    for _, make_child in evaluator.moves(state, (), ctx):
        child = make_child()
        if child is not None and child.nodes > state.nodes:
            return child
    raise AssertionError("no F-Tree move split the graph")


def _child_hash(state, rewrite, checker: MetaChecker) -> int | None:
    """The hash of the rewrite's child as the search computes it (None: dropped)."""
    built = rewrite.build()
    report = checker.derive(built.graph, built.touched)
    if not report.ok:
        return None
    touched = built.touched | report.restrided
    return wl_hash_incremental(state.hash, state.graph, built.graph, touched, built.removed).value


@pytest.mark.parametrize(("make_state", "least"), [(_block_stack_state, 3), (_split_state, 0)])
def test_a_move_skipped_as_a_mirror_would_have_been_a_duplicate(make_state, least):
    """Every rewrite of a state is built and hashed: each one the signatures skip has the hash
    of a child of a rewrite offered before it (nothing new is lost), and in a stack of
    repeated blocks some are skipped. (With two hops instead of four around each named node,
    four recomputed chains of the stack were skipped although their graphs were new.)"""
    cost = get_cost_model("rtx3090")
    state = make_state(cost)
    ctx = RuleContext(state.graph, state.order, state.sim, frozenset(), hotspots_only=False)
    mirrors, checker = MoveSignatures(state.graph, state.hash.labels[-1]), MetaChecker()
    offered: set[int | None] = set()
    skipped = 0
    for rule in default_rules():
        for rewrite in rule.match(ctx):
            child = _child_hash(state, rewrite, checker)
            if mirrors.first(rewrite):
                offered.add(child)
            else:
                skipped += 1
                assert child in offered, rewrite.description
    assert skipped >= least
    assert len(offered) >= 10


def test_the_search_skips_and_counts_the_mirrors():
    """The evaluator's moves leave the mirrors out, counted in the search's statistics."""
    cost = get_cost_model("rtx3090")
    state = _block_stack_state(cost)
    evaluator = Evaluator(cost, seen={state.hash.value})
    ctx = RuleContext(state.graph, state.order, state.sim, frozenset(), hotspots_only=False)
    described = [name for name, _ in evaluator.moves(state, default_rules(), ctx)]
    assert evaluator.stats.mirrored >= 3
    assert len(described) >= 10


def test_a_childs_node_names_derived_from_its_parents_are_the_ones_built_afresh():
    """Down a line of rewritten children of a split state (each child's names derived from its
    parent's as the evaluator does), every name maps to the node of that name, as a fresh
    build of the child's names does."""
    from magis.search.symmetry import _NAMES, node_names

    cost = get_cost_model("rtx3090")
    state = _split_state(cost)
    evaluator = Evaluator(cost, seen={state.hash.value})
    rules = set()
    for _ in range(6):
        node_names(state.graph)  # the parent's, as expanding a state builds them
        ctx = RuleContext(state.graph, state.order, state.sim, state.frozen)
        moves = evaluator.moves(state, default_rules(), ctx)
        child = next(
            c
            for name, make in moves
            if not name.startswith("fission:") and (c := make()) is not None
        )
        derived = child.graph.known(_NAMES)
        assert derived is not None
        fresh = {n.name: nid for nid, n in child.graph.nodes.items()}
        assert dict(derived.items()) == fresh
        rules.add(child.history[-1])
        state = child
    assert len(rules) > 1, rules
