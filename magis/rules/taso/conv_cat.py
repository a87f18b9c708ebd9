"""Convolutions over concatenations: TASO's conv/concat identities, and their duals.

- On output channels: a convolution by concatenated weights is the concatenation of the
  convolutions by each. A convolution whose output is read only in channel slices — the input
  gradient of a convolution over a concatenation, U-Net's skip connections — becomes one
  convolution per slice. The dual merges them back.
- On input channels: the weight gradient of a convolution over a concatenation is the
  concatenation of the weight gradients over its parts, so the concatenated activation is not
  saved for the backward. The dual merges them back.
"""

from __future__ import annotations

from collections import defaultdict

from magis.ir import Graph, Ref, TensorMeta
from magis.rules.base import Rewritten, RuleContext, RuleKind, group_rule, node_rule
from magis.rules.taso.common import (
    CAT,
    CONV_BACKWARD,
    CONVOLUTION,
    NOTHING,
    SLICE,
    add_cat,
    add_slice,
    cat_dim,
    contiguous,
    conv_backward_mask,
    largest_first,
    part_meta,
)

# --- a convolution whose output channels are read in slices ------------------------------------


def _conv_weight_out_dim(graph: Graph, nid: int) -> int | None:
    """The weight dimension that indexes `nid`'s output channels (0 for a convolution, 1 for
    a transposed one), or None for a grouped convolution (its channels interleave groups)."""
    node = graph.node(nid)
    if node.op != CONVOLUTION or len(node.args) != 9 or node.kwargs or node.args[8] != 1:
        return None
    return 1 if node.args[6] else 0


def _channel_slice(graph: Graph, nid: int) -> tuple[int, int] | None:
    """(start, end) of a unit-step slice along dim 1, or None."""
    node = graph.node(nid)
    if node.op != SLICE or len(node.args) < 4 or node.kwargs or node.args[1] != 1:
        return None
    if (node.args[4] if len(node.args) > 4 else 1) != 1:
        return None
    return node.args[2], node.args[3]


def channel_sliced_conv(graph: Graph, nid: int) -> list[tuple[int, int, int]] | None:
    """(slice node, start, end) for each reader of convolution `nid` when every reader is a
    channel slice and the slices partition the channels (a concatenation's backward reads an
    input gradient so), at least two of them; else None."""
    if _conv_weight_out_dim(graph, nid) is None or Ref(nid) in graph.outputs:
        return None
    users = graph.users(nid)
    bounds = [(u, *b) for u in users if (b := _channel_slice(graph, u)) is not None]
    if len(bounds) < 2 or len(bounds) != len(users):
        return None
    bounds.sort(key=lambda x: x[1])
    edges = [0] + [b[2] for b in bounds]
    if [b[1] for b in bounds] != edges[:-1] or edges[-1] != graph.meta(Ref(nid)).shape[1]:
        return None
    return bounds


def split_conv_output(graph: Graph, nid: int) -> Rewritten:
    """conv(x, [W_1 .. W_k]) = [conv(x, W_1) .. conv(x, W_k)] along the output channels (a
    TASO substitution): each channel slice of the output becomes a convolution by that slice
    of the weight (and bias). The concatenated gradient of U-Net's skip connections then never
    exists whole; each piece is computed when its reader runs (the scheduler places them)."""
    g = graph.copy()
    node = g.node(nid)
    x, w, bias, *geometry = node.args
    wdim = _conv_weight_out_dim(g, nid)
    added, changed, places = [], set(), []
    slices = channel_sliced_conv(g, nid)
    for s, start, end in slices:
        name = g.node(s).name
        ws = add_slice(g, f"{name}_weight", w, wdim, start, end)
        bs = None if bias is None else add_slice(g, f"{name}_bias", bias, 0, start, end)
        conv = g.add_op(
            f"{name}_conv",
            CONVOLUTION,
            (x, ws, bs, *geometry),
            outputs=(contiguous(g.meta(Ref(s))),),
        )
        piece = (ws.node, *([bs.node] if bs is not None else []), conv)
        added += piece
        readers = g.replace_uses(Ref(s), Ref(conv))
        changed.update(readers)
        places.append((tuple(readers), piece))  # each piece right before its first reader
        g.remove_node(s)
    removed = {nid, *(s for s, _, _ in slices)}
    g.remove_node(nid)
    return Rewritten(
        g,
        frozenset(added),
        frozenset(changed - removed),
        frozenset(removed),
        in_place_of=tuple(places),
    )


