"""TASO rules, checked the TASO way: the rewritten program on random inputs equals eager PyTorch."""

from dataclasses import replace

import pytest
import rustworkx as rx
import torch

from magis.backend import compile_program, verify
from magis.capture import capture, training_step, workload_step
from magis.cost import get_cost_model
from magis.ir.topological import place_after_inputs
from magis.rules import RuleContext
from magis.rules.compact import DECOMPACT
from magis.rules.taso import (
    EXPAND,
    FACTOR,
    FOLD_SLICE_OF_CAT,
    MERGE_CONV_BACKWARD,
    MERGE_CONV_OUTPUT,
    MERGE_MATMUL,
    MERGE_WGRADS_OF_CAT,
    SPLIT_CONV_BACKWARD,
    SPLIT_CONV_OUTPUT,
    SPLIT_MATMUL,
    SPLIT_MATMUL_OF_CAT,
    SPLIT_WGRAD_OF_CAT,
)
from magis.rules.taso.matmul import parallel_groups
from magis.search.hashing import wl_hash, wl_hash_incremental
from magis.sim import simulate


def _ctx(graph, order):
    order = graph.program_order() if order is None else order
    return RuleContext(graph, tuple(order), simulate(graph, order, get_cost_model("unit")))


def _apply_and_verify(step, rule, order=None, expect_at_least=1):
    graph = step.graph
    order = list(order or graph.program_order())
    rewrites = list(rule.match(_ctx(graph, order)))
    assert len(rewrites) >= expect_at_least, f"{rule.name} matched nothing"
    results = []
    for rw in rewrites:
        res = rw.build()
        res.graph.verify()
        new_order = place_after_inputs(res.graph, order, res.added)
        assert res.graph.is_valid_schedule(new_order), rw.description
        check = verify(step, compile_program(res.graph, new_order), step.make_inputs())
        assert check.verified, f"{rw.description}: {check.worst} off by {check.max_rel_err:.1e}"
        incremental = wl_hash_incremental(
            wl_hash(graph), graph, res.graph, res.touched, res.removed
        )
        assert incremental.value == wl_hash(res.graph).value
        results.append((res, new_order))
    return results


@pytest.fixture(scope="module")
def bert_tiny():
    return workload_step("bert-base:tiny", dtype=torch.float64)[1]


def test_merge_parallel_matmuls_and_split_back(bert_tiny):
    merged = _apply_and_verify(bert_tiny, MERGE_MATMUL, expect_at_least=2)
    qkv = [
        r
        for r, _ in merged
        if any(bert_tiny.graph.node(n).op == "aten.addmm.default" for n in r.removed)
    ]
    assert qkv, "the QKV projections were not merged"
    for res, order in merged[:3]:
        sub = type(bert_tiny)(
            res.graph,
            bert_tiny.fn,
            bert_tiny.input_names,
            bert_tiny.input_kinds,
            bert_tiny.output_names,
            bert_tiny.example_inputs,
            bert_tiny.constants,
        )
        back = _apply_and_verify(sub, SPLIT_MATMUL, order)
        assert (
            any(wl_hash(b.graph).value == wl_hash(bert_tiny.graph).value for b, _ in back) or back
        )


def test_fold_slice_of_cat():
    step = capture(
        lambda a, b: torch.cat([a, b], 1)[:, 3:5] * 2,
        torch.randn(4, 3, dtype=torch.float64),
        torch.randn(4, 2, dtype=torch.float64),
    )
    ((res, _),) = _apply_and_verify(step, FOLD_SLICE_OF_CAT)
    assert not any(res.graph.node(n).op == "aten.slice.Tensor" for n in res.graph.ops())


def test_a_cat_along_its_default_dimension_is_read_by_the_cat_rules():
    """`torch.cat(tensors)` is captured without its dimension (0, the default): the rules that
    read a cat's dimension (a data-parallel gradient bucket met `merge_wgrads_of_cat` so and
    raised IndexError) read the default, and a slice of it still folds."""
    step = capture(
        lambda a, b: torch.cat([a, b])[4:6] * 2,
        torch.randn(4, 3, dtype=torch.float64),
        torch.randn(2, 3, dtype=torch.float64),
    )
    cat = next(n for n in step.graph.ops() if step.graph.node(n).op == "aten.cat.default")
    assert len(step.graph.node(cat).args) == 1  # the dimension left out by the trace
    ctx = _ctx(step.graph, list(step.graph.program_order()))
    assert list(MERGE_WGRADS_OF_CAT.match(ctx)) == []
    ((res, _),) = _apply_and_verify(step, FOLD_SLICE_OF_CAT)
    assert not any(res.graph.node(n).op == "aten.slice.Tensor" for n in res.graph.ops())


