"""The simulator on hand-built graphs, checked by hand (MAGIS §2.1 on storages)."""

import numpy as np

from magis.cost import UnitCostModel
from magis.ir import Graph, PlaceholderKind, Ref, TensorMeta
from magis.sim import Category, simulate


def f32(*shape):
    return TensorMeta(tuple(shape), "float32", 4)


def chain_graph():
    """w (resident 400 B) -> a = mm(x, w) 400 B -> v = view(a) -> b = relu(v) 400 B -> sum 4 B."""
    g = Graph()
    x = g.add_placeholder("x", f32(10, 10), PlaceholderKind.DATA)
    w = g.add_placeholder("w", f32(10, 10), PlaceholderKind.WEIGHT)
    a = g.add_op("a", "aten.mm.default", (Ref(x), Ref(w)), outputs=(f32(10, 10),))
    v = g.add_op("v", "aten.view.default", (Ref(a), [100]), outputs=(f32(100),))
    b = g.add_op("b", "aten.relu.default", (Ref(v),), outputs=(f32(100),))
    s = g.add_op("s", "aten.sum.default", (Ref(b),), outputs=(f32(),))
    g.set_outputs([Ref(s)])
    return g, (x, w, a, v, b, s)


def test_views_share_storage_and_cost_nothing():
    g, (x, w, a, v, b, s) = chain_graph()
    sim = simulate(g, g.program_order(), UnitCostModel())
    # resident: x and w (800 B). While b runs, a (through its view) and b are live: 800 more.
    assert sim.resident_bytes == 800
    assert sim.peak_bytes == 800 + 400 + 400
    assert list(sim.timeline) == [800, 800, 1200, 1200, 1600, 1204]
    assert sim.latency_s == 3.0  # mm, relu, sum; the view costs nothing
    assert [h.name for h in sim.hotspots] == ["a", "b"]


def test_peak_breakdown_counts_resident_and_live_storages():
    g, _ = chain_graph()
    sim = simulate(g, g.program_order(), UnitCostModel())
    assert sim.breakdown[Category.WEIGHTS.value] == 400
    assert sim.breakdown[Category.INPUTS.value] == 400
    assert sum(sim.breakdown.values()) == sim.peak_bytes


def test_in_place_write_allocates_nothing():
    g = Graph()
    w = g.add_placeholder("w", f32(10), PlaceholderKind.WEIGHT)
    gr = g.add_placeholder("g", f32(10), PlaceholderKind.DATA)
    u = g.add_op("u", "aten.sub.Tensor", (Ref(w), Ref(gr)), outputs=(f32(10),), writes_into=Ref(w))
    g.set_outputs([Ref(u)])
    sim = simulate(g, g.program_order(), UnitCostModel())
    assert sim.peak_bytes == 80


def test_multi_output_storages_live_separately():
    g = Graph()
    x = g.add_placeholder("x", f32(4, 4), PlaceholderKind.DATA)
    vm = g.add_op("vm", "aten.var_mean.correction", (Ref(x), [0]), outputs=(f32(4), f32(4)))
    a = g.add_op("a", "aten.neg.default", (Ref(vm, 1),), outputs=(f32(4),))
    g.set_outputs([Ref(a)])
    sim = simulate(g, g.program_order(), UnitCostModel())
    # x 64 B resident; both outputs (16 B each) at vm; mean and a at the neg; var freed after vm.
    assert list(sim.timeline) == [64, 96, 96]


def test_order_changes_the_peak():
    # Two independent branches, each a large temporary reduced to a scalar: running a branch to
    # completion before starting the other halves the peak.
    g = Graph()
    x = g.add_placeholder("x", f32(1), PlaceholderKind.DATA)
    big1 = g.add_op("big1", "aten.expand_copy.default", (Ref(x), [1000]), outputs=(f32(1000),))
    big2 = g.add_op("big2", "aten.expand_copy.default", (Ref(x), [1000]), outputs=(f32(1000),))
    s1 = g.add_op("s1", "aten.sum.default", (Ref(big1),), outputs=(f32(),))
    s2 = g.add_op("s2", "aten.sum.default", (Ref(big2),), outputs=(f32(),))
    out = g.add_op("out", "aten.add.Tensor", (Ref(s1), Ref(s2)), outputs=(f32(),))
    g.set_outputs([Ref(out)])
    program = simulate(g, g.program_order(), UnitCostModel())
    better = simulate(g, [x, big1, s1, big2, s2, out], UnitCostModel())
    assert program.peak_bytes == 4 + 8000 + 4
    assert better.peak_bytes == 4 + 4000 + 4 + 4
    assert np.argmax(program.timeline) == program.peak_step


