"""Models of the corpus with inputs of two kinds: CLIP (text and images) and Whisper (audio
features and transcripts), from transformers configs with random init.

Full sizes: CLIP ViT-B/32 on b128 image-caption pairs (224 px, 77 tokens), trained on its own
symmetric contrastive loss (`return_loss=True`); Whisper-base on b16 thirty-second clips (80
mel bins x 3000 frames) with 128-token transcripts as `labels=`.
"""

from __future__ import annotations

from magis.capture.corpus.base import FULL, TINY, Architecture, Size, hf_architecture
from magis.capture.corpus.losses import (
    contrastive_loss,
    speech_batch,
    speech_seq2seq_loss,
    text_image_batch,
)

MULTI_INPUT = "multi-input"

MULTIMODAL: tuple[Architecture, ...] = (
    hf_architecture(
        "clip",
        MULTI_INPUT,
        "CLIP ViT-B/32: a text transformer and a vision transformer, contrastive loss over the "
        "batch's image-caption pairs",
        ("CLIPConfig", "CLIPModel"),
        text_image_batch,
        contrastive_loss,
        {
            FULL: Size({}, batch=128, length=224, target_length=77),
            TINY: Size(
                {
                    "text_config": {
                        "vocab_size": 96,
                        "hidden_size": 16,
                        "intermediate_size": 32,
                        "num_hidden_layers": 1,
                        "num_attention_heads": 2,
                        "max_position_embeddings": 16,
                        "bos_token_id": 0,
                        "eos_token_id": 2,
                        "pad_token_id": 1,
                    },
                    "vision_config": {
                        "image_size": 16,
                        "patch_size": 8,
                        "hidden_size": 16,
                        "intermediate_size": 32,
                        "num_hidden_layers": 1,
                        "num_attention_heads": 2,
                    },
                    "projection_dim": 8,
                },
                batch=4,
                length=16,
                target_length=8,
            ),  # fmt: skip
        },
    ),
    hf_architecture(
        "whisper",
        MULTI_INPUT,
        "Whisper-base: a convolutional audio stem and encoder over log-mel frames, a decoder "
        "over transcript ids (labels= shifted into decoder inputs)",
        ("WhisperConfig", "WhisperForConditionalGeneration"),
        speech_batch,
        speech_seq2seq_loss,
        {
            FULL: Size(
                {
                    "d_model": 512,
                    "encoder_layers": 6,
                    "decoder_layers": 6,
                    "encoder_attention_heads": 8,
                    "decoder_attention_heads": 8,
                    "encoder_ffn_dim": 2048,
                    "decoder_ffn_dim": 2048,
                },
                batch=16,
                length=3000,
                target_length=128,
            ),  # fmt: skip
            TINY: Size(
                {
                    "vocab_size": 96,
                    "num_mel_bins": 8,
                    "d_model": 16,
                    "encoder_layers": 1,
                    "decoder_layers": 1,
                    "encoder_attention_heads": 2,
                    "decoder_attention_heads": 2,
                    "encoder_ffn_dim": 32,
                    "decoder_ffn_dim": 32,
                    "max_source_positions": 8,
                    "max_target_positions": 16,
                    "decoder_start_token_id": 1,
                    "pad_token_id": 0,
                    "bos_token_id": 1,
                    "eos_token_id": 2,
                    "suppress_tokens": None,
                    "begin_suppress_tokens": None,
                },
                batch=4,
                length=16,
                target_length=8,
            ),  # fmt: skip
        },
        dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        attention_dropout=0.0,
    ),
)