def sliced_weight_convs(graph: Graph, order, frozen=frozenset()) -> list[list[int]]:
    """Groups of convolutions that `split_conv_output` made: the same input and geometry,
    weights (and biases) that are channel slices partitioning one weight, in channel order."""
    groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for nid in order:
        wdim = _conv_weight_out_dim(graph, nid)
        if wdim is None or nid in frozen:
            continue
        x, w, bias, *geometry = graph.node(nid).args
        wnode = graph.node(w.node)
        if wnode.op != SLICE or len(wnode.args) != 4 or wnode.args[1] != wdim:
            continue
        bias_src = None
        if bias is not None:
            bnode = graph.node(bias.node)
            if bnode.op != SLICE or tuple(bnode.args[1:]) != (0, *wnode.args[2:4]):
                continue
            bias_src = bnode.args[0]
        key = (x, wnode.args[0], bias_src, repr(geometry))
        groups[key].append((wnode.args[2], nid))
    out = []
    for (_, w, _, _), members in groups.items():
        members.sort()
        ends = [graph.node(graph.node(n).args[1].node).args[3] for _, n in members]
        starts = [s for s, _ in members]
        wdim = _conv_weight_out_dim(graph, members[0][1])
        full = graph.meta(w).shape[wdim]
        if len(members) >= 2 and starts == [0, *ends[:-1]] and ends[-1] == full:
            out.append([n for _, n in members])
    return out


def merge_conv_output(graph: Graph, convs: list[int]) -> Rewritten:
    """The dual: convolutions by channel slices of one weight, of the same input, become one
    convolution whose output the old readers read in slices."""
    g = graph.copy()
    first = g.node(convs[0])
    x, ws, bs, *geometry = first.args
    w = g.node(ws.node).args[0]
    bias = None if bs is None else g.node(bs.node).args[0]
    shape = list(first.outputs[0].shape)
    shape[1] = sum(g.node(c).outputs[0].shape[1] for c in convs)
    out = TensorMeta(tuple(shape), first.outputs[0].dtype, first.outputs[0].itemsize)
    name = first.name.removesuffix("_conv")
    merged = g.add_op(f"{name}_merged", CONVOLUTION, (x, w, bias, *geometry), outputs=(out,))
    added, changed, removed = [merged], set(), set()
    olds = tuple(
        c for conv in convs for c in (conv, *(r.node for r in g.node(conv).args[1:3] if r))
    )
    for c in convs:
        node = g.node(c)
        start, end = g.node(node.args[1].node).args[2:4]
        piece = add_slice(g, node.name.removesuffix("_conv"), Ref(merged), 1, start, end)
        added.append(piece.node)
        changed.update(g.replace_uses(Ref(c), piece))
        weight_views = [r.node for r in node.args[1:3] if r is not None]
        g.remove_node(c)
        removed.add(c)
        for v in weight_views:
            if not g.users(v):
                g.remove_node(v)
                removed.add(v)
    return Rewritten(
        g,
        frozenset(added),
        frozenset(changed - removed),
        frozenset(removed),
        in_place_of=((olds, tuple(added)),),  # where the first piece (or its weight view) ran
    )


# --- a weight gradient over a concatenated input -------------------------------------------------


