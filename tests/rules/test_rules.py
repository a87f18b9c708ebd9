"""Every rewrite rule preserves meaning: rewritten programs run and match eager PyTorch exactly
(DESIGN principle 1), and the incremental hash equals a fresh one."""

import random

import pytest
import rustworkx as rx
import torch

from magis.backend import compile_program, measure, verify
from magis.capture import workload_step
from magis.cost import get_cost_model
from magis.ir import Ref
from magis.ir.builder import GraphBuilder
from magis.ir.topological import place_after_inputs, stable_topological_order
from magis.rules import (
    DECOMPACT,
    DEREMAT,
    DESWAP,
    REMAT,
    REMAT_TO_SWAP,
    SWAP,
    TASO_RULES,
    Rewritten,
    RuleContext,
    RuleKind,
    candidates,
    fuzzed_rules,
    node_rule,
)
from magis.rules.catalog import FIRST_FUZZ_ROUND
from magis.rules.remat import MAX_CHAIN
from magis.rules.repeated import MIN_GROUP
from magis.schedule.swaps import time_swaps
from magis.search.hashing import wl_hash, wl_hash_incremental
from magis.search.reschedule import order_without_solving
from magis.sim import simulate


@pytest.fixture(scope="module")
def bert_tiny():
    _, step = workload_step("bert-base:tiny", dtype=torch.float64)
    return step


def _context(graph, order, cost):
    return RuleContext(graph, tuple(order), simulate(graph, order, cost), max_candidates=3)


def _check(step, graph, order):
    program = compile_program(graph, order)
    inputs = step.make_inputs()
    check = verify(step, program, inputs)
    assert check.verified, f"{check.worst} differs by {check.max_rel_err:.2e}"
    measured = measure(program, step.program_inputs(inputs), repeats=1, warmup=0)
    assert simulate(graph, order, get_cost_model("unit")).peak_bytes == measured.peak_bytes


@pytest.mark.parametrize("rule, dual", [(REMAT, DEREMAT), (SWAP, DESWAP)], ids=["remat", "swap"])
def test_rule_and_its_dual_preserve_meaning(bert_tiny, rule, dual):
    cost = get_cost_model("rtx3090")
    graph = bert_tiny.graph
    order = list(graph.program_order())
    rewrites = list(rule.match(_context(graph, order, cost)))
    assert rewrites, f"{rule.name} found nothing to do on bert-base:tiny"
    # a repeated kind (one per layer) in one rewrite, and its first half in another, checked
    # below as every rewrite is
    kinds = [rw for rw in rewrites if "hot tensors like it" in rw.description]
    assert len(kinds) >= 2, [rw.description for rw in rewrites]
    sizes = [len(rw.build().placements) for rw in kinds]
    assert sizes[0] // 2 in sizes[1:], sizes
    for rw in rewrites:
        res = rw.build()
        res.graph.verify()
        placed = order_without_solving(order, res)  # the search's placement: its hint
        assert placed is not None and res.graph.is_valid_schedule(placed), rw.description
        new_order = place_after_inputs(res.graph, order, res.added)
        new_order = time_swaps(res.graph, new_order, cost)
        assert res.graph.is_valid_schedule(new_order)
        _check(bert_tiny, res.graph, new_order)
        full = wl_hash(res.graph).value
        assert (
            wl_hash_incremental(wl_hash(graph), graph, res.graph, res.touched, res.removed).value
            == full
        )
        # the dual undoes it (a repeated kind mostly in one rewrite, then a recomputed segment
        # one node at a time): the original hash
        back, back_order = res, new_order
        if len(res.placements) >= MIN_GROUP:  # a smaller half is taken back one at a time
            back, back_order = _group_undo(bert_tiny, res, new_order, dual, cost)
        for _ in range(MAX_CHAIN * max(1, len(res.placements))):  # a repeated kind: each one
            if wl_hash(back.graph).value == wl_hash(graph).value:
                break
            undo = [d for d in dual.match(_context(back.graph, back_order, cost))]
            assert undo, f"{dual.name} cannot undo {rw.description}"
            back = undo[0].build()
            back_order = [n for n in back_order if n in back.graph]
            _check(bert_tiny, back.graph, back_order)
        assert wl_hash(back.graph).value == wl_hash(graph).value


