"""The architectures `magis bench coverage` sweeps, and each one built tiny with a batch.

An architecture is a model class of an installed library that trains with a loss: a class of
transformers' task mappings (`TASKS`, from causal LM to audio classification), or a diffusers
model (`magis.bench.coverage_diffusers`). Each is named by its library and class, so a worker
process builds it from the name alone.

A tiny configuration is derived from the class's own config class, generically: every
attribute listed in `TINY_INTS` that the config has is capped (2 layers, hidden 64, 4 heads,
vocabulary 512, ...), lists of per-stage sizes are capped element-wise (`TINY_LISTS`), special
token ids are kept inside the vocabulary, and the training-only random choices that one static
graph cannot hold are switched off (`NO_RANDOM_CHOICE`: LayerDrop and SpecAugment masks, which
a captured step would draw once while eager PyTorch draws anew; README "Coverage"). There is no
table of per-model settings: what the derivation misses is a failure row of the sweep.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

TRANSFORMERS, DIFFUSERS = "transformers", "diffusers"

# transformers' task mappings swept, each with the batch its head trains on
TASKS = (
    "CAUSAL_LM",
    "MASKED_LM",
    "SEQ_TO_SEQ_CAUSAL_LM",
    "SEQUENCE_CLASSIFICATION",
    "TOKEN_CLASSIFICATION",
    "IMAGE_CLASSIFICATION",
    "CTC",
    "AUDIO_CLASSIFICATION",
    "SPEECH_SEQ_2_SEQ",
)

BATCH, LENGTH, TARGET_LENGTH, IMAGE, AUDIO_SAMPLES, LABEL_LENGTH = 2, 16, 8, 32, 4000, 4

# Config attributes capped at a value, where a config has them (a smaller value is kept).
TINY_INTS: Mapping[str, int] = {
    **dict.fromkeys(
        (
            "num_hidden_layers",
            "num_layers",
            "n_layer",
            "n_layers",
            "encoder_layers",
            "decoder_layers",
            "num_encoder_layers",
            "num_decoder_layers",
            "num_hidden_groups",
        ),
        2,
    ),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "hidden_dim"), 64),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
        ),
        4,
    ),
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
    **dict.fromkeys(("vocab_size", "n_vocab", "decoder_vocab_size"), 512),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_source_positions"), 64),
    "max_target_positions": 64,
    "image_size": IMAGE,
    "num_mel_bins": 16,
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
FILL_WHEN_NONE = ("vocab_size", "head_dim", "num_key_value_heads")
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


@dataclass(frozen=True)
class Architecture:
    """A model class of a library that trains with a loss, and the batch kind it takes."""

    library: str
    name: str  # the class name: BertForMaskedLM, UNet2DModel
    task: str  # a TASKS entry, or the diffusers input convention

    @property
    def label(self) -> str:
        return f"{self.library}:{self.name}"


@dataclass(frozen=True)
class Case:
    """A tiny model in training mode, its batch by keyword, and `loss_fn(model, **batch)`."""

    model: torch.nn.Module
    batch: dict[str, torch.Tensor]
    loss_fn: Callable[..., torch.Tensor] | None  # None: the model's own `.loss`


def transformers_architectures() -> list[Architecture]:
    """Every class of transformers' task mappings in `TASKS`, once (its first task)."""
    from transformers.models.auto import modeling_auto

    seen: dict[str, Architecture] = {}
    for task in TASKS:
        names = getattr(modeling_auto, f"MODEL_FOR_{task}_MAPPING_NAMES", {})
        for cls in names.values():
            for name in (cls,) if isinstance(cls, str) else cls:
                seen.setdefault(name, Architecture(TRANSFORMERS, name, task))
    return sorted(seen.values(), key=lambda a: a.name)


def build_transformers_case(arch: Architecture, dtype: torch.dtype, seed: int = 0) -> Case:
    """The architecture at its tiny config in `dtype`, seeded, with a batch for its task."""
    import transformers

    cls = getattr(transformers, arch.name)
    config = tiny_config(cls.config_class())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        model = cls(config).to(dtype).train()
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator().manual_seed(seed)
    loss = ctc_loss if arch.task == "CTC" else None
    return Case(model, task_batch(arch.task, model, config, dtype, generator), loss)


def ctc_loss(model: torch.nn.Module, labels: torch.Tensor, **inputs) -> torch.Tensor:
    """The CTC loss written from the logits, as a training loop writes it: every frame and every
    label counted (tensor lengths, as the libraries pass them). The heads' own `labels=` path
    checks the labels' values in Python and selects the unpadded ones (`masked_select`), which
    no static graph holds."""
    log_probs = model(**inputs).logits.log_softmax(-1).transpose(0, 1)
    steps, batch = log_probs.shape[:2]
    input_lengths = torch.full((batch,), steps, dtype=torch.long)
    target_lengths = torch.full((batch,), labels.shape[1], dtype=torch.long)
    blank = getattr(model.config, "pad_token_id", None) or 0
    return F.ctc_loss(log_probs, labels, input_lengths, target_lengths, blank, zero_infinity=True)


