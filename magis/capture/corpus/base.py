"""The corpus's data: an architecture, its sizes, and how one is built, batched and captured.

An `Architecture` is a config factory (`make_config(overrides)`), a model factory
(`make_model(config)`), a batch factory (`make_batch(config, size, batch, generator)`) and the
loss its users write (`loss_fn(model, *batch)`). A `Size` is a row of config overrides and a
batch shape: ``full`` is the family's usual training size, built under fake tensors and never
run; ``tiny`` executes in float64 in well under a second.

Full size is built on the meta device and moved to fake tensors (`to_empty` inside the ambient
`FakeTensorMode`): no initialisation runs, so constructors that read tensor values (Swin's and
ConvNeXt's drop-path rates from `torch.linspace(...).tolist()`) and initialisers that loop on data
(`trunc_normal_`) cannot fail, and a 1B-parameter model builds in a second.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily

LossFn = Callable[..., torch.Tensor]
Batch = tuple[torch.Tensor, ...]

# the corpus's two sizes: the family's usual training size, and one that executes in tests
FULL, TINY = "full", "tiny"


@dataclass(frozen=True)
class Case:
    """A model, an example batch for it and the loss its users write: `loss_fn(model, *batch)`."""

    name: str
    model: nn.Module
    batch: Batch
    loss_fn: LossFn


@dataclass(frozen=True)
class Size:
    """One size of an architecture: config overrides and the batch's shape.

    `length` is the sequence length or the image side; `target_length` an encoder-decoder's
    target length (default: half the source); `dtype` the full-size model's dtype (tiny ones
    follow the caller's)."""

    config: Mapping[str, Any]
    batch: int
    length: int
    target_length: int | None = None
    dtype: torch.dtype = torch.float32

    @property
    def target(self) -> int:
        return self.target_length if self.target_length is not None else max(self.length // 2, 1)

    def shape_text(self) -> str:
        tgt = f"->{self.target_length}" if self.target_length is not None else ""
        return f"b{self.batch}x{self.length}{tgt}"


@dataclass(frozen=True)
class Architecture:
    """A public architecture: how to build it at each size, and what it shows."""

    name: str
    family: str  # decoder LM, encoder-decoder, encoder, CNN, vision transformer, ...
    description: str
    make_config: Callable[[Mapping[str, Any]], Any]
    make_model: Callable[[Any], nn.Module]
    make_batch: Callable[[Any, Size, int, torch.Generator], Batch]
    loss_fn: LossFn
    sizes: Mapping[str, Size] = field(default_factory=dict)

    def build_model(self, overrides: Mapping[str, Any]) -> nn.Module:
        """The model for these config overrides, in training mode (fake under a fake mode)."""
        return build_in_mode(lambda: self.make_model(self.make_config(overrides)))

    def example_batch(self, size: str, batch: int | None, generator: torch.Generator) -> Batch:
        row = self.sizes[size]
        config = self.make_config(row.config)
        return self.make_batch(config, row, row.batch if batch is None else batch, generator)


def build_in_mode(factory: Callable[[], nn.Module]) -> nn.Module:
    """`factory()` in training mode: real as usual, or, inside a FakeTensorMode, built on the
    meta device and given fake storage (nothing initialised, nothing allocated)."""
    mode = detect_fake_mode()
    if mode is None:
        return factory().train()
    with unset_fake_temporarily(), torch.device("meta"):
        model = factory()
    model = model.to_empty(device="cpu")  # fake CPU tensors: the fake mode is active again
    tie = getattr(model, "tie_weights", None)
    if callable(tie):  # to_empty copies tied parameters apart; Hugging Face ties them again
        tie()
    return model.train()


class UserLoss(nn.Module):
    """`loss_fn(model, *batch)` as a module whose `forward(*batch)` is the loss: how a corpus
    entry enters the workload registry, whose steps call `model(*inputs)` for the loss."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model, *batch)


# --- Hugging Face models ---------------------------------------------------------------------


def hf_config(config_cls: str, **fixed: Any) -> Callable[[Mapping[str, Any]], Any]:
    """A transformers config from `fixed` values and a size's overrides, with eager attention
    (plain ops, not a fused SDPA kernel)."""

    def make(overrides: Mapping[str, Any]) -> Any:
        import transformers

        config = getattr(transformers, config_cls)(**{**fixed, **overrides})
        config._attn_implementation = "eager"
        return config

    return make


def hf_model(model_cls: str) -> Callable[[Any], nn.Module]:
    def make(config: Any) -> nn.Module:
        import transformers

        return getattr(transformers, model_cls)(config)

    return make


def hf_architecture(
    name: str,
    family: str,
    description: str,
    classes: tuple[str, str],
    make_batch: Callable[[Any, Size, int, torch.Generator], Batch],
    loss_fn: LossFn,
    sizes: Mapping[str, Size],
    **fixed: Any,
) -> Architecture:
    """An Architecture from a transformers (config class, model class) pair."""
    config_cls, model_cls = classes
    return Architecture(
        name,
        family,
        description,
        hf_config(config_cls, **fixed),
        hf_model(model_cls),
        make_batch,
        loss_fn,
        sizes,
    )