def _group_undo(step, res, order, dual, cost):
    """The dual's first rewrite on a repeated kind's rewrite is its group undo: it takes back
    most of what the rewrite added (each member's whole recomputed segment, when the members'
    segments are of one kind) in one rewrite, placed by the search's hint, and it runs."""
    (undo, *_) = dual.match(_context(res.graph, order, cost))
    assert "like" in undo.description, undo.description
    back = undo.build()
    back_order = [n for n in order if n in back.graph]
    assert order_without_solving(order, back) == back_order
    assert len(back.removed) >= len(res.added) // 2, undo.description
    _check(step, back.graph, back_order)
    return back, back_order


def test_a_recomputation_traded_for_a_swap_keeps_meaning_and_leaves_no_copy(bert_tiny):
    """remat_to_swap on every recomputation REMAT offers (a repeated kind and single segments):
    the copies merge back, the original is swapped out for the readers the copy fed, the
    search's placement holds, the program verifies against eager, and the storage map and the
    hash the search derives from the parent's are the fresh ones."""
    from magis.ir.graph import StorageMap, derive_storages
    from magis.ir.ops import LOAD_OP
    from magis.rules.duplicates import recomputed_pairs

    cost = get_cost_model("rtx3090")
    graph = bert_tiny.graph
    order = list(graph.program_order())
    traded = moved = 0
    for rw in REMAT.match(_context(graph, order, cost)):
        res = rw.build()
        remat_order = order_without_solving(order, res)
        ctx = _context(res.graph, remat_order, cost)
        copies = len(recomputed_pairs(ctx))
        if res.removed:  # every reader was late: the segment moved, its original is gone
            assert not any(n in res.graph for n in res.removed)
            _check(bert_tiny, res.graph, remat_order)
            moved += 1
            continue
        trades = list(REMAT_TO_SWAP.match(ctx))
        assert trades, f"nothing traded for {rw.description}"
        trade = trades[0]  # a group's when the recomputation was a group's
        out = trade.build()
        out.graph.verify()
        placed = order_without_solving(remat_order, out)
        assert placed is not None and out.graph.is_valid_schedule(placed), trade.description
        placed = time_swaps(out.graph, placed, cost)
        after = _context(out.graph, placed, cost)
        assert len(recomputed_pairs(after)) < copies, trade.description
        assert any(out.graph.node(n).op == LOAD_OP for n in out.added), trade.description
        _check(bert_tiny, out.graph, placed)
        derived = derive_storages(res.graph, out.graph, out.added, out.changed, out.removed)
        assert _same_storages(derived, StorageMap.build(out.graph)), trade.description
        assert (
            wl_hash_incremental(
                wl_hash(res.graph), res.graph, out.graph, out.touched, out.removed
            ).value
            == wl_hash(out.graph).value
        )
        traded += 1
    assert traded >= 2 and moved >= 1


def test_random_ops_are_never_recomputed(bert_tiny):
    cost = get_cost_model("rtx3090")
    graph = bert_tiny.graph
    order = graph.program_order()
    ctx = RuleContext(
        graph,
        tuple(order),
        simulate(graph, order, cost),
        hotspots_only=False,
        max_candidates=10_000,
    )
    for rw in candidates([REMAT], ctx):
        res = rw.build()
        for nid in res.added:
            assert not res.graph.info(nid).is_random


