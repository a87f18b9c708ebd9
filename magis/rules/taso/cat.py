"""Concat/split algebra (TASO, thesis ch. 3): a slice within one input of a cat reads that
input, and a matrix product of a cat is the cat of the products along a dimension it keeps,
their sum along the one it contracts.

Fission concatenates a region's parts where a reader outside it needs the whole tensor, and
two regions split in different numbers (SD U-Net's attention: its forward recomputed in 2
parts, its backward in 8) meet at such a cat: the backward slices the 2-part cat into 8, and
the product for the values' gradient reads the transposed probabilities' cat whole, so two
whole copies of the [64 x 4096 x 4096] probabilities held that plan's peak. Folding the slices
into the parts they lie in, and taking the product part by part, leaves neither cat.
"""

from __future__ import annotations

from dataclasses import replace

from magis.ir import Graph, Ref
from magis.rules.base import Rewritten, RuleContext, RuleKind, group_rule, node_rule
from magis.rules.taso.common import (
    ADD,
    CAT,
    MM,
    SLICE,
    Replacement,
    add_cat,
    add_slice,
    cat_dim,
    contiguous,
    part_meta,
    replaced_in_place,
)
from magis.rules.unread import remove_unread

BMM = "aten.bmm.default"


def slice_of_cat(graph: Graph, nid: int) -> tuple[Ref, int, int, int] | None:
    """(the cat input a unit-step slice lies within, the dimension, the slice's start and end
    in that input), or None. Negative bounds and dimensions count from the end, and an end
    past the tensor (`x[a:]`) stops at it, as `aten.slice` reads them."""
    node = graph.node(nid)
    if node.op != SLICE or len(node.args) < 4 or node.kwargs:
        return None
    src = graph.node(node.args[0].node)
    if src.op != CAT:
        return None
    dim, start, end = node.args[1], node.args[2], node.args[3]
    step = node.args[4] if len(node.args) > 4 else 1
    if not all(isinstance(x, int) for x in (dim, start, end, step)) or step != 1:
        return None
    shape = graph.meta(node.args[0]).shape
    if dim % len(shape) != cat_dim(src) % len(shape):
        return None
    dim %= len(shape)
    start, end = (min(max(b + shape[dim] if b < 0 else b, 0), shape[dim]) for b in (start, end))
    offset = 0
    for part in src.args[0]:
        width = graph.meta(part).shape[dim]
        if offset <= start < end <= offset + width:
            return part, dim, start - offset, end - offset
        offset += width
    return None


def slices_of_cats(ctx: RuleContext) -> list[list[int]]:
    """The slices `slice_of_cat` folds outside frozen regions, one group per cat: folded
    together, the cat dies in one move (one at a time, no fold but the last frees anything,
    and a search does not follow seven moves that gain nothing)."""
    graph, groups = ctx.graph, {}
    for n in ctx.nodes_of_ops((SLICE,)):
        if n not in ctx.frozen and slice_of_cat(graph, n) is not None:
            groups.setdefault(graph.node(n).args[0].node, []).append(n)
    return list(groups.values())


def fold_slices_of_cat(graph: Graph, nids: list[int]) -> Rewritten:
    """Each slice's readers read the cat input it covers exactly, or a slice of the input it
    lies within; the cat goes when they were its last readers."""
    found = {n: slice_of_cat(graph, n) for n in nids}
    inside = [n for n in nids if found[n][2:] != (0, graph.meta(found[n][0]).shape[found[n][1]])]

    def narrowed(g: Graph, old: int) -> Replacement:
        part, dim, start, end = found[old]
        new = add_slice(g, f"{g.node(old).name}_in_part", part, dim, start, end)
        return Replacement((old,), (new.node,), ((Ref(old), new),))

    done = replaced_in_place(graph, inside, narrowed)  # a copy of the graph, even for none
    g, changed, removed = done.graph, set(done.changed), set(done.removed)
    for n in nids:
        if n not in inside:
            changed.update(g.replace_uses(Ref(n), found[n][0]))
            g.remove_node(n)
            removed.add(n)
    done = replace(done, changed=frozenset(changed - removed), removed=frozenset(removed))
    return _without_unread(done, graph.node(nids[0]).args[0].node)


def _cat_name(graph: Graph, nid: int) -> str:
    return graph.node(graph.node(nid).args[0].node).name


