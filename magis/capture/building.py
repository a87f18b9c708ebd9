"""Building models for capture: at full size under fake tensors, or small and real.

Construction that works in both modes: the default dtype set around construction
(`module.to(torch.bfloat16)` fails on fake parameters), and a truncated-normal initialisation
without the data-dependent rejection loop (ViT's `trunc_normal_` raises under FakeTensorMode),
and, for a constructor that reads values it computes, small constants made for real.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily set torch's default floating dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def trunc_normal_icdf(
    tensor: torch.Tensor,
    mean: float,
    std: float,
    a: float,
    b: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Fill `tensor` from N(mean, std^2) truncated to [a, b] by inverse-CDF sampling.

    Exact and free of data-dependent control flow (unlike rejection sampling), so it also runs on
    fake tensors.
    """

    def cdf(value: float) -> float:
        return 0.5 * (1.0 + math.erf((value - mean) / (std * math.sqrt(2.0))))

    with torch.no_grad():
        tensor.uniform_(2.0 * cdf(a) - 1.0, 2.0 * cdf(b) - 1.0, generator=generator)
        tensor.erfinv_()
        tensor.mul_(std * math.sqrt(2.0)).add_(mean)
        tensor.clamp_(min=a, max=b)
    return tensor


@contextmanager
def data_independent_trunc_normal() -> Iterator[None]:
    """Route `torch.nn.init.trunc_normal_` (and transformers' wrapper of it) to `trunc_normal_icdf`.

    Both call the module-level `_no_grad_trunc_normal_` of `torch.nn.init`, which is swapped.
    """
    init_module: Any = torch.nn.init
    original = init_module._no_grad_trunc_normal_
    init_module._no_grad_trunc_normal_ = trunc_normal_icdf
    try:
        yield
    finally:
        init_module._no_grad_trunc_normal_ = original


def build_for_training(
    factory: Callable[[], nn.Module], *, patch_trunc_normal: bool = False
) -> nn.Module:
    """Run `factory` (in the ambient default dtype) and return the model in training mode."""
    if patch_trunc_normal:
        with data_independent_trunc_normal():
            model = factory()
    else:
        model = factory()
    return model.train()


# Tensors this small are computed for real while a model is built under fake tensors (see
# `small_constants_real`): 2^16 elements, 256 KiB in float32.
SMALL_CONSTANT_NUMEL = 1 << 16


class _SmallConstantsReal(TorchDispatchMode):
    """Under a FakeTensorMode: an op that reads no fake tensor and makes only small tensors runs
    for real, so a constructor can read the values it computes (`torch.linspace(...).tolist()`
    for drop-path rates, PoolFormer's and many vision models'). The output size is found on the
    meta device first, so no large tensor is allocated; an op that cannot run there (a value
    read, `.item()`) runs for real when its inputs are small."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                if _makes_small_tensors(func, args, kwargs):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)  # the fake mode's


def _makes_small_tensors(func, args: tuple, kwargs: dict) -> bool:
    """Whether `func` makes only tensors of at most SMALL_CONSTANT_NUMEL elements, run on meta
    copies of its tensors (and on the meta device where it creates one)."""
    meta = torch.device("meta")

    def on_meta(x: Any) -> Any:
        return x.to(meta) if isinstance(x, torch.Tensor) else x

    margs, mkwargs = pytree.tree_map(on_meta, (args, kwargs))
    if "device" in mkwargs:
        mkwargs["device"] = meta
    try:
        out = func(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - no meta kernel: a value read (.item()), or an op
        # that has none; it runs for real only on small tensors
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return all(t.numel() <= SMALL_CONSTANT_NUMEL for t in ins)
    made = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return all(t.numel() <= SMALL_CONSTANT_NUMEL for t in made)


@contextmanager
def small_constants_real() -> Iterator[None]:
    """Inside a FakeTensorMode: small tensors made from no fake tensor are real (see
    `_SmallConstantsReal`); parameters and buffers that end up real are small, and the capture
    makes them fake as it does a real model's."""
    with _SmallConstantsReal():
        yield