def test_training_batch_norm_is_recomputed_without_touching_running_stats():
    """A batch norm's outputs are recomputed with its running statistics left out: the plan
    verifies (running means included: they are outputs of the step) and the peak falls."""
    from dataclasses import replace

    from magis.rules.remat import late_reads, recompute

    _, step = workload_step("resnet50:tiny", dtype=torch.float64)
    cost = get_cost_model("rtx3090")
    graph = step.graph
    order = list(graph.program_order())
    sim = simulate(graph, order, cost)
    bn = next(n for n in order if graph.node(n).op == "aten.native_batch_norm.default")
    # as if the peak were right after the batch norm: every later reader is a late one
    ctx = RuleContext(graph, tuple(order), replace(sim, peak_step=order.index(bn)))
    reads = late_reads(ctx, Ref(bn, 0))
    assert reads is not None
    res = recompute(graph, reads)
    twin = next(iter(sorted(res.added)))
    assert res.graph.node(twin).args[3] is None and res.graph.node(twin).args[4] is None
    new_order = place_after_inputs(res.graph, order, res.added)
    _check(step, res.graph, new_order)


def test_segment_recomputation_frees_what_one_node_cannot():
    """A ReLU after a training batch norm: recomputing the ReLU alone keeps the batch norm's
    output alive until the copy runs; recomputing both from the convolution's output (which
    the backward keeps anyway) frees it. The plan verifies, and it needs less memory."""
    from dataclasses import replace

    from magis.rules.remat import late_reads, recompute, recompute_chain, recompute_segment

    _, step = workload_step("resnet50:tiny", dtype=torch.float64)
    cost = get_cost_model("unit")
    graph = step.graph
    order = list(graph.program_order())
    sim = simulate(graph, order, cost)
    relu = next(
        n
        for n in order
        if graph.node(n).op == "aten.relu.default"
        and graph.node(graph.node(n).inputs[0].node).op == "aten.native_batch_norm.default"
    )
    first = min(order.index(u) for u in graph.users(relu) if not graph.info(u).is_view)
    ctx = RuleContext(graph, tuple(order), replace(sim, peak_step=first + 1))  # read early too
    reads = late_reads(ctx, Ref(relu, 0))
    chain = recompute_chain(ctx, reads)
    assert [graph.node(n).op for n in chain] == [
        "aten.native_batch_norm.default",
        "aten.relu.default",
    ]
    peaks = {}
    for name, res in [
        ("segment", recompute_segment(graph, reads, chain)),
        ("one", recompute(graph, reads)),
    ]:
        at = order.index(reads.readers[0])
        new_order = [*order[:at], *sorted(res.added), *order[at:]]
        assert relu in res.graph  # its first reader keeps the original (a view of it may go)
        new_order = [n for n in new_order if n not in res.removed]
        _check(step, res.graph, new_order)
        timeline = simulate(res.graph, new_order, cost).timeline
        window = new_order.index(order[first + 1]), new_order.index(min(res.added))
        peaks[name] = int(timeline[window[0] : window[1]].max())  # till the copy runs
    assert peaks["segment"] < peaks["one"]


def test_compaction_copies_out_the_late_slices_and_its_dual_undoes_it():
    """U-Net's concatenated gradients: the skip connection's slice is read at the end of the
    backward. Copied out, the whole buffer dies early: the plan verifies, needs less memory
    until the late reader, and decompaction gives the original graph back."""
    from dataclasses import replace

    from magis.rules.compact import compact, compactable
    from magis.rules.remat import late_reads

    _, step = workload_step("unet:tiny", dtype=torch.float64)
    cost = get_cost_model("unit")
    graph = step.graph
    order = list(graph.program_order())
    pos = {n: i for i, n in enumerate(order)}
    sim = simulate(graph, order, cost)
    checked = 0
    for nid in order:  # cat gradients: convolution backwards read through several slices
        slices = [u for u in graph.users(nid) if graph.node(u).op == "aten.slice.Tensor"]
        if graph.node(nid).op != "aten.convolution_backward.default" or len(slices) < 2:
            continue
        first_use = min(pos[r] for v in slices for r in graph.users(v))
        ctx = RuleContext(graph, tuple(order), replace(sim, peak_step=first_use))
        reads = late_reads(ctx, Ref(nid, 0))
        assert reads is not None and compactable(ctx, reads)
        res = compact(ctx, reads)
        res.graph.verify()
        at = order.index(res.anchor)
        new_order = [*order[:at], *sorted(res.added), *order[at:]]
        _check(step, res.graph, new_order)
        last = pos[reads.readers[0]]
        before = sim.timeline[at:last].max()
        after = simulate(res.graph, new_order, cost).timeline[at + len(res.added) : last].max()
        assert after < before
        (undo,) = [d for d in DECOMPACT.match(_context(res.graph, new_order, cost))]
        assert wl_hash(undo.build().graph).value == wl_hash(graph).value
        checked += 1
    assert checked >= 2


