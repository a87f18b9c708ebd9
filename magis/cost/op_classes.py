"""Which class of kernel an ATen op is, for comparing cost models class by class (issue 41).

A roofline preset can be right on matrix products and wrong on pointwise ops; one ratio over a
whole step hides that. The classes follow where a GPU spends a training step's time: matrix
products, convolutions, fused attention, pointwise ops, reductions (norms and softmax
included: each reduces a row), and copies (layout changes, concatenation, Store/Load).
"""

from __future__ import annotations

OP_CLASSES: tuple[str, ...] = ("matmul", "conv", "attention", "pointwise", "reduction", "copy")

_MATMUL = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm"})
_ATTENTION_PREFIXES = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")
_REDUCTION = frozenset(
    {
        "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std",
        "var_mean", "norm", "linalg_vector_norm", "prod", "logsumexp", "cumsum",
        "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
        "native_layer_norm", "native_layer_norm_backward", "native_batch_norm",
        "native_batch_norm_backward", "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
        "native_group_norm", "native_group_norm_backward", "_fused_rms_norm",
        "_fused_rms_norm_backward", "nll_loss_forward", "nll_loss_backward",
        "nll_loss2d_forward", "nll_loss2d_backward", "embedding_dense_backward",
        "index_add", "scatter_add", "max_pool2d_with_indices_backward",
        "avg_pool2d_backward", "_adaptive_avg_pool2d_backward", "mse_loss",
    }
)  # fmt: skip
_COPY = frozenset(
    {
        "_to_copy", "copy", "copy_", "clone", "cat", "stack", "contiguous", "constant_pad_nd",
        "index", "index_select", "gather", "embedding", "slice_scatter", "select_scatter",
        "as_strided_scatter", "repeat", "store", "load",
    }
)  # fmt: skip


def op_class(op: str) -> str:
    """The class of `op` (an overload name such as 'aten.mm.default', or magis's Store/Load)."""
    packet = op.split(".")[1] if op.startswith("aten.") else op.split(".")[-1]
    if packet in _MATMUL:
        return "matmul"
    if packet.startswith(("convolution", "cudnn_convolution", "_convolution")):
        return "conv"
    if packet.startswith(_ATTENTION_PREFIXES):
        return "attention"
    if packet in _REDUCTION:
        return "reduction"
    if packet in _COPY or "copy" in packet:
        return "copy"
    return "pointwise"
