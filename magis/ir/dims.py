"""Dimension rules: which input dimension of an op call is which output dimension (MAGIS §4.1).

An op call iterates over *axes*. Every output dimension is an axis (a spatial axis); an axis that
appears in no output is a reduce axis (mm's k). A rule says, for one call, which axis each output
dimension is and which axis each dimension of each tensor argument runs along — or that it runs
along none (the argument is read whole in that dimension: a broadcast, a normalized dimension, the
window of a convolution). These correspondences are the edges of the D-Graph (`magis.analyze.dgraph`).

What splitting along an axis means (MAGIS §4.2) is decided here too:

- an axis is *splittable* when the call can compute 1/n of it from 1/n slices of the arguments
  that run along it, the others whole: every axis some argument runs along, plus the axes a rule
  declares `generated` (expand, zeros, new_ones ...: the output is made smaller by a shape argument);
- when an axis is split, an output containing it is concatenated from the parts; an output in
  `sums` is the sum of the parts (mm's k, the batch of a weight gradient); an output in
  `part_outputs` is each part's own (a fused kernel's workspace, laid out in no sliceable way):
  it may only pass from a part to the same part of a reader that declares the slot in
  `part_inputs`, inside one region; any other output is *blocked*: the parts cannot be merged,
  so the call may not be split along that axis while that output is used;
- an output in `sums` that the call adds *into* one of its arguments (`accumulates`: index_add,
  scatter_add and index_put with accumulate add the indexed rows to x) would hold that argument
  once per part if the parts were summed; its parts are chained instead: each part adds into
  the previous part's result, the first into the argument (the running sum of MAGIS §4.2's
  "reducing them", with x as its start). The edge dimension of message passing is such an axis:
  the messages of 1/n of the edges scatter-added into the nodes, n times.

Axes are not declared when splitting would change the result: the normalized dimensions of layer
norm, the softmax dimension, the window dimensions of convolution and pooling (the paper's
footnote 2: "we do not consider spatial-axis with sliding-window"), and the batch of batch norm in
training (the statistics reduce over it non-linearly). A reduce axis is only declared when the op
is linear in the reduced values (sum, mm, the weight gradient of a convolution); mean, amax and
the mean-reduced losses are not split along what they reduce.

Rules are keyed by the op's base name ('aten.mm.default' -> 'mm') and receive the call's
arguments with every tensor replaced by its TensorMeta (`Graph.meta_args`) and its output metas.
An op without a rule is opaque to fission: fission stops there (DESIGN principle 5).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from magis.ir.ops import base_name, tensor_metas
from magis.ir.tensor import TensorMeta, pickled_by_fields

Axis = int
DimMap = tuple[Axis | None, ...]  # one entry per dimension of a tensor


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class OpDims:
    """The dimension correspondences of one op call.

    `lengths[a]` is the length of axis a; `outputs[k][d]` is the axis of dimension d of output k
    (None: not an axis this call can be split along); `inputs[j][d]` the axis that dimension d of
    tensor argument j runs along (arguments numbered in the order `tensor_metas` flattens the
    positional arguments, then the keyword arguments). `shape_args` lists (argument position,
    output index) pairs where a positional argument spells an output's shape: it is rewritten
    when the output shrinks (view sizes, expand sizes, bias_sizes ...); an (argument position,
    output index, dimension) triple names an int argument that spells one dimension of it
    (group norm's N). `accumulates` holds (output index, argument slot) pairs: the output is
    the argument plus what the call adds, so its parts along a summed axis are chained through
    that slot (see the module docstring). `part_outputs` holds (output, axis) pairs whose parts
    are each part's own and `part_inputs` (tensor slot, axis) pairs that read such a part (see
    the module docstring: a workspace made by a forward kernel for its backward).
    """

    lengths: tuple[int, ...]
    outputs: tuple[DimMap, ...]
    inputs: tuple[DimMap, ...]
    sums: frozenset[tuple[int, Axis]] = frozenset()
    generated: frozenset[Axis] = frozenset()
    shape_args: tuple[tuple[int, ...], ...] = ()
    accumulates: frozenset[tuple[int, int]] = frozenset()
    part_outputs: frozenset[tuple[int, Axis]] = frozenset()
    part_inputs: frozenset[tuple[int, Axis]] = frozenset()
    splittable: frozenset[Axis] = field(init=False)

    def __post_init__(self) -> None:
        fed = {a for dims in self.inputs for a in dims if a is not None}
        object.__setattr__(self, "splittable", frozenset(fed | set(self.generated)))

    def is_reduce(self, axis: Axis) -> bool:
        """A reduce axis appears in no output (MAGIS §4.1: the vertex <v, -j>)."""
        return not any(axis in dims for dims in self.outputs)

    def carries(self, k: int, axis: Axis) -> bool:
        """Output k passes the axis on to a reader split along it in the same region: it has a
        dimension along the axis, or each part's output is that part's own (`part_outputs`)."""
        return axis in self.outputs[k] or (k, axis) in self.part_outputs

    def output_dim(self, k: int, axis: Axis) -> int | None:
        dims = self.outputs[k]
        return dims.index(axis) if axis in dims else None

    def input_dim(self, j: int, axis: Axis) -> int | None:
        dims = self.inputs[j]
        return dims.index(axis) if axis in dims else None

    def accumulated_slot(self, k: int) -> int | None:
        """The argument slot output k adds into (its parts are chained through it), or None."""
        return next((j for out, j in self.accumulates if out == k), None)


Rule = Callable[[tuple, dict, tuple[TensorMeta, ...]], OpDims | None]


class _Builder:
    """Assembles an OpDims: axes are numbered output dims first (output 0, then 1 ...), then the
    reduce axes, so an axis index stays the same when a split shrinks the shapes."""

    def __init__(self, outs: tuple[TensorMeta, ...], ins: list[TensorMeta]) -> None:
        self.lengths: list[int] = []
        self.outputs = [[None] * len(o.shape) for o in outs]
        self.inputs: list[list[Axis | None]] = []
        self._ins = ins
        self.outs = outs
        self.sums: set[tuple[int, Axis]] = set()
        self.generated: set[Axis] = set()
        self.accumulates: set[tuple[int, int]] = set()
        self.part_outputs: set[tuple[int, Axis]] = set()
        self.part_inputs: set[tuple[int, Axis]] = set()

    def axis(self, length: int) -> Axis:
        self.lengths.append(int(length))
        return len(self.lengths) - 1

    def out_axes(self, k: int = 0) -> list[Axis]:
        """A new axis for every dimension of output k."""
        axes = [self.axis(s) for s in self.outs[k].shape]
        self.outputs[k] = list(axes)
        return axes

    def bind_out(self, k: int, d: int, axis: Axis) -> None:
        self.outputs[k][d] = axis

    def input(self, dims: list[Axis | None]) -> None:
        self.inputs.append(list(dims))

    def build(self, shape_args: tuple[tuple[int, ...], ...] = ()) -> OpDims:
        while len(self.inputs) < len(self._ins):  # arguments read whole in every dim
            self.inputs.append([None] * len(self._ins[len(self.inputs)].shape))
        return OpDims(
            tuple(self.lengths),
            tuple(tuple(d) for d in self.outputs),
            tuple(tuple(d) for d in self.inputs),
            frozenset(self.sums),
            frozenset(self.generated),
            shape_args,
            frozenset(self.accumulates),
            frozenset(self.part_outputs),
            frozenset(self.part_inputs),
        )


def _ins(args: tuple, kwargs: dict) -> list[TensorMeta]:
    """The call's tensor arguments in slot order: positional ones flattened, then keywords."""
    return tensor_metas(args) + tensor_metas(tuple(kwargs.values()))


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _aligned(b: _Builder, t: TensorMeta, out_axes: list[Axis], out: TensorMeta) -> list:
    """Broadcasting: t's dims aligned to the output's from the right; a dim runs along the
    output's axis when the sizes agree (a size-1 dim broadcast against a longer one does not)."""
    off = len(out.shape) - len(t.shape)
    return [
        out_axes[d + off] if off + d >= 0 and t.shape[d] == out.shape[d + off] else None
        for d in range(len(t.shape))
    ]


