"""TASO-style substitutions that matter in training graphs (thesis ch. 3; MAGIS §5, §7.1).

- Merging parallel matmuls that share an input (the QKV projections, A-Trans): k matmuls
  `x @ W_i (+ b_i)` become one `x @ [W_1 .. W_k] (+ [b_1 .. b_k])` whose column slices feed the
  old users; `W_i^T @ g` style matmuls sharing their *second* operand stack their first operands
  by rows instead, and their row slices are contiguous. The dual splits such a merged matmul back.
- Concat/split algebra: a slice that exactly covers one input of a cat is that input.
- Distributivity: a*c + b*c = (a + b)*c, and back.
- Convolution backward, one op into two: `convolution_backward` computes the input gradient
  (dgrad) and the weight and bias gradients (wgrad) in one node that reads the saved input,
  so the saved input and the new input gradient are live together. Split, dgrad is the
  transposed convolution of the output gradient (it reads no saved input), the scheduler
  runs wgrad first, and the saved input can die before dgrad allocates its gradient. A transformer's backward has this
  freedom already, because its linear layers' dgrad and wgrad are separate `mm`s. A CNN's
  backward gets it from this rule, at no extra work: a GPU library launches the two as
  separate kernels anyway. The dual merges such a pair back.
- A convolution by concatenated weights is the concatenation of the convolutions by each
  (TASO's conv/concat identity, on output channels): a convolution whose output is read only
  in channel slices — the input gradient of a convolution over a concatenation, U-Net's skip
  connections — becomes one convolution per slice. The dual merges them back. On input
  channels: the weight gradient of a convolution over a concatenation is the concatenation
  of the weight gradients over its parts, so the concatenated activation is not saved for
  the backward. The dual merges them back.

Each rule is checked the TASO way (thesis §3.4): by running the rewritten program on random
inputs and comparing with the original (tests/test_taso.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator

from magis.ir import Graph, Ref, TensorMeta
from magis.rules.base import Rewrite, Rewritten, Rule, RuleContext, RuleKind, node_rewrites

MM, ADDMM = "aten.mm.default", "aten.addmm.default"
CAT, SLICE = "aten.cat.default", "aten.slice.Tensor"
ADD, MUL = "aten.add.Tensor", "aten.mul.Tensor"


def canonical(graph: Graph, ref: Ref) -> tuple:
    """A key equal for values that are the same view of the same tensor (make_fx records a
    separate `view` node for every `x.view(...)`, so parallel projections read twins)."""
    node = graph.node(ref.node)
    if node.is_placeholder or not graph.info(ref.node).is_view:
        return ("value", ref.node, ref.index)
    consts = tuple(a for a in node.args[1:])
    return ("view", node.op, canonical(graph, node.inputs[0]), repr(consts), ref.index)


def _operands(graph: Graph, nid: int) -> tuple[Ref | None, Ref, Ref]:
    """(bias or None, left, right) of an mm/addmm node."""
    node = graph.node(nid)
    if node.op == ADDMM:
        return node.args[0], node.args[1], node.args[2]
    return None, node.args[0], node.args[1]


def _addmm_is_plain(graph: Graph, nid: int) -> bool:
    node = graph.node(nid)
    if node.op != ADDMM:
        return True
    bias = graph.meta(node.args[0])
    return (
        len(bias.shape) == 1
        and dict(node.kwargs).get("beta", 1) == 1
        and dict(node.kwargs).get("alpha", 1) == 1
    )


def parallel_groups(ctx: RuleContext) -> Iterator[tuple[str, list[int]]]:
    """Groups of >= 2 matmuls of one kind sharing an operand ('left': same x, merge columns;
    'right': same second operand, merge rows), largest groups first."""
    graph = ctx.graph
    by_left: dict[tuple, list[int]] = defaultdict(list)
    by_right: dict[tuple, list[int]] = defaultdict(list)
    for nid in ctx.order:
        node = graph.node(nid)
        if node.op not in (MM, ADDMM) or nid in ctx.frozen or not _addmm_is_plain(graph, nid):
            continue
        bias, left, right = _operands(graph, nid)
        kind = node.op
        by_left[(kind, canonical(graph, left), graph.meta(right).shape)].append(nid)
        if node.op == MM:
            by_right[(kind, canonical(graph, right), graph.meta(left).shape)].append(nid)
    groups = [("left", g) for g in by_left.values() if len(g) > 1]
    groups += [("right", g) for g in by_right.values() if len(g) > 1]
    groups.sort(key=lambda kg: -len(kg[1]))
    yield from groups


def merge_matmuls(graph: Graph, side: str, group: list[int]) -> Rewritten:
    g = graph.copy()
    first = g.node(group[0])
    added: list[int] = []
    changed: set[int] = set()
    ops = [_operands(g, n) for n in group]
    if side == "left":  # x @ [W_1 .. W_k]: concatenate the right operands' columns
        dim = 1
        shared = ops[0][1]
        right_cat = _add_cat(g, f"{first.name}_wcat", [o[2] for o in ops], 1)
        added.append(right_cat)
        if first.op == ADDMM:
            bias_cat = _add_cat(g, f"{first.name}_bcat", [o[0] for o in ops], 0)
            added.append(bias_cat)
            args = (Ref(bias_cat), shared, Ref(right_cat))
        else:
            args = (shared, Ref(right_cat))
        width = sum(g.meta(o[2]).shape[1] for o in ops)
        out_shape = (g.meta(shared).shape[0], width)
    else:  # [A_1; ..; A_k] @ y: stack the left operands' rows (row slices stay contiguous)
        dim = 0
        shared = ops[0][2]
        left_cat = _add_cat(g, f"{first.name}_acat", [o[1] for o in ops], 0)
        added.append(left_cat)
        args = (Ref(left_cat), shared)
        out_shape = (sum(g.meta(o[1]).shape[0] for o in ops), g.meta(shared).shape[1])
    meta = g.meta(Ref(group[0]))
    merged = g.add_op(
        f"{first.name}_merged",
        first.op,
        args,
        dict(first.kwargs),
        (TensorMeta(out_shape, meta.dtype, meta.itemsize),),
    )
    added.append(merged)
    start = 0
    for nid in group:
        width = g.meta(Ref(nid)).shape[dim]
        part = g.add_op(
            f"{g.node(nid).name}_part",
            SLICE,
            (Ref(merged), dim, start, start + width),
            outputs=(g.meta(Ref(nid)),),
        )
        added.append(part)
        changed.update(g.replace_uses(Ref(nid), Ref(part)))
        start += width
    for nid in group:
        g.remove_node(nid)
    return Rewritten(g, frozenset(added), frozenset(changed - set(group)), frozenset(group))


def _add_cat(g: Graph, name: str, parts: list[Ref], dim: int) -> int:
    metas = [g.meta(p) for p in parts]
    shape = list(metas[0].shape)
    shape[dim] = sum(m.shape[dim] for m in metas)
    out = TensorMeta(tuple(shape), metas[0].dtype, metas[0].itemsize)
    return g.add_op(name, CAT, (list(parts), dim), outputs=(out,))


def split_matmul(graph: Graph, merged: int) -> Rewritten:
    """The dual: a matmul over cat'ed operands whose users are all slices of it becomes one
    matmul per slice."""
    g = graph.copy()
    node = g.node(merged)
    bias, left, right = _operands(g, merged)
    slices = sorted(g.users(merged), key=lambda s: g.node(s).args[2])
    dim = g.node(slices[0]).args[1]
    cat_ref = right if dim == 1 else left
    parts = g.node(cat_ref.node).args[0]
    bias_parts = g.node(bias.node).args[0] if bias is not None else [None] * len(parts)
    added, changed = [], set()
    for s, part, b in zip(slices, parts, bias_parts, strict=True):
        if dim == 1:
            args = (b, left, part) if bias is not None else (left, part)
        else:
            args = (part, right)
        one = g.add_op(f"{g.node(s).name}_mm", node.op, args, dict(node.kwargs), (g.meta(Ref(s)),))
        added.append(one)
        changed.update(g.replace_uses(Ref(s), Ref(one)))
    removed = set(slices) | {merged}
    for s in slices:
        g.remove_node(s)
    g.remove_node(merged)
    for cat in {cat_ref.node, *([bias.node] if bias is not None else [])}:
        if not g.users(cat):
            g.remove_node(cat)
            removed.add(cat)
    return Rewritten(g, frozenset(added), frozenset(changed - removed), frozenset(removed))


def _is_merged_matmul(graph: Graph, nid: int) -> bool:
    node = graph.node(nid)
    if node.op not in (MM, ADDMM):
        return False
    users = graph.users(nid)
    if not users or any(graph.node(u).op != SLICE for u in users):
        return False
    dim = graph.node(users[0]).args[1]
    if any(graph.node(u).args[1] != dim for u in users):
        return False
    bias, left, right = _operands(graph, nid)
    cat_ref = right if dim == 1 else left
    cat = graph.node(cat_ref.node)
    if cat.op != CAT or cat.args[1] != (1 if dim == 1 else 0) or len(cat.args[0]) != len(users):
        return False
    if dim == 0 and node.op == ADDMM:
        return False
    if bias is not None and graph.node(bias.node).op != CAT:
        return False
    widths = [graph.meta(p).shape[dim] for p in cat.args[0]]
    bounds = sorted((graph.node(u).args[2], graph.node(u).args[3]) for u in users)
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return bounds == [(s, s + w) for s, w in zip(starts, widths, strict=True)]


def _match_merge(ctx: RuleContext) -> Iterator[Rewrite]:
    for side, group in parallel_groups(ctx):
        names = ", ".join(ctx.graph.node(n).name for n in group)
        yield Rewrite(
            "merge_matmul",
            RuleKind.TASO,
            f"merge parallel matmuls {names}",
            lambda s=side, g=group: merge_matmuls(ctx.graph, s, g),
        )


def _match_split(ctx: RuleContext) -> Iterator[Rewrite]:
    g = ctx.graph
    return node_rewrites(
        ctx,
        "split_matmul",
        RuleKind.TASO,
        lambda n: _is_merged_matmul(g, n),
        lambda n: f"split {g.node(n).name}",
        lambda n: split_matmul(g, n),
    )


def slice_of_cat(graph: Graph, nid: int) -> Ref | None:
    """The cat input a slice covers exactly, or None (concat/split algebra)."""
    node = graph.node(nid)
    if node.op != SLICE or len(node.args) < 4:
        return None
    src = graph.node(node.args[0].node)
    if src.op != CAT or node.args[1] != (src.args[1] if len(src.args) > 1 else 0):
        return None
    step = node.args[4] if len(node.args) > 4 else 1
    dim, start, end = node.args[1], node.args[2], node.args[3]
    offset = 0
    for part in src.args[0]:
        width = graph.meta(part).shape[dim]
        if (start, end, step) == (offset, offset + width, 1):
            return part
        offset += width
    return None


def fold_slice_of_cat(graph: Graph, nid: int) -> Rewritten:
    g = graph.copy()
    part = slice_of_cat(g, nid)
    changed = set(g.replace_uses(Ref(nid), part))
    g.remove_node(nid)
    return Rewritten(g, frozenset(), frozenset(changed), frozenset({nid}))


def _match_fold(ctx: RuleContext) -> Iterator[Rewrite]:
    g = ctx.graph
    return node_rewrites(
        ctx,
        "fold_slice_of_cat",
        RuleKind.TASO,
        lambda n: slice_of_cat(g, n) is not None,
        lambda n: f"fold {g.node(n).name}",
        lambda n: fold_slice_of_cat(g, n),
    )


def _distributable(graph: Graph, nid: int) -> tuple[Ref, Ref, Ref] | None:
    """(a, b, c) when `nid` is a*c + b*c with both products used only here and alpha 1."""
    node = graph.node(nid)
    if node.op != ADD or dict(node.kwargs).get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    left, right = node.args
    if not isinstance(left, Ref) or not isinstance(right, Ref) or left.node == right.node:
        return None
    lhs, rhs = graph.node(left.node), graph.node(right.node)
    if (
        lhs.op != MUL
        or rhs.op != MUL
        or graph.users(left.node) != [nid]
        or graph.users(right.node) != [nid]
    ):
        return None
    if not all(isinstance(a, Ref) for a in (*lhs.args, *rhs.args)):
        return None
    for a, c in ((lhs.args[0], lhs.args[1]), (lhs.args[1], lhs.args[0])):
        for b, c2 in ((rhs.args[0], rhs.args[1]), (rhs.args[1], rhs.args[0])):
            same_shapes = graph.meta(a) == graph.meta(b) == graph.node(nid).outputs[0]
            if c == c2 and same_shapes:
                return a, b, c
    return None


def factor(graph: Graph, nid: int) -> Rewritten:
    """a*c + b*c -> (a + b)*c."""
    g = graph.copy()
    a, b, c = _distributable(g, nid)
    out = g.node(nid).outputs[0]
    total = g.add_op(f"{g.node(nid).name}_sum", ADD, (a, b), outputs=(out,))
    product = g.add_op(f"{g.node(nid).name}_factored", MUL, (Ref(total), c), outputs=(out,))
    changed = set(g.replace_uses(Ref(nid), Ref(product)))
    muls = [r.node for r in g.node(nid).inputs]
    g.remove_node(nid)
    for m in muls:
        g.remove_node(m)
    return Rewritten(g, frozenset({total, product}), frozenset(changed), frozenset({nid, *muls}))


def _expandable(graph: Graph, nid: int) -> tuple[Ref, Ref, Ref] | None:
    """(a, b, c) when `nid` is (a + b)*c with the sum used only here."""
    node = graph.node(nid)
    if node.op != MUL or len(node.args) != 2 or not all(isinstance(x, Ref) for x in node.args):
        return None
    for s, c in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        total = graph.node(s.node)
        if (
            total.op == ADD
            and graph.users(s.node) == [nid]
            and dict(total.kwargs).get("alpha", 1) == 1
        ):
            a, b = total.args[0], total.args[1]
            if (
                isinstance(a, Ref)
                and isinstance(b, Ref)
                and graph.meta(a) == graph.meta(b) == node.outputs[0]
            ):
                return a, b, c
    return None


def expand(graph: Graph, nid: int) -> Rewritten:
    """(a + b)*c -> a*c + b*c."""
    g = graph.copy()
    a, b, c = _expandable(g, nid)
    out = g.node(nid).outputs[0]
    name = g.node(nid).name
    ac = g.add_op(f"{name}_l", MUL, (a, c), outputs=(out,))
    bc = g.add_op(f"{name}_r", MUL, (b, c), outputs=(out,))
    total = g.add_op(f"{name}_expanded", ADD, (Ref(ac), Ref(bc)), outputs=(out,))
    changed = set(g.replace_uses(Ref(nid), Ref(total)))
    old_sum = next(
        r.node for r in g.node(nid).inputs if g.node(r.node).op == ADD and g.users(r.node) == [nid]
    )
    g.remove_node(nid)
    g.remove_node(old_sum)
    return Rewritten(g, frozenset({ac, bc, total}), frozenset(changed), frozenset({nid, old_sum}))


def _match_factor(ctx: RuleContext) -> Iterator[Rewrite]:
    g = ctx.graph
    return node_rewrites(
        ctx,
        "factor",
        RuleKind.TASO,
        lambda n: _distributable(g, n) is not None,
        lambda n: f"factor {g.node(n).name}",
        lambda n: factor(g, n),
    )


def _match_expand(ctx: RuleContext) -> Iterator[Rewrite]:
    g = ctx.graph
    return node_rewrites(
        ctx,
        "expand",
        RuleKind.TASO,
        lambda n: _expandable(g, n) is not None,
        lambda n: f"expand {g.node(n).name}",
        lambda n: expand(g, n),
    )


CONV_BACKWARD = "aten.convolution_backward.default"
CONVOLUTION = "aten.convolution.default"
_NOTHING = TensorMeta((0,), "float32", 4)  # what a masked-out gradient is (an empty tensor)


def _conv_backward_mask(graph: Graph, nid: int) -> list[bool] | None:
    node = graph.node(nid)
    if node.op != CONV_BACKWARD or node.kwargs or len(node.args) != 11:
        return None
    return [bool(m) for m in node.args[10]]


def _dgrad_output_padding(graph: Graph, nid: int) -> list[int] | None:
    """The output padding that makes the transposed convolution of `nid`'s gradient come out
    at its input's size (a strided convolution drops the last rows: they are put back here),
    or None when no valid one exists."""
    gy, x, w, _, stride, padding, dilation, transposed = graph.node(nid).args[:8]
    if transposed:
        return None
    shapes = graph.meta(gy).shape[2:], graph.meta(x).shape[2:], graph.meta(w).shape[2:]
    pads = []
    for out, size, k, s, p, d in zip(*shapes, stride, padding, dilation, strict=True):
        pad = size - ((out - 1) * s - 2 * p + d * (k - 1) + 1)
        if not 0 <= pad < max(s, d):
            return None
        pads.append(pad)
    return pads


def _splittable_conv_backward(graph: Graph, nid: int) -> bool:
    mask = _conv_backward_mask(graph, nid)
    return (
        mask is not None
        and mask[0]
        and (mask[1] or mask[2])
        and _dgrad_output_padding(graph, nid) is not None
    )


def split_conv_backward(graph: Graph, nids: Iterable[int]) -> Rewritten:
    """dgrad as the transposed convolution of the output gradient (which reads no saved
    input), wgrad as a `convolution_backward` that computes only the weight and bias
    gradients, for each of `nids`; the scheduler places the two."""
    g = graph.copy()
    added: set[int] = set()
    changed: set[int] = set()
    places = []
    for nid in nids:
        node = g.node(nid)
        gy, _, w, _, stride, padding, dilation, _, _, groups, mask = node.args
        out = node.outputs
        wgrad = g.add_op(
            f"{node.name}_wgrad",
            node.op,
            (*node.args[:10], [False, bool(mask[1]), bool(mask[2])]),
            outputs=(_NOTHING, out[1] if mask[1] else _NOTHING, out[2] if mask[2] else _NOTHING),
        )
        dgrad = g.add_op(
            f"{node.name}_dgrad",
            CONVOLUTION,
            (gy, w, None, stride, padding, dilation, True, _dgrad_output_padding(g, nid), groups),
            outputs=(out[0],),
        )
        changed.update(g.replace_uses(Ref(nid, 0), Ref(dgrad, 0)))
        for i in (1, 2):
            changed.update(g.replace_uses(Ref(nid, i), Ref(wgrad, i)))
        g.remove_node(nid)
        added |= {dgrad, wgrad}
        places.append(((nid,), (wgrad, dgrad)))  # wgrad first: the saved input dies before
    removed = frozenset(nids)
    return Rewritten(
        g,
        frozenset(added),
        frozenset(changed - removed - added),
        removed,
        in_place_of=tuple(places),
    )


def conv_backward_pairs(graph: Graph, order, frozen=frozenset()) -> Iterator[tuple[int, int]]:
    """(dgrad, wgrad) pairs as `split_conv_backward` makes them: a transposed convolution of
    an output gradient by a weight, and a weight-gradient-only `convolution_backward` of the
    same gradient, weight and geometry."""
    dgrads: dict[str, int] = {}
    wgrads: dict[str, int] = {}
    for nid in order:
        if nid in frozen:
            continue
        node = graph.node(nid)
        mask = _conv_backward_mask(graph, nid)
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
    g = graph.copy()
    added: set[int] = set()
    changed: set[int] = set()
    places = []
    for dgrad, wgrad in pairs:
        d, w = g.node(dgrad), g.node(wgrad)
        mask = w.args[10]
        name = d.name.removesuffix("_dgrad")
        merged = g.add_op(
            name if name != d.name else f"{d.name}_merged",
            w.op,
            (*w.args[:10], [True, bool(mask[1]), bool(mask[2])]),
            outputs=(d.outputs[0], w.outputs[1], w.outputs[2]),
        )
        changed.update(g.replace_uses(Ref(dgrad, 0), Ref(merged, 0)))
        for i in (1, 2):
            changed.update(g.replace_uses(Ref(wgrad, i), Ref(merged, i)))
        g.remove_node(dgrad)
        g.remove_node(wgrad)
        added.add(merged)
        places.append(((dgrad, wgrad), (merged,)))
    removed = frozenset(n for olds, _ in places for n in olds)
    return Rewritten(
        g,
        frozenset(added),
        frozenset(changed - removed - added),
        removed,
        in_place_of=tuple(places),
    )


def _match_split_conv_backward(ctx: RuleContext) -> Iterator[Rewrite]:
    """Every convolution's backward split in one rewrite. A CNN has dozens, each worth a little
    and none costing memory once placed (wgrad first), and the searches that offered them one
    at a time spent most of their states on near-identical splits (resnet50 under a 0.4
    memory limit: 4,059 of 13,000 states, and the limit missed)."""
    nids = [
        n
        for n in _largest_first(ctx, CONV_BACKWARD)
        if n not in ctx.frozen and _splittable_conv_backward(ctx.graph, n)
    ]
    if nids:
        yield Rewrite(
            "split_conv_backward",
            RuleKind.TASO,
            f"split {len(nids)} convolution backwards into dgrad and wgrad",
            lambda: split_conv_backward(ctx.graph, nids),
        )


def _largest_first(ctx: RuleContext, op: str) -> list[int]:
    """The nodes of `op`, largest first output first (the rewrites that matter most)."""
    nodes = [n for n in ctx.order if ctx.graph.node(n).op == op]
    return sorted(nodes, key=lambda n: -max(m.nbytes for m in ctx.graph.node(n).outputs))


def _match_merge_conv_backward(ctx: RuleContext) -> Iterator[Rewrite]:
    pairs = list(conv_backward_pairs(ctx.graph, ctx.order, ctx.frozen))
    if pairs:
        yield Rewrite(
            "merge_conv_backward",
            RuleKind.TASO,
            f"merge {len(pairs)} dgrad and wgrad pairs",
            lambda: merge_conv_backward(ctx.graph, pairs),
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


def _slice_meta(meta: TensorMeta, dim: int, start: int, end: int) -> TensorMeta:
    shape = list(meta.shape)
    shape[dim] = end - start
    return TensorMeta(tuple(shape), meta.dtype, meta.itemsize)


def _add_slice(g: Graph, name: str, ref: Ref, dim: int, start: int, end: int) -> Ref:
    out = _slice_meta(g.meta(ref), dim, start, end)
    return Ref(g.add_op(name, SLICE, (ref, dim, start, end), outputs=(out,)))


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
        ws = _add_slice(g, f"{name}_weight", w, wdim, start, end)
        bs = None if bias is None else _add_slice(g, f"{name}_bias", bias, 0, start, end)
        conv = g.add_op(
            f"{name}_conv", CONVOLUTION, (x, ws, bs, *geometry), outputs=(g.meta(Ref(s)),)
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
        piece = _add_slice(g, node.name.removesuffix("_conv"), Ref(merged), 1, start, end)
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


def _match_split_conv_output(ctx: RuleContext) -> Iterator[Rewrite]:
    g = ctx.graph
    return node_rewrites(
        ctx,
        "split_conv_output",
        RuleKind.TASO,
        lambda n: channel_sliced_conv(g, n) is not None,
        lambda n: f"split {g.node(n).name} by its channel slices",
        lambda n: split_conv_output(g, n),
        nodes=_largest_first(ctx, CONVOLUTION),
    )


def _match_merge_conv_output(ctx: RuleContext) -> Iterator[Rewrite]:
    for convs in sliced_weight_convs(ctx.graph, ctx.order, ctx.frozen):
        yield Rewrite(
            "merge_conv_output",
            RuleKind.TASO,
            f"merge {len(convs)} convolutions by slices of one weight",
            lambda c=convs: merge_conv_output(ctx.graph, c),
        )


# --- a weight gradient over a concatenated input -------------------------------------------------


def wgrad_of_cat(graph: Graph, nid: int) -> list[Ref] | None:
    """The concatenated parts when `nid` is a weight-gradient-only `convolution_backward`
    (as `split_conv_backward` makes them) of an ungrouped convolution whose input is a channel
    concatenation; else None."""
    mask = _conv_backward_mask(graph, nid)
    if mask is None or mask[0] or not mask[1]:
        return None
    args = graph.node(nid).args
    if args[7] or args[9] != 1:  # transposed or grouped
        return None
    cat = graph.node(args[1].node)
    if cat.op != CAT or (cat.args[1] if len(cat.args) > 1 else 0) not in (1, -3):
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
        ws = _add_slice(g, f"{node.name}_weight{i}", w, 1, start, end)
        bias = bool(mask[2]) and i == 0  # the bias gradient reads only the output gradient
        piece = g.add_op(
            f"{node.name}_{i}",
            node.op,
            (gy, part, ws, bias_sizes, *geometry, [False, True, bias]),
            outputs=(
                _NOTHING,
                _slice_meta(node.outputs[1], 1, start, end),
                node.outputs[2] if bias else _NOTHING,
            ),
        )
        added += [ws.node, piece]
        start = end
    pieces = [Ref(p, 1) for p in added[1::2]]
    whole = _add_cat(g, f"{node.name}_cat", pieces, 1)
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
    if node.op != CAT or node.args[1] != 1 or any(r.index != 1 for r in node.args[0]):
        return None
    pieces = [r.node for r in node.args[0]]
    nodes = [graph.node(p) for p in pieces]
    if any(_conv_backward_mask(graph, p) is None for p in pieces):
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
        if node.op == CAT and list(node.args[0]) == parts and node.args[1] in (1, -3):
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
        outputs=(_NOTHING, out, bias[0].outputs[2] if bias else _NOTHING),
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


def _match_split_wgrad_of_cat(ctx: RuleContext) -> Iterator[Rewrite]:
    g = ctx.graph
    return node_rewrites(
        ctx,
        "split_wgrad_of_cat",
        RuleKind.TASO,
        lambda n: wgrad_of_cat(g, n) is not None,
        lambda n: f"split {g.node(n).name} by the parts of its input",
        lambda n: split_wgrad_of_cat(g, n),
        nodes=_largest_first(ctx, CONV_BACKWARD),
    )


def _match_merge_wgrads_of_cat(ctx: RuleContext) -> Iterator[Rewrite]:
    g = ctx.graph
    return node_rewrites(
        ctx,
        "merge_wgrads_of_cat",
        RuleKind.TASO,
        lambda n: cat_of_wgrads(g, n) is not None,
        lambda n: f"merge the weight gradients of {g.node(n).name}",
        lambda n: merge_wgrads_of_cat(g, n),
    )


MERGE_MATMUL = Rule("merge_matmul", RuleKind.TASO, _match_merge)
SPLIT_MATMUL = Rule("split_matmul", RuleKind.TASO, _match_split)
FOLD_SLICE_OF_CAT = Rule("fold_slice_of_cat", RuleKind.TASO, _match_fold)
FACTOR = Rule("factor", RuleKind.TASO, _match_factor)
EXPAND = Rule("expand", RuleKind.TASO, _match_expand)
SPLIT_CONV_BACKWARD = Rule("split_conv_backward", RuleKind.TASO, _match_split_conv_backward)
MERGE_CONV_BACKWARD = Rule("merge_conv_backward", RuleKind.TASO, _match_merge_conv_backward)
SPLIT_CONV_OUTPUT = Rule("split_conv_output", RuleKind.TASO, _match_split_conv_output)
MERGE_CONV_OUTPUT = Rule("merge_conv_output", RuleKind.TASO, _match_merge_conv_output)
SPLIT_WGRAD_OF_CAT = Rule("split_wgrad_of_cat", RuleKind.TASO, _match_split_wgrad_of_cat)
MERGE_WGRADS_OF_CAT = Rule("merge_wgrads_of_cat", RuleKind.TASO, _match_merge_wgrads_of_cat)
TASO_RULES = (
    MERGE_MATMUL,
    SPLIT_MATMUL,
    FOLD_SLICE_OF_CAT,
    FACTOR,
    EXPAND,
    SPLIT_CONV_BACKWARD,
    MERGE_CONV_BACKWARD,
    SPLIT_CONV_OUTPUT,
    MERGE_CONV_OUTPUT,
    SPLIT_WGRAD_OF_CAT,
    MERGE_WGRADS_OF_CAT,
)
