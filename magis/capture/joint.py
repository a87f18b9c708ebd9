"""AOTAutograd's joint forward/backward graph as a magis `Step` (issue 43, `magis.torch_backend`).

torch.compile's AOTAutograd traces a model's forward and backward as one functional FX graph,
the *joint* graph (`torch._functorch.aot_autograd`): placeholders `primals_*` (parameters,
buffers, the model's inputs) and `tangents_*` (the gradients of the forward's outputs, known
only when `backward()` is called); outputs: the forward's `num_fwd_outputs` values, then one
gradient per primal (None where there is none). Its partitioner (`partition_fn`,
`torch._functorch.partitioners`) splits it into a forward and a backward graph: what the
forward saves for the backward and what the backward recomputes.

Here the joint graph becomes magis IR (`fx_import`, as a capture does) with one addition: the
backward cannot start before the forward has ended, so every node that reads a tangent runs
after every producer of a forward output (control edges, which every rewrite and scheduler of
magis keeps). In any order of the graph, the nodes before the first one that depends on a
tangent are then the forward, the others the backward (`magis.backend.aot`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx

from magis.capture.fx_import import import_fx
from magis.capture.trace import Step
from magis.ir import Graph, PlaceholderKind, Ref


@dataclass(frozen=True)
class JointStep:
    """A joint graph as a Step, and how its outputs map back to the joint's: `slots[i]` is the
    index in `step.graph.outputs` of joint output i, None where the joint returns None."""

    step: Step
    num_fwd_outputs: int
    slots: tuple[int | None, ...]


def is_tangent(name: str) -> bool:
    """AOTAutograd's test for a tangent placeholder (`_aot_autograd.utils._is_tangent`)."""
    return "tangents" in name


def joint_step(
    joint: fx.GraphModule, num_fwd_outputs: int, static_inputs: Sequence[int] = ()
) -> JointStep:
    """`joint` (modified: its dead nodes dropped) as a Step whose backward runs after its
    forward. `static_inputs` are the positions of the parameters and buffers among the
    placeholders (AOTAutograd's `static_lifetime_input_indices`): WEIGHT, the rest DATA."""
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    static = set(static_inputs)
    kinds = [
        PlaceholderKind.WEIGHT if i in static else PlaceholderKind.DATA
        for i in range(len(placeholders))
    ]
    outputs = list(joint.graph.output_node().args[0])
    slots, k = [], 0
    for out in outputs:
        slots.append(None if out is None else k)
        k += out is not None
    graph = import_fx(joint, kinds)
    n_fwd = sum(s is not None for s in slots[:num_fwd_outputs])
    backward_after_forward(graph, graph.outputs[:n_fwd])
    step = Step(
        graph,
        joint,
        [graph.node(p).name for p in graph.placeholders()],
        kinds,
        [f"out{i}" for i in range(len(graph.outputs))],
    )
    return JointStep(step, num_fwd_outputs, tuple(slots))


def backward_after_forward(graph: Graph, forward_outputs: Sequence[Ref]) -> None:
    """Every reader of a tangent runs after every op that makes a forward output."""
    producers = {r.node for r in forward_outputs if not graph.node(r.node).is_placeholder}
    readers = {
        user
        for p in graph.placeholders()
        if is_tangent(graph.node(p).name)
        for user in graph.users(p)
    }
    for reader in sorted(readers):
        for producer in sorted(producers):
            graph.add_control_dep(producer, reader)


def tangent_dependents(graph: Graph) -> set[int]:
    """The nodes that read a tangent, directly or through other nodes: the backward's own."""
    found = {p for p in graph.placeholders() if is_tangent(graph.node(p).name)}
    for nid in graph.topological_order():
        if any(r.node in found for r in graph.node(nid).inputs):
            found.add(nid)
    return found
