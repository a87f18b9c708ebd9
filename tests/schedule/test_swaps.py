"""Store/Load timing (schedule/swaps.py, MAGIS §6.2): the indexed `time_swaps` places every copy
exactly where moving the copies one by one does (`time_swaps_by_moves`, the definition), on
swapped graphs in many valid orders."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from magis.capture import workload_step
from magis.cost import UnitCostModel, get_cost_model
from magis.ir import Ref, positions
from magis.rules import DEREMAT, DESWAP, REMAT, REMAT_TO_SWAP, SWAP, RuleContext
from magis.rules.remat import LateReads
from magis.rules.swap import swap
from magis.schedule.random_graphs import random_topological_order
from magis.schedule.swaps import time_swaps, time_swaps_by_moves
from magis.search.reschedule import hinted_order, order_without_solving
from magis.sim import simulate, tables

COST = get_cost_model("rtx3090")


class _SlowCopies(UnitCostModel):
    """Every op 1 s, every copy 2.5 s: each Load walks back over three ops (rtx3090's copies
    of tiny tensors walk to their Store)."""

    def transfer_time(self, nbytes: int) -> float:
        return 2.5


COSTS = [COST, UnitCostModel(), _SlowCopies()]


@pytest.fixture(scope="module")
def swapped():
    """bert-base:tiny with a dozen tensors swapped, one swap rewrite after another, and two
    outputs of one layer norm (two Stores right after one producer)."""
    _, step = workload_step("bert-base:tiny", dtype=torch.float64)
    graph, order = step.graph, list(step.graph.program_order())
    for _ in range(12):
        ctx = RuleContext(graph, tuple(order), simulate(graph, order, COST), cost=COST)
        rewrite = next(rw for rw in SWAP.match(ctx) if "like it" not in rw.description)
        graph, order = _placed(order, rewrite.build())
    norm = next(n for n in order if graph.node(n).op == "aten.native_layer_norm.default")
    for index in (1, 2):
        pos = {n: i for i, n in enumerate(order)}
        readers = sorted(graph.storages().readers[Ref(norm, index)], key=pos.__getitem__)
        graph, order = _placed(order, swap(graph, LateReads(Ref(norm, index), tuple(readers), ())))
    assert len(tables(graph).copy_nodes) >= 28
    return graph, order


def _placed(order, res):
    return res.graph, time_swaps_by_moves(res.graph, order_without_solving(order, res), COST)


@pytest.mark.parametrize("cost", COSTS, ids=lambda c: type(c).__name__)
def test_indexed_timing_equals_moving_copies_one_by_one_in_the_search_order(swapped, cost):
    graph, order = swapped
    assert time_swaps(graph, order, cost) == time_swaps_by_moves(graph, order, cost)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), which=st.sampled_from(range(len(COSTS))))
def test_indexed_timing_equals_moving_copies_one_by_one_in_any_valid_order(swapped, seed, which):
    graph, _ = swapped
    order = random_topological_order(graph, random.Random(seed))
    timed = time_swaps(graph, order, COSTS[which])
    assert timed == time_swaps_by_moves(graph, order, COSTS[which])
    assert sorted(timed) == sorted(order)


def test_a_childs_positions_from_its_parents_are_its_indices_and_time_its_copies_alike(swapped):
    """`hinted_order` gives a child's positions without indexing its order (the parent's
    indices, less the nodes taken out, plus the nodes put in below, `_Keys.rank`): they are
    the child's indices, and Store/Load timing on them places every copy as on the index."""
    graph, order = swapped
    ctx = RuleContext(graph, tuple(order), simulate(graph, order, COST), cost=COST)
    ranked = 0
    for rule in (SWAP, DESWAP, REMAT, DEREMAT, REMAT_TO_SWAP):
        for rewrite in list(rule.match(ctx))[:6]:
            res = rewrite.build()
            hinted = hinted_order(order, res, positions(order))
            if hinted is None or hinted[1] is None:
                continue
            new_order, pos = hinted
            exact = positions(new_order)
            assert all(pos[n] == i for n, i in exact.items()), rewrite.description
            if tables(res.graph).copy_nodes:
                timed = time_swaps(res.graph, new_order, COST, pos)
                assert timed == time_swaps(res.graph, new_order, COST)
            ranked += 1
    assert ranked >= 12
