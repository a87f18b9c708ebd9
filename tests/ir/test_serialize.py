"""Graphs round-trip through JSON exactly, and bad files give a PlanError."""

import json

import pytest
import torch

from magis.backend import compile_program, generate
from magis.errors import PlanError
from magis.ir.serialize import graph_from_json, graph_to_json


def test_training_graph_round_trips(mlp_step_factory):
    step = mlp_step_factory("adam")
    g = step.graph
    text = json.dumps(graph_to_json(g))
    back = graph_from_json(json.loads(text))
    assert back.program_order() == g.program_order()
    assert all(back.node(n) == g.node(n) for n in g.program_order())
    assert all(back.control_deps(n) == g.control_deps(n) for n in g.nodes)
    assert back.outputs == g.outputs
    order = g.program_order()
    assert generate(back, order) == generate(g, order)
    inputs = step.make_inputs()
    torch.manual_seed(0)
    a = compile_program(g, order)(*step.program_inputs([t.clone() for t in inputs]))
    torch.manual_seed(0)
    b = compile_program(back, order)(*step.program_inputs([t.clone() for t in inputs]))
    assert torch.equal(a[0], b[0])


def test_non_finite_floats_and_tuples_survive():
    from magis.ir.serialize import decode_value, encode_value

    value = (float("inf"), [1, 2.5, None], torch.float16, torch.device("cpu"), torch.channels_last)
    assert decode_value(json.loads(json.dumps(encode_value(value)))) == value


@pytest.mark.parametrize(
    "data, message",
    [
        ({"format": "other"}, "not a magis graph"),
        ({"format": "magis.graph", "version": 99}, "version 99"),
        ({"format": "magis.graph", "version": 1, "nodes": [{"id": 0}]}, "re-run magis optimize"),
        ({"format": "magis.graph", "version": 2, "nodes": []}, "missing field"),
    ],
)
def test_bad_graph_files_are_plan_errors(data, message):
    with pytest.raises(PlanError, match=message):
        graph_from_json(data)


def test_objects_cannot_be_smuggled_in():
    from magis.ir.serialize import decode_value

    with pytest.raises(PlanError, match="unreadable value"):
        decode_value({"__reduce__": "os.system"})


def test_graph_objects_pickle_to_equal_ones_between_search_processes(mlp_step_factory):
    """States travel to search workers pickled (`magis.search.workers`); the IR's slotted
    classes pickle by their fields (a transposed output keeps its strides, an op's dimension
    map its derived splittable axes)."""
    from magis.analyze.dgraph import node_dims
    from magis.ir.tensor import TensorMeta
    from magis.search.pickling import dumps, loads

    g = mlp_step_factory("adam").graph
    nodes = [g.node(n) for n in g.program_order()]
    dims = node_dims(g)
    back_nodes, back_dims = loads(dumps((nodes, dims)))
    assert back_nodes == nodes
    assert back_dims == dims
    assert all(back_dims[n].splittable == dims[n].splittable for n in dims)
    transposed = TensorMeta((3, 4), "float32", 4, (1, 3))
    assert loads(dumps(transposed)).strides == (1, 3)
