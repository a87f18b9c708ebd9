"""Merging parallel matmuls that share an input, and the dual (TASO; MAGIS §5, A-Trans).

k matmuls `x @ W_i (+ b_i)` become one `x @ [W_1 .. W_k] (+ [b_1 .. b_k])` whose column slices
feed the old users (the QKV projections of attention); `W_i^T @ g` style matmuls sharing their
*second* operand stack their first operands by rows instead, and their row slices are
contiguous. The dual splits such a merged matmul back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from magis.ir import Graph, Ref, TensorMeta
from magis.rules.base import Rewritten, RuleContext, RuleKind, group_rule, node_rule
from magis.rules.taso.common import ADDMM, CAT, MM, SLICE, add_cat, contiguous, slice_meta


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
    for nid in ctx.nodes_of_ops((MM, ADDMM)):
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
    groups = [(side, _independent(graph, g, ctx.position)) for side, g in groups]
    groups = [(side, g) for side, g in groups if len(g) > 1]
    groups.sort(key=lambda kg: -len(kg[1]))
    yield from groups


def _independent(graph: Graph, group: list[int], position: dict[int, int]) -> list[int]:
    """The members, in schedule order, that none of those kept before depends on. Sharing an
    operand does not make matmuls parallel: a model that applies one layer's weights again
    (ALBERT's shared layers, a tied projection) reads them in matmuls that depend on each
    other, and merging those would make the merged matmul an input of itself (a cycle)."""
    kept: list[int] = []
    for nid in group:
        if not kept or not _depends_on(graph, nid, kept, position):
            kept.append(nid)
    return kept


def _depends_on(graph: Graph, nid: int, earlier: list[int], position: dict[int, int]) -> bool:
    """Whether `nid` reads, through any path, one of `earlier` (scheduled before it). The walk
    back stops at what is scheduled before the first of them: parallel groups (QKV) sit side by
    side, so this runs on every popped state without walking the whole graph."""
    dag = graph.dag
    targets = {graph.rx_index(n) for n in earlier}
    floor = min(position[n] for n in earlier)
    stack, seen = [graph.rx_index(nid)], set()
    while stack:
        for p in dag.predecessor_indices(stack.pop()):
            if p in targets:
                return True
            if p not in seen and position.get(dag[p], floor) > floor:
                seen.add(p)
                stack.append(p)
    return False


def merge_matmuls(graph: Graph, side: str, group: list[int]) -> Rewritten:
    g = graph.copy()
    first = g.node(group[0])
    added: list[int] = []
    changed: set[int] = set()
    ops = [_operands(g, n) for n in group]
    if side == "left":  # x @ [W_1 .. W_k]: concatenate the right operands' columns
        dim = 1
        shared = ops[0][1]
        right_cat = add_cat(g, f"{first.name}_wcat", [o[2] for o in ops], 1)
        added.append(right_cat)
        if first.op == ADDMM:
            bias_cat = add_cat(g, f"{first.name}_bcat", [o[0] for o in ops], 0)
            added.append(bias_cat)
            args = (Ref(bias_cat), shared, Ref(right_cat))
        else:
            args = (shared, Ref(right_cat))
        width = sum(g.meta(o[2]).shape[1] for o in ops)
        out_shape = (g.meta(shared).shape[0], width)
    else:  # [A_1; ..; A_k] @ y: stack the left operands' rows (row slices stay contiguous)
        dim = 0
        shared = ops[0][2]
        left_cat = add_cat(g, f"{first.name}_acat", [o[1] for o in ops], 0)
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
            outputs=(slice_meta(g.meta(Ref(merged)), dim, start, start + width),),
        )
        added.append(part)
        changed.update(g.replace_uses(Ref(nid), Ref(part)))
        start += width
    for nid in group:
        g.remove_node(nid)
    return Rewritten(g, frozenset(added), frozenset(changed - set(group)), frozenset(group))


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
        out = contiguous(g.meta(Ref(s)))
        one = g.add_op(f"{g.node(s).name}_mm", node.op, args, dict(node.kwargs), (out,))
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


def is_merged_matmul(graph: Graph, nid: int) -> bool:
    """Whether `nid` is a matmul as `merge_matmuls` makes them: over a cat, read only in
    slices that are exactly the cat's parts."""
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


def _describe_group(graph: Graph, found: tuple[str, list[int]]) -> str:
    return "merge parallel matmuls " + ", ".join(graph.node(n).name for n in found[1])


MERGE_MATMUL = group_rule(
    "merge_matmul",
    RuleKind.TASO,
    find=parallel_groups,
    build=lambda graph, found: merge_matmuls(graph, *found),
    describe=_describe_group,
)
SPLIT_MATMUL = node_rule(
    "split_matmul",
    RuleKind.TASO,
    accepts=is_merged_matmul,
    build=split_matmul,
    describe=lambda graph, n: f"split {graph.node(n).name}",
    ops=(MM, ADDMM),
)
RULES = (MERGE_MATMUL, SPLIT_MATMUL)
