"""The op registry: one entry per ATen op, with what the cost model and the memory model need.

An entry gives the op's flags (view, random, compute-bound, hidden in-place writes) and its cost
terms (FLOPs and bytes moved). An op without an entry is *opaque* (DESIGN principle 5): it gets
generic costs — one FLOP per output element, every input and output read or written once — and is
still scheduled, simulated and executed. Dimension rules for fission join these entries later
(MAGIS §4.1).

Cost functions receive the op's positional arguments with every tensor argument replaced by its
`TensorMeta`, its keyword arguments, and its output metadata.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from magis.ir.tensor import TensorMeta

FlopsFn = Callable[[tuple, dict, tuple[TensorMeta, ...]], float]
BytesFn = FlopsFn  # (args, kwargs, outs) -> bytes the kernel moves
# (args, kwargs, outs) -> {output index: bytes its storage really holds}, for kernels whose fake
# (meta) function reports an output smaller than the buffer the real kernel allocates.
WorkspaceFn = Callable[[tuple, dict, tuple[TensorMeta, ...]], dict[int, int]]


@dataclass(frozen=True)
class OpInfo:
    """What magis knows of one ATen op (by overload name, e.g. ``aten.mm.default``)."""

    name: str
    flops: FlopsFn | None = None
    is_view: bool = False  # every output aliases the storage of argument 0, costs no time
    is_random: bool = False  # draws from the RNG: never recomputed without replaying it
    compute_bound: bool = False  # matmul / convolution class: the roofline's FLOP side dominates
    mutates: tuple[int, ...] = ()  # argument positions written in place (schema may not say so)
    opaque: bool = False  # no entry: generic costs
    copy_stream: bool = False  # a Store or Load: a host<->device copy on the copy stream (§6.2)
    host_output: bool = False  # the output lives in host memory (a Store), not on the device
    comm_stream: bool = False  # a collective: runs on the communication stream, never recomputed
    # The kernel computes the elementwise result (the broadcast of arguments 0 and 1) into the
    # output and then resizes it in place to the reduced shape: its storage keeps the
    # elementwise size (`RESIZED_LOSSES`).
    keeps_elementwise_storage: bool = False
    # The kernel fills an output with a workspace whose size the fake kernel reports as 0
    # (oneDNN's LSTM training workspace): its real bytes, from the call's arguments
    # (`RECURRENT_WORKSPACES`).
    workspace: WorkspaceFn | None = None
    # The kernel reads its tensor arguments' memory as dense row-major arrays without looking
    # at their strides (oneDNN's RNN layers): a strided view must be copied before it is passed.
    dense_inputs: bool = False
    # An argument is another kernel's workspace (oneDNN's LSTM backward reads its forward's):
    # synthetic inputs made from the metadata (0 bytes) would be read past their end, so the
    # profiler estimates the op instead of running it.
    reads_workspace: bool = False
    # The bytes the kernel moves, where that is not every input once and every output once
    # (`bytes_moved`): gathers and scatter-adds (`INDEXED_TRAFFIC`).
    moved: BytesFn | None = None
    # A value guard (`EXPECT_OP`): checks a value or shape the step read at capture; no kernel
    # of torch's, so the profiler prices it by the roofline instead of running it.
    guard: bool = False
    # The output is a copy of argument 0's whole storage, viewed as argument 0 (the functional
    # `copy(self, src)`: ATen's `clone_preserve_strides`): its storage is that storage's size.
    clones_storage: bool = False

    @property
    def sized_by_call(self) -> bool:
        """An output's storage may be larger than its metadata says (`storage_bytes`)."""
        return self.keeps_elementwise_storage or self.workspace is not None or self.clones_storage


def tensor_metas(args: tuple) -> list[TensorMeta]:
    """Every TensorMeta in an argument tuple, lists flattened, in order."""
    found: list[TensorMeta] = []
    for a in args:
        if isinstance(a, TensorMeta):
            found.append(a)
        elif isinstance(a, list | tuple):
            found.extend(tensor_metas(tuple(a)))
    return found