def _same_storages(a, b) -> bool:
    return (
        a.base == b.base
        and a.nbytes == b.nbytes
        and {s: set(r) for s, r in a.readers.items()} == {s: set(r) for s, r in b.readers.items()}
        and (a.resident, a.outputs, a.host) == (b.resident, b.outputs, b.host)
    )


@pytest.mark.parametrize(
    "workload", ["bert-base:tiny", "resnet50:tiny", "gpt-neo-1.3b:tiny", "unet:tiny"]
)
def test_storage_map_derived_from_the_parent_equals_a_fresh_build(workload):
    """The search derives each child's StorageMap from its parent's (derive_storages); for
    every rule and its dual, twice in a row, it must equal the full build."""
    from magis.ir.graph import StorageMap, derive_storages

    _, step = workload_step(workload)
    cost = get_cost_model("rtx3090")
    rules = fuzzed_rules(FIRST_FUZZ_ROUND)  # the catalog's, as the fuzzer draws them
    graph, order = step.graph, list(step.graph.program_order())
    checked = 0
    for _ in range(3):
        ctx = RuleContext(graph, tuple(order), simulate(graph, order, cost), hotspots_only=False)
        last = None
        for rw in candidates(rules, ctx):
            res = rw.build()
            derived = derive_storages(graph, res.graph, res.added, res.changed, res.removed)
            assert _same_storages(derived, StorageMap.build(res.graph)), rw.description
            checked += 1
            last = res
        if last is None:
            break
        graph = last.graph
        order = place_after_inputs(graph, order, last.added)
        graph.storages()  # the next round derives from this one
    assert checked >= 20


# --- the rule contract ------------------------------------------------------------------------


def _chain_graph():
    """x -> relu -> relu -> ... (six relus), each reading the one before."""
    b = GraphBuilder(torch.float64)
    y = b.input("x", (4, 4))
    for i in range(6):
        y = b.relu(y, name=f"r{i}")
    b.output(y)
    return b.build()


def _relu_rule(built: list[int]):
    def build(graph, nid):
        built.append(nid)
        return Rewritten(graph.copy(), frozenset())

    return node_rule(
        "touch_relu",
        RuleKind.TASO,
        accepts=lambda graph, n: graph.node(n).op == "aten.relu.default",
        build=build,
    )


def test_node_rule_yields_one_lazy_rewrite_per_accepted_node_capped_and_outside_frozen():
    graph = _chain_graph()
    order = graph.program_order()
    relus = [n for n in order if graph.node(n).op == "aten.relu.default"]
    sim = simulate(graph, order, get_cost_model("unit"))
    built: list[int] = []
    rule = _relu_rule(built)

    everything = list(rule.match(RuleContext(graph, tuple(order), sim)))
    assert [rw.description for rw in everything] == [
        f"touch_relu {graph.node(n).name}" for n in relus
    ]
    assert {rw.rule for rw in everything} == {"touch_relu"}
    assert built == []  # nothing is built until asked
    everything[2].build()
    assert built == [relus[2]]

    frozen = frozenset(relus[:2])
    capped = list(rule.match(RuleContext(graph, tuple(order), sim, frozen, max_candidates=3)))
    assert [rw.description for rw in capped] == [
        f"touch_relu {graph.node(n).name}" for n in relus[2:5]
    ]