def test_distributivity_both_ways():
    args = [torch.randn(5, 4, dtype=torch.float64) for _ in range(3)]
    step = capture(lambda a, b, c: a * c + b * c, *args)
    ((res, _),) = _apply_and_verify(step, FACTOR)
    assert sum(res.graph.node(n).op == "aten.mul.Tensor" for n in res.graph.ops()) == 1
    step = capture(lambda a, b, c: (a + b) * c, *args)
    ((res, _),) = _apply_and_verify(step, EXPAND)
    assert sum(res.graph.node(n).op == "aten.mul.Tensor" for n in res.graph.ops()) == 2


def test_rules_that_read_only_their_ops_offer_what_reading_every_node_does(bert_tiny, monkeypatch):
    """The node rules with `ops` and the matmul grouping read only their ops' nodes: they
    offer the same rewrites, in the same order, as reading every node of the order does."""
    rules = (MERGE_MATMUL, SPLIT_MATMUL, FOLD_SLICE_OF_CAT, FACTOR, EXPAND)
    rules += (MERGE_WGRADS_OF_CAT, DECOMPACT)
    x = [torch.randn(5, 4, dtype=torch.float64) for _ in range(3)]
    small = capture(
        lambda a, b, c: (
            (torch.cat([a, b], 1)[:, 4:8] * 2).sum()
            + (a * c + b * c).sum()
            + ((a + b) * c).sum()
            + (a.t().clone() * 2).sum()
        ),
        *x,
    ).graph
    merged = next(rw.build().graph for rw in MERGE_MATMUL.match(_ctx(bert_tiny.graph, None)))
    offered_by = set()
    for graph in (small, bert_tiny.graph, merged):
        order = graph.program_order()
        narrow = {r.name: [w.description for w in r.match(_ctx(graph, order))] for r in rules}
        with monkeypatch.context() as m:
            m.setattr(RuleContext, "nodes_of_ops", lambda self, ops: list(self.order))
            wide = {r.name: [w.description for w in r.match(_ctx(graph, order))] for r in rules}
        assert narrow == wide
        offered_by |= {name for name, found in narrow.items() if found}
    assert offered_by >= {"merge_matmul", "split_matmul", "fold_slice_of_cat", "factor", "expand"}


@pytest.fixture(scope="module")
def unet_tiny():
    return workload_step("unet:tiny", dtype=torch.float64)[1]


def test_split_conv_backward_and_merge_back(unet_tiny):
    ((split, order),) = _apply_and_verify(unet_tiny, SPLIT_CONV_BACKWARD)
    convs = [
        n for n in unet_tiny.graph.ops() if "convolution_backward" in unet_tiny.graph.node(n).op
    ]
    assert 10 <= len(split.removed) < len(convs)  # all but the first layer's (no input grad)
    ops = sorted(split.graph.node(n).op for n in split.added)
    assert ops.count("aten.convolution.default") == len(split.removed)
    sub = type(unet_tiny)(
        split.graph,
        unet_tiny.fn,
        unet_tiny.input_names,
        unet_tiny.input_kinds,
        unet_tiny.output_names,
        unet_tiny.example_inputs,
        unet_tiny.constants,
    )
    ((back, _),) = _apply_and_verify(sub, MERGE_CONV_BACKWARD, order)
    assert wl_hash(back.graph).value == wl_hash(unet_tiny.graph).value


