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
