"""Tiny configurations for `magis bench coverage`, derived from a transformers config class.

The derivation is generic (no table of per-model settings): every attribute listed in
`TINY_INTS` that the config has is capped (2 layers, hidden 64, 4 heads, vocabulary 512, ...),
lists of per-stage sizes are capped element-wise (`TINY_LISTS`), special token ids are kept
inside the vocabulary, the training-only random choices that one static graph cannot hold are
switched off (`NO_RANDOM_CHOICE`: LayerDrop and SpecAugment masks, which a captured step would
draw once while eager PyTorch draws anew; README "Coverage"), and a training step keeps no
key/value cache (`TRAINING`).

Capping each attribute alone breaks the relations a config holds between them (the 2026-11-28
sweep's `build` failures), so the caps are applied with the relations kept:

- the config is built again through its own constructor with the capped values
  (`rebuilt`): the attributes its `__post_init__` derives from others (DeepSeek's and Mistral
  4's `qk_head_dim` and `head_dim` from the latent-attention head parts, the rotary factor from
  them, per-layer type lists from the depth) are derived from the tiny values, not left at the
  full-size ones;
- heads divide the hidden size, and the ratio of attention heads to key/value heads is kept
  (multi-head latent attention has as many key/value heads as query heads; capping the two
  apart made grouped-query attention of it);
- a head size that times the heads made a multiple of the hidden size still does;
- a list with one entry per layer is cut to the new depth keeping every kind of layer it names,
  and a count of some layers that no longer fits the depth is scaled to it;
- expert groups divide the experts, attention windows fit the last stage's feature map, and
  sizes that summed to the hidden size sum to the tiny one;
- factors whose product was the number of positions multiply to the sweep's sequence length
  (Reformer's axial positions), and a default left None takes the first of the choices the
  config lists (X-MOD's language).

The relations are functions of their own (`coverage_relations`). Where the tiny config does
not fit a model, two roomier derivations are tried (`DERIVATIONS`: the hidden size with its
odd factors, the widths at full size), the first on which the loss runs taken.

A change the constructor does not take is set on the new config only where the constructor
derived no such attribute (a derived `head_dim` is the constructor's, not the cap's).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

from magis.bench import coverage_relations as rel
from magis.bench.coverage_names import (
    BATCH,
    HEAD_NAMES,
    HIDDEN_NAMES,
    IMAGE,
    LAYER_COUNT_NAMES,
    LENGTH,
    POSITION_NAMES,
)

__all__ = ["BATCH", "IMAGE", "LENGTH", "rebuilt", "tiny_changes", "tiny_config"]

# Config attributes capped at a value, where a config has them (a smaller value is kept).
TINY_INTS: Mapping[str, int] = {
    **dict.fromkeys(LAYER_COUNT_NAMES, 2),
    **dict.fromkeys(HIDDEN_NAMES, 64),
    **dict.fromkeys(HEAD_NAMES, 4),
    "num_key_value_heads": 2,
    "head_dim": 16,
    # latent attention's and partial rotary's head parts, as large as a head (they derive
    # head_dim from them, or check against it)
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rotary_dim"), 16),
    "pooler_hidden_size": 64,
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "d_ff",
            "n_inner",
            "intermediate_dim",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        ),
        128,
    ),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_selected_experts"), 2),
    "n_shared_experts": 1,
    "num_groups": 8,  # group normalization's groups, which divide the tiny channel widths
    "n_groups": 1,  # a state-space model's groups of heads, which divide the heads
    "max_length": 64,  # a spectrogram's frames (audio spectrogram transformers)
    **dict.fromkeys(("vocab_size", "n_vocab", "decoder_vocab_size"), 512),
    **dict.fromkeys(POSITION_NAMES, 64),
    "max_target_positions": 64,
    "image_size": IMAGE,
    **dict.fromkeys(("num_mel_bins", "input_feat_per_channel"), 16),
    **dict.fromkeys(("embedding_size", "projection_dim", "kv_lora_rank", "q_lora_rank"), 64),
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
    "conv_dim": 32,
    "tdnn_dim": 32,
    "output_hidden_size": 64,
    "classifier_proj_size": 32,
    "xvector_output_dim": 32,
    "num_labels": 2,
    # a latent-array model's latents, their width and its blocks' depth (Perceiver)
    "num_latents": 16,
    "d_latents": 64,
    "num_self_attends_per_block": 2,
    "num_self_attention_heads": 4,
    # cross-attention heads divide the width of inputs no config field names (Perceiver's
    # pixels with their position features: 261 or 322 channels), so there is one
    "num_cross_attention_heads": 1,
    # a byte-level model's global width as its local parts name it, and its hashed n-gram
    # vocabulary (BLT: 500,002 entries)
    "hidden_size_global": 64,
    "encoder_hash_byte_group_vocab": 512,
}
# Attributes a config may leave None for the model to derive or require: given the cap.
FILL_WHEN_NONE = (
    "vocab_size",
    "head_dim",
    "num_key_value_heads",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
)
# Per-stage lists (a CNN's widths, a hierarchical transformer's depths): each element capped.
TINY_LISTS: Mapping[str, int] = {
    "depths": 1,
    "hidden_sizes": 64,
    "embed_dims": 64,
    "num_heads": 2,
    "conv_dim": 32,
    "tdnn_dim": 32,
}
# Training-only random choices a static graph holds only once: off for the captured step.
NO_RANDOM_CHOICE = (
    "layerdrop",
    "encoder_layerdrop",
    "decoder_layerdrop",
    "mask_time_prob",
    "mask_feature_prob",
)
# A training step computes every position at once and keeps no key/value cache (a cache is
# inference's; hybrid models without attention layers even fail to size one).
TRAINING: Mapping[str, Any] = {"use_cache": False}
# The derivations tried in turn, the first on which the training loss runs taken
# (`coverage_models`): "tiny" caps every size; "roomy" halves the hidden size down to at most
# `ROOMY_HIDDEN`, which keeps its odd factors (768 -> 96, still divisible by 6 for a layout
# model's six box embeddings; 4096 -> 64 as "tiny"), keeps fractions of it and each repeated
# kind of layer twice; "wide" also leaves the widths at their full size (a CNN whose head
# width is computed from a scaling rule, not read from `hidden_dim`: EfficientNet) and gives
# the image twice the side (a network whose strides exceed the tiny image: MobileViT v2).
DERIVATIONS = ("tiny", "roomy", "wide")
ROOMY_HIDDEN = 128
WIDTHS = ("hidden_sizes", "embed_dims", *HIDDEN_NAMES)


def tiny_config(config: Any, derivation: str = "tiny") -> Any:
    """A tiny config of `config`'s class (module docstring); its sub-configs (an
    encoder-decoder's text and vision parts) made tiny the same way. `derivation`: one of
    `DERIVATIONS`, for a model the tiny one does not fit."""
    return rebuilt(config, tiny_changes(config, derivation))


def tiny_changes(config: Any, derivation: str = "tiny") -> dict[str, Any]:
    """The attributes of `config` to change, by name, with the relations between them kept."""
    before = dict(vars(config))
    changes = {k: v for k, v in TRAINING.items() if k in before and before[k] != v}
    for key, value in before.items():
        new = _tiny_value(key, value, derivation)
        if new is not value:
            changes[key] = new
    for fix in rel.RELATIONS if derivation == "tiny" else rel.ROOMY_RELATIONS:
        changes.update(fix(before, {**before, **changes}))
    return changes


def rebuilt(config: Any, changes: Mapping[str, Any]) -> Any:
    """`config`'s class built again with `changes`, so that its own derivation
    (`__post_init__`) derives the dependent attributes from the tiny values. The arguments are
    the changes over what `config` set apart from the class's defaults (a sub-config its parent
    built with its own values). A config whose constructor refuses them is changed in place."""
    cls = type(config)
    accepted = _constructor_arguments(cls)
    try:
        chosen = _set_apart_from_defaults(config, cls())
        arguments = {**chosen, **changes}
        fresh = cls(**{k: v for k, v in arguments.items() if accepted is None or k in accepted})
    except Exception:  # noqa: BLE001 - any refusal: the caps set in place, as they are
        for key, value in changes.items():
            setattr(config, key, value)
        return config
    # a change the constructor does not take, to an attribute it did not derive (T5's decoder
    # start id, which its classification head reads), is set on the new config
    for key, value in changes.items():
        if accepted is not None and key not in accepted and not hasattr(fresh, key):
            setattr(fresh, key, value)
    return fresh


def _set_apart_from_defaults(config: Any, default: Any) -> dict[str, Any]:
    """The public attributes of `config` whose values differ from the default instance's."""
    return {
        k: v
        for k, v in vars(config).items()
        if not k.startswith("_") and repr(getattr(default, k, None)) != repr(v)
    }


