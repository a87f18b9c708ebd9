"""Language models of the corpus: decoder LMs of several styles, encoders, encoder-decoders.

Full sizes are the published configs (random init) at a usual training batch: decoder LMs
b8 x 1024-2048, encoders b32 x 512, encoder-decoders b16 with 512 source and 128 target tokens;
models of a billion parameters or near it in bfloat16, as they are trained, the rest float32.
"""

from __future__ import annotations

import torch

from magis.capture.corpus.base import FULL, TINY, Architecture, Size, hf_architecture
from magis.capture.corpus.losses import lm_loss, seq2seq_batch, seq2seq_loss, token_batch

DECODER, ENCODER, ENCODER_DECODER = "decoder LM", "encoder", "encoder-decoder"

# Dropout off: the equal-training tests compare twenty steps with eager PyTorch (dropout itself
# is covered by the zoo's verification, where both sides draw the same masks).
_NO_DROPOUT = {"attention_dropout": 0.0}
_TINY_LM = {"vocab_size": 96, "max_position_embeddings": 64}
_TINY_BLOCKS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
_BF16 = torch.bfloat16


def _tiny(**config) -> Size:
    return Size(config, batch=4, length=32)


LANGUAGE: tuple[Architecture, ...] = (
    hf_architecture(
        "llama",
        DECODER,
        "Llama (TinyLlama-1.1B): grouped-query attention (32 heads, 4 key/value heads), RoPE, "
        "SwiGLU, RMSNorm",
        ("LlamaConfig", "LlamaForCausalLM"),
        token_batch,
        lm_loss,
        {
            FULL: Size(
                {
                    "vocab_size": 32000,
                    "hidden_size": 2048,
                    "intermediate_size": 5632,
                    "num_hidden_layers": 22,
                    "num_attention_heads": 32,
                    "num_key_value_heads": 4,
                    "max_position_embeddings": 2048,
                },
                batch=8,
                length=2048,
                dtype=_BF16,
            ),  # fmt: skip
            TINY: _tiny(**_TINY_LM, **_TINY_BLOCKS, num_attention_heads=4, num_key_value_heads=2),
        },
        **_NO_DROPOUT,
    ),
    hf_architecture(
        "qwen2",
        DECODER,
        "Qwen2-0.5B: grouped-query attention with biased q/k/v projections, tied embeddings, "
        "a 152k vocabulary",
        ("Qwen2Config", "Qwen2ForCausalLM"),
        token_batch,
        lm_loss,
        {
            FULL: Size(
                {
                    "vocab_size": 151936,
                    "hidden_size": 896,
                    "intermediate_size": 4864,
                    "num_hidden_layers": 24,
                    "num_attention_heads": 14,
                    "num_key_value_heads": 2,
                    "max_position_embeddings": 1024,
                    "tie_word_embeddings": True,
                },
                batch=8,
                length=1024,
                dtype=_BF16,
            ),  # fmt: skip
            TINY: _tiny(
                **_TINY_LM,
                **_TINY_BLOCKS,
                num_attention_heads=4,
                num_key_value_heads=1,
                tie_word_embeddings=True,
            ),
        },
        **_NO_DROPOUT,
    ),
    hf_architecture(
        "gpt2",
        DECODER,
        "GPT-2 small: learned positions, pre-LayerNorm, tied input and output embeddings",
        ("GPT2Config", "GPT2LMHeadModel"),
        token_batch,
        lm_loss,
        {
            FULL: Size({"n_positions": 1024}, batch=8, length=1024),
            TINY: _tiny(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4),
        },
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    hf_architecture(
        "gpt_neox",
        DECODER,
        "Pythia-410M (GPT-NeoX): parallel attention and MLP residuals, rotary on a quarter of "
        "each head",
        ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
        token_batch,
        lm_loss,
        {
            FULL: Size(
                {
                    "vocab_size": 50304,
                    "hidden_size": 1024,
                    "intermediate_size": 4096,
                    "num_hidden_layers": 24,
                    "num_attention_heads": 16,
                    "max_position_embeddings": 2048,
                },
                batch=8,
                length=2048,
                dtype=_BF16,
            ),  # fmt: skip
            TINY: _tiny(**_TINY_LM, **_TINY_BLOCKS, num_attention_heads=4),
        },
        rotary_pct=0.25,
        use_parallel_residual=True,
        hidden_dropout=0.0,
        tie_word_embeddings=False,
        **_NO_DROPOUT,
    ),
    hf_architecture(
        "opt",
        DECODER,
        "OPT-125M: learned positions with an offset, ReLU MLP, pre-LayerNorm",
        ("OPTConfig", "OPTForCausalLM"),
        token_batch,
        lm_loss,
        {
            FULL: Size(
                {
                    "vocab_size": 50272,
                    "hidden_size": 768,
                    "ffn_dim": 3072,
                    "num_hidden_layers": 12,
                    "num_attention_heads": 12,
                    "word_embed_proj_dim": 768,
                    "max_position_embeddings": 2048,
                },
                batch=8,
                length=2048,
            ),  # fmt: skip
            TINY: _tiny(
                **_TINY_LM,
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                word_embed_proj_dim=32,
            ),
        },
        dropout=0.0,
        layerdrop=0.0,
        **_NO_DROPOUT,
    ),
    hf_architecture(
        "phi",
        DECODER,
        "Phi-1.5 (1.4B): attention and MLP in parallel off one LayerNorm, partial rotary (half "
        "of each head), GELU",
        ("PhiConfig", "PhiForCausalLM"),
        token_batch,
        lm_loss,
        {
            FULL: Size(
                {
                    "vocab_size": 51200,
                    "hidden_size": 2048,
                    "intermediate_size": 8192,
                    "num_hidden_layers": 24,
                    "num_attention_heads": 32,
                    "max_position_embeddings": 2048,
                },
                batch=8,
                length=2048,
                dtype=_BF16,
            ),  # fmt: skip
            TINY: _tiny(**_TINY_LM, **_TINY_BLOCKS, num_attention_heads=4),
        },
        partial_rotary_factor=0.5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        **_NO_DROPOUT,
    ),
    hf_architecture(
        "bert",
        ENCODER,
        "BERT-base masked LM: a bidirectional encoder, post-LayerNorm",
        ("BertConfig", "BertForMaskedLM"),
        token_batch,
        lm_loss,
        {
            FULL: Size({}, batch=32, length=512),
            TINY: _tiny(**_TINY_LM, **_TINY_BLOCKS, num_attention_heads=4),
        },
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    hf_architecture(
        "roberta",
        ENCODER,
        "RoBERTa-base masked LM: BERT's encoder with positions counted past the padding id",
        ("RobertaConfig", "RobertaForMaskedLM"),
        token_batch,
        lm_loss,
        {
            FULL: Size({"vocab_size": 50265, "max_position_embeddings": 514}, batch=32, length=512),
            TINY: _tiny(
                vocab_size=96, max_position_embeddings=66, **_TINY_BLOCKS, num_attention_heads=4
            ),
        },
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=1,
        type_vocab_size=1,
    ),
    hf_architecture(
        "t5",
        ENCODER_DECODER,
        "T5-base: encoder-decoder with relative position buckets, two inputs (source ids, "
        "target ids as labels)",
        ("T5Config", "T5ForConditionalGeneration"),
        seq2seq_batch,
        seq2seq_loss,
        {
            FULL: Size(
                {
                    "vocab_size": 32128,
                    "d_model": 768,
                    "d_kv": 64,
                    "d_ff": 3072,
                    "num_layers": 12,
                    "num_decoder_layers": 12,
                    "num_heads": 12,
                },
                batch=16,
                length=512,
                target_length=128,
            ),  # fmt: skip
            TINY: Size(
                {
                    "vocab_size": 96,
                    "d_model": 32,
                    "d_kv": 8,
                    "d_ff": 64,
                    "num_layers": 2,
                    "num_decoder_layers": 2,
                    "num_heads": 4,
                    "relative_attention_num_buckets": 8,
                },
                batch=4,
                length=24,
            ),  # fmt: skip
        },
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    ),
    hf_architecture(
        "bart",
        ENCODER_DECODER,
        "BART-base: encoder-decoder with learned positions, labels shifted into decoder inputs",
        ("BartConfig", "BartForConditionalGeneration"),
        seq2seq_batch,
        seq2seq_loss,
        {
            FULL: Size(
                {
                    "vocab_size": 50265,
                    "d_model": 768,
                    "encoder_layers": 6,
                    "decoder_layers": 6,
                    "encoder_attention_heads": 12,
                    "decoder_attention_heads": 12,
                    "encoder_ffn_dim": 3072,
                    "decoder_ffn_dim": 3072,
                },
                batch=16,
                length=512,
                target_length=128,
            ),  # fmt: skip
            TINY: Size(
                {
                    **_TINY_LM,
                    "d_model": 32,
                    "encoder_layers": 2,
                    "decoder_layers": 2,
                    "encoder_attention_heads": 4,
                    "decoder_attention_heads": 4,
                    "encoder_ffn_dim": 64,
                    "decoder_ffn_dim": 64,
                },
                batch=4,
                length=24,
            ),  # fmt: skip
        },
        dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        **_NO_DROPOUT,
    ),
)
