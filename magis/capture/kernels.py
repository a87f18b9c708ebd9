"""magis's own fake kernels, registered only while a step is captured (`capture_kernels`).

Some ops have no fake kernel, or one more restricted than the op itself, although the shapes of
their outputs follow from the shapes of their inputs; a capture that meets one would give up.
For each such op magis registers its own shape function, on a `torch.library` fragment of its
own that is torn down when the capture ends: the registration goes into torch's registry of fake
kernels (consulted by FakeTensorMode before its refusals of ops tagged `dynamic_output_shape`)
and onto the op's Meta key (`torch.library.register_fake(..., allow_override=True)`); destroying
the fragment restores the kernels torch had (and the fake tensors' cache of outputs is cleared),
so nothing changes outside a capture.

- `aten._ctc_loss` (int and tensor lengths) and its backward: the CPU kernels allocate the loss
  per sequence [batch] and `log_alpha` [batch, T, 2 * longest target + 1]. With int lengths the
  longest target is known; with tensor lengths and padded 2-D targets it is the padding width
  (targets padded to the longest one, as collate functions pad them); with 1-D concatenated
  targets and tensor lengths it is data-dependent, and the capture says so.
- `aten._grouped_mm` (mixture-of-experts layers): torch's fake kernel accepts only bfloat16, as
  its CUDA kernel does, while the CPU kernel also runs float32.
- the activations' backward ops of `POINTWISE_BACKWARD` (softplus, hardswish, ELU, ...): fake
  tensors run torch's Python decomposition of them, whose output takes the layout of the
  forward's input, while the kernels' TensorIterator gives it the layout of the incoming
  gradient. The shapes agree, the strides do not, and a later `view` the capture recorded as
  valid (a `reshape` of the gradient) fails when the program runs (Doge's softplus over a
  transposed gradient). magis's kernel is the TensorIterator's own result for (gradient,
  input), and the op is entered in `torch._decomp.meta_table` for the block, as FakeTensorMode
  prefers a decomposition over a registered fake kernel for ops without a meta. The regression
  losses' backward ops (`LOSS_BACKWARD`: MSE, smooth L1, Huber) likewise: their kernels return a
  contiguous gradient, the decomposition one laid out as the input (Sana's and HunyuanImage's
  loss on a permuted prediction), and `_log_softmax_backward_data` (`SOFTMAX_BACKWARD`: a CTC
  head's log_softmax over a transposed projection).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch._decomp import meta_table
from torch._subclasses.fake_tensor import FakeTensorMode

_CTC_ONE_D = (
    "aten._ctc_loss with 1-D (concatenated) targets and tensor lengths: the longest target "
    "is data-dependent; pass the targets padded to 2-D, or the lengths as Python ints"
)


def _longest_target(targets: torch.Tensor, target_lengths: Sequence[int] | torch.Tensor) -> int:
    if not isinstance(target_lengths, torch.Tensor):
        return max(target_lengths, default=0)
    if targets.dim() == 2:
        return targets.size(1)
    raise RuntimeError(_CTC_ONE_D)


def ctc_loss_fake(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths,
    target_lengths,
    blank: int = 0,
    zero_infinity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per sequence [batch], log_alpha [batch, T, 2 * longest target + 1]), as the CPU
    kernel allocates them (log_probs is [T, batch, classes])."""
    steps, batch = log_probs.size(0), log_probs.size(1)
    longest = _longest_target(targets, target_lengths)
    loss = log_probs.new_empty((batch,))
    log_alpha = log_probs.new_empty((batch, steps, 2 * longest + 1))
    return loss, log_alpha


