"""The relations a transformers config holds between its fields, kept by the tiny
derivation (`coverage_configs`): each is a function of the config's attributes before the caps
(`before`) and after them (`now`) that returns the attributes to change so the relation holds
again. Capping each attribute alone broke these relations (the 2026-11-28 sweep's `build`
failures); each function's docstring names the models that hold it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from functools import partial
from typing import Any

from magis.bench.coverage_names import (
    HEAD_NAMES,
    HIDDEN_NAMES,
    LAYER_COUNT_NAMES,
    LENGTH,
    POSITION_NAMES,
)

Values = Mapping[str, Any]


def _int(values: Values, key: str) -> int | None:
    value = values.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def per_layer_lists_cut(before: Values, now: Values, repeats: int = 1) -> dict[str, Any]:
    """A list with one entry per layer (`layer_types`, per-layer sliding windows) cut to the
    new number of layers, recognized by its length (the old number). Every kind of layer it
    names is kept (a hybrid model's attention layers and linear-attention layers): the cut list
    is each kind once, in order of first appearance, then the first entry repeated; where there
    are more kinds than layers, the model gets one layer per kind. `repeats` (the roomy
    derivation): a kind the full list repeats is kept that many times (a block shared by the
    layers of a kind, Zamba's shared transformer, has layers to share it)."""
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
                kinds = _kinds(list(value), repeats)
                new = max(new, len(kinds))
                cut = kinds + [value[0]] * (new - len(kinds)) if kinds else list(value[:new])
                changes[name] = type(value)(cut)
                changes[key] = new
    return changes


def _kinds(values: list[Any], repeats: int) -> list[str]:
    """Each kind of layer `values` names, in order of first appearance, in up to `repeats`
    rounds (a kind in a round only while it appears that often)."""
    counts = Counter(v for v in values if isinstance(v, str))
    return [k for r in range(repeats) for k in counts if counts[k] > r]


def layer_counts_fit(before: Values, now: Values) -> dict[str, Any]:
    """A count of some of the layers (`num_kv_shared_layers`: the last 15 of 35 share their
    keys and values) that no longer fits the new depth, scaled to it (rounded down); a count of
    all of them (a Gemma 4 assistant shares every layer's keys and values) is the new depth."""
    depths = [(_int(before, k), _int(now, k)) for k in LAYER_COUNT_NAMES]
    old, new = next(((o, n) for o, n in depths if o and n and n < o), (None, None))
    if old is None or new is None:
        return {}
    return {
        key: value * new // old  # all of them: the new depth
        for key, value in before.items()
        if key.endswith("_layers")
        and key not in LAYER_COUNT_NAMES
        and _int(before, key)
        and new < value <= old
    }


def _first(values: Values, names: tuple[str, ...]) -> tuple[str | None, int | None]:
    return next(((k, _int(values, k)) for k in names if _int(values, k)), (None, None))


def heads_consistent(before: Values, now: Values) -> dict[str, Any]:
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


def expert_groups_divide(before: Values, now: Values) -> dict[str, Any]:
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


def windows_fit(before: Values, now: Values) -> dict[str, Any]:
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


def parts_of_the_hidden_size(before: Values, now: Values) -> dict[str, Any]:
    """A list of sizes that summed to the hidden size (Reformer's axial position embeddings,
    concatenated into it) split in the same proportions to sum to the tiny one."""
    hidden_key, old = _first(before, HIDDEN_NAMES)
    new = _int(now, hidden_key) if hidden_key else None
    if not old or not new or new == old:
        return {}
    return {
        key: type(value)(_split(new, list(value)))
        for key, value in _int_lists(before, least=1)
        if sum(value) == old
    }


def _int_lists(values: Values, least: int) -> list[tuple[str, list | tuple]]:
    """The (key, value) pairs of `values` that are lists of two or more ints, each at least
    `least`: the size lists that combine (a sum, a product) into another field."""
    return [
        (key, value)
        for key, value in values.items()
        if isinstance(value, list | tuple)
        and len(value) > 1
        and all(type(v) is int and v >= least for v in value)
    ]


def _split(total: int, weights: list[int]) -> list[int]:
    """`total` in parts of at least 1, in proportion to `weights`; the rest to the last."""
    parts = [max(1, total * w // sum(weights)) for w in weights[:-1]]
    return [*parts, max(1, total - sum(parts))]


def token_ids_in_vocabulary(before: Values, now: Values) -> dict[str, Any]:
    """Special token ids inside the tiny vocabulary."""
    vocab = _int(now, "vocab_size")
    if vocab is None:
        return {}
    return {
        key: value % vocab
        for key, value in now.items()
        if key.endswith("token_id") and isinstance(value, int) and value >= vocab
    }


def start_ids(before: Values, now: Values) -> dict[str, Any]:
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


def positions_factored(before: Values, now: Values) -> dict[str, Any]:
    """Factors whose product was the number of positions (Reformer's axial position shape:
    in training the sequence must be exactly as long as the product) factored again into the
    sweep's sequence length."""
    _, old = _first(before, POSITION_NAMES)
    if not old:
        return {}
    return {
        key: type(value)(_factors(LENGTH, len(value)))
        for key, value in _int_lists(before, least=2)
        if math.prod(value) == old
    }


def _factors(total: int, count: int) -> list[int]:
    """`total` as a product of `count` factors, as even as its prime factors allow."""
    parts = [1] * count
    rest, prime = total, 2
    primes = []
    while rest > 1:
        while rest % prime == 0:
            primes.append(prime)
            rest //= prime
        prime += 1
    for p in sorted(primes, reverse=True):
        parts[parts.index(min(parts))] *= p
    return sorted(parts, reverse=True)


def defaults_from_choices(before: Values, now: Values) -> dict[str, Any]:
    """A default left None that the model needs where the config lists the choices
    (`default_language` among `languages`: X-MOD's adapters are chosen per language, and a
    batch without language ids takes the default): the first choice."""
    changes: dict[str, Any] = {}
    for key, value in now.items():
        choices = now.get(f"{key.removeprefix('default_')}s")
        if key.startswith("default_") and value is None and _names(choices):
            changes[key] = choices[0]
    return changes


def _names(values: Any) -> bool:
    return isinstance(values, list | tuple) and bool(values) and isinstance(values[0], str)


def fractions_of_the_hidden_size(before: Values, now: Values) -> dict[str, Any]:
    """Sizes that were the hidden size over a small integer (LayoutLMv3's box coordinate and
    shape embeddings, four and two of them concatenated into the hidden size: 768 / 6) that
    same fraction of the tiny hidden size (the roomy derivation's, which keeps the divisor)."""
    hidden_key, old = _first(before, HIDDEN_NAMES)
    new = _int(now, hidden_key) if hidden_key else None
    if not old or not new or new == old:
        return {}
    changes: dict[str, Any] = {}
    for key, value in before.items():
        if key.endswith("_size") and key not in HIDDEN_NAMES and _int(before, key):
            ratio, rest = divmod(old, value)
            if not rest and 2 <= ratio <= 8 and new % ratio == 0 and now[key] == value:
                changes[key] = new // ratio
    return changes


def widths_of_the_text(before: Values, now: Values) -> dict[str, Any]:
    """A sub-config's output width that was the text model's hidden size (Dots3 Note's vision
    and audio adapters project into the text's width, which its config validates) is the
    tiny text model's hidden size."""
    text_before, text_now = before.get("text_config"), now.get("text_config")
    if not _is_config(text_before) or not _is_config(text_now):
        return {}
    key, old = _first(vars(text_before), HIDDEN_NAMES)
    new = _int(vars(text_now), key) if key else None
    if not old or not new or new == old:
        return {}
    changes: dict[str, Any] = {}
    for name, sub in now.items():
        was = before.get(name)
        if name == "text_config" or not _is_config(sub) or not _is_config(was):
            continue
        for attr, value in vars(was).items():
            if attr.endswith(("_out_dim", "_output_dim")) and value == old:
                setattr(sub, attr, new)
                changes[name] = sub
    return changes


def _is_config(value: Any) -> bool:
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


def halved_to(value: int, most: int) -> int:
    """`value` halved until it is at most `most`: a tiny size with the full one's odd factors
    (768 -> 96, still divisible by 3 and by 6)."""
    while value > most and value % 2 == 0:
        value //= 2
    return value


RELATIONS = (
    per_layer_lists_cut,
    layer_counts_fit,
    heads_consistent,
    expert_groups_divide,
    windows_fit,
    parts_of_the_hidden_size,
    positions_factored,
    defaults_from_choices,
    widths_of_the_text,
    token_ids_in_vocabulary,
    start_ids,
)
# the roomy derivation (`coverage_configs.ROOMY_HIDDEN`): the same relations, layer kinds kept
# twice, and fractions of the hidden size kept
ROOMY_RELATIONS = (
    partial(per_layer_lists_cut, repeats=2),
    *RELATIONS[1:],
    fractions_of_the_hidden_size,
)
