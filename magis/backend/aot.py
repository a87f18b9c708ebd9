"""A plan of AOTAutograd's joint graph handed back as its forward and backward (issue 43).

`magis.torch_backend` plans the joint forward/backward graph (`magis.capture.joint`); this
module turns the plan (graph + order) into what AOTAutograd's `partition_fn` returns, and
compiles each half for its `fw_compiler` / `bw_compiler`:

- The plan becomes one FX graph in the plan's order (`fx_export.segment_module`), with the
  joint's placeholder names (AOTAutograd tells primals from tangents by name), the joint's
  outputs (None where the joint returns no gradient) and fake values propagated
  (`FakeTensorProp`: AOTAutograd reads the saved tensors' metadata).
- The forward is that order up to the first node that depends on a tangent. Every value the
  forward makes or takes (a primal) that a later node reads is SAVED; a later node that does
  not depend on a tangent is a RECOMPUTATION, run by the backward.
- torch's own extraction (`partitioners._extract_fwd_bwd_modules`, as its `default_partition`
  calls it) cuts the two modules out of that graph given those saved values: each keeps the
  nodes it needs, in the graph's order, which is the plan's.
- Each module is compiled as `compiler="inductor"` compiles a plan (`InductorProgram`:
  segments, no re-ordering, no CSE merging a recomputation back), so Inductor keeps the plan.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from magis.backend.fx_export import Segment, segment_module
from magis.backend.inductor import InductorProgram
from magis.capture.fx_import import constant_values, import_fx
from magis.capture.joint import is_tangent
from magis.errors import MagisError
from magis.ir import Graph, PlaceholderKind, Ref


class PartitionError(MagisError):
    """A plan of a joint graph that cannot be split into a forward and a backward."""


@dataclass(frozen=True)
class Partition:
    """What a plan of a joint graph hands AOTAutograd: the forward and backward modules, the
    values the forward saves for the backward and the ops the backward recomputes (names of
    the plan's FX nodes)."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: tuple[str, ...]
    recomputed: tuple[str, ...]


def forward_backward(
    graph: Graph,
    order: Sequence[int],
    slots: Sequence[int | None],
    num_fwd_outputs: int,
    joint: fx.GraphModule,
    joint_inputs,
) -> Partition:
    """The forward and backward of the plan `graph` in `order` of `joint` (what a
    `partition_fn` returns); `slots` map the joint's outputs to the graph's (`JointStep`)."""
    from torch._functorch.partitioners import _extract_fwd_bwd_modules

    gm = plan_module(graph, order, slots, joint, joint_inputs)
    cut = cut_at_backward(gm, num_fwd_outputs, mutated_inputs(joint))
    fw, bw = _extract_fwd_bwd_modules(
        gm, list(cut.saved), saved_sym_nodes=[], num_fwd_outputs=num_fwd_outputs
    )
    for module in (fw, bw):  # as default_partition does after extracting
        module.graph.eliminate_dead_code()
        module.recompile()
    return Partition(
        fw, bw, tuple(n.name for n in cut.saved), tuple(n.name for n in cut.recomputed)
    )


def plan_module(
    graph: Graph, order: Sequence[int], slots: Sequence[int | None], joint: fx.GraphModule, inputs
) -> fx.GraphModule:
    """The plan as one FX graph shaped as `joint`: same placeholders (tensor constants as
    `get_attr` of the joint's), same outputs, nodes in the plan's order, fake values set."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    placeholders = graph.placeholders()
    flat = pytree.tree_leaves(inputs)
    device = next((t.device for t in flat if isinstance(t, torch.Tensor)), torch.device("cpu"))
    seg = Segment(
        [n for n in order if not graph.node(n).is_placeholder],
        [Ref(p) for p in placeholders],
        list(graph.outputs),
    )
    names = [graph.node(p).name for p in placeholders]
    gm = segment_module(graph, seg, device, pool=0, names=names)
    constants = [graph.node(p).name for p in graph.placeholders(PlaceholderKind.CONSTANT)]
    _constants_as_attributes(gm, joint, constants)
    _outputs_as_joint(gm, joint, slots)
    FakeTensorProp(gm, detect_fake_mode(flat)).propagate_dont_convert_inputs(*flat)
    return gm


def _constants_as_attributes(gm: fx.GraphModule, joint: fx.GraphModule, names: list[str]) -> None:
    for node in [n for n in gm.graph.nodes if n.op == "placeholder" and n.target in names]:
        setattr(gm, node.target, getattr(joint, node.target))
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(node.target)
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)


def _outputs_as_joint(gm: fx.GraphModule, joint: fx.GraphModule, slots) -> None:
    out = gm.graph.output_node()
    values = out.args[0]
    gm.graph.erase_node(out)
    new = gm.graph.output([None if s is None else values[s] for s in slots])
    if "desc" in joint.graph.output_node().meta:  # what each output is, for AOTAutograd
        new.meta["desc"] = joint.graph.output_node().meta["desc"]
    gm.recompile()


@dataclass(frozen=True)
class Cut:
    """A plan's FX graph cut where the backward starts: what crosses, what is made again."""

    saved: tuple[fx.Node, ...]  # made or taken before the cut, read after it
    recomputed: tuple[fx.Node, ...]  # ops after the cut that read no tangent


def cut_at_backward(
    gm: fx.GraphModule, num_fwd_outputs: int, mutated: frozenset[str] = frozenset()
) -> Cut:
    """Cut `gm` before its first op that depends on a tangent: the forward is what comes
    before. A forward output made after that point moves before it (`_move_into_forward`).
    An input in `mutated` (AOTAutograd writes its new
    value after the forward) that the backward reads is saved as a copy made in the forward:
    saved as it is, autograd refuses it once written ("modified by an inplace operation"),
    as when a plan recomputes a batch norm, which reads its running statistics."""
    nodes = list(gm.graph.nodes)
    backward: set[fx.Node] = set()
    boundary = len(nodes) - 1  # the output node
    for i, n in enumerate(nodes):
        tangent = n.op == "placeholder" and is_tangent(str(n.target))
        if tangent or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
            # a view of a tangent computes nothing: it may come early, and goes to the
            # backward with the tangent
            if n.op != "placeholder" and not _is_view(n):
                boundary = min(boundary, i)
    later, first_later = set(nodes[boundary:]), nodes[boundary]
    for n in nodes[:boundary]:
        if n.op == "placeholder" and n.target in mutated:
            _read_later_as_copy(gm, n, first_later, later)
    nodes = list(gm.graph.nodes)
    boundary = nodes.index(first_later)
    outputs = gm.graph.output_node().args[0][:num_fwd_outputs]
    late = [o for o in outputs if isinstance(o, fx.Node) and o in later]
    if late:
        _move_into_forward(late, first_later, backward)
        nodes = list(gm.graph.nodes)
        boundary = nodes.index(first_later)
        later = set(nodes[boundary:])
    saved = [
        n
        for n in nodes[:boundary]
        if n not in backward and any(u in later and u.op != "output" for u in n.users)
    ]
    recomputed = [
        n
        for n in nodes[boundary:]
        if n.op == "call_function" and n not in backward and not _is_view(n)
    ]
    return Cut(tuple(saved), tuple(recomputed))


def _move_into_forward(late: list[fx.Node], at: fx.Node, backward: set[fx.Node]) -> None:
    """Move forward outputs a plan computes after the backward's start (and what they need
    from there) to right before `at`, in their order. None reads a tangent, so the forward
    can make them; the plan's order left them late where no edge held them early (a batch
    norm's running-statistics update: nothing in the forward reads it). A PartitionError if
    one depends on a tangent."""
    needed: set[fx.Node] = set()
    stack = list(late)
    while stack:
        n = stack.pop()
        if n in needed or n.op == "placeholder" or n.op == "get_attr":
            continue
        if n in backward:
            raise PartitionError(
                f"forward output {late[0].name} depends on a gradient: "
                "report it with the model (magis.torch_backend)"
            )
        needed.add(n)
        stack.extend(a for a in n.all_input_nodes if a not in needed)
    order = {n: i for i, n in enumerate(at.graph.nodes)}
    start = order[at]
    for n in sorted((n for n in needed if order[n] > start), key=order.__getitem__):
        at.prepend(n)


def _read_later_as_copy(gm: fx.GraphModule, node: fx.Node, at: fx.Node, later: set) -> None:
    """Make the readers of `node` in `later` (the output aside) read a copy of it made right
    before `at`."""
    readers = [u for u in node.users if u in later and u.op != "output"]
    if not readers:
        return
    with gm.graph.inserting_before(at):
        copy = gm.graph.call_function(torch.ops.aten.clone.default, (node,))
    copy.meta["val"] = node.meta.get("val")
    for user in readers:
        user.replace_input_with(node, copy)


def mutated_inputs(joint: fx.GraphModule) -> frozenset[str]:
    """The joint's placeholders AOTAutograd writes after the forward: those whose new value
    is a forward output (`InputMutationAOTOutput` in the output node's descriptors)."""
    descs = joint.graph.output_node().meta.get("desc") or ()
    written = [d.mutated_input for d in descs if hasattr(d, "mutated_input")]
    return frozenset(
        str(n.target)
        for n in joint.graph.nodes
        if n.op == "placeholder" and n.meta.get("desc") in written
    )


def _is_view(node: fx.Node) -> bool:
    """An op whose output aliases its input (the schema's alias annotation, `Tensor(a)`)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return node.target is operator.getitem
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None


def compile_module(gm: fx.GraphModule, example_inputs: Sequence) -> Callable:
    """AOTAutograd's `fw_compiler` / `bw_compiler`: `gm` (in the plan's order) as magis IR run
    by an `InductorProgram`, compiled on its first call. Boxed (`_boxed_call`): AOTAutograd
    passes the inputs as one list, which is emptied so that they die inside the program."""
    n = len([node for node in gm.graph.nodes if node.op == "placeholder"])
    outputs = list(gm.graph.output_node().args[0])
    slots, k = [], 0
    for out in outputs:
        slots.append(None if out is None else k)
        k += out is not None
    graph = import_fx(gm, [PlaceholderKind.DATA] * n)
    constants = constant_values(gm)
    device = next(
        (t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu")
    )
    program = InductorProgram(graph, graph.program_order(), device, owns_inputs=True)

    def run(args: list) -> list:
        inputs = [*args, *constants]
        args.clear()
        values = program.run(inputs)  # empties `inputs`: a saved value dies at its last use
        return [None if s is None else values[s] for s in slots]

    run._boxed_call = True  # noqa: SLF001 - AOTAutograd's marker of a boxed compiled function
    return run