def _constructor_arguments(cls: type) -> set[str] | None:
    """The names the constructor takes; None where it takes any (`**kwargs`)."""
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def _tiny_value(key: str, value: Any, derivation: str = "tiny") -> Any:
    """The tiny value of one attribute, or `value` itself where it stays."""
    if hasattr(value, "to_dict") and hasattr(value, "model_type"):
        # a copy: a sub-config changed in place (its constructor refused the caps) would
        # change the full-size values the relations read
        return tiny_config(copy.deepcopy(value), derivation)
    number = isinstance(value, int) and not isinstance(value, bool)
    if derivation == "wide" and key in WIDTHS:
        return value
    if derivation == "wide" and key == "image_size" and number:
        return min(value, 2 * IMAGE)
    if derivation != "tiny" and key in HIDDEN_NAMES and number:
        return rel.halved_to(value, ROOMY_HIDDEN)
    if key in TINY_LISTS and isinstance(value, list | tuple) and value:
        capped = [min(v, TINY_LISTS[key]) if isinstance(v, int) else v for v in value]
        return type(value)(capped)
    if key in TINY_INTS and isinstance(value, int) and not isinstance(value, bool):
        return min(value, TINY_INTS[key]) if value > TINY_INTS[key] else value
    ints = isinstance(value, list | tuple) and all(type(v) is int for v in value)
    if key in TINY_INTS and ints and value:  # (height, width)
        return type(value)(min(v, TINY_INTS[key]) for v in value)
    if key in FILL_WHEN_NONE and value is None:
        return TINY_INTS[key]
    if random_choice(key) and isinstance(value, float) and value:
        return 0.0
    return value


def random_choice(key: str) -> bool:
    """Whether config field `key` is the probability of a training-only random choice
    (`NO_RANDOM_CHOICE`, or a LayerDrop under any prefix: `speech_encoder_layerdrop`)."""
    return key in NO_RANDOM_CHOICE or key.endswith("layerdrop")


def without_random_choices(config: Any) -> None:
    """Every `random_choice` probability of `config` and of its sub-configs set to 0 (a
    sub-config's fields are not capped with the top config's: OmniASR's `audio_config`)."""
    # the fields a config holds, not `dir`: a per-layer config's properties raise when read
    # globally (Gemma 4's `head_dim`: AmbiguousGlobalPerLayerAttributeError)
    for name, value in list(getattr(config, "__dict__", {}).items()):
        if name.startswith("_"):
            continue
        if random_choice(name) and isinstance(value, float | int) and value > 0:
            setattr(config, name, 0.0)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            without_random_choices(value)
