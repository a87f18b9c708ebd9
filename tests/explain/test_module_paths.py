"""Module paths: capture records the model module each node computes for, plan files keep them,
and `magis explain` rows name them (issue #17)."""

import json

import pytest
import torch

from magis.capture import training_step, workload_step
from magis.ir import PlaceholderKind
from magis.ir.serialize import content_digest, graph_from_json, graph_to_json


@pytest.fixture(scope="module")
def bert():
    return workload_step("bert-base:tiny", float64_when_tiny=True)[1].graph


def test_forward_nodes_name_their_module(bert):
    by_name = {bert.node(n).name: bert.node(n) for n in bert.program_order()}
    paths = {n.module for n in by_name.values()}
    assert "bert.encoder.layer.0.attention.self" in paths
    assert "bert.encoder.layer.1.output.dense" in paths
    query = by_name["bert.encoder.layer.0.attention.self.query.weight"]
    assert query.module == "bert.encoder.layer.0.attention.self.query"
    # the query projection's forward matmul reads that weight and runs in that module
    readers = [n for n in by_name.values() if any(r.node == query.id for r in n.inputs)]
    assert any(n.module == query.module for n in readers)


def test_backward_and_update_nodes_inherit_a_module(bert):
    ops = [bert.node(n) for n in bert.ops()]
    assert sum(1 for n in ops if n.module) >= 0.95 * len(ops)
    backward = [n for n in ops if "backward" in n.op]
    assert backward and all(n.module for n in backward)


def test_a_users_model_gets_its_own_attribute_names():
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
            self.head = torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.encoder(x)).sum()

    graph = training_step(Net(), (torch.randn(3, 4),)).graph
    paths = {graph.node(n).module for n in graph.program_order()}
    assert {"encoder.0", "encoder.1", "head"} <= paths
    data = graph.placeholders(PlaceholderKind.DATA)
    assert all(graph.node(n).module == "" for n in data)


def test_plan_files_keep_module_paths_and_read_graphs_without_them(bert):
    data = graph_to_json(bert)
    back = graph_from_json(json.loads(json.dumps(data)))
    assert [back.node(n).module for n in back.program_order()] == [
        bert.node(n).module for n in bert.program_order()
    ]
    for node in data["nodes"]:  # a graph written before module paths
        node.pop("module", None)
    data["digest"] = content_digest(data)
    old = graph_from_json(data)
    assert all(old.node(n).module == "" for n in old.program_order())


def test_a_hostile_module_path_is_refused(bert):
    from magis.ir.schema import GraphSchemaError

    data = graph_to_json(bert)
    data["nodes"][0]["module"] = "x'); import os"
    data["digest"] = content_digest(data)
    with pytest.raises(GraphSchemaError, match=r"nodes\[0\]\.module"):
        graph_from_json(data)