def _without_unread(done: Rewritten, cat: int) -> Rewritten:
    """`done` with the cat removed when the rewrite took its last reader (`remove_unread`)."""
    gone = remove_unread(done.graph, {cat})
    return replace(done, changed=done.changed - gone, removed=done.removed | gone)


FOLD_SLICE_OF_CAT = group_rule(
    "fold_slice_of_cat",
    RuleKind.TASO,
    find=slices_of_cats,
    build=fold_slices_of_cat,
    describe=lambda graph, nids: f"fold {len(nids)} slices of {_cat_name(graph, nids[0])}",
)


# (op, operand, operand's dimension) -> (the product's dimension, or None where the dimension
# is contracted; the other operand's dimension sliced with the parts, or None): a kept
# dimension makes a cat of products, a contracted one a sum of products.
_SPLITS = {
    (MM, 0, 0): (0, None),
    (MM, 0, 1): (None, 0),
    (MM, 1, 0): (None, 1),
    (MM, 1, 1): (1, None),
    (BMM, 0, 0): (0, 0),
    (BMM, 0, 1): (1, None),
    (BMM, 0, 2): (None, 1),
    (BMM, 1, 0): (0, 0),
    (BMM, 1, 1): (None, 2),
    (BMM, 1, 2): (2, None),
}


def matmul_of_cat(graph: Graph, nid: int) -> tuple[int, int, int | None, int | None] | None:
    """(operand, the cat node, the product's dimension or None, the other operand's sliced
    dimension or None: `_SPLITS`) for an `mm`/`bmm` whose operand is a cat that this product
    alone reads (the rewrite frees it), or None."""
    node = graph.node(nid)
    if node.op not in (MM, BMM) or node.kwargs or len(node.args) != 2:
        return None
    for i, ref in enumerate(node.args):
        src = graph.node(ref.node)
        if src.op != CAT or len(src.args[0]) < 2 or set(graph.users(ref.node)) != {nid}:
            continue
        split = _SPLITS.get((node.op, i, cat_dim(src) % len(graph.meta(ref).shape)))
        if split is not None and node.args[1 - i] != ref:
            return i, ref.node, *split
    return None


def split_matmul_of_cat(graph: Graph, nid: int) -> Rewritten:
    """A product of a cat, part by part: mm/bmm(cat(A_1 .. A_k), B) is cat(A_j B_j) along a
    dimension the product keeps (B_j: B's batch slice matching A_j along the batch, else B)
    and the sum of A_j B_j along the contracted one (B_j: B's matching rows), and so for a cat
    in the second operand. Each product reads its part; the cat is never made. A sum adds its
    products in order as they come (a float sum in another order: equal to rounding)."""
    which, cat, out_dim, other_dim = matmul_of_cat(graph, nid)

    def by_parts(g: Graph, old: int) -> Replacement:
        node = g.node(old)
        other, out, dim = node.args[1 - which], node.outputs[0], cat_dim(g.node(cat))
        news, products, offset, running = [], [], 0, None
        for j, part in enumerate(g.node(cat).args[0]):
            width = g.meta(part).shape[dim]
            mine = other
            if other_dim is not None:
                mine = add_slice(g, f"{node.name}_b{j}", other, other_dim, offset, offset + width)
                news.append(mine.node)
            args = (part, mine) if which == 0 else (mine, part)
            meta = contiguous(out) if out_dim is None else part_meta(out, out_dim, 0, width)
            products.append(Ref(g.add_op(f"{node.name}_p{j}", node.op, args, outputs=(meta,))))
            news.append(products[-1].node)
            if out_dim is None:  # the running sum, as each product comes
                if j > 0:
                    total = (running, products[-1])
                    news.append(g.add_op(f"{node.name}_s{j}", ADD, total, outputs=(meta,)))
                running = Ref(news[-1])
            offset += width
        if out_dim is not None:
            news.append(add_cat(g, f"{node.name}_cat", products, out_dim))
        return Replacement((old,), tuple(news), ((Ref(old), Ref(news[-1])),))

    return _without_unread(replaced_in_place(graph, [nid], by_parts), cat)


SPLIT_MATMUL_OF_CAT = node_rule(
    "split_matmul_of_cat",
    RuleKind.TASO,
    accepts=lambda graph, n: matmul_of_cat(graph, n) is not None,
    build=split_matmul_of_cat,
    describe=lambda graph, n: f"split {graph.node(n).name} by its operand's parts",
    ops=(MM, BMM),
)
RULES = (FOLD_SLICE_OF_CAT,)
LATER_RULES = (SPLIT_MATMUL_OF_CAT,)