def bytes_moved(info: OpInfo, args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    """Bytes read and written: every tensor input once, every output once (unless the op says
    otherwise: `OpInfo.moved`); views move nothing."""
    if info.is_view:
        return 0.0
    if info.moved is not None:
        return float(info.moved(args, kwargs, outs))
    return _every_tensor_once(args, kwargs, outs)


def flops_of(info: OpInfo, args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    if info.is_view:
        return 0.0
    if info.flops is not None:
        return float(info.flops(args, kwargs, outs))
    return float(sum(o.numel for o in outs))


# --- FLOP formulas -----------------------------------------------------------------------------


def _mm(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    a, b = args[0], args[1]
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]


def _addmm(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    a, b = args[1], args[2]
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1] + outs[0].numel


def _bmm(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    a, b = args[0], args[1]
    return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def _baddbmm(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    return _bmm(args[1:], kwargs, outs) + outs[0].numel


def _conv_macs(x: TensorMeta, w: TensorMeta, out: TensorMeta, groups: int) -> float:
    # out: (N, Cout, *spatial); w: (Cout, Cin/groups, *kernel)
    return float(out.numel) * math.prod(w.shape[1:])


def _convolution(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    x, w = args[0], args[1]
    if len(args) > 6 and args[6]:  # transposed: w is (Cin, Cout/groups, *kernel), per input
        return 2.0 * float(x.numel) * math.prod(w.shape[1:])
    groups = args[8] if len(args) > 8 else 1
    return 2.0 * _conv_macs(x, w, outs[0], groups)


def _convolution_backward(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    # args: grad_out, input, weight, bias_sizes, stride, padding, dilation, transposed,
    # output_padding, groups, output_mask. Each of grad_input and grad_weight costs one
    # forward convolution's worth of MACs.
    grad_out, x, w = args[0], args[1], args[2]
    mask = args[10] if len(args) > 10 else [True, True, True]
    fwd = 2.0 * _conv_macs(x, w, grad_out, args[9] if len(args) > 9 else 1)
    return fwd * (int(bool(mask[0])) + int(bool(mask[1]))) + grad_out.numel * int(bool(mask[2]))


def _reduction(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    ins = tensor_metas(args)
    return float(ins[0].numel) if ins else 0.0


def _per_input_element(k: float) -> FlopsFn:
    def flops(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
        ins = tensor_metas(args)
        return k * (ins[0].numel if ins else sum(o.numel for o in outs))

    return flops


def _per_output_element(k: float) -> FlopsFn:
    def flops(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
        return k * sum(o.numel for o in outs)

    return flops


def _zero(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    return 0.0


# --- Bytes of indexed ops ----------------------------------------------------------------------


def _every_tensor_once(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    read = sum(m.nbytes for m in tensor_metas(args) + tensor_metas(tuple(kwargs.values())))
    return float(read + sum(o.nbytes for o in outs))


def _gathered(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    """A gather (index_select, embedding, gather, advanced indexing) reads one element of its
    table (argument 0) per output element, not the whole table: the rows of a GCN's node
    features it gathers for 4,000,000 edges are 20 times the table, and an LM's embedding
    lookup reads a few thousand of its 50,000 rows. Counting the table instead made the
    gather of a batch of tokens cost the whole vocabulary, and every part of a gather split
    along its index re-read the whole table: a GCN's message passing split in 8 cost 5% of
    the step where the rows gathered are the same. (Repeated rows may hit a cache; a roofline
    does not model one.)"""
    table = tensor_metas(args[:1])
    others = _every_tensor_once(args, kwargs, ()) - sum(m.nbytes for m in table)
    return others + 2.0 * sum(o.nbytes for o in outs)


def _scatter_added(source: int) -> BytesFn:
    """A scatter-add (index_add, scatter_add, the embedding's backward) reads each element of
    its source (argument `source`) and reads and writes the output element it adds into:
    every tensor once, and the output's added elements twice more."""

    def moved(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
        added = tensor_metas(args[source : source + 1])
        return _every_tensor_once(args, kwargs, outs) + 2.0 * sum(m.nbytes for m in added)

    return moved


INDEXED_TRAFFIC: dict[str, BytesFn] = {
    "index_select": _gathered,
    "embedding": _gathered,
    "gather": _gathered,
    "index": _gathered,
    "index_add": _scatter_added(3),
    "scatter_add": _scatter_added(3),
    "embedding_dense_backward": _scatter_added(0),
}


# --- The table ---------------------------------------------------------------------------------

VIEW_OPS = (
    "view",
    "_unsafe_view",
    "_reshape_alias",
    "reshape",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "alias",
    "detach",
    "as_strided",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "diagonal",
    "narrow",
    "unfold",
    "view_as_real",
    "view_as_complex",
    "lift_fresh",
    "_reshape_copy_alias",
)
RANDOM_OPS = (
    "bernoulli",
    "native_dropout",
    "rand",
    "randn",
    "rand_like",
    "randn_like",
    "randint",
    "normal",
    "uniform",
    "multinomial",
    "randperm",
    "dropout",
    # the functional forms functionalization gives the in-place draws (`exponential_`:
    # PhiMoE's Gumbel routing noise; `normal_` -> `normal_functional`), and the other ops
    # that take a Generator (tests/ir: every functional ATen op with one is here)
    "exponential",
    "normal_functional",
    "geometric",
    "cauchy",
    "log_normal",
    "random",
    "randint_like",
    "poisson",
    "binomial",
    "_standard_gamma",
    "_sample_dirichlet",
    "_fused_dropout",
    "rrelu",
    "rrelu_with_noise_functional",
)
COMPUTE_BOUND = {
    "mm": _mm,
    "addmm": _addmm,
    "bmm": _bmm,
    "baddbmm": _baddbmm,
    "convolution": _convolution,
    "convolution_backward": _convolution_backward,
}
# Ops whose cost is a few passes over the input rather than one FLOP per output element.
WEIGHTED = {
    "native_layer_norm": _per_input_element(8),
    "native_layer_norm_backward": _per_input_element(12),
    "native_batch_norm": _per_input_element(8),
    "_native_batch_norm_legit_functional": _per_input_element(8),
    "native_batch_norm_backward": _per_input_element(12),
    "_softmax": _per_input_element(5),
    "_safe_softmax": _per_input_element(5),  # SDPA's math path (rows of -inf give zeros)
    "_log_softmax": _per_input_element(5),
    "_softmax_backward_data": _per_input_element(4),
    "_log_softmax_backward_data": _per_input_element(4),
    "gelu": _per_input_element(8),
    "gelu_backward": _per_input_element(12),
    "silu": _per_input_element(4),
    "silu_backward": _per_input_element(6),
    "tanh": _per_input_element(4),
    "sum": _reduction,
    "mean": _reduction,
    "amax": _reduction,
    "max": _reduction,
    "var_mean": _per_input_element(3),
    "nll_loss_forward": _per_output_element(1),
    "nll_loss_backward": _per_output_element(1),
    "nll_loss2d_forward": _per_input_element(1),
    "nll_loss2d_backward": _per_output_element(1),
    "ones": _per_output_element(1),
    "embedding": _zero,
    "embedding_dense_backward": _per_input_element(1),
    "max_pool2d_with_indices": _per_output_element(9),
    "max_pool2d_with_indices_backward": _per_input_element(2),
    "empty": _zero,
    "empty_like": _zero,
    "empty_strided": _zero,
    "zeros": _per_output_element(1),
    "zeros_like": _per_output_element(1),
    "ones_like": _per_output_element(1),
    "full": _per_output_element(1),
    "arange": _per_output_element(1),
    "copy_": _per_output_element(1),
}
# Losses whose kernel allocates the output at the elementwise loss's size (the broadcast of
# input and target) and then `resize_`s it to the mean's or sum's 0-d shape, which never
# shrinks a storage: the scalar loss holds the whole buffer until it dies, measured by
# the dispatch tracker (mse_loss on a 2x8x16x16 float64 input: 32,768 B, not 8). mse_loss
# and smooth_l1_loss are structured kernels whose meta function allocates it (any device);
# soft_margin_loss writes it through its out= overload; binary_cross_entropy's CPU and CUDA
# kernels start from empty_like(input). (huber_loss, l1_loss and the others reduce into a
# fresh tensor, so they are not here.)
RESIZED_LOSSES = ("mse_loss", "smooth_l1_loss", "soft_margin_loss", "binary_cross_entropy")
# Ops whose schema does not mark an argument as written, although the CPU and CUDA kernels do:
# Batch norms in training update running_mean and running_var (arguments 3 and 4) in place
# without their schema saying so: the native kernel, and the cuDNN and MIOpen ones that
# `aten.batch_norm` picks on a GPU.
HIDDEN_MUTATIONS = {
    "native_batch_norm": (3, 4),
    "cudnn_batch_norm": (3, 4),
    "miopen_batch_norm": (3, 4),
}


# --- fused recurrent layers (oneDNN) -----------------------------------------------------------
#
# On a CPU, nn.LSTM in float32 or bfloat16 runs one `mkldnn_rnn_layer` per layer and direction
# (aten/src/ATen/native/mkldnn/RNN.cpp): input (T, N, I) time-major whatever batch_first says,
# weights (G*H, I) and (G*H, H), states (N, H); G = 4 gates. Its training workspace is a oneDNN
# buffer the meta function reports as 0 bytes.


def _recurrent_sizes(args: tuple) -> tuple[int, int, int, int, int]:
    """(T, N, I, H, gates x H) of an mkldnn_rnn_layer call or its backward (same first args)."""
    x, w_ih = args[0], args[1]
    t, n, i = x.shape
    gh = w_ih.shape[0]
    return t, n, i, args[2].shape[1], gh


def _recurrent_layer(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    """Every step multiplies the input and the state by the gate weights: 2 T N GH (I + H)."""
    t, n, i, h, gh = _recurrent_sizes(args)
    return 2.0 * t * n * gh * (i + h) + 10.0 * t * n * h


def _recurrent_layer_backward(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> float:
    """The gradients of the inputs and of the weights: two forward products' worth."""
    return 2.0 * _recurrent_layer(args, kwargs, outs)


def _good_ld(floats: int) -> int:
    """oneDNN's leading dimension for f32 workspace rows (rnn_utils get_good_ld): rounded up to
    64 bytes, and one more 64-byte step when the result is a multiple of 256 (4K aliasing)."""
    ld = -(-floats // 16) * 16
    return ld + 16 if ld % 256 == 0 else ld


def _pages(nbytes: int) -> int:
    """oneDNN starts every workspace array on a 4,096-byte page (rnn_utils set_offsets)."""
    return -(-nbytes // 4096) * 4096


def onednn_lstm_workspace_bytes(t: int, n: int, i: int, h: int) -> int:
    """The workspace `mkldnn_rnn_layer` allocates for one LSTM layer in training (f32).

    oneDNN lays out, each array on its own page: the gates (T x N rows of 4H), the hidden
    outputs (T x N rows of H), and for (2 layers) x (T + 1) steps x N rows the states, the
    cell states and their three gradients — three arrays with rows of max(I, H) and two of
    exactly H. Calibrated against oneDNN 3.12 (PyTorch 2.13's CPU build) on 30 shapes, every
    byte equal (tests/sim/test_sim_measured.py checks some against the real kernel).
    """
    state, rows = _good_ld(max(i, h)), 2 * (t + 1) * n
    arrays = [t * n * _good_ld(4 * h), t * n * _good_ld(h)]
    arrays += [rows * state] * 3 + [rows * h] * 2
    return sum(_pages(4 * a) for a in arrays)


def _mkldnn_lstm_workspace(args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...]) -> dict:
    """Output 3 of an LSTM (mode 2) mkldnn_rnn_layer in training holds the workspace."""
    mode, train = args[9], args[15]
    if mode != 2 or not train:
        return {}
    t, n, i, h, _ = _recurrent_sizes(args)
    return {3: onednn_lstm_workspace_bytes(t, n, i, h)}


RECURRENT = {
    "mkldnn_rnn_layer": _recurrent_layer,
    "mkldnn_rnn_layer_backward": _recurrent_layer_backward,
}
RECURRENT_WORKSPACES = {"mkldnn_rnn_layer": _mkldnn_lstm_workspace}
RECURRENT_WORKSPACE_READERS = ("mkldnn_rnn_layer_backward",)


def base_name(op: str) -> str:
    """'aten.mm.default' -> 'mm'; 'aten.add_.Tensor' -> 'add_'."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


@dataclass(frozen=True)
class OpRegistry:
    """Entries by overload name; `lookup` never fails (unknown ops are opaque)."""

    entries: dict[str, OpInfo]
    # op -> its entry, as `lookup` resolved it: a search asks for every node's op again and
    # again (a duplicate scan of a 42,000-node graph: 19,000 lookups, most of its time), and
    # a graph has a few hundred distinct ops
    _resolved: dict[str, OpInfo] = field(default_factory=dict, compare=False, repr=False)

    def lookup(self, op: str) -> OpInfo:
        info = self._resolved.get(op)
        if info is None:
            info = self.entries.get(op) or self.entries.get(base_name(op))
            if info is None:
                info = OpInfo(name=op, opaque=True)
            self._resolved[op] = info
        return info

    def known(self, op: str) -> bool:
        return not self.lookup(op).opaque


def build_default_registry() -> OpRegistry:
    entries: dict[str, OpInfo] = {}
    for name in VIEW_OPS:
        entries[name] = OpInfo(name, is_view=True)
    for name in RANDOM_OPS:
        entries[name] = OpInfo(name, is_random=True)
    for name, fn in COMPUTE_BOUND.items():
        entries[name] = OpInfo(name, flops=fn, compute_bound=True)
    for name, fn in WEIGHTED.items():
        entries[name] = OpInfo(name, flops=fn, mutates=HIDDEN_MUTATIONS.get(name, ()))
    for name, fn in RECURRENT.items():
        workspace = RECURRENT_WORKSPACES.get(name)
        entries[name] = OpInfo(
            name,
            flops=fn,
            compute_bound=True,
            workspace=workspace,
            dense_inputs=True,
            reads_workspace=name in RECURRENT_WORKSPACE_READERS,
        )
    for name in POINTWISE:
        entries.setdefault(name, OpInfo(name, flops=_per_output_element(1)))
    for name, positions in HIDDEN_MUTATIONS.items():  # GPU batch norms: no FLOP rule, mutating
        entries.setdefault(name, OpInfo(name, flops=_per_input_element(8), mutates=positions))
    for name in RESIZED_LOSSES:  # one without an entry keeps its generic costs (opaque)
        info = entries.get(name) or OpInfo(name, opaque=True)
        entries[name] = replace(info, keeps_elementwise_storage=True)
    for name, moved in INDEXED_TRAFFIC.items():
        info = entries.get(name) or OpInfo(name, flops=_per_output_element(1))
        entries[name] = replace(info, moved=moved)
    entries[STORE_OP] = OpInfo(STORE_OP, flops=_zero, copy_stream=True, host_output=True)
    entries[LOAD_OP] = OpInfo(LOAD_OP, flops=_zero, copy_stream=True)
    entries[EXPECT_OP] = OpInfo(EXPECT_OP, flops=_zero, guard=True)
    # no entry of its own otherwise: generic costs, as before (opaque)
    copy = entries.get(STORAGE_CLONING_COPY) or OpInfo(STORAGE_CLONING_COPY, opaque=True)
    entries[STORAGE_CLONING_COPY] = replace(copy, clones_storage=True)
    for name in COLLECTIVE_OPS:
        entries[name] = OpInfo(name, flops=_zero, comm_stream=True)
    # The wait returns the collective's own output tensor (c10d's functional collectives):
    # an alias of its argument that takes no compute time; its readers wait for the collective.
    entries[WAIT_OP] = OpInfo(WAIT_OP, is_view=True)
    return OpRegistry(entries)


# Swapping (MAGIS §5.2, Fig. 8): Store copies a device tensor to host memory, Load copies it back.
STORE_OP = "magis.store"
LOAD_OP = "magis.load"

# The functional form of `copy_` (what functionalization records for a write into a view).
STORAGE_CLONING_COPY = "aten.copy.default"

# A value guard (`magis.capture.specialize`): a step that reads a tensor's value in Python is
# captured for the value it read; the guard checks, where the step read it, that a run reads the
# same (args: the tensor, the shape it had, the value or None, the source line).
EXPECT_OP = "magis.expect"

# Functional collectives (torch.distributed._functional_collectives), as make_fx records them:
# each returns a new buffer, filled on the communication stream; `wait_tensor` hands it over.
ALL_REDUCE_OP = "_c10d_functional.all_reduce.default"
ALL_GATHER_OP = "_c10d_functional.all_gather_into_tensor.default"
REDUCE_SCATTER_OP = "_c10d_functional.reduce_scatter_tensor.default"
WAIT_OP = "_c10d_functional.wait_tensor.default"
COLLECTIVE_OPS = (ALL_REDUCE_OP, ALL_GATHER_OP, REDUCE_SCATTER_OP)


POINTWISE = (
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "pow",
    "relu",
    "sigmoid",
    "threshold_backward",
    "where",
    "clone",
    "_to_copy",
    "masked_fill",
    "fill",
    "abs",
    "sign",
    "maximum",
    "minimum",
    "clamp",
    "erf",
    "sigmoid_backward",
    "tanh_backward",
    "reciprocal",
    "lt",
    "gt",
    "le",
    "ge",
    "eq",
    "ne",
    "logical_not",
    "bitwise_not",
    "cat",
    "stack",
    "upsample_bilinear2d",
    "upsample_bilinear2d_backward",
    "upsample_nearest2d",
    "upsample_nearest2d_backward",
    "index",
    "index_put",
    "gather",
    "scatter",
    "scatter_add",
    "constant_pad_nd",
    "triu",
    "tril",
    "addcmul",
    "addcdiv",
    "lerp",
    "cumsum",
    "round",
    "floor",
    "ceil",
    "sin",
    "cos",
    "square",
    "native_dropout_backward",
    "hardtanh",
    "hardtanh_backward",
    "leaky_relu",
    "leaky_relu_backward",
    "slice_backward",
    "select_backward",
    "new_zeros",
    "new_ones",
    "new_empty",
    "new_full",
    "scalar_tensor",
    "mse_loss",
    "mse_loss_backward",
    "avg_pool2d",
    "avg_pool2d_backward",
    "_adaptive_avg_pool2d",
    "_adaptive_avg_pool2d_backward",
    "expand_copy",
    "repeat",
    "bitwise_and",
    "bitwise_or",
    "logical_and",
    "logical_or",
    "lift_fresh_copy",
)

DEFAULT_REGISTRY = build_default_registry()


def resolve_overload(op: str):
    """torch.ops.aten.mm.default for 'aten.mm.default'; a clear error for anything else."""
    import torch

    from magis.errors import UnsupportedOpError

    parts = op.split(".")
    if len(parts) != 3:
        raise UnsupportedOpError(
            f"cannot run op {op!r}: not an ATen overload name (ns.op.overload)"
        )
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError) as exc:
        raise UnsupportedOpError(
            f"cannot run op {op!r}: this PyTorch has no such operator"
        ) from exc


def out_overload(op: str):
    """The `out=` overload matching a functional overload ('aten.sub.Tensor' -> sub.out), or None.

    In-place updates run through it, writing straight into the parameter's storage. The match
    requires the same argument names, so a wrong overload is never picked.
    """
    base = resolve_overload(op)
    packet = base.overloadpacket
    overload = op.split(".")[2]
    names = [a.name for a in base._schema.arguments]
    for candidate in (f"{overload}_out", "out"):
        if candidate not in packet.overloads():
            continue
        out = getattr(packet, candidate)
        out_args = [a.name for a in out._schema.arguments if not a.is_out]
        if out_args == names:
            return out
    return None