def ctc_loss_backward_fake(grad, log_probs: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The gradient of log_probs: its shape, contiguous (the CPU kernel's `full_like`)."""
    return log_probs.new_empty(log_probs.shape)


def grouped_mm_fake(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The output of a grouped matmul in any floating dtype: 2-D x 3-D is [tokens, out] (one
    expert's matrix per group of rows), 3-D x 2-D [rows, out], 2-D x 2-D one [rows, out] per
    group, 3-D x 3-D a batched matmul."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        groups = offs.size(0) if offs is not None else 1
        size = (groups, mat_a.size(0), mat_b.size(1))
    elif a2:
        size = (mat_a.size(0), mat_b.size(-1))
    elif b2:
        size = (mat_a.size(1), mat_b.size(1))
    else:
        size = (mat_a.size(0), mat_a.size(1), mat_b.size(-1))
    return mat_a.new_empty(size, dtype=out_dtype or mat_a.dtype)


def pointwise_backward_fake(grad_output: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The gradient of an activation's input, laid out as the CPU and CUDA kernels lay it out:
    a TensorIterator over (grad_output, the other tensor), here `aten.add`'s meta over them."""
    other = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
    return torch.ops.aten.add.Tensor(grad_output, other)


# activations' backward ops whose fake kernel (torch's decomposition) lays out the output
# unlike their kernels (module docstring); each one's real and fake strides are tested
POINTWISE_BACKWARD = (
    "softplus_backward",
    "hardswish_backward",
    "elu_backward",
    "hardsigmoid_backward",
    "logit_backward",
    "hardtanh_backward",
)


def loss_backward_fake(
    grad_output: torch.Tensor, self: torch.Tensor, *args, **kwargs
) -> torch.Tensor:
    """The gradient of a regression loss's input, contiguous as the kernels allocate it
    (`zeros_like(input, LEGACY_CONTIGUOUS_MEMORY_FORMAT)`), whatever the input's layout."""
    return self.new_empty(self.shape)


# regression losses' backward ops whose decomposition lays the gradient out as the input while
# the kernels make it contiguous (Sana's loss on a permuted prediction); tested as above
LOSS_BACKWARD = ("mse_loss_backward", "smooth_l1_loss_backward", "huber_loss_backward")


def log_softmax_backward_fake(
    grad_output: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: torch.dtype
) -> torch.Tensor:
    """The gradient of log_softmax's input, contiguous as the kernel allocates it (its
    structured meta: the gradient's sizes, no strides), whatever the gradient's layout."""
    return grad_output.new_empty(grad_output.shape, dtype=input_dtype)


# softmax backward ops whose decomposition lays the gradient out as the incoming one while the
# kernels make it contiguous (OmniASR's CTC head: log_softmax over a transposed projection)
SOFTMAX_BACKWARD = ("_log_softmax_backward_data",)

# ops without a meta kernel whose decomposition lays out the output unlike their kernels: for
# the capture, FakeTensorMode takes magis's kernel before the decomposition
LAYOUT_KERNELS: dict[str, Callable] = {
    **dict.fromkeys(POINTWISE_BACKWARD, pointwise_backward_fake),
    **dict.fromkeys(LOSS_BACKWARD, loss_backward_fake),
    **dict.fromkeys(SOFTMAX_BACKWARD, log_softmax_backward_fake),
}

# op overload -> its fake kernel, registered by `capture_kernels`
CAPTURE_KERNELS: dict[str, Callable] = {
    "aten::_ctc_loss": ctc_loss_fake,
    "aten::_ctc_loss.Tensor": ctc_loss_fake,
    "aten::_ctc_loss_backward": ctc_loss_backward_fake,
    "aten::_ctc_loss_backward.Tensor": ctc_loss_backward_fake,
    "aten::_grouped_mm": grouped_mm_fake,
    **{f"aten::{name}": kernel for name, kernel in LAYOUT_KERNELS.items()},
}


def _overload_name(qualname: str) -> str:
    """`aten::_ctc_loss.Tensor` as a graph node names its op: `aten._ctc_loss.Tensor`."""
    namespace, _, name = qualname.partition("::")
    return f"{namespace}.{name}" if "." in name else f"{namespace}.{name}.default"


# the ops of CAPTURE_KERNELS as graph nodes name them
KERNEL_OPS = frozenset(_overload_name(q) for q in CAPTURE_KERNELS)


@contextmanager
def capture_kernels() -> Iterator[None]:
    """`CAPTURE_KERNELS` registered for the block, and removed after it (module docstring)."""
    lib = torch.library.Library("aten", "FRAGMENT")
    preferred = {getattr(torch.ops.aten, n).default: k for n, k in LAYOUT_KERNELS.items()}
    kept = {op: meta_table[op] for op in preferred if op in meta_table}
    # fake tensors cache an op's output per input signature: forget what torch's kernels gave
    FakeTensorMode.cache_clear()
    try:
        for name, kernel in CAPTURE_KERNELS.items():
            torch.library.register_fake(name, kernel, lib=lib, allow_override=True)
        meta_table.update(preferred)  # FakeTensorMode takes these, not the decomposition
        yield
    finally:
        for op in preferred:
            meta_table.pop(op, None)
        meta_table.update(kept)
        lib._destroy()  # torch.library's own teardown of a fragment (what its finalizer calls)
        # and forget what these kernels gave
        FakeTensorMode.cache_clear()