def tiny_config(config: Any) -> Any:
    """`config` made tiny in place (see the module docstring), with its sub-configs (an
    encoder-decoder's text and vision parts) made tiny the same way."""
    layers = {k: v for k, v in vars(config).items() if k in _LAYER_COUNTS and isinstance(v, int)}
    for key, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            tiny_config(value)
        elif key in TINY_LISTS and isinstance(value, list | tuple) and value:
            capped = [min(v, TINY_LISTS[key]) if isinstance(v, int) else v for v in value]
            setattr(config, key, type(value)(capped))
        elif key in TINY_INTS and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, key, min(value, TINY_INTS[key]))
        elif key in FILL_WHEN_NONE and value is None:
            setattr(config, key, TINY_INTS[key])
        elif key in NO_RANDOM_CHOICE and isinstance(value, float):
            setattr(config, key, 0.0)
    _per_layer_lists_cut(config, layers)
    _heads_divide(config)
    _token_ids_in_vocabulary(config)
    _padding_and_start_ids(config)
    return config


def _padding_and_start_ids(config: Any) -> None:
    """A padding id where the config has none (a decoder's sequence classification finds each
    row's last token by it), and an encoder-decoder's decoder starting from it where the config
    names no start id (T5's convention)."""
    if hasattr(config, "pad_token_id") and config.pad_token_id is None:
        config.pad_token_id = 0
    encoder_decoder = getattr(config, "is_encoder_decoder", False)
    if encoder_decoder and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", 0) or 0


_LAYER_COUNTS = tuple(k for k, v in TINY_INTS.items() if v == 2 and "layer" in k)


def _per_layer_lists_cut(config: Any, before: Mapping[str, int]) -> None:
    """A list with one entry per layer (`layer_types`, per-layer sliding windows) cut to the
    new number of layers, recognized by its length (the old number). Every kind of layer it
    names is kept (a hybrid model's attention layers and linear-attention layers): the cut list
    is each kind once, in order of first appearance, then the first entry repeated; where there
    are more kinds than layers, the model gets one layer per kind."""
    for key, old in before.items():
        new = getattr(config, key)
        for name, value in list(vars(config).items()):
            if new < old and isinstance(value, list | tuple) and len(value) == old:
                kinds = list(dict.fromkeys(v for v in value if isinstance(v, str)))
                new = max(new, len(kinds))
                cut = kinds + [value[0]] * (new - len(kinds)) if kinds else list(value[:new])
                setattr(config, name, type(value)(cut))
                setattr(config, key, new)


def _heads_divide(config: Any) -> None:
    """Heads that divide the hidden size, and key/value heads that divide the heads."""
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads and hidden % heads:
        config.num_attention_heads = 1
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and kv and heads % kv:
        config.num_key_value_heads = heads


def _token_ids_in_vocabulary(config: Any) -> None:
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    for key, value in list(vars(config).items()):
        if key.endswith("token_id") and isinstance(value, int) and value >= vocab:
            setattr(config, key, value % vocab)


def _ids(generator: torch.Generator, high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, max(high, 1), shape, generator=generator)


def task_batch(
    task: str, model: torch.nn.Module, config: Any, dtype: torch.dtype, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """The keyword batch a head of `task` trains on, with `labels=` so it returns `.loss`."""
    vocab = getattr(config, "vocab_size", None) or 2
    labels = getattr(config, "num_labels", 2)
    inputs = _main_input(model, config, dtype, gen)
    if task in ("CAUSAL_LM", "MASKED_LM"):
        return {**inputs, "labels": _ids(gen, vocab, BATCH, LENGTH)}
    if task in ("SEQ_TO_SEQ_CAUSAL_LM", "SPEECH_SEQ_2_SEQ"):
        # ids from 1: 0 is often the padding id, which the decoder's masks treat apart; the
        # decoder's inputs are given, as a config need not name the id that starts them
        target = 1 + _ids(gen, vocab - 1, BATCH, TARGET_LENGTH)
        decoder = {"decoder_input_ids": 1 + _ids(gen, vocab - 1, BATCH, TARGET_LENGTH)}
        takes = "decoder_input_ids" in inspect.signature(model.forward).parameters
        return {**inputs, **(decoder if takes else {}), "labels": target}
    if task == "TOKEN_CLASSIFICATION":
        return {**inputs, "labels": _ids(gen, labels, BATCH, LENGTH)}
    if task == "CTC":  # anything but the blank (the padding id)
        blank = getattr(config, "pad_token_id", None) or 0
        ids = (blank + 1 + _ids(gen, vocab - 1, BATCH, LABEL_LENGTH)) % vocab
        return {**inputs, "labels": ids}
    return {**inputs, "labels": _ids(gen, labels, BATCH)}


def _main_input(
    model: torch.nn.Module, config: Any, dtype: torch.dtype, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """The model's main input (`model.main_input_name`) at the sweep's sizes."""
    name = getattr(model, "main_input_name", "input_ids")
    if name == "pixel_values":
        channels = getattr(config, "num_channels", 3)
        side = getattr(config, "image_size", IMAGE)
        side = side if isinstance(side, int) else IMAGE
        shape = (BATCH, channels, side, side)
    elif name == "input_values":
        shape = (BATCH, AUDIO_SAMPLES)
    elif name == "input_features":
        frames = 2 * getattr(config, "max_source_positions", LENGTH)
        shape = (BATCH, getattr(config, "num_mel_bins", 16), frames)
    else:  # token ids, each row ending as a sentence does, with the end-of-sequence id
        vocab = getattr(config, "vocab_size", None) or 2
        ids = _ids(gen, vocab, BATCH, LENGTH)
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, int) and 0 <= eos < vocab:
            ids[:, -1] = eos
        return {name: ids}
    return {name: torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)}
