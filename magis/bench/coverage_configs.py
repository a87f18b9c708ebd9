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
  sizes that summed to the hidden size sum to the tiny one.

A change the constructor does not take is set on the new config only where the constructor
derived no such attribute (a derived `head_dim` is the constructor's, not the cap's).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

BATCH, LENGTH, IMAGE = 2, 16, 32

LAYER_COUNT_NAMES = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
    "num_hidden_groups",
)
HIDDEN_NAMES = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "hidden_dim")
HEAD_NAMES = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
)

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
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_source_positions"), 64),
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


def tiny_config(config: Any) -> Any:
    """A tiny config of `config`'s class (module docstring); its sub-configs (an
    encoder-decoder's text and vision parts) made tiny the same way."""
    return rebuilt(config, tiny_changes(config))


def tiny_changes(config: Any) -> dict[str, Any]:
    """The attributes of `config` to change, by name, with the relations between them kept."""
    before = dict(vars(config))
    changes = {k: v for k, v in TRAINING.items() if k in before and before[k] != v}
    for key, value in before.items():
        new = _tiny_value(key, value)
        if new is not value:
            changes[key] = new
    fixes = (
        _per_layer_lists_cut,
        _layer_counts_fit,
        _heads_consistent,
        _expert_groups_divide,
        _windows_fit,
        _parts_of_the_hidden_size,
        _token_ids_in_vocabulary,
        _start_ids,
    )
    for fix in fixes:
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


def _tiny_value(key: str, value: Any) -> Any:
    """The tiny value of one attribute, or `value` itself where it stays."""
    if hasattr(value, "to_dict") and hasattr(value, "model_type"):
        return tiny_config(value)
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
    if key in NO_RANDOM_CHOICE and isinstance(value, float) and value:
        return 0.0
    return value


def _int(values: Mapping[str, Any], key: str) -> int | None:
    value = values.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _per_layer_lists_cut(before: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, Any]:
    """A list with one entry per layer (`layer_types`, per-layer sliding windows) cut to the
    new number of layers, recognized by its length (the old number). Every kind of layer it
    names is kept (a hybrid model's attention layers and linear-attention layers): the cut list
    is each kind once, in order of first appearance, then the first entry repeated; where there
    are more kinds than layers, the model gets one layer per kind."""
    changes: dict[str, Any] = {}
    for key in LAYER_COUNT_NAMES:
        old, new = _int(before, key), _int(now, key)
        if old is None or new is None or new >= old:
            continue
        for name, was in before.items():
            value = now[name]  # as capped (a per-stage list of as many stages as layers)
            if (
                isinstance(was, list | tuple)
                and len(was) == old
                and isinstance(value, list | tuple)
            ):
                kinds = list(dict.fromkeys(v for v in value if isinstance(v, str)))
                new = max(new, len(kinds))
                cut = kinds + [value[0]] * (new - len(kinds)) if kinds else list(value[:new])
                changes[name] = type(value)(cut)
                changes[key] = new
    return changes


def _layer_counts_fit(before: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, Any]:
    """A count of some of the layers (`num_kv_shared_layers`: the last 15 of 35 share their
    keys and values) that no longer fits the new depth, scaled to it (rounded down)."""
    depths = [(_int(before, k), _int(now, k)) for k in LAYER_COUNT_NAMES]
    old, new = next(((o, n) for o, n in depths if o and n and n < o), (None, None))
    if old is None or new is None:
        return {}
    return {
        key: value * new // old
        for key, value in before.items()
        if key.endswith("_layers")
        and key not in LAYER_COUNT_NAMES
        and _int(before, key)
        and new <= value < old
    }


def _first(values: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str | None, int | None]:
    return next(((k, _int(values, k)) for k in names if _int(values, k)), (None, None))


