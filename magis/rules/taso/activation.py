"""An activation's backward reads its output (TASO-style substitution; MAGIS §5).

`hardtanh_backward(g, x, lo, hi)` passes `g` where `lo < x < hi` and zero elsewhere. With
`y = hardtanh(x, lo, hi)`, `lo < x < hi` holds exactly where `lo < y < hi` (inside the interval
`y` is `x`; outside it `y` is `lo` or `hi`), so the backward computes the same values from `y`.
Likewise `leaky_relu_backward(g, x, slope, False)` with `slope >= 0` tests `x > 0`, which is
`y > 0`: ATen's own `self_is_result=True` form reads `y`. (ReLU's backward reads its output
already; GELU's and SiLU's need their input and are not rewritten.)

What it saves: the backward no longer keeps the activation's input (a batch norm's output in
MobileNetV2's ReLU6 blocks, as large as the activation) alive from the forward to the backward;
it keeps `y`, which the next layer's backward keeps anyway, or a view of `y`'s padded copy when
the next layer reads `y` through a `constant_pad_nd` with no negative pad (`y` is that copy's
interior: a slice per padded dimension, no new storage).
"""

from __future__ import annotations

from dataclasses import dataclass

from magis.ir import Graph, Ref
from magis.rules.base import Rewritten, RuleContext, RuleKind, group_rule
from magis.rules.taso.common import SLICE, Replacement, replaced_in_place, slice_meta
from magis.rules.taso.pad import PAD

HARDTANH, HARDTANH_BACKWARD = "aten.hardtanh.default", "aten.hardtanh_backward.default"
LEAKY_RELU, LEAKY_RELU_BACKWARD = "aten.leaky_relu.default", "aten.leaky_relu_backward.default"
BACKWARDS = (HARDTANH_BACKWARD, LEAKY_RELU_BACKWARD)


@dataclass(frozen=True)
class OutputRead:
    """One backward to rewrite: `backward` reads `x`, the input of `forward`, whose output
    holds the same mask; `padded` is a pad of that output to read it through, or None."""

    backward: int
    forward: int
    padded: int | None


def _hardtanh_bounds(args: tuple) -> tuple[float, float]:
    lo = args[1] if len(args) > 1 else -1.0
    hi = args[2] if len(args) > 2 else 1.0
    return lo, hi


def _forward_of(graph: Graph, nid: int) -> int | None:
    """The activation whose input `nid` (a backward) reads and whose output holds the same
    mask, or None."""
    node = graph.node(nid)
    if node.kwargs or len(node.args) < 2 or not isinstance(node.args[1], Ref):
        return None
    x = node.args[1]
    for uid in graph.users(x.node):
        fwd = graph.node(uid)
        if fwd.kwargs or not fwd.args or fwd.args[0] != x:
            continue
        if node.op == HARDTANH_BACKWARD and fwd.op == HARDTANH:
            bounds = _hardtanh_bounds(fwd.args)
            if len(node.args) == 4 and bounds == tuple(node.args[2:]) and bounds[0] < bounds[1]:
                return uid
        elif node.op == LEAKY_RELU_BACKWARD and fwd.op == LEAKY_RELU and len(node.args) == 4:
            slope = fwd.args[1] if len(fwd.args) > 1 else 0.01
            if node.args[2] == slope and slope >= 0 and node.args[3] is False:
                return uid
    return None


def _interior_pad(graph: Graph, fwd: int) -> int | None:
    """A `constant_pad_nd` of `fwd`'s output with no negative pad (its interior is the output),
    or None."""
    y = Ref(fwd)
    for uid in graph.users(fwd):
        node = graph.node(uid)
        if node.op == PAD and not node.kwargs and node.args[0] == y and len(node.args) > 1:
            pads = node.args[1]
            if all(p >= 0 for p in pads) and len(pads) // 2 <= len(graph.meta(y).shape):
                return uid
    return None


def output_reads(ctx: RuleContext) -> list[list[OutputRead]]:
    """Every hardtanh and leaky-ReLU backward outside frozen regions that reads its forward's
    input, rewritten in one step (each saves its own input's bytes; none costs time)."""
    graph = ctx.graph
    found = []
    for nid in ctx.nodes_of_ops(BACKWARDS):
        fwd = _forward_of(graph, nid)
        if nid in ctx.frozen or fwd is None or fwd in ctx.frozen:
            continue
        padded = _interior_pad(graph, fwd)
        found.append(OutputRead(nid, fwd, None if padded in ctx.frozen else padded))
    return [found] if found else []


def read_outputs(graph: Graph, reads: list[OutputRead]) -> Rewritten:
    """Each backward of `reads` as a new node reading the forward's output (or its padded
    copy's interior), in place of the old one."""
    return replaced_in_place(graph, reads, _read_output)


def _read_output(g: Graph, read: OutputRead) -> Replacement:
    node = g.node(read.backward)
    source, views = _output_source(g, read)
    args = (node.args[0], source, *node.args[2:])
    if node.op == LEAKY_RELU_BACKWARD:
        args = (*args[:3], True)
    new = g.add_op(f"{node.name}_of_output", node.op, args, outputs=node.outputs)
    return Replacement((read.backward,), (*views, new), ((Ref(read.backward), Ref(new)),))


def _output_source(g: Graph, read: OutputRead) -> tuple[Ref, list[int]]:
    """The ref holding the forward's output for `read`'s backward, and the view nodes added to
    reach it: the output itself, or slices of its padded copy's interior."""
    y = Ref(read.forward)
    if read.padded is None:
        return y, []
    source, views = Ref(read.padded), []
    pads = g.node(read.padded).args[1]
    shape = g.meta(y).shape
    for i in range(len(pads) // 2):
        before, after = pads[2 * i], pads[2 * i + 1]
        if before == after == 0:
            continue
        dim = len(shape) - 1 - i
        end = before + shape[dim]
        meta = slice_meta(g.meta(source), dim, before, end)
        name = f"{g.node(read.forward).name}_interior{len(views)}"
        views.append(g.add_op(name, SLICE, (source, dim, before, end), outputs=(meta,)))
        source = Ref(views[-1])
    return source, views


READ_ACTIVATION_OUTPUTS = group_rule(
    "read_activation_outputs",
    RuleKind.TASO,
    find=output_reads,
    build=read_outputs,
    describe=lambda graph, reads: f"{len(reads)} activation backwards read their outputs",
    memory_saving=True,  # the search tries it with the memory rules
)
RULES = (READ_ACTIVATION_OUTPUTS,)