def wgrad_of_cat(graph: Graph, nid: int) -> list[Ref] | None:
    """The concatenated parts when `nid` is a weight-gradient-only `convolution_backward`
    (as `split_conv_backward` makes them) of an ungrouped convolution whose input is a channel
    concatenation; else None."""
    mask = conv_backward_mask(graph, nid)
    if mask is None or mask[0] or not mask[1]:
        return None
    args = graph.node(nid).args
    if args[7] or args[9] != 1:  # transposed or grouped
        return None
    cat = graph.node(args[1].node)
    if cat.op != CAT or cat_dim(cat) not in (1, -3):
        return None
    return list(cat.args[0]) if len(cat.args[0]) >= 2 else None


def split_wgrad_of_cat(graph: Graph, nid: int) -> Rewritten:
    """dW of conv(cat(x_1 .. x_k), W) = cat(dW_1 .. dW_k) along W's input channels, dW_i the
    weight gradient of conv(x_i, W_i) (TASO's conv/concat identity on input channels): the
    weight gradient reads the parts, not their concatenation, so the concatenated activation
    need not live from the forward pass to the backward. U-Net++'s dense skip connections
    concatenate up to five maps per node."""
    g = graph.copy()
    node = g.node(nid)
    gy, _, w, bias_sizes, *geometry, mask = node.args
    added, start = [], 0
    for i, part in enumerate(wgrad_of_cat(g, nid)):
        end = start + g.meta(part).shape[1]
        ws = add_slice(g, f"{node.name}_weight{i}", w, 1, start, end)
        bias = bool(mask[2]) and i == 0  # the bias gradient reads only the output gradient
        piece = g.add_op(
            f"{node.name}_{i}",
            node.op,
            (gy, part, ws, bias_sizes, *geometry, [False, True, bias]),
            outputs=(
                NOTHING,
                part_meta(node.outputs[1], 1, start, end),
                node.outputs[2] if bias else NOTHING,
            ),
        )
        added += [ws.node, piece]
        start = end
    pieces = [Ref(p, 1) for p in added[1::2]]
    whole = add_cat(g, f"{node.name}_cat", pieces, 1)
    changed = set(g.replace_uses(Ref(nid, 1), Ref(whole)))
    if mask[2]:
        changed.update(g.replace_uses(Ref(nid, 2), Ref(added[1], 2)))
    g.remove_node(nid)
    added.append(whole)
    return Rewritten(
        g,
        frozenset(added),
        frozenset(changed - {nid}),
        frozenset({nid}),
        in_place_of=(((nid,), tuple(added)),),
    )


def cat_of_wgrads(graph: Graph, nid: int) -> list[int] | None:
    """The weight-gradient pieces when `nid` is the cat `split_wgrad_of_cat` made: pieces of
    one output gradient and geometry, by consecutive input-channel slices of one weight, over
    the parts of one concatenation in order; else None."""
    node = graph.node(nid)
    if node.op != CAT or cat_dim(node) != 1 or any(r.index != 1 for r in node.args[0]):
        return None
    pieces = [r.node for r in node.args[0]]
    nodes = [graph.node(p) for p in pieces]
    if any(conv_backward_mask(graph, p) is None for p in pieces):
        return None
    key = {(n.args[0], repr(n.args[3:10])) for n in nodes}
    if len(key) != 1 or not all(isinstance(n.args[2], Ref) for n in nodes):
        return None
    views = [graph.node(n.args[2].node) for n in nodes]
    if any(v.op != SLICE or v.args[1] != 1 for v in views):
        return None
    w = views[0].args[0]
    bounds = [tuple(v.args[2:4]) for v in views]
    edges = [0] + [b[1] for b in bounds]
    if len({v.args[0] for v in views}) != 1 or [b[0] for b in bounds] != edges[:-1]:
        return None
    if edges[-1] != graph.meta(w).shape[1]:
        return None
    if any(n.args[10][0] for n in nodes):  # a piece that also computes an input gradient
        return None
    return pieces if _cat_of(graph, [n.args[1] for n in nodes]) is not None else None