def _heads_consistent(before: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, Any]:
    """Heads that divide the hidden size; key/value heads in the config's ratio to the heads
    (as many as the heads where they were as many: multi-head and latent attention); a head
    size that, times the heads, made a multiple of the hidden size (a state-space model's
    heads span `expand` times it) still making that multiple."""
    changes: dict[str, Any] = {}
    hidden_key, hidden = _first(now, HIDDEN_NAMES)
    heads_key, heads = _first(now, HEAD_NAMES)
    if hidden and heads and heads_key == "num_attention_heads" and hidden % heads:
        heads = max(h for h in range(1, heads + 1) if hidden % h == 0)
        changes[heads_key] = heads
    old_heads = _int(before, heads_key) if heads_key else None
    old_kv = _int(before, "num_key_value_heads")
    if heads and heads_key == "num_attention_heads" and "num_key_value_heads" in now:
        group = old_heads // old_kv if old_heads and old_kv and old_heads % old_kv == 0 else 1
        kv = max(1, heads // group)
        changes["num_key_value_heads"] = kv if heads % kv == 0 else heads
    old_hidden = _int(before, hidden_key) if hidden_key else None
    old_dim = _int(before, "head_dim")
    if hidden and heads and old_dim and old_heads and old_hidden:
        spans, rest = divmod(old_dim * old_heads, old_hidden)
        if spans and not rest and (spans * hidden) % heads == 0:
            changes["head_dim"] = spans * hidden // heads
    return changes


def _expert_groups_divide(before: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, Any]:
    """Expert groups (DeepSeek's group-limited routing: each token's experts come from its
    best `topk_group` of `n_group` groups) that divide the experts, two or more to a group
    (a group is scored by its best two), and no more groups chosen than there are."""
    _, experts = _first(now, ("n_routed_experts", "num_experts", "num_local_experts"))
    groups = _int(now, "n_group")
    if not experts or not groups:
        return {}
    fits = [g for g in range(1, groups + 1) if experts % g == 0 and experts // g >= 2]
    new = max(fits, default=1)
    changes: dict[str, Any] = {"n_group": new} if new != groups else {}
    chosen = _int(now, "topk_group")
    if chosen and chosen > new:
        changes["topk_group"] = new
    return changes


def _windows_fit(before: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, Any]:
    """An attention window no larger than the last stage's feature map (a Swin's stages halve
    the image's patches: at full size the last is as large as the window, at tiny size it is
    smaller, and the relative-position table sized for the window no longer fits)."""
    window, image, patch = (
        _int(now, "window_size"),
        _int(now, "image_size"),
        _int(now, "patch_size"),
    )
    depths = now.get("depths")
    if not (window and image and patch and isinstance(depths, list | tuple) and depths):
        return {}
    last = max(1, image // patch // 2 ** (len(depths) - 1))
    return {"window_size": last} if window > last else {}


def _parts_of_the_hidden_size(before: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, Any]:
    """A list of sizes that summed to the hidden size (Reformer's axial position embeddings,
    concatenated into it) split in the same proportions to sum to the tiny one."""
    hidden_key, old = _first(before, HIDDEN_NAMES)
    new = _int(now, hidden_key) if hidden_key else None
    if not old or not new or new == old:
        return {}
    return {
        key: type(value)(_split(new, list(value)))
        for key, value in before.items()
        if isinstance(value, list | tuple)
        and len(value) > 1
        and all(type(v) is int and v > 0 for v in value)
        and sum(value) == old
    }


def _split(total: int, weights: list[int]) -> list[int]:
    """`total` in parts of at least 1, in proportion to `weights`; the rest to the last."""
    parts = [max(1, total * w // sum(weights)) for w in weights[:-1]]
    return [*parts, max(1, total - sum(parts))]


def _token_ids_in_vocabulary(before: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, Any]:
    vocab = _int(now, "vocab_size")
    if vocab is None:
        return {}
    return {
        key: value % vocab
        for key, value in now.items()
        if key.endswith("token_id") and isinstance(value, int) and value >= vocab
    }


def _start_ids(before: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, Any]:
    """A padding id where the config has none (a decoder's sequence classification finds each
    row's last token by it), and an encoder-decoder's decoder starting from it where the config
    names no start id (T5's convention)."""
    changes: dict[str, Any] = {}
    if "pad_token_id" in now and now["pad_token_id"] is None:
        changes["pad_token_id"] = 0
    if now.get("is_encoder_decoder") and now.get("decoder_start_token_id") is None:
        changes["decoder_start_token_id"] = (
            changes.get("pad_token_id", now.get("pad_token_id")) or 0
        )
    return changes
