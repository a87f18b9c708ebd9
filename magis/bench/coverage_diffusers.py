"""diffusers' image denoisers for `magis bench coverage`: every 2-D model (UNets, DiTs and the
other image transformers), built tiny from its constructor's own defaults, on a noisy latent.

The tiny configuration is derived generically, as transformers' is (`coverage_models`): the
constructor's defaults with the attributes of `TINY_INIT` capped where the constructor takes
them, per-level tuples cut to two levels (the down path's first two, the up path's last two, as
the up path mirrors the down one), and the step is the one diffusion training writes: the model
predicts the noise of a latent at a timestep, and the loss is the mean squared error against it.
The forward's inputs are derived in `coverage_diffusers_inputs`; a model needing one no rule
sizes is a failure row.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from magis.bench.coverage_diffusers_inputs import (
    LATENT_SIDE,
    ROPE_AXES,
    TEXT_WIDTH,
    Inputs,
    forward_inputs,
    layouts,
    takes_latent,
)
from magis.bench.coverage_models import DIFFUSERS, Architecture, Case

LEVELS = 2

TINY_INIT: Mapping[str, int] = {
    "sample_size": LATENT_SIDE,
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "attention_head_dim": 8,
    "cross_attention_head_dim": 8,
    "num_embeds_ada_norm": 10,
    "num_class_embeds": 10,
    "transformer_layers_per_block": 1,
    # depths: blocks of each kind (joint, single-stream, refiners, text encoders' layers)
    **dict.fromkeys(("num_layers", "n_layers", "depth", "num_hidden_layers"), 2),
    **dict.fromkeys(
        (
            "num_single_layers",
            "num_mmdit_layers",
            "num_single_dit_layers",
            "num_refiner_layers",
            "n_refiner_layers",
            "num_res_blocks",
            "num_text_layers",
            "perceiver_num_layers",
            "approximator_layers",
            "num_layerwise_text_blocks",
            "num_refiner_text_blocks",
        ),
        1,
    ),
    # heads: key/value heads are set in the heads' ratio (`_kv_heads`)
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_heads",
            "num_heads",
            "num_cross_attention_heads",
            "text_num_attention_heads",
            "block_num_heads",
        ),
        2,
    ),
    # widths
    **dict.fromkeys(("hidden_size", "dim"), 32),
    **dict.fromkeys(
        ("intermediate_size", "ffn_hidden_size", "approximator_hidden_dim", "moe_intermediate_dim"),
        64,
    ),
    **dict.fromkeys(("num_experts", "num_routed_experts"), 4),
    # token ids' ranges (aMUSEd's VQ codebook; its vocabulary adds the mask tokens to it)
    "codebook_size": 64,
    "vocab_size": 128,
    # the widths of conditioning inputs (text encoders' features, pooled embeddings)
    **dict.fromkeys(
        (
            *TEXT_WIDTH,
            "caption_projection_dim",
            "pooled_projection_dim",
            "cross_attention_dim_t5",
            "cond_embed_dim",
            "text_encoder_dim",
        ),
        32,
    ),
}
KV_HEADS = ("num_kv_heads", "n_kv_heads", "num_key_value_heads", "text_num_key_value_heads")
# constructor arguments whose default None a model cannot build from, and the tiny value
FILL_WHEN_NONE: Mapping[str, int] = {"in_channels": 8, "patch_size": 2, "sample_size": LATENT_SIDE}
# of those, the ones that choose a path (a patched latent, not a continuous one): filled only
# where the constructor refuses the model without them
PATH_FILLS = ("patch_size", "sample_size")
BLOCK_WIDTHS = (32, 64)


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
    per_level = defaults.get("block_out_channels")  # aMUSEd's is one width, not one per level
    levels = len(per_level) if isinstance(per_level, list | tuple) and per_level else None
    init: dict[str, Any] = {}
    for name, value in defaults.items():
        if name in TINY_INIT and isinstance(value, int) and not isinstance(value, bool):
            init[name] = min(value, TINY_INIT[name]) if value else value
        elif name in TINY_INIT and isinstance(value, tuple) and value:
            init[name] = (TINY_INIT[name],) * LEVELS
        elif name == "block_out_channels" and levels:
            init[name] = BLOCK_WIDTHS
        elif name == "block_out_channels" and isinstance(value, int):  # one level's width
            init[name] = BLOCK_WIDTHS[0]
        elif levels and isinstance(value, tuple) and len(value) == levels:
            init[name] = value[-LEVELS:] if name.startswith("up") else value[:LEVELS]
    init.update({k: v for k, v in FILL_WHEN_NONE.items() if k in defaults and defaults[k] is None})
    init.update(_kv_heads(defaults, {**defaults, **init}))
    init.update(_inner_widths(defaults, {**defaults, **init}))
    init.update(_rope_axes(defaults, {**defaults, **init}))
    return init


# (heads, head size) of the self- and the cross-attention
ATTENTIONS = (
    (("num_attention_heads", "n_heads", "num_heads"), "attention_head_dim"),
    (("num_cross_attention_heads",), "cross_attention_head_dim"),
)


def _inner_width(values: Mapping[str, Any], heads: tuple[str, ...], head: str) -> int | None:
    """An attention's inner width: heads x head size."""
    count = next((values[k] for k in heads if isinstance(values.get(k), int)), None)
    size = values.get(head)
    return count * size if isinstance(count, int) and isinstance(size, int) else None


