"""Re-ordering (MAGIS §5.2, §6.1, Alg. 2): the DP is optimal, every schedule is a topological
order, narrow waists, incremental scheduling."""

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from magis.bench.incremental import run_incremental_bench
from magis.cost import UnitCostModel
from magis.ir import Graph, PlaceholderKind, Ref, TensorMeta
from magis.schedule import (
    Scheduler,
    UnknownSchedulerError,
    incremental_schedule,
    nw_values,
    peak_lower_bound,
    problem_of,
    schedule,
)
from magis.schedule.dp import dp_schedule
from magis.schedule.incremental import extend_bound
from magis.schedule.memo import DpMemo
from magis.schedule.random_graphs import (
    NasnetShape,
    RewriteKind,
    nasnet_dag,
    random_dag,
    random_rewrite,
)
from magis.schedule.segment import segment_problems
from magis.sim import simulate


def f32(*shape):
    return TensorMeta(tuple(shape), "float32", 4)


def brute_force_peak(g: Graph) -> int:
    """The least peak over all topological orders, straight from the storage map (no units, no
    pruning): min over ready v of max(step(S, v), best(S + v)) over every set S of nodes run."""
    smap = g.storages()
    nodes = list(g.nodes)
    bit = {n: i for i, n in enumerate(nodes)}
    preds = [sum(1 << bit[p] for p in g.predecessors(n)) for n in nodes]
    stores = [
        (smap.nbytes[s], bit[s.node], sum(1 << bit[r] for r in smap.readers[s]), s in smap.outputs)
        for s in smap.nbytes
        if s not in smap.resident
    ]
    alloc = [sum(b for b, p, _, _ in stores if p == i) for i in range(len(nodes))]
    full = (1 << len(nodes)) - 1

    @functools.cache
    def best(done: int) -> int:
        if done == full:
            return 0
        live = sum(b for b, p, readers, out in stores if done >> p & 1 and (out or readers & ~done))
        return min(
            max(live + alloc[v], best(done | 1 << v))
            for v in range(len(nodes))
            if not done >> v & 1 and not preds[v] & ~done
        )

    return sum(smap.nbytes[s] for s in smap.resident) + best(0)


def small_dag(seed: int) -> Graph:
    rng = np.random.default_rng(seed)
    updates = int(rng.integers(0, 3))
    inputs = int(rng.integers(1, 3))
    ops = int(rng.integers(3, 15 - inputs - max(updates, 1) - updates))
    return random_dag(rng, ops, n_inputs=inputs, n_updates=updates, p_view=0.25, p_multi=0.15)


def test_dp_is_optimal_on_200_random_dags():
    for seed in range(200):
        g = small_dag(seed)
        assert len(g) <= 14
        best = brute_force_peak(g)
        res = schedule(g, Scheduler.DP, check=True)
        assert res.peak_bytes == best, f"seed {seed}"
        assert peak_lower_bound(g) <= best
        assert res.exact_segments == len(res.segments)
        assert simulate(g, res.order, UnitCostModel()).peak_bytes == best


def test_dp_without_upper_bound_is_optimal_and_claims_the_simulated_peak():
    for seed in range(200, 260):
        g = small_dag(seed)
        p = problem_of(g)
        (seg,) = segment_problems(p, [list(range(p.n))])
        res = dp_schedule(seg)
        order = p.full_order([seg.units[i] for i in res.order])
        assert res.exact and g.is_valid_schedule(order)
        assert res.peak + p.resident == simulate(g, order, UnitCostModel()).peak_bytes
        assert res.peak + p.resident == brute_force_peak(g)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    ops=st.integers(1, 80),
    updates=st.integers(0, 4),
    budget=st.sampled_from([0, 50, 20_000]),
)
def test_every_schedule_is_a_topological_order(seed, ops, updates, budget):
    rng = np.random.default_rng(seed)
    g = random_dag(rng, ops, n_updates=updates, p_view=0.2, p_multi=0.1, p_swap=0.05, p_random=0.1)
    draws = [n for n in g.topological_order() if g.node(n).op == "aten.bernoulli.default"]
    for kind in Scheduler:
        res = schedule(g, kind, budget=budget, check=True)  # asserts validity and the peak
        assert g.is_valid_schedule(list(res.order))
        assert [n for n in res.order if n in draws] == draws  # the RNG is drawn in order
    program = schedule(g, Scheduler.PROGRAM).peak_bytes
    assert schedule(g, Scheduler.DP, budget=budget).peak_bytes <= max(program, 0) or budget < 50


