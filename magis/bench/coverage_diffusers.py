"""diffusers' image denoisers for `magis bench coverage`: every 2-D model (UNets, DiTs and the
other image transformers), built tiny from its constructor's own defaults, on a noisy latent.

The tiny configuration is derived generically, as transformers' is (`coverage_models`): the
constructor's defaults with the attributes of `TINY_INIT` capped where the constructor takes
them, per-level tuples cut to two levels (the down path's first two, the up path's last two, as
the up path mirrors the down one), and the step is the one diffusion training writes: the model
predicts the noise of a latent at a timestep, and the loss is the mean squared error against it.
Forward parameters are filled by name from `INPUTS`; a model needing any other is a failure row.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from magis.bench.coverage_models import BATCH, DIFFUSERS, Architecture, Case

LATENT_SIDE, TEXT_TOKENS, LEVELS = 16, 8, 2

TINY_INIT: Mapping[str, int] = {
    "sample_size": LATENT_SIDE,
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "cross_attention_dim": 32,
    "joint_attention_dim": 32,
    "caption_channels": 32,
    "pooled_projection_dim": 32,
    "num_layers": 2,
    "num_single_layers": 1,
    "transformer_layers_per_block": 1,
    "num_embeds_ada_norm": 10,
    "num_class_embeds": 10,
}
BLOCK_WIDTHS = (32, 64)
# the config attributes that give a conditioning input's width, in the order they are looked up
TEXT_WIDTH = ("cross_attention_dim", "joint_attention_dim", "caption_channels")


def diffusers_architectures() -> list[Architecture]:
    """The 2-D denoisers among diffusers' models (ControlNets, which need a denoiser, left out)."""
    import diffusers.models as models
    from diffusers.models.modeling_utils import ModelMixin

    found = []
    for name in dir(models):
        cls = getattr(models, name)
        if (
            isinstance(cls, type)
            and issubclass(cls, ModelMixin)
            and "2D" in name
            and "ControlNet" not in name
        ):
            found.append(Architecture(DIFFUSERS, name, "denoise"))
    return found


def tiny_init(cls: type) -> dict[str, Any]:
    """Constructor arguments of `cls` for a tiny model (see the module docstring)."""
    params = inspect.signature(cls.__init__).parameters
    defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    levels = len(defaults.get("block_out_channels") or ()) or None
    init: dict[str, Any] = {}
    for name, value in defaults.items():
        if name in TINY_INIT and isinstance(value, int) and not isinstance(value, bool):
            init[name] = min(value, TINY_INIT[name]) if value else value
        elif name in TINY_INIT and isinstance(value, tuple) and value:
            init[name] = (TINY_INIT[name],) * LEVELS
        elif name == "block_out_channels" and levels:
            init[name] = BLOCK_WIDTHS
        elif levels and isinstance(value, tuple) and len(value) == levels:
            init[name] = value[-LEVELS:] if name.startswith("up") else value[:LEVELS]
    return init


def build_diffusers_case(arch: Architecture, dtype: torch.dtype, seed: int) -> Case:
    """The tiny denoiser, a batch of its forward's inputs plus the noise it is to predict."""
    import diffusers

    cls = getattr(diffusers, arch.name)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        model = cls(**tiny_init(cls)).to(dtype).train()
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator().manual_seed(seed)
    batch = forward_inputs(model, dtype, gen)
    with torch.no_grad():  # the prediction's shape: the noise target's
        shape = _prediction(model(**batch)).shape
    batch["target"] = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return Case(model, batch, denoising_loss)


def denoising_loss(model: torch.nn.Module, target: torch.Tensor, **inputs) -> torch.Tensor:
    """The diffusion training loss: the mean squared error of the predicted noise."""
    return F.mse_loss(_prediction(model(**inputs)), target)


def _prediction(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    sample = getattr(out, "sample", None)
    return sample if isinstance(sample, torch.Tensor) else out[0]


def _config_int(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def forward_inputs(
    model: torch.nn.Module, dtype: torch.dtype, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """The forward's parameters named in `INPUTS`, at tiny sizes; a required parameter that is
    not there is an error naming it."""
    config = model.config
    params = list(inspect.signature(model.forward).parameters.values())
    batch = {}
    for p in params:
        make = INPUTS.get(p.name)
        value = make(config, dtype, gen) if make is not None else None
        if value is not None:
            batch[p.name] = value
        elif p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD:
            raise ValueError(f"no tiny input for {type(model).__name__}.forward's `{p.name}`")
    return batch


def _latent(config: Any, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    channels = getattr(config, "in_channels", 4) or 4
    side = getattr(config, "sample_size", LATENT_SIDE) or LATENT_SIDE
    side = side if isinstance(side, int) else LATENT_SIDE
    shape = (BATCH, channels, side, side)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _timestep(config: Any, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(1, 1000, (BATCH,), generator=gen)


def _text(config: Any, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor | None:
    width = _config_int(config, TEXT_WIDTH)
    if width is None:
        return None
    shape = (BATCH, TEXT_TOKENS, width)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _pooled(config: Any, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor | None:
    width = _config_int(config, ("pooled_projection_dim",))
    if width is None:
        return None
    return torch.randn((BATCH, width), generator=gen, dtype=torch.float64).to(dtype)


def _class_labels(config: Any, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor | None:
    classes = _config_int(config, ("num_embeds_ada_norm", "num_class_embeds"))
    if classes is None:
        return None
    return torch.randint(0, classes, (BATCH,), generator=gen)


INPUTS: Mapping[str, Callable[[Any, torch.dtype, torch.Generator], torch.Tensor | None]] = {
    "sample": _latent,
    "hidden_states": _latent,
    "timestep": _timestep,
    "encoder_hidden_states": _text,
    "pooled_projections": _pooled,
    "class_labels": _class_labels,
}
