"""What the TASO families share: the ATen ops they rewrite and small graph-building helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TypeVar

from magis.ir import Graph, Ref, TensorMeta
from magis.ir.topological import carry_control_deps
from magis.rules.base import Rewritten, RuleContext

T = TypeVar("T")

MM, ADDMM = "aten.mm.default", "aten.addmm.default"
CAT, SLICE = "aten.cat.default", "aten.slice.Tensor"
ADD, MUL = "aten.add.Tensor", "aten.mul.Tensor"
CONV_BACKWARD = "aten.convolution_backward.default"
CONVOLUTION = "aten.convolution.default"
NOTHING = TensorMeta((0,), "float32", 4)  # what a masked-out gradient is (an empty tensor)


def cat_dim(node) -> int:
    """The dimension a captured `aten.cat` joins along: its second argument, or the default 0
    when the trace left it out (`torch.cat(tensors)`: a data-parallel step's gradient bucket)."""
    if len(node.args) > 1:
        return node.args[1]
    return node.kwargs_dict.get("dim", 0)


def add_cat(g: Graph, name: str, parts: list[Ref], dim: int) -> int:
    """A new `cat` of `parts` along `dim`."""
    metas = [g.meta(p) for p in parts]
    shape = list(metas[0].shape)
    shape[dim] = sum(m.shape[dim] for m in metas)
    out = TensorMeta(tuple(shape), metas[0].dtype, metas[0].itemsize)
    return g.add_op(name, CAT, (list(parts), dim), outputs=(out,))


def slice_meta(meta: TensorMeta, dim: int, start: int, end: int) -> TensorMeta:
    """The meta of a unit-step slice of a tensor with `meta`: a view, so its strides are the
    tensor's."""
    shape = list(meta.shape)
    shape[dim] = end - start
    return replace(meta, shape=tuple(shape))


def part_meta(meta: TensorMeta, dim: int, start: int, end: int) -> TensorMeta:
    """The meta of a new (contiguous) tensor shaped like a slice of one with `meta`."""
    return contiguous(slice_meta(meta, dim, start, end))


def contiguous(meta: TensorMeta) -> TensorMeta:
    """`meta` with row-major strides: what an op that computes a new tensor (a matmul, a
    convolution) makes where a view of another tensor stood."""
    return TensorMeta(meta.shape, meta.dtype, meta.itemsize)


def add_slice(g: Graph, name: str, ref: Ref, dim: int, start: int, end: int) -> Ref:
    """A new unit-step slice of `ref` along `dim`."""
    out = slice_meta(g.meta(ref), dim, start, end)
    return Ref(g.add_op(name, SLICE, (ref, dim, start, end), outputs=(out,)))


def conv_backward_mask(graph: Graph, nid: int) -> list[bool] | None:
    """The output mask (input, weight, bias gradients) of a `convolution_backward`, or None."""
    node = graph.node(nid)
    if node.op != CONV_BACKWARD or node.kwargs or len(node.args) != 11:
        return None
    return [bool(m) for m in node.args[10]]


def largest_first(ctx: RuleContext, op: str) -> list[int]:
    """The nodes of `op`, largest first output first (the rewrites that matter most)."""
    nodes = ctx.nodes_of(op)
    return sorted(nodes, key=lambda n: -max(m.nbytes for m in ctx.graph.node(n).outputs))


@dataclass(frozen=True)
class Replacement:
    """New nodes made for old ones by a substitution: `olds` go, `news` (already in the graph,
    in a valid order) run where the first of `olds` ran, and each (old output, new ref) pair
    of `outputs` re-points the old output's readers."""

    olds: tuple[int, ...]
    news: tuple[int, ...]
    outputs: tuple[tuple[Ref, Ref], ...]


def replaced_in_place(
    graph: Graph, items: Iterable[T], replace_one: Callable[[Graph, T], Replacement]
) -> Rewritten:
    """A copy of `graph` with each of `items` replaced by the nodes `replace_one` adds for it
    to the copy: the old outputs' readers re-pointed, the old nodes' control dependencies
    carried to the new ones, the old nodes removed, and the new ones placed where they ran
    (`Rewritten.in_place_of`)."""
    g = graph.copy()
    added: set[int] = set()
    changed: set[int] = set()
    places = []
    for item in items:
        done = replace_one(g, item)
        for old, new in done.outputs:
            changed.update(g.replace_uses(old, new))
        for old in done.olds[::-1]:
            carry_control_deps(g, old, done.news)
            g.remove_node(old)
        added.update(done.news)
        places.append((done.olds, done.news))
    removed = frozenset(n for olds, _ in places for n in olds)
    return Rewritten(
        g,
        frozenset(added),
        frozenset(changed - removed - added),
        removed,
        in_place_of=tuple(places),
    )