def test_random_ops_keep_their_program_order():
    """Two dropout masks: the DP would rather draw the second first (reduced at once, it never
    meets the first), but swapping them swaps the numbers each draws."""
    g = Graph()
    x = g.add_placeholder("x", f32(10), PlaceholderKind.DATA)
    first = g.add_op("first", "aten.bernoulli.default", (Ref(x),), outputs=(f32(1000),))
    second = g.add_op("second", "aten.bernoulli.default", (Ref(x),), outputs=(f32(500),))
    reduced = g.add_op("reduced", "aten.sum.default", (Ref(second),), outputs=(f32(),))
    out = g.add_op("out", "aten.mul.Tensor", (Ref(first), Ref(reduced)), outputs=(f32(),))
    g.set_outputs([Ref(out)])
    res = schedule(g, Scheduler.DP, check=True)
    assert res.order.index(first) < res.order.index(second)
    assert res.peak_bytes == 40 + 4000 + 2000 + 4  # at `reduced`; swapped it would be 4048


def test_nw_values_on_a_hand_graph():
    """a -> {b, c} -> d -> e, with f hanging off b: nw = |V| - |anc| - |des| - 1 on units."""
    g = Graph()
    x = g.add_placeholder("x", f32(4), PlaceholderKind.DATA)
    a = g.add_op("a", "aten.relu.default", (Ref(x),), outputs=(f32(4),))
    b = g.add_op("b", "aten.relu.default", (Ref(a),), outputs=(f32(4),))
    c = g.add_op("c", "aten.relu.default", (Ref(a),), outputs=(f32(4),))
    d = g.add_op("d", "aten.add.Tensor", (Ref(b), Ref(c)), outputs=(f32(4),))
    e = g.add_op("e", "aten.relu.default", (Ref(d),), outputs=(f32(4),))
    f = g.add_op("f", "aten.relu.default", (Ref(b),), outputs=(f32(4),))
    g.set_outputs([Ref(e), Ref(f)])
    p = problem_of(g)
    nw = {p.members[u][0]: w for u, w in nw_values(p, range(p.n)).items()}
    # a: everything after it -> 0; b: c independent -> 1; c: b, f -> 2; d: f -> 1; e: f -> 1;
    # f: c, d, e -> 3. The placeholder is in the prologue, not a unit.
    assert nw == {a: 0, b: 1, c: 2, d: 1, e: 1, f: 3}


def test_views_fold_into_their_producer_and_placeholders_into_the_prologue():
    g = Graph()
    w = g.add_placeholder("w", f32(4, 4), PlaceholderKind.WEIGHT)
    t = g.add_op("t", "aten.t.default", (Ref(w),), outputs=(f32(4, 4),))
    a = g.add_op("a", "aten.mm.default", (Ref(t), Ref(w)), outputs=(f32(4, 4),))
    v = g.add_op("v", "aten.view.default", (Ref(a), [16]), outputs=(f32(16),))
    s = g.add_op("s", "aten.sum.default", (Ref(v),), outputs=(f32(),))
    g.set_outputs([Ref(s)])
    p = problem_of(g)
    assert p.prologue == (w, t)
    assert p.members == ((a, v), (s,))


def test_unknown_scheduler_is_a_user_error():
    g = random_dag(np.random.default_rng(0), 4)
    with pytest.raises(UnknownSchedulerError, match="choose one of program, dp"):
        schedule(g, "serenity")


def test_schedule_of_a_captured_training_step(mlp_step_factory):
    for optimizer in ("sgd", "adam"):
        g = mlp_step_factory(optimizer).graph
        program = schedule(g, Scheduler.PROGRAM, check=True)
        dp = schedule(g, Scheduler.DP, check=True)
        assert g.is_valid_schedule(list(dp.order))
        assert dp.peak_bytes <= program.peak_bytes


# --- incremental scheduling (Alg. 2) -----------------------------------------------------------


def test_extend_bound_walks_while_nw_falls_with_the_papers_constants():
    psi = list(range(30))
    # from position 0 outward: 50, 30, 12, 9, 11 -> stops after 9 (a waist <= 10, next >= 4)
    nw = dict(enumerate([50, 30, 12, 9, 11, *[1] * 25]))
    assert extend_bound(psi, nw, 0, 1) == 4
    # tight waists keep it going: 5, 3, 2, 1, 0 all below 4, and it stops at the rise
    nw = dict(enumerate([5, 3, 2, 1, 0, 7, *[0] * 24]))
    assert extend_bound(psi, nw, 0, 1) == 5
    # at most 20 steps
    nw = {i: 100 - i for i in range(30)}
    assert extend_bound(psi, nw, 0, 1) == 20
    assert extend_bound(psi, nw, 29, -1) == 28  # rising that way: one step


