"""Convolution backward, one op into two, and the dual (TASO-style; MAGIS §5, §7.1).

`convolution_backward` computes the input gradient (dgrad) and the weight and bias gradients
(wgrad) in one node that reads the saved input, so the saved input and the new input gradient
are live together. Split, dgrad is the transposed convolution of the output gradient (it reads
no saved input), the scheduler runs wgrad first, and the saved input can die before dgrad
allocates its gradient. A transformer's backward has this freedom already, because its linear
layers' dgrad and wgrad are separate `mm`s. A CNN's backward gets it from this rule, at no extra
work: a GPU library launches the two as separate kernels anyway. The dual merges such a pair
back.

Strides: eager's `convolution_backward` can return the input gradient channels-last (when the
forward's input was a channels-last view, as tokens viewed as an image are), and later `view`s
in the captured backward rely on it; a transposed convolution of a contiguous gradient returns
NCHW. So when the recorded gradient is channels-last, the split puts it back in that layout
(`clone(memory_format=channels_last)`, one copy) and its readers see what eager gave them; the
dual folds that copy away again. A gradient in any other non-contiguous layout is not split.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from magis.ir import Graph, Ref, TensorMeta
from magis.rules.base import Rewritten, RuleContext, RuleKind, group_rule
from magis.rules.taso.common import (
    CONV_BACKWARD,
    CONVOLUTION,
    NOTHING,
    Replacement,
    contiguous,
    conv_backward_mask,
    largest_first,
    replaced_in_place,
)

CLONE = "aten.clone.default"
_RELAYOUT = "_nhwc"  # name suffix of the copy that restores a channels-last input gradient


def _channels_last_strides(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    if len(shape) != 4:
        return None
    n, c, h, w = shape
    return h * w * c, 1, w * c, c


def _needs_relayout(meta: TensorMeta) -> bool | None:
    """Whether eager's input gradient is channels-last (then the split restores it); None
    when it is neither that nor contiguous (then the rule does not apply)."""
    if meta.is_row_major or meta.numel == 0:
        return False
    return True if meta.strides == _channels_last_strides(meta.shape) else None


def _dgrad_output_padding(graph: Graph, nid: int) -> list[int] | None:
    """The output padding that makes the transposed convolution of `nid`'s gradient come out
    at its input's size (a strided convolution drops the last rows: they are put back here),
    or None when no valid one exists."""
    gy, x, w, _, stride, padding, dilation, transposed = graph.node(nid).args[:8]
    if transposed:
        return None
    shapes = graph.meta(gy).shape[2:], graph.meta(x).shape[2:], graph.meta(w).shape[2:]
    params = [_per_dim(v, len(shapes[0])) for v in (stride, padding, dilation)]
    if any(v is None for v in params):
        return None
    pads = []
    for out, size, k, s, p, d in zip(*shapes, *params, strict=True):
        pad = size - ((out - 1) * s - 2 * p + d * (k - 1) + 1)
        if not 0 <= pad < max(s, d):
            return None
        pads.append(pad)
    return pads


def _per_dim(value, dims: int) -> list[int] | None:
    """A convolution's stride, padding or dilation with one entry per spatial dimension (ATen
    takes one entry for all of them: EfficientNet's strided depthwise convolutions have padding [0]),
    or None when it has neither."""
    value = list(value) if isinstance(value, list | tuple) else [value]
    if len(value) == 1:
        return value * dims
    return value if len(value) == dims else None


def _splittable_conv_backward(graph: Graph, nid: int) -> bool:
    mask = conv_backward_mask(graph, nid)
    return (
        mask is not None
        and mask[0]
        and (mask[1] or mask[2])
        and _dgrad_output_padding(graph, nid) is not None
        and _needs_relayout(graph.node(nid).outputs[0]) is not None
    )


def split_conv_backward(graph: Graph, nids: Iterable[int]) -> Rewritten:
    """dgrad as the transposed convolution of the output gradient (which reads no saved
    input), wgrad as a `convolution_backward` that computes only the weight and bias
    gradients, for each of `nids`; the scheduler places the two."""
    return replaced_in_place(graph, nids, _split_one)


def _split_one(g: Graph, nid: int) -> Replacement:
    node = g.node(nid)
    gy, _, w, _, stride, padding, dilation, _, _, groups, mask = node.args
    out = node.outputs
    wgrad = g.add_op(
        f"{node.name}_wgrad",
        node.op,
        (*node.args[:10], [False, bool(mask[1]), bool(mask[2])]),
        outputs=(NOTHING, out[1] if mask[1] else NOTHING, out[2] if mask[2] else NOTHING),
    )
    dgrad = g.add_op(
        f"{node.name}_dgrad",
        CONVOLUTION,
        (gy, w, None, stride, padding, dilation, True, _dgrad_output_padding(g, nid), groups),
        outputs=(contiguous(out[0]),),
    )
    news = [wgrad, dgrad]  # wgrad first: the saved input dies before dgrad allocates
    if _needs_relayout(out[0]):
        news.append(
            g.add_op(
                f"{node.name}_dgrad{_RELAYOUT}",
                CLONE,
                (Ref(dgrad, 0),),
                {"memory_format": torch.channels_last},
                outputs=(out[0],),
            )
        )
    outputs = ((Ref(nid, 0), Ref(news[-1], 0)), *((Ref(nid, i), Ref(wgrad, i)) for i in (1, 2)))
    return Replacement((nid,), tuple(news), outputs)


def conv_backward_pairs(graph: Graph, order, frozen=frozenset()) -> Iterator[tuple[int, int]]:
    """(dgrad, wgrad) pairs as `split_conv_backward` makes them: a transposed convolution of
    an output gradient by a weight, and a weight-gradient-only `convolution_backward` of the
    same gradient, weight and geometry; `order`: the nodes to look at, in schedule order."""
    dgrads: dict[str, int] = {}
    wgrads: dict[str, int] = {}
    for nid in order:
        if nid in frozen:
            continue
        node = graph.node(nid)
        mask = conv_backward_mask(graph, nid)
        if mask is not None and not mask[0] and (mask[1] or mask[2]):
            gy, _, w, _, stride, padding, dilation, _, _, groups, _ = node.args
            wgrads[repr((gy, w, stride, padding, dilation, groups))] = nid
        elif node.op == CONVOLUTION and len(node.args) == 9 and node.args[6] and not node.kwargs:
            gy, w, bias, stride, padding, dilation, _, _, groups = node.args
            if bias is None:
                dgrads[repr((gy, w, stride, padding, dilation, groups))] = nid
    for key, d in dgrads.items():
        w = wgrads.get(key)
        if w is not None and graph.node(d).args[7] == _dgrad_output_padding(graph, w):
            yield d, w


def merge_conv_backward(graph: Graph, pairs: Iterable[tuple[int, int]]) -> Rewritten:
    """The dual: each (dgrad, wgrad) pair as one `convolution_backward` computing both."""
    return replaced_in_place(graph, pairs, _merge_one)


def _merge_one(g: Graph, pair: tuple[int, int]) -> Replacement:
    dgrad, wgrad = pair
    d, w = g.node(dgrad), g.node(wgrad)
    mask = w.args[10]
    name = d.name.removesuffix("_dgrad")
    merged = g.add_op(
        name if name != d.name else f"{d.name}_merged",
        w.op,
        (*w.args[:10], [True, bool(mask[1]), bool(mask[2])]),
        outputs=(d.outputs[0], w.outputs[1], w.outputs[2]),
    )
    relayout = _relayout_of(g, dgrad)
    grad_in = dgrad if relayout is None else relayout
    if relayout is not None:  # the merged backward makes eager's layout itself
        g.restride(merged, (g.node(relayout).outputs[0], *g.node(merged).outputs[1:]))
    outputs = (
        (Ref(grad_in, 0), Ref(merged, 0)),
        *((Ref(wgrad, i), Ref(merged, i)) for i in (1, 2)),
    )
    olds = (dgrad, wgrad) if relayout is None else (dgrad, wgrad, relayout)
    return Replacement(olds, (merged,), outputs)


def _relayout_of(graph: Graph, dgrad: int) -> int | None:
    """The channels-last copy `split_conv_backward` put after `dgrad`, if it did."""
    users = graph.users(dgrad)
    if len(users) == 1:
        user = graph.node(users[0])
        if user.op == CLONE and user.name.endswith(_RELAYOUT):
            return user.id
    return None


def splittable_conv_backwards(ctx: RuleContext) -> list[list[int]]:
    """Every convolution's backward, split in one rewrite (largest first). A CNN has dozens,
    each worth a little and none costing memory once placed (wgrad first), and the searches
    that offered them one at a time spent most of their states on near-identical splits
    (resnet50 under a 0.4 memory limit: 4,059 of 13,000 states, and the limit missed)."""
    nids = [
        n
        for n in largest_first(ctx, CONV_BACKWARD)
        if n not in ctx.frozen and _splittable_conv_backward(ctx.graph, n)
    ]
    return [nids] if nids else []


def dgrad_wgrad_pairs(ctx: RuleContext) -> list[list[tuple[int, int]]]:
    """Every (dgrad, wgrad) pair, merged in one rewrite (the dual's group). Only the two ops'
    nodes are read, from the context's index: a walk of every node was 5-13 ms of each popped
    state of a split decoder, which has none."""
    convs = ctx.nodes_of_ops((CONV_BACKWARD, CONVOLUTION))
    pairs = list(conv_backward_pairs(ctx.graph, convs, ctx.frozen))
    return [pairs] if pairs else []


SPLIT_CONV_BACKWARD = group_rule(
    "split_conv_backward",
    RuleKind.TASO,
    find=splittable_conv_backwards,
    build=split_conv_backward,
    describe=lambda graph, nids: f"split {len(nids)} convolution backwards into dgrad and wgrad",
    memory_saving=True,  # the search tries it with the memory rules
)
MERGE_CONV_BACKWARD = group_rule(
    "merge_conv_backward",
    RuleKind.TASO,
    find=dgrad_wgrad_pairs,
    build=merge_conv_backward,
    describe=lambda graph, pairs: f"merge {len(pairs)} dgrad and wgrad pairs",
)
RULES = (SPLIT_CONV_BACKWARD, MERGE_CONV_BACKWARD)
