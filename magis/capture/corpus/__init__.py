"""Public architectures outside the zoo, built the way their users build them (issues #15, #16).

The zoo (`magis.capture.workloads`) reproduces the MAGIS evaluation; this corpus is what a new
user brings: models of transformers and diffusers from their published configs (random init,
nothing downloaded) and DenseNet-121 (`magis.capture.models.densenet`), each trained through the
loss its library's users write (`losses`): `labels=` and `.loss` for Hugging Face heads,
`F.cross_entropy(model(x), y)` for image classifiers, the DDPM noise MSE for diffusion U-Nets.

Every architecture has two sizes: ``full``, its family's usual training size (`corpus:NAME` in
every command, built under fake tensors), and ``tiny`` (`corpus:NAME:tiny`), which executes in
float64 in well under a second. `build_case(name, size)` gives a model, a batch and the loss
for `magis.compile`; `magis.capture.get_workload("corpus:NAME")` the same as a zoo `Workload`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from magis.capture.building import default_dtype
from magis.capture.corpus.base import (
    FULL,
    TINY,
    Architecture,
    Case,
    Size,
    UserLoss,
)
from magis.capture.corpus.diffusion import DIFFUSION_MODELS
from magis.capture.corpus.language import LANGUAGE
from magis.capture.corpus.multimodal import MULTIMODAL
from magis.capture.corpus.sequence import SEQUENCE
from magis.capture.corpus.vision import VISION
from magis.errors import UnknownWorkloadError

__all__ = [
    "ARCHITECTURES",
    "CORPUS_NAMES",
    "CORPUS_PREFIX",
    "FULL",
    "TINY",
    "Architecture",
    "Case",
    "Size",
    "build_case",
    "workload_fields",
    "workload_names",
]

CORPUS_PREFIX = "corpus:"

ARCHITECTURES: Mapping[str, Architecture] = MappingProxyType(
    {a.name: a for a in (*LANGUAGE, *VISION, *DIFFUSION_MODELS, *MULTIMODAL, *SEQUENCE)}
)
CORPUS_NAMES: tuple[str, ...] = tuple(ARCHITECTURES)


def get_architecture(name: str, size: str = TINY) -> Architecture:
    """Architecture `name`, checked to have `size`; an unknown one is `UnknownWorkloadError`."""
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise UnknownWorkloadError(
            f"unknown corpus architecture '{name}'; known: {', '.join(CORPUS_NAMES)} "
            "(run `magis workloads --corpus`)"
        )
    if size not in arch.sizes:
        raise UnknownWorkloadError(
            f"corpus architecture '{name}' has no size '{size}'; sizes: {', '.join(arch.sizes)}"
        )
    return arch


def build_case(
    name: str, size: str = TINY, dtype: torch.dtype = torch.float64, seed: int = 0
) -> Case:
    """Architecture `name` at `size`: a freshly initialised model (seeded), a batch, the loss.

    The model is built with `dtype` as the default dtype (float64 for the equal-training tests).
    Raises `UnknownWorkloadError` for an unknown name or size.
    """
    arch = get_architecture(name, size)
    with default_dtype(dtype):
        torch.manual_seed(seed)
        model = arch.build_model(arch.sizes[size].config)
        batch = arch.example_batch(size, None, torch.Generator().manual_seed(seed + 1))
    return Case(name, model, batch, arch.loss_fn)


def workload_fields(name: str) -> dict[str, Any]:
    """`corpus:NAME` (full size) or `corpus:NAME:tiny`: the fields of a zoo `Workload`
    (`magis.capture.workloads.get_workload` builds it; this package does not import that one).

    Its model is `UserLoss(model, loss_fn)`, whose forward is the user's loss, so its
    `loss_fn` is None (the step's loss is `model(*inputs)`). A full-size entry has the zoo's
    size name "paper": commands build it under fake tensors, as they build the zoo's.
    """
    arch_name, _, size = name.strip().removeprefix(CORPUS_PREFIX).partition(":")
    size = size or FULL
    arch = get_architecture(arch_name, size)
    row = arch.sizes[size]

    def build_model() -> torch.nn.Module:
        return UserLoss(arch.build_model(row.config), arch.loss_fn)

    def make_inputs(batch: int) -> tuple[torch.Tensor, ...]:
        return arch.example_batch(size, batch, torch.Generator().manual_seed(1))

    full = size == FULL
    return {
        "name": f"{CORPUS_PREFIX}{arch_name}" + ("" if full else f":{size}"),
        "family": f"{CORPUS_PREFIX}{arch_name}",
        "size": "paper" if full else size,
        "dtype": row.dtype if full else torch.float32,
        "batch": row.batch,
        "build_model": build_model,
        "make_inputs": make_inputs,
        "loss_fn": None,  # the model's forward is the loss
        "description": f"{arch.family}: {arch.description}; "
        + ("" if full else f"{size} config, ")
        + row.shape_text(),
    }


def workload_names(sizes: tuple[str, ...] = (FULL, TINY)) -> list[str]:
    """Every corpus entry's workload name, each at each of `sizes`."""
    return [
        f"{CORPUS_PREFIX}{name}" + ("" if s == FULL else f":{s}")
        for name in CORPUS_NAMES
        for s in sizes
    ]