def _cat_of(graph: Graph, parts: list[Ref]) -> int | None:
    """A channel concatenation of exactly `parts`, in order, or None."""
    for u in graph.users(parts[0].node):
        node = graph.node(u)
        if node.op == CAT and list(node.args[0]) == parts and cat_dim(node) in (1, -3):
            return u
    return None


def merge_wgrads_of_cat(graph: Graph, nid: int) -> Rewritten:
    """The dual: the concatenated weight-gradient pieces as one weight gradient over the
    concatenation of their inputs."""
    g = graph.copy()
    pieces = cat_of_wgrads(g, nid)
    nodes = [g.node(p) for p in pieces]
    cat = _cat_of(g, [n.args[1] for n in nodes])
    first = nodes[0]
    w = g.node(first.args[2].node).args[0]
    bias = [n for n in nodes if n.args[10][2]]
    mask = [False, True, bool(bias)]
    out = g.meta(Ref(nid))
    merged = g.add_op(
        first.name.removesuffix("_0"),
        first.op,
        (first.args[0], Ref(cat), w, *first.args[3:10], mask),
        outputs=(NOTHING, out, bias[0].outputs[2] if bias else NOTHING),
    )
    changed = set(g.replace_uses(Ref(nid), Ref(merged, 1)))
    if bias:
        changed.update(g.replace_uses(Ref(bias[0].id, 2), Ref(merged, 2)))
    g.remove_node(nid)
    removed = [nid]
    for n in nodes:
        view = n.args[2].node
        g.remove_node(n.id)
        removed.append(n.id)
        if not g.users(view):
            g.remove_node(view)
            removed.append(view)
    return Rewritten(
        g,
        frozenset({merged}),
        frozenset(changed - set(removed)),
        frozenset(removed),
        in_place_of=((tuple(removed), (merged,)),),
    )


def _sliced_weight_convs(ctx: RuleContext) -> list[list[int]]:
    return sliced_weight_convs(ctx.graph, ctx.nodes_of(CONVOLUTION), ctx.frozen)


SPLIT_CONV_OUTPUT = node_rule(
    "split_conv_output",
    RuleKind.TASO,
    accepts=lambda graph, n: channel_sliced_conv(graph, n) is not None,
    build=split_conv_output,
    describe=lambda graph, n: f"split {graph.node(n).name} by its channel slices",
    order=lambda ctx: largest_first(ctx, CONVOLUTION),
    memory_saving=True,  # the search tries it with the memory rules
)
MERGE_CONV_OUTPUT = group_rule(
    "merge_conv_output",
    RuleKind.TASO,
    find=_sliced_weight_convs,
    build=merge_conv_output,
    describe=lambda graph, convs: f"merge {len(convs)} convolutions by slices of one weight",
)
SPLIT_WGRAD_OF_CAT = node_rule(
    "split_wgrad_of_cat",
    RuleKind.TASO,
    accepts=lambda graph, n: wgrad_of_cat(graph, n) is not None,
    build=split_wgrad_of_cat,
    describe=lambda graph, n: f"split {graph.node(n).name} by the parts of its input",
    order=lambda ctx: largest_first(ctx, CONV_BACKWARD),
    memory_saving=True,  # the search tries it with the memory rules
)
MERGE_WGRADS_OF_CAT = node_rule(
    "merge_wgrads_of_cat",
    RuleKind.TASO,
    accepts=lambda graph, n: cat_of_wgrads(graph, n) is not None,
    build=merge_wgrads_of_cat,
    describe=lambda graph, n: f"merge the weight gradients of {graph.node(n).name}",
    ops=(CAT,),
)
RULES = (SPLIT_CONV_OUTPUT, MERGE_CONV_OUTPUT, SPLIT_WGRAD_OF_CAT, MERGE_WGRADS_OF_CAT)