def _inner_widths(defaults: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, int]:
    """Widths whose default is an attention's inner width (SD3's and AuraFlow's caption
    projection, which joins the image tokens; Sana's cross-attention width) kept equal to it."""
    found: dict[str, int] = {}
    for heads, head in ATTENTIONS:
        old, new = _inner_width(defaults, heads, head), _inner_width(now, heads, head)
        if old is None or new is None:
            continue
        found.update(
            (k, new)
            for k, v in defaults.items()
            if v == old and isinstance(v, int) and not isinstance(v, bool) and k not in found
        )
    return found


def _heads(values: Mapping[str, Any]) -> int | None:
    return next((values[k] for k in ("num_attention_heads", "n_heads", "num_heads")
                 if isinstance(values.get(k), int)), None)  # fmt: skip


def _kv_heads(defaults: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, int]:
    """Key/value heads as many as the heads where they were as many, else one (they must
    divide the heads)."""
    old, new = _heads(defaults), _heads(now)
    return {
        k: (new if v == old or v is None else 1)
        for k, v in defaults.items()
        if k in KV_HEADS and (v is None or isinstance(v, int)) and new
    }


def _rope_axes(defaults: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, tuple]:
    """Per-axis rotary sizes that sum to the tiny head size (`attention_head_dim`, or the
    hidden size over the heads), each even and at least 2, in the defaults' proportions; a
    default of `None` (the constructor's own full-size axes, PRX's) as an image's two axes."""
    head = now.get("attention_head_dim")
    hidden, heads = now.get("hidden_size") or now.get("dim"), _heads(now)
    if not isinstance(head, int) and isinstance(hidden, int) and heads:
        head = hidden // heads
    if not isinstance(head, int):
        return {}
    found = {}
    for name in ROPE_AXES:
        axes = [1, 1] if name in defaults and defaults[name] is None else defaults.get(name)
        if isinstance(axes, list | tuple) and axes and all(isinstance(a, int) for a in axes):
            found[name] = type(axes)(_split_even(head, [int(a) for a in axes]))
    return found


def _split_even(total: int, weights: list[int]) -> list[int]:
    """`total` in even parts of at least 2, in proportion to `weights`; the rest to the last."""
    parts = [max(2, 2 * (total * w // sum(weights) // 2)) for w in weights[:-1]]
    return [*parts, max(2, total - sum(parts))]


def build_diffusers_case(arch: Architecture, dtype: torch.dtype, seed: int) -> Case:
    """The tiny denoiser, a batch of its forward's inputs plus the noise it is to predict."""
    import diffusers

    cls = getattr(diffusers, arch.name)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        model = _constructed(cls, tiny_init(cls)).to(dtype).train()
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator().manual_seed(seed)
    batch = _running_inputs(model, dtype, gen)
    with torch.no_grad():  # the prediction's shape: the noise target's
        shape = _prediction(model(**batch)).shape
    batch["target"] = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    tensors, loss = _tensor_batch(batch)
    return Case(model, tensors, loss)


def _running_inputs(model: torch.nn.Module, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """The inputs of the first layout (`layouts`) on which the model runs eagerly; where none
    does, the last layout's error (the packed tokens': an image model runs on the first)."""
    error: Exception | None = None
    for layout in layouts(model.config):
        try:
            batch = forward_inputs(
                model, Inputs(model.config, dtype, gen, layout, takes_latent(model))
            )
            with torch.no_grad():
                model(**batch)
        except Exception as e:  # noqa: BLE001 - any failure: the next layout
            error = e
            continue
        return batch
    assert error is not None
    raise error


def _constructed(cls: type, init: dict[str, Any]) -> torch.nn.Module:
    """`cls(**init)`; where the constructor refuses it, without the fills of `PATH_FILLS`
    (Transformer2DModel with an input width only is a continuous, not a patched, model)."""
    try:
        return cls(**init)
    except Exception:  # noqa: BLE001 - any refusal: the other path
        return cls(**{k: v for k, v in init.items() if k not in PATH_FILLS})


def denoising_loss(model: torch.nn.Module, target: torch.Tensor, **inputs) -> torch.Tensor:
    """The diffusion training loss: the mean squared error of the predicted noise."""
    return F.mse_loss(_prediction(model(**inputs)), target)


@dataclass(frozen=True)
class BoundLoss:
    """`denoising_loss` with the batch's values that are not tensors bound (a token grid's
    shapes, `img_shapes`: the step captures tensors only, and these are the step's constants)
    and its lists of tensors passed one tensor an input (`NAME_0`, `NAME_1`, ...) and regrouped."""

    static: Mapping[str, Any]
    lists: Mapping[str, int]  # a list's name: its length

    def __call__(self, model: torch.nn.Module, target: torch.Tensor, **inputs) -> torch.Tensor:
        for name, count in self.lists.items():
            inputs[name] = [inputs.pop(f"{name}_{i}") for i in range(count)]
        return denoising_loss(model, target, **inputs, **self.static)


def _tensor_batch(batch: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Callable]:
    """The batch's tensors (a list of them spread out) and the loss that takes them."""
    tensors: dict[str, torch.Tensor] = {}
    static, lists = {}, {}
    for name, value in batch.items():
        if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
            lists[name] = len(value)
            tensors.update((f"{name}_{i}", v) for i, v in enumerate(value))
        elif isinstance(value, torch.Tensor):
            tensors[name] = value
        else:
            static[name] = value
    return tensors, (BoundLoss(static, lists) if static or lists else denoising_loss)


def _prediction(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    sample = getattr(out, "sample", None)
    return sample if isinstance(sample, torch.Tensor) else out[0]