# --- incremental facts: a child's, derived from its parent's, equal a build from scratch ------

import random  # noqa: E402

import pytest  # noqa: E402

from magis.backend.meta_check import MetaChecker  # noqa: E402
from magis.capture import workload_step  # noqa: E402
from magis.cost import get_cost_model  # noqa: E402
from magis.ir import StorageMap  # noqa: E402
from magis.ir.collectives import comm_nodes  # noqa: E402
from magis.rules import RuleContext, candidates, fuzzed_rules  # noqa: E402
from magis.rules.catalog import FIRST_FUZZ_ROUND  # noqa: E402
from magis.schedule.random_graphs import random_topological_order  # noqa: E402
from magis.schedule.swaps import time_swaps  # noqa: E402
from magis.search.reschedule import reschedule  # noqa: E402
from magis.sim import derive_facts, node_scratch, node_times, tables, tensor_peak_bytes  # noqa: E402
from magis.sim.simulator import two_stream_makespan  # noqa: E402
from magis.sim.tables import _build, wait_predecessors  # noqa: E402

# every rule the fuzzer drew from its first round (the catalog's, `fuzzed_rules`)
RULES = fuzzed_rules(FIRST_FUZZ_ROUND)


def _pairs(t) -> list[tuple[int, int]]:
    return sorted(zip(t.reader_storage.tolist(), t.reader_node.tolist(), strict=True))


