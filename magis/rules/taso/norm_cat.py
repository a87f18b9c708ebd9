"""A batch norm's backward over a concatenation, one per part (TASO-style; MAGIS §5).

Batch norm is per channel: channel `c` of `native_batch_norm_backward(g, cat(x_1 .. x_k), w, ..,
mean, invstd, True, eps)` reads only channel `c` of `g`, of the input, of `w` and of the saved
statistics. So the backward over a channel concatenation is the concatenation of the backwards
over its parts, each given its channels of `g`, `w` and the statistics the forward saved (the
forward still normalizes the concatenation: the statistics are its). The concatenated input is
then read by the forward alone and dies there; the parts, which the later layers' concatenations
read anyway, are what the backward keeps.

DenseNet is the case: each layer normalizes the concatenation of every feature map before it,
and each concatenation was saved for its backward, so the saved bytes grew with the square of a
block's depth; the parts are each saved once (the memory-efficient DenseNet's saving, without
its recomputation). A part of `g` is a strided channel slice; it is copied to a contiguous
tensor first, as GPU batch-norm kernels need (the copy is then in the graph, where the simulator
sees it, rather than inside the kernel).
"""

from __future__ import annotations

import torch

from magis.ir import Graph, Ref
from magis.rules.base import Rewritten, RuleContext, RuleKind, group_rule
from magis.rules.taso.common import (
    CAT,
    Replacement,
    add_cat,
    add_slice,
    cat_dim,
    contiguous,
    part_meta,
    replaced_in_place,
)

BN_BACKWARD = "aten.native_batch_norm_backward.default"
CLONE = "aten.clone.default"


def concatenated_parts(graph: Graph, nid: int) -> list[Ref] | None:
    """The parts when `nid` is a training-mode batch norm backward computing all three
    gradients of a channel concatenation of row-major tensors (one, in a DenseNet block's
    first layer: a copy); else None."""
    node = graph.node(nid)
    if node.op != BN_BACKWARD or node.kwargs or len(node.args) != 10:
        return None
    g, x, w, _, _, mean, invstd, train, _, mask = node.args
    if not train or list(mask) != [True, True, True]:
        return None
    if not all(isinstance(r, Ref) for r in (g, x, w, mean, invstd)):
        return None
    cat = graph.node(x.node)
    if cat.op != CAT or cat_dim(cat) not in (1, -3):
        return None
    parts = list(cat.args[0])
    if not all(graph.meta(p).is_row_major for p in parts) or not node.outputs[0].is_row_major:
        return None
    return parts


def bn_backwards_of_cat(ctx: RuleContext) -> list[list[int]]:
    """Every such backward outside frozen regions, split in one rewrite (a DenseNet has one
    per layer, each saving its own concatenation)."""
    graph = ctx.graph
    nids = [
        n
        for n in ctx.nodes_of(BN_BACKWARD)
        if n not in ctx.frozen and concatenated_parts(graph, n) is not None
    ]
    return [nids] if nids else []


def split_bn_backwards_of_cat(graph: Graph, nids: list[int]) -> Rewritten:
    """Each of `nids` as one batch norm backward per part of its concatenated input, their
    three gradients concatenated back along the channels."""
    return replaced_in_place(graph, nids, _split_one)


def _replacing(nid: int, news: list[int], grads: list[Ref]) -> Replacement:
    return Replacement((nid,), tuple(news), tuple((Ref(nid, i), g) for i, g in enumerate(grads)))


def _split_one(g: Graph, nid: int) -> Replacement:
    """The new nodes for `nid`, in a valid order, its three gradients (input, weight, bias)
    read from them."""
    node = g.node(nid)
    gy, _, w, rm, rv, mean, invstd, train, eps, mask = node.args
    parts = concatenated_parts(g, nid)
    if len(parts) == 1:  # a copy: read what it copies
        new = g.add_op(
            f"{node.name}_of_part", node.op, (gy, parts[0], *node.args[2:]), outputs=node.outputs
        )
        return _replacing(nid, [new], [Ref(new, i) for i in range(3)])
    news: list[int] = []
    pieces: list[int] = []
    start = 0
    for i, part in enumerate(parts):
        end = start + g.meta(part).shape[1]

        bounds = (start, end)
        views = {
            label: _channel_view(g, ref, dim, bounds, f"{node.name}_{label}{i}", news)
            for label, ref, dim in (
                ("grad", gy, 1),
                ("weight", w, 0),
                ("running_mean", rm, 0),
                ("running_var", rv, 0),
                ("mean", mean, 0),
                ("invstd", invstd, 0),
            )
        }
        dense = g.add_op(
            f"{node.name}_grad{i}_dense",
            CLONE,
            (views["grad"],),
            {"memory_format": torch.contiguous_format},
            outputs=(contiguous(g.meta(views["grad"])),),
        )
        args = (
            Ref(dense),
            part,
            views["weight"],
            views["running_mean"],
            views["running_var"],
            views["mean"],
            views["invstd"],
            train,
            eps,
            list(mask),
        )
        outs = (
            part_meta(node.outputs[0], 1, start, end),
            part_meta(node.outputs[1], 0, start, end),
            part_meta(node.outputs[2], 0, start, end),
        )
        piece = g.add_op(f"{node.name}_{i}", node.op, args, outputs=outs)
        news.extend((dense, piece))
        pieces.append(piece)
        start = end
    wholes = [
        add_cat(g, f"{node.name}_cat{k}", [Ref(p, k) for p in pieces], dim)
        for k, dim in ((0, 1), (1, 0), (2, 0))
    ]
    return _replacing(nid, [*news, *wholes], [Ref(w) for w in wholes])


def _channel_view(g: Graph, ref, dim: int, bounds: tuple[int, int], name: str, news: list[int]):
    """`ref`'s channels `bounds` along `dim` as a new slice (recorded in `news`); a constant
    argument (an absent running statistic) as it is."""
    if not isinstance(ref, Ref):
        return ref
    view = add_slice(g, name, ref, dim, *bounds)
    news.append(view.node)
    return view


SPLIT_BN_BACKWARD_OF_CAT = group_rule(
    "split_bn_backward_of_cat",
    RuleKind.TASO,
    find=bn_backwards_of_cat,
    build=split_bn_backwards_of_cat,
    describe=lambda graph, nids: f"split {len(nids)} batch norm backwards over concatenations",
    memory_saving=True,  # the search tries it with the memory rules
)
RULES = (SPLIT_BN_BACKWARD_OF_CAT,)
