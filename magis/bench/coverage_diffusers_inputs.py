"""The forward inputs of a tiny diffusers denoiser (`coverage_diffusers`), derived from its
forward's signature and its config, with no per-model table.

Each parameter gets its value from a rule keyed on its name (or a suffix of it) that applies to
every model with that parameter: the latent, the timestep, the text features and their widths
under their config names, lengths and masks that mark every text token valid, the token grid's
shapes (`img_shapes`), the rotary positions of the tokens (`img_ids`, `txt_ids`,
`position_ids`: the text's zeros, then each image token's (0, row, column)), token ids under a
codebook or vocabulary size, micro-conditions. What a rule cannot size is an error naming the
parameter. The diffusers models differ in how they lay out the latent and the text (an image or
Flux's packed tokens; one text encoder's features or a stack of its layers), so `layouts` lists
the layouts the config admits and the caller takes the first on which the model runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from magis.bench.coverage_models import BATCH
from magis.capture.source import parameter_site

LATENT_SIDE, TEXT_TOKENS = 16, 8

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
POOLED_WIDTH = ("pooled_projection_dim", "cond_embed_dim")
# per-axis rotary sizes (time, height, width), whose sum is the head size
ROPE_AXES = ("axes_dims_rope", "axes_dim_rope", "rope_axes_dim", "axes_dims", "axes_dim")
# the depths of a transformer's kinds of blocks (joint and single-stream)
BLOCK_DEPTHS = ("num_layers", "num_single_layers")
# the sizes an id input's values are drawn under (a VQ codebook's, a vocabulary's)
ID_RANGE = ("codebook_size", "vocab_size")


@dataclass(frozen=True)
class Layout:
    """How the latent and the text are laid out: the latent as an image [batch, channels, side,
    side] or as a sequence of tokens [batch, side x side, channels] (Flux's packed latent); the
    text as one encoder's features [batch, tokens, width] or a stack of `text_layers` of its
    layers [batch, tokens, layers, width] (Krea 2's)."""

    packed: bool = False
    text_layers: int | None = None


@dataclass(frozen=True)
class Inputs:
    """What a rule reads: the config, the layout, and the sizes derived from them."""

    config: Any
    dtype: torch.dtype
    gen: torch.Generator
    layout: Layout
    takes_latent: bool  # the forward has a latent input (else token ids are the image)

    @property
    def side(self) -> int:
        side = getattr(self.config, "sample_size", LATENT_SIDE) or LATENT_SIDE
        return side if isinstance(side, int) else LATENT_SIDE

    @property
    def grid(self) -> tuple[int, int]:
        """The latent's token grid: one token a latent pixel when packed, else a patch."""
        patch = getattr(self.config, "patch_size", None)
        patch = patch if isinstance(patch, int) and patch > 0 and not self.layout.packed else 1
        return self.side // patch, self.side // patch

    @property
    def axes(self) -> int:
        """The rotary axes (time, height, width unless the config lists others)."""
        found = (getattr(self.config, k, None) for k in ROPE_AXES)
        return next((len(v) for v in found if isinstance(v, list | tuple)), 3)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, dtype=torch.float64).to(self.dtype)


def layouts(config: Any) -> list[Layout]:
    """The layouts to try, in order: the image first, then the packed tokens; a stack of text
    layers only where the config counts them (`num_text_layers`)."""
    stacked = config_int(config, ("num_text_layers",))
    texts = [None, stacked] if stacked else [None]
    return [Layout(packed, layers) for layers in texts for packed in (False, True)]


def forward_inputs(model: torch.nn.Module, inputs: Inputs) -> dict[str, Any]:
    """The forward's parameters that a rule sizes; a required one no rule sizes is an error
    naming it."""
    batch = {}
    for p in inspect.signature(model.forward).parameters.values():
        required = p.default is inspect.Parameter.empty
        make = _rule(p.name, required)
        value = make(inputs, p) if make is not None else None
        if value is not None:
            batch[p.name] = value
        elif required and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            raise ValueError(_unsized(model, p.name))
    return batch


def _unsized(model: torch.nn.Module, name: str) -> str:
    """The error for a required forward input that no rule sizes: the input, where the model
    declares it, and where a rule for it goes."""
    site = parameter_site(model.forward, name)
    where = f" (declared at {site})" if site is not None else ""
    return (
        f"no tiny input for {type(model).__name__}.forward's `{name}`{where}: no rule of "
        "magis/bench/coverage_diffusers_inputs.py sizes it; add one there"
    )


def takes_latent(model: torch.nn.Module) -> bool:
    return bool(LATENTS & set(inspect.signature(model.forward).parameters))


def config_int(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


Rule = Callable[[Inputs, inspect.Parameter], Any]


def _rule(name: str, required: bool) -> Rule | None:
    """The rule for a parameter: by its name, else by its name's suffix; the optional inputs
    that change what the forward computes only where it requires them."""
    if name in INPUTS:
        return INPUTS[name]
    if name in REQUIRED_INPUTS:
        return REQUIRED_INPUTS[name] if required else None
    if name.startswith("encoder_hidden_states_"):  # a second text encoder's features
        return _text
    return next((rule for suffix, rule in SUFFIXES.items() if name.endswith(suffix)), None)


def _latent(inp: Inputs, p: inspect.Parameter) -> torch.Tensor:
    channels = getattr(inp.config, "in_channels", 4) or 4
    if inp.layout.packed:
        return inp.randn(BATCH, inp.side * inp.side, channels)
    return inp.randn(BATCH, channels, inp.side, inp.side)


def _timestep(inp: Inputs, p: inspect.Parameter) -> torch.Tensor:
    """Timesteps in [1, 1000), in the model's float dtype as the flow-matching pipelines pass
    them (a model that embeds them with a linear layer takes no integers)."""
    return torch.randint(1, 1000, (BATCH,), generator=inp.gen).to(inp.dtype)


def _text(inp: Inputs, p: inspect.Parameter) -> torch.Tensor | None:
    """A text encoder's features; `encoder_hidden_states_X` at the width `cross_attention_dim_X`
    where the config has one (HunyuanDiT's second, T5, encoder)."""
    suffix = p.name.removeprefix("encoder_hidden_states_")
    width = config_int(inp.config, (f"cross_attention_dim_{suffix}",))
    width = width or config_int(inp.config, TEXT_WIDTH)
    if width is None:
        return None
    layers = inp.layout.text_layers
    return inp.randn(BATCH, TEXT_TOKENS, *((layers,) if layers else ()), width)


def _text_encoder_layers(inp: Inputs, p: inspect.Parameter) -> list[torch.Tensor] | None:
    """One text-encoder layer's features per transformer block (Bria FIBO's), at the width
    `text_encoder_dim`: the blocks are the config's depths of every kind summed."""
    width = config_int(inp.config, ("text_encoder_dim",))
    blocks = sum(config_int(inp.config, (k,)) or 0 for k in BLOCK_DEPTHS)
    if width is None or not blocks:
        return None
    return [inp.randn(BATCH, TEXT_TOKENS, width) for _ in range(blocks)]


def _pooled(inp: Inputs, p: inspect.Parameter) -> torch.Tensor | None:
    width = config_int(inp.config, POOLED_WIDTH)
    return None if width is None else inp.randn(BATCH, width)


def _class_labels(inp: Inputs, p: inspect.Parameter) -> torch.Tensor | None:
    classes = config_int(inp.config, ("num_embeds_ada_norm", "num_class_embeds"))
    if classes is None:
        return None
    return torch.randint(0, classes, (BATCH,), generator=inp.gen)


def _text_mask(inp: Inputs, p: inspect.Parameter) -> torch.Tensor:
    """Every text token valid."""
    return torch.ones(BATCH, TEXT_TOKENS, dtype=torch.bool)


def _text_lengths(inp: Inputs, p: inspect.Parameter) -> torch.Tensor:
    """Every text token valid, as lengths (ERNIE-Image's `text_lens`)."""
    return torch.full((BATCH,), TEXT_TOKENS, dtype=torch.long)


def _image_size(inp: Inputs, p: inspect.Parameter) -> torch.Tensor:
    """An image's (height, width) or crop corner, as SDXL-style micro-conditions take them."""
    side = 8 * LATENT_SIDE
    return torch.tensor([[side, side]] * BATCH, dtype=torch.float64).to(inp.dtype)


def _img_shapes(inp: Inputs, p: inspect.Parameter) -> list | None:
    """Each sample's token grid (frames, rows, columns), nested as the annotation nests it
    (`list[tuple]`: one image per sample; `list[list[tuple]]`: a list of images per sample)."""
    if not inp.layout.packed:
        return None
    shape = (1, *inp.grid)
    per_sample = [shape] if "list[list[" in str(p.annotation) else shape
    return [per_sample] * BATCH


def _grid_ids(inp: Inputs) -> torch.Tensor:
    """Each latent token's rotary position: (0, row, column), one column per rotary axis."""
    h, w = inp.grid
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.zeros(h * w, max(inp.axes, 3))
    ids[:, 1], ids[:, 2] = rows.flatten(), cols.flatten()  # Flux 2's fourth axis (a layer) 0
    return ids


def _img_ids(inp: Inputs, p: inspect.Parameter) -> torch.Tensor | None:
    return _grid_ids(inp) if inp.layout.packed else None


def _txt_ids(inp: Inputs, p: inspect.Parameter) -> torch.Tensor | None:
    return torch.zeros(TEXT_TOKENS, inp.axes) if inp.layout.packed else None


def _position_ids(inp: Inputs, p: inspect.Parameter) -> torch.Tensor | None:
    """The joint sequence's rotary positions, text first (zeros), then the latent's tokens."""
    if not inp.layout.packed:
        return None
    return torch.cat([torch.zeros(TEXT_TOKENS, inp.axes), _grid_ids(inp)])


def _token_ids(inp: Inputs, p: inspect.Parameter) -> torch.Tensor | None:
    """Token ids under the config's codebook or vocabulary size: one per latent token beside a
    latent (GLM-Image's prior tokens), else the image itself as a grid of ids (aMUSEd's)."""
    high = next((v for k, v in dict(inp.config).items()
                 if k.endswith(ID_RANGE) and isinstance(v, int) and v > 0), None)  # fmt: skip
    if high is None:
        return None
    h, w = inp.grid
    shape = (BATCH, h * w) if inp.takes_latent else (BATCH, h, w)
    return torch.randint(0, high, shape, generator=inp.gen)


def _token_drop(inp: Inputs, p: inspect.Parameter) -> torch.Tensor:
    """No token dropped (classifier-free guidance's drop of the prior tokens)."""
    h, w = inp.grid
    return torch.zeros(BATCH, h * w, dtype=torch.bool)


def _micro_conds(inp: Inputs, p: inspect.Parameter) -> torch.Tensor | None:
    """SDXL-style micro-conditions: as many as the embedding holds encodings of them."""
    embed = config_int(inp.config, ("micro_cond_embed_dim",))
    encode = config_int(inp.config, ("micro_cond_encode_dim",))
    if not (embed and encode) or embed % encode:
        return None
    return torch.full((BATCH, embed // encode), float(8 * LATENT_SIDE), dtype=inp.dtype)


# the forward's latent input, under its names
LATENTS = {"sample", "hidden_states"}

INPUTS: Mapping[str, Rule] = {
    **dict.fromkeys(LATENTS, _latent),
    **dict.fromkeys(("timestep", "timesteps"), _timestep),
    **dict.fromkeys(("encoder_hidden_states", "text_bth"), _text),
    **dict.fromkeys(("pooled_projections", "pooled_text_emb", "pooled_embeds"), _pooled),
    "class_labels": _class_labels,
    "img_ids": _img_ids,
    "txt_ids": _txt_ids,
    "img_shapes": _img_shapes,
    "micro_conds": _micro_conds,
    "text_encoder_layers": _text_encoder_layers,
}

# inputs given only where the forward requires them (optional, they change what it computes)
REQUIRED_INPUTS: Mapping[str, Rule] = {
    **dict.fromkeys(
        ("encoder_attention_mask", "encoder_hidden_states_mask", "encoder_mask"), _text_mask
    ),
    **dict.fromkeys(("original_size", "target_size", "crop_coords"), _image_size),
    "position_ids": _position_ids,
}

# rules by a parameter's name's ending, where the name is not above
SUFFIXES: Mapping[str, Rule] = {
    "_lens": _text_lengths,
    "_lengths": _text_lengths,
    "input_ids": _token_ids,
    "_token_id": _token_ids,
    "_token_ids": _token_ids,
    "_token_drop": _token_drop,
}
