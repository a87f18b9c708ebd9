"""Interim transformations that open the loss to fission (MAGIS §2.2: algebraic identities
that open opportunities for others).

`prepare` rewrites a captured graph so that a split may cross the loss:

- `ones_like(loss)` (the seed of the backward pass) and the other `*_like` creations become
  `ones(shape)`: they read only the shape, and the false data dependency would make every
  forward+backward region non-convex. `x.new_zeros(size)` and the other `new_*` creations
  read only x's dtype, and become `zeros(size)` too (DeBERTa's gather backward scatters into
  a `new_zeros` of an attention tensor: the region of the whole step was rejected for it);
- `nll_loss_forward(x, t, reduction=mean)` becomes `nll_loss_forward(x, t, reduction=sum) /
  total_weight` with the total weight computed from the targets alone (`sum(t != ignore_index)`),
  so the loss of a batch slice is a partial sum and the backward reads the whole batch's total
  weight. Only without class weights (the workloads have none);
- `mse_loss(x, t, reduction=mean)` becomes `mse_loss(x, t, reduction=sum) / numel`, and its
  backward reads `grad / numel` with reduction=sum (a diffusion model's loss): the same identity
  with a count known from the shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from magis.ir import Graph, Ref, TensorMeta
from magis.ir.graph import Node
from magis.ir.ops import LOAD_OP, STORE_OP, base_name
from magis.ir.tensor import dense_permutation
from magis.rules.rebuild import GraphRebuilder

_LIKE = {"ones_like": "ones", "zeros_like": "zeros", "empty_like": "empty", "full_like": "full"}
_NEW = {"new_ones": "ones", "new_zeros": "zeros", "new_empty": "empty", "new_full": "full"}
_CREATIONS = {**_LIKE, **_NEW}
_NLL = ("nll_loss_forward", "nll_loss2d_forward")
_MEAN, _SUM = 1, 2  # ATen's reduction codes


def prepare(graph: Graph, order: Sequence[int] | None = None) -> Graph:
    """The graph with `*_like` creations detached and mean NLL losses split into sum / count
    (see the module docstring); placeholders are kept, and the program order is `order`
    (default: the graph's own)."""
    rb = GraphRebuilder(graph)
    detached: list[Ref] = []  # what the detached creations read
    for nid in graph.program_order() if order is None else order:
        node = graph.node(nid)
        base = base_name(node.op)
        if base in _CREATIONS and not node.is_placeholder and node.writes_into is None:
            _detach_creation(rb, node)
            detached.extend(node.inputs)
        elif base in _NLL and _mean_nll_without_weight(node):
            _split_mean_nll(rb, node)
        elif base == "mse_loss" and _reduction(node, 2) == _MEAN:
            _split_mean_mse(rb, node)
        elif base == "mse_loss_backward" and _reduction(node, 3) == _MEAN:
            _split_mean_mse_backward(rb, node)
        else:
            rb.copy(nid)
    g = rb.finish()
    _drop_unread_loads(g, [rb.env[r] for r in detached])
    return g


def _drop_unread_loads(g: Graph, refs: list[Ref]) -> None:
    """A swap's Load that only a detached creation read (`x.new_zeros(size)` of a swapped-out
    `x`: the fuzzer's chain min-cut, swap, fission) is read by nothing now: it is removed, and
    its Store when no other Load reads that. A Load with no reader has no place to be timed."""
    for ref in dict.fromkeys(refs):
        if ref.node not in g or g.users(ref.node) or ref in g.outputs:
            continue
        load = g.node(ref.node)
        if load.op != LOAD_OP:
            continue
        store = load.inputs[0]
        g.remove_node(load.id)
        if g.node(store.node).op == STORE_OP and not g.users(store.node) and store not in g.outputs:
            g.remove_node(store.node)


def _detach_creation(rb: GraphRebuilder, node: Node) -> None:
    """The `*_like` or `new_*` creation `node` as the creation of its output's shape and dtype,
    reading no tensor."""
    meta = node.outputs[0]
    kw = {"dtype": meta.torch_dtype, "layout": torch.strided, "device": torch.device("cpu")}
    kw["pin_memory"] = False
    name = base_name(node.op)
    base = _CREATIONS[name]
    fill = ()
    if base == "full":  # full_like(x, fill) or x.new_full(size, fill)
        fill = (node.args[1] if name in _LIKE else node.args[2],)
    if base == "empty" and not meta.is_row_major:
        # Laid out as recorded: dropout draws its mask into it in memory order (codegen)
        args, op = (list(meta.shape), list(meta.strides)), "aten.empty_strided.default"
    elif not meta.is_row_major:
        _permuted_creation(rb, node, base, fill, kw)
        return
    elif base == "empty":
        args, op = (list(meta.shape),), "aten.empty.memory_format"
    else:
        args, op = (list(meta.shape), *fill), f"aten.{base}.default"
    new = rb.add(node.name, op, args, node.outputs, **kw)
    rb.bind(node.id, [new.node])


def _permuted_creation(rb: GraphRebuilder, node: Node, base: str, fill: tuple, kw: dict) -> None:
    """A `*_like` creation laid out as its input (preserve_format: LaraMini's linear attention
    state is transposed) made as the creation of the permuted shape and a `permute` back: the
    recorded strides exactly, reading no tensor. A layout that is no permutation of a row-major
    one (gaps, overlaps) keeps its `*_like` creation, copied as it is."""
    meta = node.outputs[0]
    perm = dense_permutation(meta.shape, meta.strides)
    if perm is None:
        rb.copy(node.id)
        return
    permuted = TensorMeta(tuple(meta.shape[d] for d in perm), meta.dtype, meta.itemsize)
    dense = rb.add(
        f"{node.name}_dense",
        f"aten.{base}.default",
        (list(permuted.shape), *fill),
        (permuted,),
        **kw,
    )
    back = [perm.index(d) for d in range(len(perm))]
    view = rb.add(node.name, "aten.permute.default", (dense, back), node.outputs)
    rb.ids[node.id] = [dense.node, view.node]
    rb.env[Ref(node.id, 0)] = view


def _mean_nll_without_weight(node: Node) -> bool:
    return len(node.args) >= 5 and node.args[3] == 1 and node.args[2] is None


def _split_mean_nll(rb: GraphRebuilder, node: Node) -> None:
    """loss = nll(x, t, reduction=sum) / sum(t != ignore_index): the numerator splits over the
    batch as a partial sum, the denominator reads only the targets."""
    x, t, _, _, ignore = node.args[:5]
    loss_meta, tw_meta = node.outputs[0], node.outputs[1]
    total = rb.add(
        f"{node.name}_sum", node.op, (rb.mapped(x), rb.mapped(t), None, 2, ignore), node.outputs
    )
    t_meta = rb.old.meta(t)
    valid = rb.add(
        f"{node.name}_valid",
        "aten.ne.Scalar",
        (rb.mapped(t), ignore),
        (TensorMeta(t_meta.shape, "bool", 1),),
    )
    count = rb.add(
        f"{node.name}_count", "aten.sum.default", (valid,), (tw_meta,), dtype=tw_meta.torch_dtype
    )
    loss = rb.add(node.name, "aten.div.Tensor", (total, count), (loss_meta,))
    rb.ids[node.id] = [total.node, valid.node, count.node, loss.node]
    rb.env[Ref(node.id, 0)] = loss
    rb.env[Ref(node.id, 1)] = count


def _reduction(node: Node, pos: int) -> int:
    return node.args[pos] if len(node.args) > pos else dict(node.kwargs).get("reduction", _MEAN)


def _numel(rb: GraphRebuilder, ref: Ref) -> int:
    return int(np.prod(rb.old.meta(ref).shape, dtype=np.int64))


def _split_mean_mse(rb: GraphRebuilder, node: Node) -> None:
    """loss = mse(x, t, reduction=sum) / numel(x): the numerator splits as a partial sum."""
    x, t = node.args[:2]
    total = rb.add(f"{node.name}_sum", node.op, (rb.mapped(x), rb.mapped(t), _SUM), node.outputs)
    loss = rb.add(node.name, "aten.div.Scalar", (total, _numel(rb, x)), node.outputs)
    rb.ids[node.id] = [total.node, loss.node]
    rb.env[Ref(node.id, 0)] = loss


def _split_mean_mse_backward(rb: GraphRebuilder, node: Node) -> None:
    """grad_input = mse_backward(grad / numel(x), x, t, reduction=sum)."""
    grad, x, t = node.args[:3]
    scaled = rb.add(
        f"{node.name}_grad",
        "aten.div.Scalar",
        (rb.mapped(grad), _numel(rb, x)),
        (rb.old.meta(grad),),
    )
    out = rb.add(node.name, node.op, (scaled, rb.mapped(x), rb.mapped(t), _SUM), node.outputs)
    rb.ids[node.id] = [scaled.node, out.node]
    rb.env[Ref(node.id, 0)] = out