def _same_tables(a, b) -> None:
    assert list(a.storages) == list(b.storages)  # same rows in the same order
    for name in ("keys", "nbytes", "host_bytes", "producer", "is_output"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert _pairs(a) == _pairs(b)
    assert (a.resident_bytes, a.resident_by_kind) == (b.resident_bytes, b.resident_by_kind)
    assert (a.copy_nodes, a.comm_nodes) == (b.copy_nodes, b.comm_nodes)


def _waits_cover(derived, graph) -> None:
    """A derived wait table holds every node a fresh one does, each with its predecessors
    as the graph has them (extra nodes on the compute stream alone walk as a run would)."""
    fresh = wait_predecessors(graph, graph.copy_nodes() | comm_nodes(graph))
    assert set(fresh) <= set(derived)
    assert all(set(derived[n]) == set(graph.predecessors(n)) for n in derived)


def _same_sim(a, b) -> None:
    assert (a.peak_bytes, a.latency_s, a.peak_step) == (b.peak_bytes, b.latency_s, b.peak_step)
    assert (a.compute_s, a.copy_s, a.host_peak_bytes) == (b.compute_s, b.copy_s, b.host_peak_bytes)
    assert np.array_equal(a.timeline, b.timeline)
    assert sorted((h.storage, h.nbytes) for h in a.hotspots) == sorted(
        (h.storage, h.nbytes) for h in b.hotspots
    )


def _search_children(workload: str, rounds: int, seed: int):
    """(parent, its order, rewrite, child's restrided nodes) along a random line of rewrites
    from real rules, each child checked on fake tensors as the search does."""
    _, step = workload_step(workload)
    cost = get_cost_model("rtx3090")
    checker = MetaChecker()
    rng = random.Random(seed)
    graph, order = step.graph, list(step.graph.program_order())
    for _ in range(rounds):
        ctx = RuleContext(graph, tuple(order), simulate(graph, order, cost), hotspots_only=False)
        kept = []
        for rw in candidates(RULES, ctx):
            res = rw.build()
            report = checker.derive(res.graph, res.touched)
            if report.ok:
                yield graph, order, res, report.restrided
                kept.append(res)
        if not kept:
            return
        res = rng.choice(kept)
        order = reschedule(graph, order, res, cost)
        graph = res.graph


@pytest.mark.parametrize(
    "workload", ["bert-base:tiny", "resnet50:tiny", "gpt-neo-1.3b:tiny", "unet:tiny"]
)
def test_facts_derived_from_the_parent_equal_a_fresh_build(workload):
    """derive_facts (storages, tables, node times) on rewrites from every rule, along a random
    line of them: equal to what a build from scratch gives, and so is the simulation."""
    cost = get_cost_model("rtx3090")
    checked = 0
    for parent, order, res, restrided in _search_children(workload, rounds=3, seed=len(workload)):
        child = res.graph
        derive_facts(parent, child, res.added, res.changed | restrided, res.removed, cost)
        fresh = child.copy()  # no derived facts: every one built from scratch
        _same_tables(tables(child), _build(child))
        _waits_cover(tables(child).wait_preds, child)
        smap, full = child.storages(), StorageMap.build(fresh)
        assert smap.nbytes == full.nbytes and smap.base == full.base
        assert {s: set(r) for s, r in smap.readers.items()} == {
            s: set(r) for s, r in full.readers.items()
        }
        assert (smap.outputs, smap.host) == (full.outputs, full.host)
        ids = list(child.nodes)
        fresh_cost = get_cost_model("rtx3090")
        assert np.array_equal(node_times(child, cost)[ids], fresh_cost.node_times(fresh)[ids])
        child_order = reschedule(parent, order, res, cost)
        _same_sim(simulate(child, child_order, cost), simulate(fresh, child_order, fresh_cost))
        checked += 1
    assert checked >= 20


class _InputSizedScratch(type(get_cost_model("rtx3090"))):
    """rtx3090's times, and a scratch of each op equal to its inputs' bytes: a scratch that
    changes when an input's metadata does, as a real op's workspace does."""

    measures_scratch = True

    def scratch_bytes(self, graph, nid) -> int:
        if graph.node(nid).is_placeholder or graph.info(nid).is_view:
            return 0
        return sum(graph.meta(r).nbytes for r in graph.node(nid).inputs)


def test_scratch_derived_from_the_parent_equals_a_fresh_build():
    """A cost model that measures op scratch (`CostModel.node_scratch`): the child's scratch
    derived with its times equals a fresh build's, and so does the simulation that adds it."""
    cost = _InputSizedScratch(get_cost_model("rtx3090").hardware)
    checked = 0
    for parent, order, res, restrided in _search_children("unet:tiny", rounds=2, seed=7):
        child = res.graph
        derive_facts(parent, child, res.added, res.changed | restrided, res.removed, cost)
        fresh, fresh_cost = child.copy(), _InputSizedScratch(cost.hardware)
        ids = list(child.nodes)
        assert np.array_equal(node_scratch(child, cost)[ids], fresh_cost.node_scratch(fresh)[ids])
        child_order = reschedule(parent, order, res, cost)
        derived = simulate(child, child_order, cost)
        _same_sim(derived, simulate(fresh, child_order, fresh_cost))
        assert derived.peak_bytes >= tensor_peak_bytes(child, child_order)
        checked += 1
    assert checked >= 10


def _makespan_node_by_node(graph, order, times, copies) -> float:
    """The two-stream walk, one node at a time (the reference)."""
    finish: dict[int, float] = {}
    compute_free = copy_free = issued = 0.0
    for nid in order:
        ready = max((finish[p] for p in graph.predecessors(nid)), default=0.0)
        if nid in copies:
            start = max(ready, copy_free, issued)
            finish[nid] = copy_free = start + float(times[nid])
        else:
            start = issued = max(ready, compute_free)
            finish[nid] = compute_free = start + float(times[nid])
    return max(finish.values(), default=0.0)


def test_two_stream_makespan_equals_the_node_by_node_walk():
    """Swapped graphs (Store/Load on the copy stream), in the search's order and in random
    topological orders: the run-by-run makespan is the node-by-node one, to the last bit."""
    cost = get_cost_model("rtx3090")
    rng = random.Random(0)
    swapped = 0
    for parent, order, res, _ in _search_children("bert-base:tiny", rounds=2, seed=1):
        child = res.graph
        copies = child.copy_nodes()
        if not copies:
            continue
        swapped += 1
        times = cost.node_times(child)
        orders = [time_swaps(child, reschedule(parent, order, res, cost), cost)]
        orders += [random_topological_order(child, rng) for _ in range(3)]
        derive_facts(parent, child, res.added, res.changed, res.removed)
        for o in orders:
            ids = np.asarray(o, dtype=np.int64)
            expected = _makespan_node_by_node(child, o, times, copies)
            assert two_stream_makespan(child, ids, times, copies) == expected
            derived_waits = tables(child).wait_preds  # the parent's, re-asked where it changed
            assert two_stream_makespan(child, ids, times, copies, waits=derived_waits) == expected
    assert swapped >= 3
