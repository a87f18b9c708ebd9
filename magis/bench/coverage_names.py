"""The names and sizes the tiny derivation of `magis bench coverage` shares between its
modules (`coverage_configs`, `coverage_relations`, `coverage_models`): the config attributes
that name a depth, a width or a head count, and the batch's sizes."""

from __future__ import annotations

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
# the attributes that bound the positions a model embeds
POSITION_NAMES = ("max_position_embeddings", "n_positions", "max_source_positions")
