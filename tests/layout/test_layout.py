"""Memory layout (ROAM §IV-B, §IV-C): tensors alive together never overlap, the exact method is
never worse than LLFB, and a plan runs inside one arena of exactly the planned size."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from magis.backend import compile_program, measure, verify
from magis.backend.arena import arena_out, compile_arena_program
from magis.capture import WORKLOAD_FAMILIES, capture, workload_step
from magis.ir import Graph, PlaceholderKind, Ref, TensorMeta
from magis.ir.ops import resolve_overload
from magis.layout import (
    ALIGNMENT,
    LayoutMethod,
    LayoutOptions,
    LayoutOverlapError,
    UnknownLayoutMethodError,
    check_layout,
    find_overlap,
    from_arrays,
    layout_lifetimes,
    lifetimes,
    plan_layout,
)
from magis.layout.check import overlapping_pairs_bruteforce
from magis.layout.tree import build_tree

FAST = LayoutOptions(time_limit=0.5, budget=5.0)  # limits that keep the tests quick


# --- random instances --------------------------------------------------------------------------


@st.composite
def interval_sets(draw, max_n: int = 60):
    n = draw(st.integers(1, max_n))
    steps = draw(st.integers(1, 40))
    starts = draw(st.lists(st.integers(0, steps - 1), min_size=n, max_size=n))
    lengths = draw(st.lists(st.integers(0, steps), min_size=n, max_size=n))
    sizes = draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n))
    ends = [min(s + ln, steps - 1) for s, ln in zip(starts, lengths, strict=True)]
    return from_arrays(sizes, starts, ends, steps)


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(t.shape), "float64", 8)


def random_graph(seed: int, n_ops: int = 40) -> Graph:
    """An executable random DAG of float64 vectors: elementwise ops, cat (new sizes), views,
    a multi-output op, and in-place updates of weights ordered after their readers."""
    rng = np.random.default_rng(seed)
    g = Graph()
    values: list[Ref] = []
    shapes: dict[Ref, tuple[int, ...]] = {}
    for i in range(3):
        kind = PlaceholderKind.DATA if i < 2 else PlaceholderKind.WEIGHT
        n = int(rng.integers(1, 40))
        ref = Ref(g.add_placeholder(f"x{i}", TensorMeta((n,), "float64", 8), kind))
        values.append(ref)
        shapes[ref] = (n,)
    for i in range(n_ops):
        op, args = _random_call(rng, values, shapes)
        metas = [torch.empty(shapes[a], dtype=torch.float64, device="meta") for a in _refs(args)]
        out = resolve_overload(op)(*_substitute(args, iter(metas)))
        outs = out if isinstance(out, tuple) else (out,)
        nid = g.add_op(f"op{i}", op, args, outputs=tuple(_meta(t) for t in outs))
        for k, t in enumerate(outs):
            values.append(Ref(nid, k))
            shapes[Ref(nid, k)] = tuple(t.shape)
    _add_update(g, rng, values, shapes)
    sinks = [n for n in g.ops() if not g.users(n) and g.node(n).writes_into is None]
    g.set_outputs([Ref(s) for s in sinks[-2:]])
    g.verify()
    return g


def _random_call(rng, values, shapes):
    pool = values[-6:] if rng.random() < 0.7 else values
    x = pool[int(rng.integers(len(pool)))]
    same = [v for v in values if shapes[v] == shapes[x] and v != x]
    kind = int(rng.integers(6))
    if kind == 0:
        return "aten.view.default", (x, [-1])
    if kind == 1 and shapes[x]:
        return "aten.var_mean.correction", (x, [0])
    if kind == 2 and same:
        return "aten.add.Tensor", (x, same[int(rng.integers(len(same)))])
    if kind == 3 and len(shapes[x]) == 1:
        vecs = [v for v in pool if len(shapes[v]) == 1]
        picks = [vecs[int(i)] for i in rng.choice(len(vecs), size=min(2, len(vecs)))]
        return "aten.cat.default", ([x, *picks], 0)
    if kind == 4:
        return "aten.mul.Tensor", (x, x)
    return "aten.relu.default", (x,)


def _refs(args):
    for a in args:
        if isinstance(a, Ref):
            yield a
        elif isinstance(a, list):
            yield from (v for v in a if isinstance(v, Ref))


def _substitute(args, metas):
    return tuple(
        next(metas) if isinstance(a, Ref) else [next(metas) for _ in a] if _is_refs(a) else a
        for a in args
    )


def _is_refs(a) -> bool:
    return isinstance(a, list) and bool(a) and all(isinstance(v, Ref) for v in a)


def _add_update(g: Graph, rng, values, shapes) -> None:
    (w,) = g.placeholders(PlaceholderKind.WEIGHT)
    fits = [v for v in values if v.node != w and shapes[v] in (shapes[Ref(w)], ())]
    if not fits:
        return
    src = fits[int(rng.integers(len(fits)))]
    readers = list(g.storages().readers[Ref(w)])
    upd = g.add_op(
        "update", "aten.sub.Tensor", (Ref(w), src), outputs=(g.meta(Ref(w)),), writes_into=Ref(w)
    )
    for r in readers:
        g.add_control_dep(r, upd)


def random_order(g: Graph, seed: int) -> list[int]:
    """A random topological order (the layout must hold for any schedule, not just one)."""
    rng = np.random.default_rng(seed)
    indeg = {n: len(set(g.predecessors(n))) for n in g.nodes}
    ready = sorted(n for n, d in indeg.items() if d == 0)
    order = []
    while ready:
        n = ready.pop(int(rng.integers(len(ready))))
        order.append(n)
        for s in set(g.successors(n)):
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    assert g.is_valid_schedule(order)
    return order


# --- the checker -------------------------------------------------------------------------------


def test_checker_catches_a_planted_overlap():
    lt = from_arrays([128, 128, 64], [0, 2, 5], [3, 6, 9], 10)
    assert find_overlap([0, 128, 0], lt.size, lt.start, lt.end) is None
    hit = find_overlap([0, 64, 0], lt.size, lt.start, lt.end)  # 0 and 1 share steps 2-3
    assert hit is not None and {hit.first, hit.second} == {0, 1}
    layout = layout_lifetimes(lt, "llfb")
    check_layout(layout)
    bad = type(layout)(**{**layout.__dict__, "offsets": np.array([0, 64, 0])})
    with pytest.raises(LayoutOverlapError, match="overlap"):
        check_layout(bad)


def test_checker_treats_lifetimes_as_inclusive_and_empty_slots_as_nothing():
    lt = from_arrays([64, 64, 0], [0, 3, 0], [3, 5, 9], 10)  # 0 ends where 1 starts
    assert find_overlap([0, 0, 0], lt.size, lt.start, lt.end) is not None
    lt = from_arrays([64, 64, 0], [0, 4, 0], [3, 5, 9], 10)
    assert find_overlap([0, 0, 0], lt.size, lt.start, lt.end) is None


@settings(max_examples=150, deadline=None)
@given(interval_sets(), st.integers(0, 2**31))
def test_checker_agrees_with_all_pairs(lt, seed):
    rng = np.random.default_rng(seed)
    offsets = rng.integers(0, 4, size=len(lt)) * 2048
    expected = overlapping_pairs_bruteforce(offsets, lt.size, lt.start, lt.end)
    hit = find_overlap(offsets, lt.size, lt.start, lt.end)
    assert (hit is None) == (not expected)
    if hit is not None:
        assert tuple(sorted((hit.first, hit.second))) in expected


def test_checker_passes_a_valid_layout_and_finds_one_moved_storage_among_ten_thousand():
    """The sweep on 10k storages: LLFB's layout passes; the same layout with one storage moved
    onto a neighbour alive at the same time is refused, naming that pair."""
    rng = np.random.default_rng(0)
    n = 10_000
    start = rng.integers(0, 20_000, n)
    lt = from_arrays(rng.integers(1, 10**6, n), start, start + rng.integers(0, 300, n), 20_300)
    layout = layout_lifetimes(lt, "llfb")
    check_layout(layout)  # LLFB on 10k storages is the slow part; the sweep takes milliseconds
    # Two storages alive together: put the second at the first's offset.
    a, b = next(
        (i, j)
        for i in range(n)
        for j in range(i + 1, min(i + 50, n))
        if lt.start[i] <= lt.end[j] and lt.start[j] <= lt.end[i]
    )
    moved = layout.offsets.copy()
    moved[b] = moved[a]
    overlap = find_overlap(moved, lt.size, lt.start, lt.end)
    assert overlap is not None and {overlap.first, overlap.second} == {a, b}
    with pytest.raises(LayoutOverlapError):
        check_layout(dataclasses.replace(layout, offsets=moved))


# --- layouts on random instances ---------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(interval_sets())
def test_layouts_never_overlap_and_exact_is_never_worse(lt):
    base = layout_lifetimes(lt, "llfb")
    best = layout_lifetimes(lt, "exact", options=FAST)
    for layout in (base, best):
        check_layout(layout)
        assert np.all(layout.offsets % ALIGNMENT == 0)
        assert layout.arena_bytes >= lt.aligned_peak >= lt.theoretical_peak
    assert best.arena_bytes <= base.arena_bytes == best.llfb_arena_bytes


@pytest.mark.parametrize("seed", range(6))
def test_layouts_of_random_graphs_in_random_orders(seed):
    g = random_graph(seed)
    for order in (g.program_order(), random_order(g, seed)):
        for method in LayoutMethod:
            layout = plan_layout(g, order, method, options=FAST)
            check_layout(layout)
            assert layout.fragmentation >= 0


@pytest.mark.parametrize("seed", range(4))
def test_random_graphs_run_in_their_arena(seed):
    g = random_graph(seed, n_ops=30)
    order = random_order(g, seed)
    layout = plan_layout(g, order, options=FAST)
    arena = compile_arena_program(g, order, layout)
    plain = compile_program(g, order)
    rng = torch.Generator().manual_seed(seed)
    inputs = [
        torch.randn(g.meta(Ref(p)).shape, generator=rng, dtype=torch.float64)
        for p in g.placeholders()
    ]
    expected_in, actual_in = [t.clone() for t in inputs], [t.clone() for t in inputs]
    expected, actual = plain(*expected_in), arena(*actual_in)
    for a, e in zip([*actual, *actual_in], [*expected, *expected_in], strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert arena.copied_ops == ()


# --- the subgraph tree -------------------------------------------------------------------------


def test_tree_pieces_partition_the_storages_in_time_order():
    _, step = workload_step("bert-base:tiny", dtype=torch.float64)
    lt = lifetimes(step.graph, step.graph.program_order())
    tree = build_tree(lt, piece_limit=20)
    leaves = tree.leaves()
    assert len(leaves) > 1 and all(len(leaf.storages) <= 20 for leaf in leaves)
    owned = np.sort(np.concatenate([leaf.storages for leaf in leaves]))
    assert np.array_equal(owned, np.arange(len(lt)))  # each storage in exactly one piece
    for leaf in leaves:  # a storage belongs to the piece it is created in
        assert np.all((lt.start[leaf.storages] >= leaf.lo) & (lt.start[leaf.storages] < leaf.hi))
    assert [leaf.lo for leaf in leaves] == sorted(leaf.lo for leaf in leaves)


def test_unknown_method_is_a_one_line_error():
    with pytest.raises(UnknownLayoutMethodError, match="llfb, exact"):
        plan_layout(capture(lambda a: a.relu().sum(), torch.randn(3)).graph, method="ilp")


# --- arena execution ---------------------------------------------------------------------------


def test_out_overloads_match_types_and_drop_tensor_options():
    assert arena_out("aten.add.Tensor").target == "aten.add.out"  # not add.Scalar_out
    assert arena_out("aten.threshold_backward.default").out_names == ("grad_input",)
    assert arena_out("aten.native_layer_norm.default").out_names == ("out0", "out1", "out2")
    assert arena_out("aten.empty_like.default").dropped == {
        "dtype",
        "layout",
        "device",
        "pin_memory",
    }


def test_arena_source_writes_every_allocation_into_the_arena():
    step = capture(lambda a, b: ((a @ b).relu() + a).sum(), torch.randn(3, 3), torch.randn(3, 3))
    g = step.graph
    layout = plan_layout(g)
    source = compile_arena_program(g, g.program_order(), layout).source
    assert f"arena = torch.empty({layout.arena_bytes}, dtype=torch.uint8, device=device)" in source
    assert "mm = aten.mm.out(arg0, arg1, out=arena[" in source
    assert source.count("out=arena[") == 4


@pytest.mark.parametrize("family", WORKLOAD_FAMILIES)
def test_tiny_workload_runs_in_an_arena_of_the_planned_size(family):
    _, step = workload_step(f"{family}:tiny", dtype=torch.float64)
    g = step.graph
    order = g.program_order()
    layout = plan_layout(g, order, options=FAST)
    check_layout(layout)
    program = compile_arena_program(g, order, layout)
    inputs = step.make_inputs()
    check = verify(step, program.program, inputs)
    assert check.verified, f"{check.worst} differs by {check.max_rel_err:.2e}"
    measured = measure(program.program, step.program_inputs(inputs), repeats=1, warmup=0)
    live = measured.peak_bytes - measured.resident_bytes
    assert layout.arena_bytes <= live <= layout.arena_bytes + program.transient_bytes


def test_an_optimized_plan_runs_in_its_arena():
    # Plans carry fission slices, re-computation and Store/Load: all of it must fit the arena.
    from magis import optimize

    _, step = workload_step("gpt-neo-1.3b:tiny", float64_when_tiny=True)
    plan = optimize(step, mem_limit=0.6, time_budget=4)
    layout = plan_layout(plan.graph, plan.order, options=FAST)
    check_layout(layout)
    program = compile_arena_program(plan.graph, plan.order, layout)
    inputs = step.make_inputs()
    check = verify(step, program.program, inputs)
    assert check.verified, f"{check.worst} differs by {check.max_rel_err:.2e}"