def _kahn_by_rank(graph, order):
    """The reference: Kahn's algorithm by rank, old nodes ranked by their position in
    `order`, a new node just ahead of its earliest ranked user (ties by id)."""
    import heapq

    rank = {n: float(i) for i, n in enumerate(order) if n in graph}
    for n in sorted(set(graph.nodes) - set(rank), reverse=True):
        users = [rank[u] for u in graph.successors(n) if u in rank]
        rank[n] = min(users) - 0.5 if users else float(len(order) + n)
    indegree = {n: len(graph.predecessors(n)) for n in graph.nodes}
    heap = [(rank[n], n) for n, d in indegree.items() if d == 0]
    heapq.heapify(heap)
    result = []
    while heap:
        _, n = heapq.heappop(heap)
        result.append(n)
        for s in graph.successors(n):
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(heap, (rank[s], s))
    return result


def _random_topological_order(graph, seed: int) -> list[int]:
    keys = {n: f"{random.Random(seed * 100_003 + n).random():.12f}" for n in graph.nodes}
    return list(rx.lexicographical_topological_sort(graph.dag, key=keys.__getitem__))


def test_stable_topological_order_matches_kahn_by_rank(bert_tiny):
    """`stable_topological_order` (rustworkx's lexicographical sort) gives the reference
    order: for rewritten graphs (new nodes, some only feeding other new nodes), old orders
    that are valid, shuffled or reversed (then only dependencies decide)."""
    cost = get_cost_model("unit")
    graph = bert_tiny.graph
    order = graph.program_order()
    ctx = RuleContext(graph, tuple(order), simulate(graph, order, cost), max_candidates=2)
    cases = [(graph, order), (graph, order[::-1]), (_chain_graph(), [])]
    for seed in range(3):
        cases.append((graph, _random_topological_order(graph, seed)))
    for rw in candidates([*TASO_RULES, REMAT, SWAP], ctx):
        res = rw.build()
        cases.append((res.graph, order))
        cases.append((res.graph, _random_topological_order(graph, 7)))
    assert len(cases) >= 12
    for g, old in cases:
        got = stable_topological_order(g, old)
        assert got == _kahn_by_rank(g, old)
        assert g.is_valid_schedule(got)
        if g is graph and g.is_valid_schedule(old):
            assert got == old  # a valid order is kept as it is


def test_a_context_derives_each_fact_once_under_typed_keys(bert_tiny):
    """`RuleContext.derived` caches what several rules read of one state under keys compared
    by identity (two keys of one name are two facts); `without_frozen` shares the order's
    indexes, not the facts, and an index of another order is refused (issue 45)."""
    from magis.ir import DerivedKey
    from magis.rules import OrderIndex

    graph = bert_tiny.graph
    order = tuple(graph.program_order())
    ctx = RuleContext(
        graph, order, simulate(graph, order, get_cost_model("unit")), frozen=frozenset({order[0]})
    )
    first, second = DerivedKey("same name"), DerivedKey("same name")
    built = []
    assert ctx.derived(first, lambda: built.append(1) or "a") == "a"
    assert ctx.derived(first, lambda: built.append(2) or "b") == "a"
    assert ctx.derived(second, lambda: "c") == "c" and built == [1]
    assert ctx.position[order[5]] == 5 and ctx.nodes_of(graph.node(order[-1]).op)
    inside = ctx.without_frozen()
    assert inside.index is ctx.index and not inside.frozen
    assert inside.derived(first, lambda: "fresh") == "fresh"
    with pytest.raises(ValueError, match="own order"):
        RuleContext(graph, order[::-1], ctx.sim, index=OrderIndex(order))