def test_incremental_on_an_unchanged_graph_equals_full_scheduling():
    rng = np.random.default_rng(1)
    for _ in range(3):
        g = nasnet_dag(rng, NasnetShape(cells=4))
        full = schedule(g, Scheduler.DP, check=True)
        some = list(g.ops())[:: max(1, len(g) // 5)]
        for node in some:
            inc = incremental_schedule(g, full.order, g.copy(), {node}, check=True)
            assert inc.peak_bytes == full.peak_bytes
            lo, hi = inc.interval
            assert 0 <= lo <= hi


def test_incremental_after_random_rewrites_is_valid_and_close_to_full():
    rng = np.random.default_rng(2)
    g = nasnet_dag(rng, NasnetShape(cells=5))
    order = schedule(g, Scheduler.DP).order
    memo = DpMemo()
    for _ in range(8):
        rewrite = random_rewrite(g, rng)
        assert rewrite is not None
        new = rewrite.graph
        inc = incremental_schedule(g, order, new, rewrite.changed, check=True, memo=memo)
        full = schedule(new.copy(), Scheduler.DP, check=True)
        assert inc.peak_bytes <= 1.05 * full.peak_bytes
        assert inc.rescheduled < len(problem_of(new).members)
        g, order = new, inc.order


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), ops=st.integers(2, 40), updates=st.integers(0, 3))
def test_incremental_orders_are_topological_after_any_rewrite(seed, ops, updates):
    rng = np.random.default_rng(seed)
    g = random_dag(rng, ops, n_updates=updates, p_view=0.2, p_multi=0.1)
    order = schedule(g, Scheduler.DP).order
    rewrite = random_rewrite(g, rng)
    if rewrite is None:
        return
    inc = incremental_schedule(g, order, rewrite.graph, rewrite.changed, check=True)
    assert rewrite.graph.is_valid_schedule(list(inc.order))


def test_rewrites_keep_graphs_valid_and_say_what_they_touched():
    rng = np.random.default_rng(3)
    g = nasnet_dag(rng, NasnetShape(cells=3))
    kinds = set()
    for _ in range(20):
        rewrite = random_rewrite(g, rng)
        rewrite.graph.verify()
        assert rewrite.changed and rewrite.changed <= set(g.nodes)
        kinds.add(rewrite.kind)
        g = rewrite.graph
    assert kinds == set(RewriteKind)


def test_bench_incremental_reports_the_fields_of_the_issue():
    rep = run_incremental_bench(dags=1, rounds=2, seed=0, repeats=1)
    data = rep.to_json()
    for key in ("cases", "mean_speedup", "min_speedup", "max_speedup", "equal_quality"):
        assert key in data
    assert len(data["cases"]) == 2
    assert data["min_speedup"] <= data["mean_speedup"] <= data["max_speedup"]
    assert sum(data["speedup_histogram"].values()) == 2
    assert 0 <= data["equal_quality"] <= 2 and data["worst_quality_ratio"] > 0


def test_the_scheduler_places_a_weight_update_where_it_lowers_the_peak():
    """ROAM §IV-A: the gradient (400 B) dies when its update runs. Captured order runs the update
    after the large activation (4000 B), so both are live; the DP runs it before."""
    g = Graph()
    x = g.add_placeholder("x", f32(10), PlaceholderKind.DATA)  # 40 B resident
    w = g.add_placeholder("w", f32(100), PlaceholderKind.WEIGHT)  # 400 B resident
    grad = g.add_op("grad", "aten.mul.Tensor", (Ref(x), Ref(w)), outputs=(f32(100),))
    big = g.add_op("big", "aten.relu.default", (Ref(x),), outputs=(f32(1000),))
    loss = g.add_op("loss", "aten.sum.default", (Ref(big),), outputs=(f32(),))
    upd = g.add_op(
        "upd", "aten.sub.Tensor", (Ref(w), Ref(grad)), outputs=(f32(100),), writes_into=Ref(w)
    )
    g.add_control_dep(grad, upd)  # grad read the old weight
    g.set_outputs([Ref(loss)])
    program = schedule(g, Scheduler.PROGRAM, check=True)
    dp = schedule(g, Scheduler.DP, check=True)
    assert program.peak_bytes == 440 + 400 + 4000 + 4  # grad, big and loss at loss's step
    assert dp.peak_bytes == 440 + 4000 + 4
    assert dp.order.index(upd) < dp.order.index(big)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    ops=st.integers(1, 400),
    tau=st.integers(0, 40),
    block=st.sampled_from([1, 5, 64, 1024]),
    windowed=st.booleans(),
)
def test_peeling_and_cutting_count_nw_among_the_core_as_defined(seed, ops, tau, block, windowed):
    """The word-wise counts of `window_above` and `cut_segments` against nw's definition, on
    random cores of random DAGs of up to 400 units (bitsets of several 64-bit words), counted
    in row blocks of several sizes (a block reads only the words its rows' sets can hold).
    `windowed`: the core lies within a window of the units, as a segment does (only the
    words of the window are read)."""
    from magis.schedule import narrow_waist

    saved, narrow_waist.ROW_BLOCK = narrow_waist.ROW_BLOCK, block
    try:
        _check_core_counts(seed, ops, tau, windowed)
    finally:
        narrow_waist.ROW_BLOCK = saved


