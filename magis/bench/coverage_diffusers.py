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

from magis.bench.coverage_models import BATCH, DIFFUSERS, Architecture, Case, runs_eagerly

LATENT_SIDE, TEXT_TOKENS, LEVELS = 16, 8, 2

# the config attributes that give a conditioning input's width, in the order they are looked up
TEXT_WIDTH = (
    "caption_channels",  # PixArt's and Sana's text width; their cross_attention_dim is inner
    "cross_attention_dim",
    "joint_attention_dim",
    "text_embed_dim",
    "text_emb_dim",
    "text_in_dim",
    "text_hidden_dim",
    "cap_feat_dim",
    "context_in_dim",
    "llm_features_dim",
    "encoder_hidden_size",
)

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
    # the widths of conditioning inputs (text encoders' features, pooled embeddings)
    **dict.fromkeys(
        (
            *TEXT_WIDTH,
            "caption_projection_dim",
            "pooled_projection_dim",
            "cross_attention_dim_t5",
            "cond_embed_dim",
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
# the rotary positions of a packed latent's tokens and of the text's (`packed_inputs`)
PACKED_POSITIONS = ("img_ids", "txt_ids")
# per-axis rotary sizes (time, height, width), whose sum is the head size
ROPE_AXES = ("axes_dims_rope", "axes_dim_rope", "rope_axes_dim", "axes_dims", "axes_dim")
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
    hidden size over the heads), each even and at least 2, in the defaults' proportions."""
    head = now.get("attention_head_dim")
    hidden, heads = now.get("hidden_size") or now.get("dim"), _heads(now)
    if not isinstance(head, int) and isinstance(hidden, int) and heads:
        head = hidden // heads
    if not isinstance(head, int):
        return {}
    found = {}
    for name in ROPE_AXES:
        axes = defaults.get(name)
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
    batch = forward_inputs(model, dtype, gen)
    if not runs_eagerly(model, batch):  # a transformer on a sequence of latent tokens
        packed = packed_inputs(model, batch)
        batch = packed if runs_eagerly(model, packed) else batch
    with torch.no_grad():  # the prediction's shape: the noise target's
        shape = _prediction(model(**batch)).shape
    batch["target"] = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return Case(model, batch, denoising_loss)


def _constructed(cls: type, init: dict[str, Any]) -> torch.nn.Module:
    """`cls(**init)`; where the constructor refuses it, without the fills of `PATH_FILLS`
    (Transformer2DModel with an input width only is a continuous, not a patched, model)."""
    try:
        return cls(**init)
    except Exception:  # noqa: BLE001 - any refusal: the other path
        return cls(**{k: v for k, v in init.items() if k not in PATH_FILLS})


def packed_inputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The latent as a sequence of tokens [batch, side x side, channels] (Flux's packed
    latent), with the positions that its rotary embedding reads where the forward takes them:
    each token's (0, row, column) and the text tokens' zeros, one column per rotary axis."""
    name = "hidden_states" if "hidden_states" in batch else "sample"
    latent = batch[name]
    if latent.dim() != 4:
        return batch
    b, c, h, w = latent.shape
    packed: dict[str, Any] = {**batch, name: latent.permute(0, 2, 3, 1).reshape(b, h * w, c)}
    axes = next((len(v) for k in ROPE_AXES if isinstance(v := getattr(model.config, k, None),
                 list | tuple)), 3)  # fmt: skip
    params = inspect.signature(model.forward).parameters
    if PACKED_POSITIONS[0] in params:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        ids = torch.zeros(h * w, axes)
        ids[:, 1], ids[:, 2] = rows.flatten(), cols.flatten()
        packed["img_ids"] = ids
    if PACKED_POSITIONS[1] in params:
        packed["txt_ids"] = torch.zeros(TEXT_TOKENS, axes)
    return packed


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
        required = p.default is inspect.Parameter.empty
        make = INPUTS.get(p.name) or (REQUIRED_INPUTS.get(p.name) if required else None)
        value = make(config, dtype, gen) if make is not None else None
        if value is not None:
            batch[p.name] = value
        elif required and p.kind is not p.VAR_KEYWORD and p.name not in PACKED_POSITIONS:
            raise ValueError(f"no tiny input for {type(model).__name__}.forward's `{p.name}`")
    return batch


def _latent(config: Any, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    channels = getattr(config, "in_channels", 4) or 4
    side = getattr(config, "sample_size", LATENT_SIDE) or LATENT_SIDE
    side = side if isinstance(side, int) else LATENT_SIDE
    shape = (BATCH, channels, side, side)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _timestep(config: Any, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Timesteps in [1, 1000), in the model's float dtype as the flow-matching pipelines pass
    them (a model that embeds them with a linear layer takes no integers)."""
    return torch.randint(1, 1000, (BATCH,), generator=gen).to(dtype)


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


def _text_mask(config: Any, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.ones(BATCH, TEXT_TOKENS, dtype=torch.bool)


def _image_size(config: Any, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """An image's (height, width) or crop corner, as SDXL-style micro-conditions take them."""
    side = 8 * LATENT_SIDE
    return torch.tensor([[side, side]] * BATCH, dtype=torch.float64).to(dtype)


# inputs given only where the forward requires them (optional, they change what it computes)
REQUIRED_INPUTS: Mapping[str, Callable[[Any, torch.dtype, torch.Generator], Any]] = {
    **dict.fromkeys(
        ("encoder_attention_mask", "encoder_hidden_states_mask", "encoder_mask"), _text_mask
    ),
    **dict.fromkeys(("original_size", "target_size", "crop_coords"), _image_size),
}

INPUTS: Mapping[str, Callable[[Any, torch.dtype, torch.Generator], torch.Tensor | None]] = {
    "sample": _latent,
    "hidden_states": _latent,
    "timestep": _timestep,
    "encoder_hidden_states": _text,
    "pooled_projections": _pooled,
    "class_labels": _class_labels,
}
