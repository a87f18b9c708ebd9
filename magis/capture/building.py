"""Building models for capture: at full size under fake tensors, or small and real.

Construction that works in both modes: the default dtype set around construction
(`module.to(torch.bfloat16)` fails on fake parameters), and a truncated-normal initialisation
without the data-dependent rejection loop (ViT's `trunc_normal_` raises under FakeTensorMode).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


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