def _check_core_counts(seed, ops, tau, windowed=False):
    from magis.schedule.narrow_waist import bits, closure, core_nw, cut_segments, window_above

    rng = np.random.default_rng(seed)
    p = problem_of(random_dag(rng, ops, p_view=0.2, p_multi=0.1))
    if p.n == 0:  # a one-op DAG whose op allocates nothing is all prologue: no unit to count
        return
    clo = closure(p, range(p.n))
    lo, hi = sorted(rng.integers(0, p.n, 2)) if windowed else (0, p.n - 1)
    core = sum(1 << i for i in range(lo, hi + 1) if rng.random() < 0.8)
    members = bits(core)
    assert members == [i for i in range(p.n) if core >> i & 1]

    def nw(i):
        inside = (clo.anc[i] & core).bit_count() + (clo.des[i] & core).bit_count()
        return len(members) - inside - 1

    assert core_nw(clo, core, np.asarray(members, dtype=np.int64)).tolist() == [
        nw(i) for i in members
    ]
    assert window_above(clo, core, tau) == sum(1 << i for i in members if nw(i) > tau)
    seg, cuts = cut_segments(clo, core)
    cut_bits = [i for i in members if nw(i) <= 1]
    assert cuts == [clo.units[i] for i in cut_bits]
    rank = {i: k + 1 for k, i in enumerate(cut_bits)}
    for i in members:
        latest = max((j for j in cut_bits if clo.anc[i] >> j & 1), default=None)
        expect = rank[i] if i in rank else rank.get(latest, 0)
        assert seg[clo.units[i]] == expect


def _greedy_by_masks(seg, key):
    """List scheduling as the module docstring defines it, on the segment's bitmasks: a
    storage is freed by a reader once its other readers (`frees` masks) have run."""
    done, live, peak, order = 0, seg.live_in, seg.live_in, []
    ready = [i for i in range(seg.m) if not seg.pred_mask[i]]
    while ready:
        scored = []
        for i in sorted(ready):
            freed = sum(b for mask, b in seg.frees[i] if not mask & ~done)
            growth, step = seg.kept[i] - freed, live + seg.alloc[i]
            if growth <= 0 and step <= peak:
                scored = [((), i, freed)]
                break
            scored.append((key(growth, step, i), i, freed))
        _, i, freed = min(scored)
        peak, live = max(peak, live + seg.alloc[i]), live + seg.kept[i] - freed
        done |= 1 << i
        order.append(i)
        ready = [j for j in range(seg.m) if not done >> j & 1 and not seg.pred_mask[j] & ~done]
    return tuple(order), peak


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), ops=st.integers(1, 120), updates=st.integers(0, 3))
def test_list_scheduling_frees_what_the_masks_define_and_reports_its_peak(seed, ops, updates):
    """The greedy's reader counts against the masks' definition, with both keys, on whole
    random DAGs and on the segments of a split of them (storages that escape a segment)."""
    from magis.schedule.heuristic import KEYS, greedy

    rng = np.random.default_rng(seed)
    p = problem_of(random_dag(rng, ops, n_updates=updates, p_view=0.2, p_multi=0.15))
    cut = int(rng.integers(0, p.n + 1))
    for seg in segment_problems(p, [list(range(cut)), list(range(cut, p.n))]):
        for key in KEYS:
            res = greedy(seg, key)
            assert (res.order, res.peak) == _greedy_by_masks(seg, key)
            assert sorted(res.order) == list(range(seg.m))
            assert res.peak == seg.peak_of(res.order)