# --- pointwise and friends ---------------------------------------------------------------------


def pointwise(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims | None:
    """Elementwise ops with broadcasting: every output dim is an axis, inputs aligned right."""
    ins = _ins(args, kwargs)
    if not outs:
        return None
    b = _Builder(outs, ins)
    axes = b.out_axes(0)
    for t in ins:
        b.input(_aligned(b, t, axes, outs[0]))
    for k in range(1, len(outs)):  # e.g. multi-output elementwise: same shape, same axes
        if outs[k].shape == outs[0].shape:
            b.outputs[k] = list(axes)
    return b.build()


def _creation(shape_pos: int | None) -> Rule:
    """zeros, ones, full, empty, new_zeros ...: no data inputs; every axis is generated by the
    shape argument, which is rewritten when a part is smaller."""

    def rule(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims | None:
        ins = _ins(args, kwargs)
        b = _Builder(outs, ins)
        axes = b.out_axes(0)
        b.generated.update(axes)
        if shape_pos is None:  # *_like: the input has the output's shape
            for t in ins:
                b.input(_aligned(b, t, axes, outs[0]))
            return b.build()
        return b.build(((shape_pos, 0),))

    return rule


def expand(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """expand(x, size): broadcast dims and new leading dims are generated by the size argument."""
    b = _Builder(outs, _ins(args, kwargs))
    axes = b.out_axes(0)
    b.input(_aligned(b, args[0], axes, outs[0]))
    b.generated.update(axes)
    return b.build(((1, 0),))


def _all_but(dims_of: Callable[[tuple, TensorMeta], set[int]]) -> Rule:
    """Ops whose output has the shape of argument 0 and whose listed dims are not splittable
    (softmax's dim, cumsum's dim, the window dims of pooling); other tensor args of the same rank
    (grad, indices) run along the same axes."""

    def rule(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims | None:
        ins = _ins(args, kwargs)
        b = _Builder(outs, ins)
        axes = b.out_axes(0)
        fixed = dims_of(args, outs[0])
        dims = [None if d in fixed else a for d, a in enumerate(axes)]
        b.outputs[0] = dims
        for k in range(1, len(outs)):
            if outs[k].shape == outs[0].shape:
                b.outputs[k] = list(dims)
        for t in ins:
            same = len(t.shape) == len(outs[0].shape)
            b.input(
                [
                    dims[d] if same and t.shape[d] == outs[0].shape[d] else None
                    for d in range(len(t.shape))
                ]
            )
        return b.build()

    return rule


def _dim_arg(pos: int) -> Callable[[tuple, TensorMeta], set[int]]:
    return lambda args, out: {_norm(args[pos], len(out.shape))}


def _last_n(n: int) -> Callable[[tuple, TensorMeta], set[int]]:
    return lambda args, out: set(range(len(out.shape) - n, len(out.shape)))


# --- matmuls -----------------------------------------------------------------------------------


def mm(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """c[m, n] = sum_k a[m, k] b[k, n]: m and n spatial, k a reduce axis whose parts are summed
    (MAGIS §4.1's worked example)."""
    a = args[0]
    b = _Builder(outs, _ins(args, kwargs))
    m, n = b.out_axes(0)
    k = b.axis(a.shape[1])
    b.input([m, k])
    b.input([k, n])
    b.sums.add((0, k))
    return b.build()


def addmm(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """bias + a @ b: k is not split (each part would add the bias again)."""
    bias = args[0]
    b = _Builder(outs, _ins(args, kwargs))
    m, n = b.out_axes(0)
    b.input(_aligned(b, bias, [m, n], outs[0]))
    b.input([m, None])
    b.input([None, n])
    return b.build()


def bmm(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    a = args[0]
    b = _Builder(outs, _ins(args, kwargs))
    bt, m, n = b.out_axes(0)
    k = b.axis(a.shape[2])
    b.input([bt, m, k])
    b.input([bt, k, n])
    b.sums.add((0, k))
    return b.build()


def baddbmm(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """beta * input + alpha * (batch1 @ batch2): as bmm with the input broadcast to the output;
    k is not split (each part would add the input again)."""
    b = _Builder(outs, _ins(args, kwargs))
    bt, m, n = b.out_axes(0)
    b.input(_aligned(b, args[0], [bt, m, n], outs[0]))
    b.input([bt, m, None])
    b.input([bt, None, n])
    return b.build()


# --- convolution -------------------------------------------------------------------------------


def convolution(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """out[N, Cout, *S'] = sum_{Cin, window} x[N, Cin, *S] w[Cout, Cin, *K] (+ bias[Cout]).

    N and Cout are spatial axes; Cin is a reduce axis when groups == 1 and there is no bias (the
    bias would be added by every part); the window dims are not split (footnote 2).
    """
    x, w, bias = args[0], args[1], args[2]
    transposed = bool(args[6]) if len(args) > 6 else False
    groups = args[8] if len(args) > 8 else 1
    b = _Builder(outs, _ins(args, kwargs))
    out_axes = b.out_axes(0)
    n_ax, cout = out_axes[0], out_axes[1]
    b.outputs[0] = [n_ax, cout] + [None] * (len(out_axes) - 2)
    spatial = [None] * (len(x.shape) - 2)
    if transposed or groups != 1:
        b.outputs[0] = [n_ax] + [None] * (len(out_axes) - 1)
        b.input([n_ax, None, *spatial])
        b.input([None] * len(w.shape))
        if isinstance(bias, TensorMeta):
            b.input([None])
        return b.build()
    cin = b.axis(x.shape[1]) if bias is None else None
    if cin is not None:
        b.sums.add((0, cin))
    b.input([n_ax, cin, *spatial])
    b.input([cout, cin, *([None] * (len(w.shape) - 2))])
    if isinstance(bias, TensorMeta):
        b.input([cout])
    return b.build()


def convolution_backward(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """(grad_input, grad_weight, grad_bias) of a convolution (groups == 1, not transposed).

    N: grad_output, input and grad_input run along it; grad_weight and grad_bias sum over it.
    Cin: input, weight, grad_input, grad_weight; grad_bias does not depend on it (blocked).
    Cout: grad_output, weight, grad_weight, grad_bias (bias_sizes rewritten); grad_input sums
    over it.
    """
    gy, x, w = args[0], args[1], args[2]
    transposed, groups = bool(args[7]), args[9]
    b = _Builder(outs, _ins(args, kwargs))
    n_ax = b.axis(x.shape[0])
    sp_gy = [None] * (len(gy.shape) - 2)
    sp_x = [None] * (len(x.shape) - 2)
    kernel = [None] * (len(w.shape) - 2)
    has = [o.numel > 0 for o in outs]
    if transposed or groups != 1:
        b.input([n_ax, None, *sp_gy])
        b.input([n_ax, None, *sp_x])
        b.input([None] * len(w.shape))
        b.outputs[0] = [n_ax, None, *sp_x] if has[0] else [None] * len(outs[0].shape)
        b.sums.update({(1, n_ax), (2, n_ax)})
        return b.build()
    cin, cout = b.axis(x.shape[1]), b.axis(gy.shape[1])
    b.input([n_ax, cout, *sp_gy])
    b.input([n_ax, cin, *sp_x])
    b.input([cout, cin, *kernel])
    if has[0]:
        b.outputs[0] = [n_ax, cin, *sp_x]
    if has[1]:
        b.outputs[1] = [cout, cin, *kernel]
    if has[2]:
        b.outputs[2] = [cout]
    b.sums.update({(0, cout), (1, n_ax), (2, n_ax)})
    return b.build(((3, 2),) if has[2] else ())


# --- normalization -----------------------------------------------------------------------------


def native_layer_norm(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """(out, mean, rstd): the leading dims are axes of all three; the normalized dims are not."""
    x, normalized = args[0], args[1]
    lead = len(x.shape) - len(normalized)
    b = _Builder(outs, _ins(args, kwargs))
    axes = [b.axis(s) for s in x.shape[:lead]]
    b.outputs[0] = axes + [None] * len(normalized)
    for k in (1, 2):
        if len(outs) > k:
            b.outputs[k] = axes + [None] * (len(outs[k].shape) - lead)
    b.input(axes + [None] * len(normalized))
    for t in tensor_metas(args[2:]):
        b.input([None] * len(t.shape))
    return b.build()


def native_layer_norm_backward(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """(grad_input, grad_weight, grad_bias): leading dims run through grad_out, input, mean,
    rstd and grad_input; grad_weight and grad_bias sum over them."""
    x, normalized, mean, rstd = args[1], args[2], args[3], args[4]
    lead = len(x.shape) - len(normalized)
    b = _Builder(outs, _ins(args, kwargs))
    axes = [b.axis(s) for s in x.shape[:lead]]
    full = axes + [None] * len(normalized)
    b.outputs[0] = list(full) if outs[0].numel else [None] * len(outs[0].shape)
    b.input(full)
    b.input(full)
    b.input(axes + [None] * (len(mean.shape) - lead))
    b.input(axes + [None] * (len(rstd.shape) - lead))
    for t in tensor_metas(args[5:]):
        b.input([None] * len(t.shape))
    for k in (1, 2):
        if len(outs) > k:
            b.sums.update((k, a) for a in axes)
    return b.build()


def native_batch_norm(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """(out, save_mean, save_invstd). Channels are independent: C runs through x, weight, bias,
    the running statistics and every output. In training the statistics reduce over N and the
    spatial dims non-linearly, so those are not axes; in eval, N and spatial dims are."""
    x = args[0]
    training = bool(args[5])
    b = _Builder(outs, _ins(args, kwargs))
    axes = b.out_axes(0)
    c = axes[1]
    if training:
        b.outputs[0] = [None, c] + [None] * (len(axes) - 2)
        b.input([None, c] + [None] * (len(axes) - 2))
    else:
        b.input(list(axes))
    for k in (1, 2):
        if len(outs) > k and len(outs[k].shape) == 1 and outs[k].shape[0] == x.shape[1]:
            b.outputs[k] = [c]
    for t in tensor_metas(args[1:5]):
        b.input([c] if len(t.shape) == 1 and t.shape[0] == x.shape[1] else [None] * len(t.shape))
    return b.build()


def native_batch_norm_backward(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """(grad_input, grad_weight, grad_bias): per channel. N and the spatial dims are reduced
    non-linearly in training and are not split (eval-mode backward is treated alike: it does not
    appear in training steps)."""
    x = args[1]
    b = _Builder(outs, _ins(args, kwargs))
    c = b.axis(x.shape[1])
    rest = [None] * (len(x.shape) - 2)
    full = [None, c, *rest]
    b.input(full)
    b.input(full)
    for t in tensor_metas(args[2:7]):
        b.input([c] if len(t.shape) == 1 and t.shape[0] == x.shape[1] else [None] * len(t.shape))
    if outs[0].numel:
        b.outputs[0] = full
    for k in (1, 2):
        if len(outs) > k and outs[k].numel:
            b.outputs[k] = [c]
    return b.build()


def native_group_norm(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """native_group_norm(x, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd): samples
    are independent, so N runs through x, out and the (N, group) statistics; the groups'
    channels and the spatial dims are reduced non-linearly. N is spelled by argument 3."""
    x = args[0]
    b = _Builder(outs, _ins(args, kwargs))
    n = b.axis(x.shape[0])
    b.outputs[0] = [n] + [None] * (len(x.shape) - 1)
    for k in (1, 2):
        if len(outs) > k:
            b.outputs[k] = [n] + [None] * (len(outs[k].shape) - 1)
    b.input([n] + [None] * (len(x.shape) - 1))
    return b.build(((3, 0, 0),))


def native_group_norm_backward(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """(grad_out, x, mean, rstd, weight, N, C, HxW, group, mask) -> (grad_input, grad_weight,
    grad_bias): N runs through the per-sample tensors and grad_input; grad_weight and grad_bias
    sum over it. N is spelled by argument 5."""
    x = args[1]
    b = _Builder(outs, _ins(args, kwargs))
    n = b.axis(x.shape[0])
    full = [n] + [None] * (len(x.shape) - 1)
    b.input(full)
    b.input(full)
    for stat in (args[2], args[3]):
        b.input([n] + [None] * (len(stat.shape) - 1))
    if outs[0].numel:
        b.outputs[0] = list(full)
    for k in (1, 2):
        if len(outs) > k and outs[k].numel:
            b.sums.add((k, n))
    return b.build(((5, 0, 0),))


def _mse(backward: bool) -> Rule:
    """mse_loss(x, target, reduction) and its backward (grad, x, target, reduction): every dim
    runs through x, target and grad_input; 'sum' sums the parts' losses, and the backward's
    scalar grad is shared. 'mean' divides by the whole count: not split."""

    def rule(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims | None:
        off = 1 if backward else 0
        reduction = args[off + 2] if len(args) > off + 2 else kwargs.get("reduction", 1)
        x = args[off]
        if reduction == 1:
            return None
        b = _Builder(outs, _ins(args, kwargs))
        if backward or reduction == 0:
            axes = b.out_axes(0)
        else:
            axes = [b.axis(s) for s in x.shape]
            b.sums.update((0, a) for a in axes)
        if backward:
            grad = args[0]
            b.input(list(axes) if tuple(grad.shape) == tuple(x.shape) else [None] * len(grad.shape))
        b.input(_aligned(b, x, axes, x))
        b.input(_aligned(b, args[off + 1], axes, x))
        return b.build()

    return rule


# --- reductions --------------------------------------------------------------------------------


def _reduced_dims(args: tuple, x: TensorMeta, pos: int = 1, kwargs: dict | None = None) -> set[int]:
    dims = args[pos] if len(args) > pos else (kwargs or {}).get("dim")
    if dims is None or dims == []:
        return set(range(len(x.shape)))
    if isinstance(dims, int):
        dims = [dims]
    return {_norm(d, len(x.shape)) for d in dims}


def _reduction(linear: bool, dim_pos: int = 1) -> Rule:
    """sum (linear: the reduced dims are reduce axes, parts summed) or mean/amax/a norm (the
    reduced dims are read whole); kept dims are axes of the output. The dims are argument
    `dim_pos`, keepdim the next (a vector norm's order comes first)."""

    def rule(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
        x = args[0]
        keep_pos = dim_pos + 1
        keepdim = bool(args[keep_pos]) if len(args) > keep_pos else bool(kwargs.get("keepdim"))
        reduced = _reduced_dims(args, x, dim_pos, kwargs)
        b = _Builder(outs, _ins(args, kwargs))
        out_dims: list[Axis | None] = []
        in_dims: list[Axis | None] = []
        kept = [d for d in range(len(x.shape)) if d not in reduced]
        kept_axes = {d: b.axis(x.shape[d]) for d in kept}
        for d in range(len(x.shape)):
            if d in kept_axes:
                out_dims.append(kept_axes[d])
                in_dims.append(kept_axes[d])
            else:
                if keepdim:
                    out_dims.append(None)
                if linear:
                    r = b.axis(x.shape[d])
                    b.sums.add((0, r))
                    in_dims.append(r)
                else:
                    in_dims.append(None)
        b.outputs[0] = (
            out_dims if len(out_dims) == len(outs[0].shape) else [None] * len(outs[0].shape)
        )
        b.input(in_dims)
        return b.build()

    return rule


# --- views -------------------------------------------------------------------------------------


def _groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of dims with equal products (size-1 dims left out): a reshape maps each run
    of `src` onto the matching run of `dst`."""
    s = [d for d, n in enumerate(src) if n != 1]
    t = [d for d, n in enumerate(dst) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(s) and j < len(t):
        gs, gt = [s[i]], [t[j]]
        ps, pt = src[s[i]], dst[t[j]]
        i, j = i + 1, j + 1
        while ps != pt:
            if ps < pt:
                gs.append(s[i])
                ps *= src[s[i]]
                i += 1
            else:
                gt.append(t[j])
                pt *= dst[t[j]]
                j += 1
        groups.append((gs, gt))
    return groups


def view(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """view/reshape: within a group of factors (e.g. [N, T] <-> [N*T]) only the leading dims
    correspond: n contiguous blocks of N*T rows are n contiguous blocks of N. The lengths of the
    two dims differ; a split must divide both (the F-Trans length is their gcd)."""
    x = args[0]
    b = _Builder(outs, _ins(args, kwargs))
    axes = b.out_axes(0)
    in_dims: list[Axis | None] = [None] * len(x.shape)
    for gs, gt in _groups(tuple(x.shape), tuple(outs[0].shape)):
        in_dims[gs[0]] = axes[gt[0]]
    b.input(in_dims)
    return b.build(((1, 0),))


def permute(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    x, perm = args[0], [_norm(p, len(args[0].shape)) for p in args[1]]
    b = _Builder(outs, _ins(args, kwargs))
    axes = b.out_axes(0)
    in_dims: list[Axis | None] = [None] * len(x.shape)
    for d_out, d_in in enumerate(perm):
        in_dims[d_in] = axes[d_out]
    b.input(in_dims)
    return b.build()


def transpose(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    x = args[0]
    nd = len(x.shape)
    perm = list(range(nd))
    if len(args) > 2:
        d0, d1 = _norm(args[1], nd), _norm(args[2], nd)
        perm[d0], perm[d1] = perm[d1], perm[d0]
    elif nd == 2:  # t
        perm = [1, 0]
    return permute((x, perm), kwargs, outs)


def unsqueeze(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    d = _norm(args[1], len(outs[0].shape))
    b = _Builder(outs, _ins(args, kwargs))
    axes = b.out_axes(0)
    b.input([a for i, a in enumerate(axes) if i != d])
    return b.build()


def squeeze(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    x = args[0]
    nd = len(x.shape)
    if len(args) < 2:
        gone = {d for d in range(nd) if x.shape[d] == 1}
    else:
        ds = args[1] if isinstance(args[1], list | tuple) else [args[1]]
        gone = {_norm(d, nd) for d in ds if x.shape[_norm(d, nd)] == 1}
    b = _Builder(outs, _ins(args, kwargs))
    axes = iter(b.out_axes(0))
    b.input([None if d in gone else next(axes) for d in range(nd)])
    return b.build()


def _joined(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]):
    """(tensors, builder, output axes, dim) of cat or stack: the joined dimension of the output
    is no axis (each of its indices comes from one input)."""
    ins = tensor_metas(args)
    dim = _norm(args[1] if len(args) > 1 else kwargs.get("dim", 0), len(outs[0].shape))
    b = _Builder(outs, ins)
    axes = b.out_axes(0)
    axes[dim] = None
    b.outputs[0] = list(axes)
    return ins, b, axes, dim


def cat(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """cat(tensors, dim): every other dim runs through all inputs; the cat dim is not split."""
    ins, b, axes, dim = _joined(args, kwargs, outs)
    out = outs[0]
    for t in ins:
        if len(t.shape) != len(out.shape):  # legacy empty tensors
            b.input([None] * len(t.shape))
        else:
            b.input([a if t.shape[d] == out.shape[d] else None for d, a in enumerate(axes)])
    return b.build()


def split(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """split / split_with_sizes(x, sizes, dim): the other dims run through every output."""
    x = args[0]
    dim = _norm(args[2] if len(args) > 2 else kwargs.get("dim", 0), len(x.shape))
    b = _Builder(outs, _ins(args, kwargs))
    axes = [None if d == dim else b.axis(s) for d, s in enumerate(x.shape)]
    for k in range(len(outs)):
        b.outputs[k] = list(axes)
    b.input(list(axes))
    return b.build()


def slice_(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """slice(x, dim, start, end, step): the sliced dim is not split unless the slice is whole."""
    x = args[0]
    dim = _norm(args[1] if len(args) > 1 else 0, len(x.shape))
    b = _Builder(outs, _ins(args, kwargs))
    axes = b.out_axes(0)
    whole = outs[0].shape[dim] == x.shape[dim]
    in_dims = [a if (d != dim or whole) else None for d, a in enumerate(axes)]
    if not whole:
        b.outputs[0][dim] = None
    b.input(in_dims)
    return b.build()


def select(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    x, dim = args[0], _norm(args[1], len(args[0].shape))
    b = _Builder(outs, _ins(args, kwargs))
    axes = iter(b.out_axes(0))
    b.input([None if d == dim else next(axes) for d in range(len(x.shape))])
    return b.build()


def _scatter_back(dim_pos: int) -> Rule:
    """select_backward / slice_backward(grad, input_sizes, dim, ...): the output has the input's
    shape (input_sizes, rewritten), grad runs along every dim but `dim`."""

    def rule(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
        g = args[0]
        out = outs[0]
        dim = _norm(args[dim_pos], len(out.shape))
        b = _Builder(outs, _ins(args, kwargs))
        axes = b.out_axes(0)
        b.outputs[0][dim] = None
        others = [a for d, a in enumerate(axes) if d != dim]
        if len(g.shape) == len(out.shape):  # slice_backward keeps the dim
            b.input([None if d == dim else a for d, a in enumerate(axes)])
        else:
            b.input(others)
        return b.build(((1, 0),))

    return rule


# --- embeddings, losses, pooling ---------------------------------------------------------------


def embedding(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """out[*idx, C] = weight[idx[*], C]: index dims and C are axes; the table's rows are not."""
    b = _Builder(outs, _ins(args, kwargs))
    axes = b.out_axes(0)
    b.input([None, axes[-1]])
    b.input(axes[:-1])
    return b.build()


def embedding_dense_backward(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """grad_weight[V, C] = scatter-add of grad[*idx, C] by idx: the index dims are reduce axes
    (parts summed) unless gradients are scaled by frequency (counts over all indices)."""
    g, idx = args[0], args[1]
    scale_by_freq = bool(args[4]) if len(args) > 4 else False
    b = _Builder(outs, _ins(args, kwargs))
    v_ax, c = b.out_axes(0)
    b.outputs[0] = [None, c]
    if scale_by_freq:
        b.input([None] * (len(g.shape) - 1) + [c])
        b.input([None] * len(idx.shape))
        return b.build()
    red = [b.axis(s) for s in idx.shape]
    b.sums.update((0, r) for r in red)
    b.input(red + [c])
    b.input(list(red))
    return b.build()


def _nll(spatial: bool, backward: bool) -> Rule:
    """nll_loss(2d) forward and backward. Batch (and, for 2d, H and W) run along the input, the
    target and, in backward, grad_input. Forward: reduction 'none' keeps them in the output;
    'sum' makes them reduce axes (loss and total_weight both summed); 'mean' divides by the total
    weight of the whole batch: not split. Backward: grad_output (a scalar unless 'none') and
    total_weight are shared by the parts."""

    def rule(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims | None:
        off = 1 if backward else 0
        x = args[off]
        reduction = args[off + 3]
        nd = len(x.shape)
        b = _Builder(outs, _ins(args, kwargs))
        if nd == 1:  # a single sample: nothing to split
            return None
        batch_x = [0, 2, 3] if spatial else [0]
        if backward:
            axes = b.out_axes(0)
            bax = [axes[d] for d in batch_x]
            b.outputs[0] = [a if d in batch_x else None for d, a in enumerate(axes)]
            gy = args[0]
            b.input(
                list(bax)
                if reduction == 0 and len(gy.shape) == len(bax)
                else [None] * len(gy.shape)
            )
        else:
            if reduction == 1:
                return None
            bax = [b.axis(x.shape[d]) for d in batch_x]
            if reduction == 0:
                b.outputs[0] = list(bax)
            else:
                b.sums.update((k, a) for k in range(len(outs)) for a in bax)
        b.input([bax[batch_x.index(d)] if d in batch_x else None for d in range(nd)])
        b.input(list(bax))
        for t in tensor_metas(args[off + 2 :]):
            b.input([None] * len(t.shape))
        return b.build()

    return rule


def max_pool2d_with_indices(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """(values, indices): N and C are axes; the window dims are not (footnote 2)."""
    x = args[0]
    b = _Builder(outs, _ins(args, kwargs))
    axes = b.out_axes(0)
    lead = len(x.shape) - 2
    dims = axes[:lead] + [None, None]
    b.outputs[0] = list(dims)
    if len(outs) > 1:
        b.outputs[1] = list(dims)
    b.input(list(dims))
    return b.build()


def _pool_backward(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """max_pool2d_with_indices_backward, avg_pool2d_backward, upsample_*_backward,
    _adaptive_avg_pool2d_backward: N and C run through every tensor argument and the output."""
    ins = tensor_metas(args)
    b = _Builder(outs, ins)
    axes = b.out_axes(0)
    lead = len(outs[0].shape) - 2
    dims = axes[:lead] + [None, None]
    b.outputs[0] = list(dims)
    for t in ins:
        ok = len(t.shape) == len(outs[0].shape)
        b.input(
            [
                dims[d] if ok and d < lead and t.shape[d] == outs[0].shape[d] else None
                for d in range(len(t.shape))
            ]
        )
    return b.build()


def _upsample_backward(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """upsample_*2d_backward(grad, output_size, input_size, ...): input_size is the output's
    shape (rewritten when a part is smaller)."""
    dims = _pool_backward(args, kwargs, outs)
    return OpDims(dims.lengths, dims.outputs, dims.inputs, shape_args=((2, 0),))


def _window(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """Forward pooling and upsampling: N and C only."""
    return _pool_backward(args, kwargs, outs)


def constant_pad_nd(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    x, pad = args[0], args[1]
    nd = len(x.shape)
    padded = {nd - 1 - i // 2 for i, p in enumerate(pad) if p}
    return _all_but(lambda a, o: padded)(args, kwargs, outs)


def gather(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """gather(x, dim, index): out has index's shape; dims other than `dim` run through x (where
    its size agrees), index and out; out's `dim` runs along index alone (x read whole there: the
    rows a part picks may be anywhere in x)."""
    x = args[0]
    dim = _norm(args[1], len(x.shape))
    b = _Builder(outs, _ins(args, kwargs))
    axes = b.out_axes(0)
    b.input(
        [a if d != dim and x.shape[d] == outs[0].shape[d] else None for d, a in enumerate(axes)]
    )
    b.input(list(axes))
    return b.build()


def scatter_add(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """scatter_add(x, dim, index, src) (gather's backward): out has x's shape; a dim other than
    `dim` runs through x, index, src and out where index and src span all of x there (a shorter
    index, or a longer src, would pair the wrong rows of a part). Index's `dim` (the edges of
    message passing) is a reduce axis of index and src where they agree in it: the parts are
    added into x one after the other (`accumulates`)."""
    x, index, src = args[0], args[2], args[3]
    dim = _norm(args[1], len(x.shape))
    b = _Builder(outs, _ins(args, kwargs))
    axes = [
        None if d == dim or index.shape[d] != s or src.shape[d] != s else a
        for d, (a, s) in enumerate(zip(b.out_axes(0), x.shape, strict=True))
    ]
    b.outputs[0] = list(axes)
    b.input(list(axes))
    edges = list(axes)
    if len(index.shape) and index.shape[dim] == src.shape[dim]:
        edges[dim] = _accumulated_axis(b, index.shape[dim])
    b.input(list(edges))  # index and src: the same shape outside `dim`
    b.input(list(edges))
    return b.build()


def _accumulated_axis(b: _Builder, length: int) -> Axis:
    """A reduce axis whose parts output 0 adds into argument 0 one after the other."""
    axis = b.axis(length)
    b.sums.add((0, axis))
    b.accumulates.add((0, 0))
    return axis


def repeat(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """repeat(x, repeats): a dim repeated once runs through x and out; a tiled dim (repeats > 1)
    is not x's parts side by side, and the leading new dims are read from the whole x."""
    x, repeats = args[0], args[1]
    lead = len(repeats) - len(x.shape)
    b = _Builder(outs, _ins(args, kwargs))
    axes = [a if d >= lead and repeats[d] == 1 else None for d, a in enumerate(b.out_axes(0))]
    b.outputs[0] = list(axes)
    b.input(axes[lead:])
    return b.build()


def _indexed(x: TensorMeta, indices: list) -> tuple[int, int, tuple[int, ...]] | None:
    """(first indexed dim, how many, the index tensors' shape) of advanced indexing by a list
    of index tensors and Nones, where the tensors are consecutive, of one shape and not masks
    (a boolean mask selects a data-dependent number of elements)."""
    picked = [d for d, t in enumerate(indices) if t is not None]
    shapes = {tuple(indices[d].shape) for d in picked}
    if not picked or picked != list(range(picked[0], picked[-1] + 1)) or len(shapes) != 1:
        return None
    if any(indices[d].dtype == "bool" for d in picked):
        return None
    return picked[0], len(picked), shapes.pop()


def index(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims | None:
    """x[..., idx, ...] (aten.index with index tensors): the dims no index selects run through x
    and out; the index's dims of out run along the index tensors (x read whole in the dims they
    select: the rows a part picks may be anywhere in x)."""
    x, indices = args[0], list(args[1])
    found = _indexed(x, indices)
    if found is None:
        return None
    first, count, shape = found
    b = _Builder(outs, _ins(args, kwargs))
    out = b.out_axes(0)
    b.input([*out[:first], *[None] * count, *out[first + len(shape) :]])
    for t in indices:
        if t is not None:
            b.input(out[first : first + len(shape)])
    return b.build()


def index_put(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims | None:
    """index_put(x, indices, values, accumulate) (indexing's backward): out has x's shape; the
    dims no index selects run through x, out and values (aligned from the right where their
    sizes agree). With accumulate, the index tensors' dims are reduce axes of the index tensors
    and values (where values spans them): the parts are added into x one after the other
    (`accumulates`); without it, the index tensors are read whole (a later write wins)."""
    x, indices, values = args[0], list(args[1]), args[2]
    found = _indexed(x, indices)
    if found is None:
        return None
    first, count, shape = found
    b = _Builder(outs, _ins(args, kwargs))
    axes = b.out_axes(0)
    free = [None if first <= d < first + count else a for d, a in enumerate(axes)]
    b.outputs[0] = free
    b.input(free)
    if _option(args, kwargs, 3, "accumulate", False):
        picked = [_accumulated_axis(b, s) for s in shape]
    else:
        picked = [None] * len(shape)
    for t in indices:
        if t is not None:
            b.input(list(picked))
    full = [*free[:first], *picked, *free[first + count :]]
    target = (*x.shape[:first], *shape, *x.shape[first + count :])
    off = len(target) - len(values.shape)
    b.input([full[d + off] if off + d >= 0 and values.shape[d] == target[d + off] else None
             for d in range(len(values.shape))])  # fmt: skip
    return b.build()


def index_select(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """index_select(x, dim, index): out[.., i, ..] = x[.., index[i], ..]. The dims other than
    `dim` run through x and out; out's `dim` runs along index (the edges of message passing,
    gathering node features per edge), x read whole there: a part's rows may be anywhere."""
    x, index = args[0], args[2]
    dim = _norm(args[1], len(x.shape))
    b = _Builder(outs, _ins(args, kwargs))
    axes = b.out_axes(0)
    if not len(x.shape):
        return b.build()
    b.input([None if d == dim else a for d, a in enumerate(axes)])
    b.input([axes[dim]] if len(index.shape) else [])
    return b.build()


def index_add(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """index_add(x, dim, index, source) (index_select's backward, message passing's scatter):
    out has x's shape; the dims other than `dim` run through x, source and out. Source's `dim`
    (the edges) is a reduce axis of index and source: the messages of a part of the edges are
    added into x, and the parts one after the other (`accumulates`: summing the parts would
    add x once per part)."""
    x, index = args[0], args[2]
    dim = _norm(args[1], len(x.shape))
    b = _Builder(outs, _ins(args, kwargs))
    axes = [None if d == dim else a for d, a in enumerate(b.out_axes(0))]
    b.outputs[0] = axes
    b.input(axes)
    if not len(x.shape) or not len(index.shape):
        return b.build()
    edges = _accumulated_axis(b, index.shape[0])
    b.input([edges])
    b.input([edges if d == dim else a for d, a in enumerate(axes)])
    return b.build()


def _option(args: tuple, kwargs: dict, pos: int, name: str, default: Any) -> Any:
    """A scalar argument given by position or by name, or its default."""
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def _attention_axes(b: _Builder, q: TensorMeta, causal: bool) -> tuple[Axis, Axis, Axis | None]:
    """Batch, heads and (not causal) query-length axes of a fused attention's output 0: a part
    of the queries of a causal attention would see keys from position 0 again."""
    bt, h, length, _ = b.out_axes(0)
    b.outputs[0] = [bt, h, None if causal else length, None]
    return bt, h, None if causal else length


def _attention_mask(b: _Builder, mask: Any, q: TensorMeta, axes: list[Axis | None]) -> None:
    """The additive or boolean mask (broadcast to (B, H, L, S)) runs along the axes it spans."""
    if isinstance(mask, TensorMeta):
        full = [*axes, None]
        target = (*q.shape[:3], mask.shape[-1])
        off = 4 - len(mask.shape)
        b.input([full[d + off] if mask.shape[d] == target[d + off] else None
                 for d in range(len(mask.shape))])  # fmt: skip


def flash_attention_cpu(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims | None:
    """_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
    scale) -> (out, logsumexp), what `F.scaled_dot_product_attention` (Hugging Face's default
    attention) runs on CPU: batch and heads run through q, k, v, the mask and both outputs, the
    query length through q, out, logsumexp and the mask when not causal. With dropout it has no
    rule (random draws, as native_dropout)."""
    if _option(args, kwargs, 3, "dropout_p", 0.0):
        return None
    q = args[0]
    b = _Builder(outs, _ins(args, kwargs))
    bt, h, length = _attention_axes(b, q, _option(args, kwargs, 4, "is_causal", False))
    b.outputs[1] = [bt, h, length]
    b.input([bt, h, length, None])
    b.input([bt, h, None, None])
    b.input([bt, h, None, None])
    _attention_mask(b, kwargs.get("attn_mask"), q, [bt, h, length])
    return b.build()


def flash_attention_cpu_backward(
    args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]
) -> OpDims | None:
    """Its backward (grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask,
    scale) -> (grad_q, grad_k, grad_v): the forward's axes; the key and value gradients sum
    over the queries, so the query length is not split here."""
    if _option(args, kwargs, 6, "dropout_p", 0.0):
        return None
    q = args[1]
    b = _Builder(outs, _ins(args, kwargs))
    bt, h, _ = _attention_axes(b, q, causal=True)
    b.outputs[1] = [bt, h, None, None]
    b.outputs[2] = [bt, h, None, None]
    for _ in range(4):  # grad_out, q, k, v
        b.input([bt, h, None, None])
    b.input([bt, h, None, None])  # out
    b.input([bt, h, None])  # logsumexp
    _attention_mask(b, kwargs.get("attn_mask"), q, [bt, h, None])
    return b.build()


def native_dropout(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> None:
    """Random ops have no rule: splitting would change the order of the RNG draws, so fission
    stops at them (their outputs enter a region as sliced inputs)."""
    return None


# --- recurrent layers ---------------------------------------------------------------------------
#
# nn.GRU on a CPU, and nn.LSTM where oneDNN does not take it (float64), decompose into one cell
# per time step: the sequence unbound along time, the gates unsafe_split, the steps stacked.


def unbind(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """unbind(x, dim) -> one slice per index of dim: the other dims run through x and every
    output; dim itself is not split (each output is one of its indices)."""
    x = args[0]
    dim = _norm(args[1] if len(args) > 1 else kwargs.get("dim", 0), len(x.shape))
    b = _Builder(outs, _ins(args, kwargs))
    axes = [None if d == dim else b.axis(s) for d, s in enumerate(x.shape)]
    kept = axes[:dim] + axes[dim + 1 :]
    for k in range(len(outs)):
        b.outputs[k] = list(kept)
    b.input(axes)
    return b.build()


def stack(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims:
    """stack(tensors, dim): the inputs' dims run through the output's other dims; the new
    dimension is not split (each index is one input)."""
    ins, b, axes, dim = _joined(args, kwargs, outs)
    kept = axes[:dim] + axes[dim + 1 :]
    for _ in ins:
        b.input(list(kept))
    return b.build()


# --- fused recurrent layers --------------------------------------------------------------------


def _state_dims(t: TensorMeta, n: Axis) -> list[Axis | None]:
    """A recurrent state, (N, H) or (layers, N, H): the batch is its second-to-last dim."""
    return [n if d == len(t.shape) - 2 else None for d in range(len(t.shape))]


def _sequence_dims(n: Axis) -> list[Axis | None]:
    """A time-major sequence (T, N, C): the batch is dim 1; time is not split (the recurrence
    carries each step's state into the next)."""
    return [None, n, None]


def mkldnn_rnn_layer(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims | None:
    """mkldnn_rnn_layer(input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, batch_sizes, mode, ...)
    -> (output, hy, cy, workspace): one layer of nn.LSTM on a CPU (oneDNN). The samples of a
    batch are independent (MAGIS §4.1: a spatial axis), so N runs through the input (T, N, I,
    time-major whatever batch_first says), the states and the outputs; the weights are read
    whole. The workspace (gates and states per step, in oneDNN's own layout) is each part's
    own, read by the same part of the backward (`part_outputs`). Packed sequences
    (batch_sizes) have no rule: their batch shrinks step by step."""
    x, hx = args[0], args[5]
    if args[8] or not isinstance(hx, TensorMeta):
        return None
    b = _Builder(outs, _ins(args, kwargs))
    n = b.axis(x.shape[1])
    b.input(_sequence_dims(n))
    for w in tensor_metas(args[1:5]):
        b.input([None] * len(w.shape))
    for state in tensor_metas(args[5:7]):
        b.input(_state_dims(state, n))
    b.outputs[0] = _sequence_dims(n)
    for k in (1, 2):
        if outs[k].numel:
            b.outputs[k] = _state_dims(outs[k], n)
    b.part_outputs.add((3, n))
    return b.build()


_RNN_BACKWARD_SEQUENCES = (0, 7, 10)  # input, output, grad_output
_RNN_BACKWARD_STATES = (5, 6, 8, 9, 11, 12)  # hx, cx, hy, cy, grad_hy, grad_cy
_RNN_BACKWARD_WORKSPACE = 22


def mkldnn_rnn_layer_backward(
    args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]
) -> OpDims | None:
    """Its backward (input, w_ih, w_hh, b_ih, b_hh, hx, cx, output, hy, cy, grad_output,
    grad_hy, grad_cy, reverse, mode, ..., batch_sizes, batch_first, workspace) -> (grad_input,
    grad_w_ih, grad_w_hh, grad_b_ih, grad_b_hh, grad_hx, grad_cx): N runs through the
    sequences, the states, their gradients and the workspace (each part reads its forward
    part's own); the weight and bias gradients sum over the samples (§4.2: reduced)."""
    x = args[0]
    if args[20] or len(args) <= _RNN_BACKWARD_WORKSPACE:
        return None
    b = _Builder(outs, _ins(args, kwargs))
    n = b.axis(x.shape[1])
    for pos, a in enumerate(args):
        if not isinstance(a, TensorMeta):
            continue
        if pos in _RNN_BACKWARD_SEQUENCES:
            b.input(_sequence_dims(n))
        elif pos in _RNN_BACKWARD_STATES:
            b.input(_state_dims(a, n))
        else:
            if pos == _RNN_BACKWARD_WORKSPACE:
                b.part_inputs.add((len(b.inputs), n))
            b.input([None] * len(a.shape))
    if outs[0].numel:
        b.outputs[0] = _sequence_dims(n)
    for k in (5, 6):
        if outs[k].numel:
            b.outputs[k] = _state_dims(outs[k], n)
    b.sums.update((k, n) for k in (1, 2, 3, 4))
    return b.build()


# --- the table ---------------------------------------------------------------------------------

POINTWISE_OPS = (
    "add", "sub", "mul", "div", "neg", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "pow",
    "relu", "sigmoid", "tanh", "gelu", "silu", "erf", "abs", "sign", "reciprocal", "square",
    "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "where", "masked_fill", "fill",
    "lt", "gt", "le", "ge", "eq", "ne", "logical_not", "logical_and", "logical_or",
    "bitwise_not", "bitwise_and", "bitwise_or", "clone", "_to_copy", "alias", "detach",
    "lift_fresh_copy", "threshold_backward", "gelu_backward", "silu_backward", "tanh_backward",
    "sigmoid_backward", "native_dropout_backward", "hardtanh", "hardtanh_backward", "leaky_relu",
    "leaky_relu_backward", "addcmul", "addcdiv", "lerp", "round", "floor", "ceil", "sin", "cos",
    "threshold", "elu", "elu_backward", "softplus", "softplus_backward", "mish",
    "hardswish", "hardswish_backward", "hardsigmoid", "hardsigmoid_backward", "relu6",
    "rsub", "remainder", "fmod", "exp2", "log2", "log10", "tan", "atan", "atan2", "trunc", "sgn",
    "erfc", "logical_xor", "bitwise_xor", "hypot", "xlogy",
)  # fmt: skip

DIM_RULES: Mapping[str, Rule] = MappingProxyType(
    {
        **dict.fromkeys(POINTWISE_OPS, pointwise),
        **dict.fromkeys(("zeros_like", "ones_like", "empty_like", "full_like"), _creation(None)),
        **dict.fromkeys(("zeros", "ones", "empty", "full"), _creation(0)),
        **dict.fromkeys(("new_zeros", "new_ones", "new_empty", "new_full"), _creation(1)),
        "expand": expand,
        "mm": mm,
        "addmm": addmm,
        "bmm": bmm,
        "convolution": convolution,
        "convolution_backward": convolution_backward,
        "native_layer_norm": native_layer_norm,
        "native_layer_norm_backward": native_layer_norm_backward,
        "native_batch_norm": native_batch_norm,
        "native_group_norm": native_group_norm,
        "native_group_norm_backward": native_group_norm_backward,
        "mse_loss": _mse(backward=False),
        "mse_loss_backward": _mse(backward=True),
        "baddbmm": baddbmm,
        "native_batch_norm_backward": native_batch_norm_backward,
        "_softmax": _all_but(_dim_arg(1)),
        "_safe_softmax": _all_but(_dim_arg(1)),
        "_log_softmax": _all_but(_dim_arg(1)),
        "_softmax_backward_data": _all_but(_dim_arg(2)),
        "_log_softmax_backward_data": _all_but(_dim_arg(2)),
        "cumsum": _all_but(_dim_arg(1)),
        "triu": _all_but(_last_n(2)),
        "tril": _all_but(_last_n(2)),
        "sum": _reduction(linear=True),
        "mean": _reduction(linear=False),
        "amax": _reduction(linear=False),
        "amin": _reduction(linear=False),
        "linalg_vector_norm": _reduction(linear=False, dim_pos=2),
        **dict.fromkeys(("view", "_unsafe_view", "reshape", "_reshape_alias"), view),
        "permute": permute,
        "transpose": transpose,
        "t": transpose,
        "unsqueeze": unsqueeze,
        "squeeze": squeeze,
        "cat": cat,
        "split": split,
        "split_with_sizes": split,
        "slice": slice_,
        "select": select,
        "select_backward": _scatter_back(2),
        "slice_backward": _scatter_back(2),
        "embedding": embedding,
        "embedding_dense_backward": embedding_dense_backward,
        "nll_loss_forward": _nll(spatial=False, backward=False),
        "nll_loss_backward": _nll(spatial=False, backward=True),
        "nll_loss2d_forward": _nll(spatial=True, backward=False),
        "nll_loss2d_backward": _nll(spatial=True, backward=True),
        "max_pool2d_with_indices": max_pool2d_with_indices,
        "max_pool2d_with_indices_backward": _pool_backward,
        "avg_pool2d": _window,
        "avg_pool2d_backward": _pool_backward,
        "_adaptive_avg_pool2d": _window,
        "_adaptive_avg_pool2d_backward": _pool_backward,
        "upsample_bilinear2d": _window,
        "upsample_nearest2d": _window,
        "upsample_bilinear2d_backward": _upsample_backward,
        "upsample_nearest2d_backward": _upsample_backward,
        "constant_pad_nd": constant_pad_nd,
        "gather": gather,
        "index": index,
        "index_put": index_put,
        "index_select": index_select,
        "index_add": index_add,
        "_scaled_dot_product_flash_attention_for_cpu": flash_attention_cpu,
        "_scaled_dot_product_flash_attention_for_cpu_backward": flash_attention_cpu_backward,
        "scatter_add": scatter_add,
        "repeat": repeat,
        "native_dropout": native_dropout,
        "unbind": unbind,
        "stack": stack,
        "unsafe_split": split,
        "mkldnn_rnn_layer": mkldnn_rnn_layer,
        "mkldnn_rnn_layer_backward": mkldnn_rnn_layer_backward,
    }
)


def dims_rule(op: str) -> Rule | None:
    """The dimension rule for an ATen overload name, or None (opaque to fission)."""
    return DIM_RULES.get(base_name(op))


def placeholder_dims(meta: TensorMeta) -> OpDims:
    """A graph input: every dimension is an axis (slicing an input is a view)."""
    n = len(meta.shape)
    return OpDims(tuple(meta.shape), (tuple(range(n)),), (), generated=frozenset(range(n)))


def op_dims(op: str, args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> OpDims | None:
    """The rule's answer for one call (None: no rule, or the rule declines)."""
    rule = dims_rule(op)
    if rule is None or not outs:
        return None
    return rule(args, kwargs, outs)


def split_shape(shape: tuple[int, ...], dim: int, n: int) -> tuple[int, ...]:
    """`shape` with dimension `dim` divided by n (the shape of one part)."""
    return tuple(s // n if d == dim else s for d, s in enumerate(shape))