def test_the_merge_of_split_conv_backwards_reads_only_their_ops(unet_tiny, monkeypatch):
    """`merge_conv_backward` finds its pairs among the two ops' nodes: the same rewrite as
    reading every node of the order."""
    ((split, order),) = _apply_and_verify(unet_tiny, SPLIT_CONV_BACKWARD)

    def offered():
        return [
            (rw.description, sorted(rw.build().removed))
            for rw in MERGE_CONV_BACKWARD.match(_ctx(split.graph, order))
        ]

    narrow = offered()
    monkeypatch.setattr(RuleContext, "nodes_of_ops", lambda self, ops: list(self.order))
    assert narrow == offered() and narrow


def test_split_conv_backward_lets_the_saved_input_die_before_dgrad():
    """The point of the split: with wgrad first, the peak of a conv's backward drops by the
    size of its saved input (here the input is the biggest tensor)."""
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.Upsample(scale_factor=2),  # its backward does not read its input
        torch.nn.Conv2d(8, 2, 3, padding=1, bias=False),
    ).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    step = training_step(model, (x,), loss_fn=lambda out, x: out.square().mean())
    graph, order = step.graph, list(step.graph.program_order())
    cost = get_cost_model("unit")
    ((res, _),) = _apply_and_verify(step, SPLIT_CONV_BACKWARD)
    ((olds, news),) = res.in_place_of  # where the rewrite puts its nodes: wgrad, then dgrad
    assert [res.graph.node(n).op for n in news] == [
        "aten.convolution_backward.default",
        "aten.convolution.default",
    ]
    before = simulate(graph, order, cost).peak_bytes
    at = order.index(olds[0])
    split_order = [*order[:at], *news, *order[at + 1 :]]
    assert res.graph.is_valid_schedule(split_order)
    after = simulate(res.graph, split_order, cost).peak_bytes
    assert after < before


@pytest.mark.parametrize("size", [8, 9])
def test_split_strided_conv_backward_puts_the_dropped_rows_back(size):
    """A stride-2 convolution of an even-sized map drops a row: its dgrad needs an output
    padding of 1 (odd size: 0)."""
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Conv2d(4, 4, 3, stride=2, padding=1)
    ).double()
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    step = training_step(model, (x,), loss_fn=lambda out, x: out.square().mean())
    ((res, _),) = _apply_and_verify(step, SPLIT_CONV_BACKWARD)
    dgrad = max(res.added)  # made after wgrad
    assert res.graph.node(dgrad).args[7] == [1 - size % 2] * 2


def test_split_conv_backward_of_a_convolution_with_one_padding_for_all_dims():
    """ATen takes one padding for every spatial dimension (EfficientNet's strided depthwise
    convolutions are captured with padding [0]): the rule read it per dimension and crashed
    the search on EfficientNet-B0."""

    class SamePadded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 3, 1)  # so that the input gradient is needed
            self.conv = torch.nn.Conv2d(3, 3, 3, stride=2, groups=3)
            self.head = torch.nn.Conv2d(3, 4, 1)

        def forward(self, x):
            y = torch.nn.functional.pad(self.stem(x), (0, 1, 0, 1))
            w, b = self.conv.weight, self.conv.bias
            y = torch.ops.aten.convolution(y, w, b, [2, 2], [0], [1, 1], False, [0, 0], 3)
            return self.head(y)

    model = SamePadded().double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    step = training_step(model, (x,), loss_fn=lambda out, x: out.square().mean())
    assert any(
        n.op == "aten.convolution_backward.default" and list(n.args[5]) == [0]
        for n in map(step.graph.node, step.graph.nodes)
    )
    _apply_and_verify(step, SPLIT_CONV_BACKWARD)


def test_split_conv_output_by_its_channel_slices_and_merge_back():
    """U-Net++'s concatenations: the input gradient of a convolution over a concatenation is
    read in channel slices. Split by them, no convolution allocates the whole gradient; every
    split verifies against eager PyTorch, and the dual gives back the original graph."""
    step = workload_step("unetpp:tiny", dtype=torch.float64)[1]
    ((split, order),) = _apply_and_verify(step, SPLIT_CONV_BACKWARD)
    dgrads = replace(step, graph=split.graph)
    results = _apply_and_verify(dgrads, SPLIT_CONV_OUTPUT, order, expect_at_least=4)
    for res, new_order in results:
        (whole,) = [n for n in res.removed if split.graph.node(n).op == "aten.convolution.default"]
        pieces = [n for n in res.added if res.graph.node(n).op == "aten.convolution.default"]
        assert len(pieces) >= 2
        widths = [res.graph.node(p).outputs[0].shape[1] for p in pieces]
        assert sum(widths) == split.graph.node(whole).outputs[0].shape[1] > max(widths)
        ((back, _),) = _apply_and_verify(
            replace(step, graph=res.graph), MERGE_CONV_OUTPUT, new_order
        )
        assert wl_hash(back.graph).value == wl_hash(split.graph).value


