"""Where a plan of a joint graph is cut into a forward and a backward (`magis.backend.aot`):
a forward output the plan left after the backward's start moves into the forward, and an input
AOTAutograd writes after the forward reaches the backward as a copy."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from magis.backend.aot import cut_at_backward
from magis.capture.joint import joint_step
from magis.ir import Ref
from magis.ir.topological import carry_control_deps

aten = torch.ops.aten


def joint_graph(late_output: bool) -> fx.GraphModule:
    """primals_1 (a weight), primals_2 (a running statistic), tangents_1; forward outputs:
    the scaled weight and the statistic's update; the backward reads the statistic."""
    g = fx.Graph()
    w, stat, t = (g.placeholder(n) for n in ("primals_1", "primals_2", "tangents_1"))
    fwd = g.call_function(aten.mul.Tensor, (w, 2.0))
    if late_output:
        grad = g.call_function(aten.mul.Tensor, (t, stat))
        update = g.call_function(aten.add.Tensor, (stat, 1.0))
    else:
        update = g.call_function(aten.add.Tensor, (stat, 1.0))
        grad = g.call_function(aten.mul.Tensor, (t, stat))
    g.output([fwd, update, grad])
    gm = fx.GraphModule(torch.nn.Module(), g)
    FakeTensorProp(gm, FakeTensorMode()).propagate(*(torch.ones(3) for _ in range(3)))
    return gm


def names(nodes) -> list[str]:
    return [n.name for n in nodes]


def test_a_forward_output_made_after_the_backward_starts_moves_into_the_forward():
    gm = joint_graph(late_output=True)
    cut = cut_at_backward(gm, num_fwd_outputs=2)
    order = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert order.index("add_tensor") < order.index("mul_tensor_1"), order
    assert "primals_2" in names(cut.saved) and cut.recomputed == ()


def test_an_input_written_after_the_forward_reaches_the_backward_as_a_copy():
    gm = joint_graph(late_output=False)
    cut = cut_at_backward(gm, num_fwd_outputs=2, mutated=frozenset({"primals_2"}))
    (copy,) = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    (grad,) = [n for n in gm.graph.nodes if n.name == "mul_tensor_1"]
    assert grad.args[1] is copy and copy.args[0].name == "primals_2"
    assert names(cut.saved) == [copy.name], names(cut.saved)
    nodes = list(gm.graph.nodes)
    assert nodes.index(copy) < nodes.index(grad)


def test_a_node_made_in_place_of_a_tangent_reader_still_waits_for_the_forward():
    """A rewrite that replaces the backward's first op (as the convolution-backward split
    does) carries its control edges to the new node (`ir.topological.carry_control_deps`)."""
    graph = joint_step(joint_graph(late_output=True), num_fwd_outputs=2).step.graph
    (reader,) = [n for n in graph.nodes if graph.node(n).name == "mul_tensor_1"]
    (update,) = [n for n in graph.nodes if graph.node(n).name == "add_tensor"]
    assert update in graph.control_deps(reader)
    old = graph.node(reader)
    new = graph.add_op("mul_1_again", old.op, old.args, outputs=old.outputs)
    graph.replace_uses(Ref(reader), Ref(new))
    carry_control_deps(graph, reader, [new])
    graph.remove_node(reader)
    assert update in graph.control_deps(new)
    assert graph.topological_order().index(update) < graph.topological_order().index(new)
