"""The meta check runs ops on fake tensors and reports every output whose shape, dtype or strides
differ from the graph's record, and every op that cannot run on its recorded inputs."""

import dataclasses

import pytest
import torch

from magis.backend.meta_check import (
    MetaChecker,
    MetaCheckError,
    check_graph,
    check_nodes,
    nodes_to_check,
)
from magis.capture import workload_step
from magis.ir import Ref
from magis.ir.builder import GraphBuilder
from magis.ir.ops import LOAD_OP, STORE_OP


def _with_meta(graph, nid, **fields):
    """`graph` with node `nid`'s first output meta edited, as a hand-edited file would have it."""
    g = graph.copy()
    node = g.node(nid)
    meta = dataclasses.replace(node.outputs[0], **fields)
    g.nodes[nid] = dataclasses.replace(node, outputs=(meta, *node.outputs[1:]))
    return g


@pytest.fixture
def chain():
    """x (4, 6) -> relu -> view (24,) -> sum."""
    b = GraphBuilder()
    x = b.input("x", (4, 6))
    r = b.relu(x, name="r")
    v = b.view(r, (24,), name="v")
    b.output(b.sum(v, [0], name="s"))
    return b.build(), r.node, v.node


@pytest.mark.parametrize(
    "name", ["resnet50:tiny", "bert-base:tiny", "unet:tiny", "gpt-neo-1.3b:tiny"]
)
def test_captured_zoo_graphs_pass(name):
    _, step = workload_step(name)
    report = check_graph(step.graph)
    assert report.ok, [str(m) for m in report.mismatches[:3]]
    assert report.checked == len(step.graph.ops())


def test_check_nodes_runs_only_the_given_ops(chain):
    g, r, v = chain
    x = g.placeholders()[0]
    assert check_nodes(g, [x, r]).checked == 1  # placeholders have nothing to run
    assert nodes_to_check(g, [r]) == {r, v}
    assert check_nodes(g, nodes_to_check(g, [r])).checked == 2


def test_an_op_that_cannot_run_on_its_recorded_strides_is_reported(chain):
    g, r, v = chain
    g = _with_meta(g, r, strides=(1, 4))  # relu's output recorded transposed: view cannot run
    report = MetaChecker().check_nodes(g, [r, v])
    by_node = {m.node: m for m in report.mismatches}
    assert by_node[r].got.strides == (6, 1) and by_node[r].expected.strides == (1, 4)
    assert by_node[v].output is None and "Cannot view a tensor" in by_node[v].error
    with pytest.raises(
        MetaCheckError, match=r"^meta check: r \(aten.relu.default\) .*\(and 1 more\)$"
    ):
        report.raise_on_mismatch()


def test_shape_and_dtype_mismatches_name_the_field(chain):
    g, r, _ = chain
    (m,) = check_nodes(_with_meta(g, r, shape=(4, 7), strides=(7, 1)), [r]).mismatches
    assert "shape (4, 6), the graph records (4, 7)" in str(m)
    (m,) = check_nodes(_with_meta(g, r, dtype="float64", itemsize=8), [r]).mismatches
    assert "dtype float32, the graph records float64" in str(m)


def test_strides_of_size_one_dims_are_not_compared():
    b = GraphBuilder()
    r = b.relu(b.input("x", (1, 4)), name="r")
    b.output(r)
    g = _with_meta(b.build(), r.node, strides=(99, 1))
    assert check_graph(g).ok


def test_store_and_load_are_checked_as_copies_that_keep_strides():
    b = GraphBuilder()
    t = b.t(b.input("x", (4, 6)), name="t")  # (6, 4) with strides (1, 6)
    b.output(b.relu(t, name="r"))
    g = b.build()
    meta = g.meta(t)
    store = g.add_op("t_store", STORE_OP, (t,), outputs=(meta,))
    load = g.add_op("t_load", LOAD_OP, (Ref(store),), outputs=(meta,))
    g.replace_uses(t, Ref(load), users=[n for n in g.users(t.node) if n != store])
    report = check_graph(g)
    assert report.ok and report.checked == 4
    flat = _with_meta(g, load, strides=(4, 1))
    assert [m.node for m in check_graph(flat).mismatches] == [load, g.users(load)[0]]


def test_device_constants_follow_the_check_device():
    """Constants made on a device (ones(..., device=cuda) from a GPU capture) run on the
    check's device, as codegen puts them on the program's."""
    b = GraphBuilder()
    x = b.input("x", (3,))
    ones = b.call("aten.ones.default", [3], dtype=torch.float32, device=torch.device("meta"))
    b.output(b.add(x, ones))
    assert check_graph(b.build()).ok