def test_split_weight_gradient_by_the_parts_of_a_concatenation_and_merge_back():
    """The weight gradient of a convolution over a concatenation, split by its parts, no
    longer reads the concatenation: only the forward convolution does. Every split verifies
    against eager PyTorch, and the dual gives back the original graph."""
    step = workload_step("unetpp:tiny", dtype=torch.float64)[1]
    ((split, order),) = _apply_and_verify(step, SPLIT_CONV_BACKWARD)
    wgrads = replace(step, graph=split.graph)
    results = _apply_and_verify(wgrads, SPLIT_WGRAD_OF_CAT, order, expect_at_least=4)
    for res, new_order in results:
        (whole,) = res.removed
        cat = split.graph.node(whole).args[1].node
        assert len(split.graph.users(cat)) == 2  # the forward convolution and the wgrad
        assert len(res.graph.users(cat)) == 1
        ((back, _),) = _apply_and_verify(
            replace(step, graph=res.graph), MERGE_WGRADS_OF_CAT, new_order
        )
        assert wl_hash(back.graph).value == wl_hash(split.graph).value


def test_matmuls_that_share_a_weight_but_depend_on_each_other_are_not_merged():
    """A layer applied twice (ALBERT's shared layers) reads one weight in matmuls that depend
    on each other: merging them would make a cycle. Only independent ones are grouped, and
    every merge offered builds an acyclic graph that verifies."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8).double()

    def model_fn(x):
        return layer(torch.tanh(layer(torch.tanh(layer(x)))))

    model = torch.nn.Module()
    model.layer = layer
    model.forward = model_fn
    x = torch.randn(4, 8, dtype=torch.float64)
    step = training_step(model, (x,), loss_fn=lambda out, x: out.square().mean())
    graph = step.graph
    groups = [g for _, g in parallel_groups(_ctx(graph, graph.program_order()))]
    for group in groups:
        for a in group:
            ancestors = rx.ancestors(graph.dag, graph.rx_index(a))
            assert not any(graph.rx_index(b) in ancestors for b in group if b != a)
    for rw in MERGE_MATMUL.match(_ctx(graph, graph.program_order())):
        res = rw.build()
        res.graph.verify()
        assert res.graph.is_valid_schedule(
            place_after_inputs(res.graph, graph.program_order(), res.added)
        )


def test_a_merge_without_a_place_keeps_the_old_order_without_alg2(bert_tiny, monkeypatch):
    """The matmul merge says nothing of where its nodes go: the child keeps the old order
    where the new dependencies allow, without Alg. 2 (0.13 s a child on a 1.1B decoder),
    and runs as eager does."""
    from magis.search import reschedule as resched

    def no_alg2(*args, **kwargs):
        raise AssertionError("Alg. 2 ran for a rewrite without a place")

    monkeypatch.setattr(resched, "incremental_schedule", no_alg2)
    order = bert_tiny.graph.program_order()
    (rw, *_) = MERGE_MATMUL.match(_ctx(bert_tiny.graph, order))
    res = rw.build()
    placed = resched.reschedule(bert_tiny.graph, order, res, get_cost_model("rtx3090"))
    assert res.graph.is_valid_schedule(placed)
    check = verify(bert_tiny, compile_program(res.graph, placed), bert_tiny.make_inputs())
    assert check.verified, rw.description


@pytest.mark.parametrize("workload", ["bert-base:tiny", "corpus:llama:tiny"])
def test_the_order_around_a_merge_is_the_whole_stable_sort(workload):
    """Around a rewrite without a place (the matmul merge, the factoring and expansion of
    products), the child's order sorts only the window the merge can change: it is the whole
    stable topological sort's order, and its position keys are that order's indices; from the
    program order and from other valid orders of the parent."""
    from magis.ir.topological import stable_topological_order
    from magis.search import reschedule as resched

    graph = workload_step(workload)[1].graph
    orders = [graph.program_order(), graph.topological_order()]
    checked = 0
    for order in orders:
        for rule in (MERGE_MATMUL, FACTOR, EXPAND):
            for rw in rule.match(_ctx(graph, order)):
                res = rw.build()
                if not resched._unplaced(res):
                    continue
                placed = resched._stable_order_around(order, res, None)
                assert placed is not None, rw.description
                new_order, keys = placed
                assert new_order == stable_topological_order(res.graph, order), rw.description
                assert all(keys[n] == i for i, n in enumerate(new_order)), rw.description
                checked += 1
    assert checked >= 8


def test_a_slice_inside_one_part_of_a_cat_reads_that_part():
    """A slice within one input of a cat (fission's 2 parts sliced into 4) becomes a slice of
    that input, and the cat dies with its last reader."""
    step = capture(
        lambda a, b: torch.cat([a * 2, b * 3], 0)[1:3] * 2 + torch.cat([a * 2, b * 3], 0)[-2:],
        torch.randn(4, 3, dtype=torch.float64),
        torch.randn(4, 3, dtype=torch.float64),
    )
    folded = _apply_and_verify(step, FOLD_SLICE_OF_CAT, expect_at_least=2)
    for res, _ in folded:
        slices = [n for n in res.added if res.graph.node(n).op == "aten.slice.Tensor"]
        (new,) = slices
        assert res.graph.node(res.graph.node(new).args[0].node).op == "aten.mul.Tensor"


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b, y: torch.bmm(torch.cat([a, b], 0), y),  # the batch: y sliced too
        lambda a, b, y: torch.bmm(y, torch.cat([a, b], 0)),
        lambda a, b, y: torch.bmm(torch.cat([a, b], 1), y[:2]),  # rows
        lambda a, b, y: torch.bmm(y[:2], torch.cat([a, b], -1)),  # columns
        lambda a, b, y: torch.mm(torch.cat([a[0], b[0]], 0), y[0]),
        lambda a, b, y: torch.mm(y[0], torch.cat([a[0], b[0]], 1)),
        lambda a, b, y: torch.bmm(torch.cat([a, b], 2), y[:2].repeat(1, 2, 1)),  # a sum
        lambda a, b, y: torch.mm(torch.cat([a[0], b[0], a[1]], 1), torch.cat([y[0]] * 3, 0)),
        lambda a, b, y: torch.mm(y[0].repeat(1, 2), torch.cat([a[0], b[0]], 0)),
    ],
)
def test_a_product_of_a_cat_is_the_cat_or_the_sum_of_the_products(fn):
    """mm/bmm over an operand concatenated: one product per part (the other operand's
    matching slice with it), concatenated along a kept dimension, summed along the contracted
    one; equal to eager PyTorch, and the operand's cat is gone."""
    a, b = (torch.randn(2, 4, 4, dtype=torch.float64) for _ in range(2))
    y = torch.randn(4, 4, 4, dtype=torch.float64)
    step = capture(lambda a, b, y: fn(a * 2, b * 3, y) * 2, a, b, y)
    ((res, _),) = _apply_and_verify(step, SPLIT_MATMUL_OF_CAT)
    (old,) = res.removed & {n for n in step.graph.ops() if "mm" in step.graph.node(n).op}
    cat = next(r.node for r in step.graph.node(old).args if r.node in res.removed)
    parts = len(step.graph.node(cat).args[0])
    products = [n for n in res.added if res.graph.node(n).op == step.graph.node(old).op]
    assert len(products) == parts


def test_a_product_over_a_cat_that_others_read_is_left_alone():
    """The cat stays for its other reader: taking the product by parts would free nothing."""
    a, b = (torch.randn(4, 2, dtype=torch.float64) for _ in range(2))
    y = torch.randn(4, 4, dtype=torch.float64)

    def shared_cat(a, b, y):
        c = torch.cat([a, b], 1)
        return torch.mm(y, c) + c.sum()

    step = capture(shared_cat, a, b, y)
    assert list(SPLIT_MATMUL_OF_CAT.match(_ctx(step.graph, None))) == []
