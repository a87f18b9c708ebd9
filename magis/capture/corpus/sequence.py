"""Sequence and graph models of the corpus: a mixture-of-experts LM, a CTC speech recognizer, a
state-space LM, a recurrent LM and a graph network (issue #46: common, and missing before).

Full sizes: Qwen3-MoE at a small config (24 layers, 64 experts, top-8) in bfloat16 at b8 x 2048;
Wav2Vec2-base on b8 clips of 16 s of 16 kHz audio with 256-character transcripts; Mamba-130m
at b8 x 32 (its slow path loops over time in Python: see `_MAMBA_LENGTH`); a 2-layer LSTM LM
at hidden 1,024 on b64 x 256 tokens; a 3-layer GCN over a 200,000-node, 4,000,000-edge graph. Random init,
dropout, LayerDrop and SpecAugment off (the equal-training tests compare with eager).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from magis.capture.corpus.base import FULL, TINY, Architecture, Batch, Size, hf_architecture
from magis.capture.corpus.losses import audio_batch, ctc_loss, lm_loss, token_batch

MOE, SPEECH, STATE_SPACE, RNN, GNN = (
    "MoE decoder LM",
    "speech CTC",
    "state-space LM",
    "RNN LM",
    "GNN",
)
_BF16 = torch.bfloat16

# Mamba's slow path unrolls its scan into ~33 nodes per token and layer (forward and backward):
# Mamba-130m's 24 layers capture 29k nodes in ~60 s at 32 tokens, 201k nodes (~8.5 min to
# capture and analyze) at 256; its usual 2048 would be ~1.6M nodes. So the full size is the
# published model at a short length, where the capture stays under a minute.
_MAMBA_LENGTH = 32


def model_loss(model: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    """A model whose forward is its own training loss (magis's GCN and recurrent LM)."""
    return model(*batch)


def dataclass_config(config_cls: type) -> Any:
    """A `make_config` for a dataclass config: its defaults with a size's overrides."""

    def make(overrides: Mapping[str, Any]) -> Any:
        return dataclasses.replace(config_cls(), **overrides)

    return make


# --- the recurrent LM and the GCN: magis's own definitions (`magis.capture.models`) ----------


def _rnn_config(overrides: Mapping[str, Any]) -> Any:
    from magis.capture.models.rnn_lm import RecurrentLMConfig

    return dataclass_config(RecurrentLMConfig)(overrides)


def _rnn_model(config: Any) -> nn.Module:
    from magis.capture.models.rnn_lm import RecurrentLM

    return RecurrentLM.from_config(config)


def _next_token_batch(config: Any, size: Size, batch: int, gen: torch.Generator) -> Batch:
    """(tokens, next tokens): a stream of `length + 1` words cut into input and target."""
    stream = torch.randint(0, config.vocab, (batch, size.length + 1), generator=gen)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def _gcn_config(overrides: Mapping[str, Any]) -> Any:
    from magis.capture.models.gcn import GCNConfig

    return dataclass_config(GCNConfig)(overrides)


def _gcn_model(config: Any) -> nn.Module:
    from magis.capture.models.gcn import GCN

    return GCN(config)


def _graph_batch(config: Any, size: Size, batch: int, gen: torch.Generator) -> Batch:
    """(node features, edges (2, E), edge weights (E,), node labels): the whole graph, one per
    step (full-graph training), so the batch count does not apply."""
    from magis.capture.models.gcn import gcn_batch

    return gcn_batch(config, gen)


SEQUENCE: tuple[Architecture, ...] = (
    hf_architecture(
        "qwen3_moe",
        MOE,
        "Qwen3-MoE (small config): 64 experts, 8 routed per token, through transformers' default "
        "grouped matmul (`aten._grouped_mm`); tiny uses transformers' static-shape `batched_mm` "
        "experts (a gathered bmm per token and expert), as the CPU grouped matmul has no float64",
        ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        token_batch,
        lm_loss,
        {
            FULL: Size(
                {
                    "vocab_size": 151936,
                    "hidden_size": 1024,
                    "intermediate_size": 3072,
                    "moe_intermediate_size": 512,
                    "num_hidden_layers": 24,
                    "num_attention_heads": 16,
                    "num_key_value_heads": 4,
                    "head_dim": 64,
                    "num_experts": 64,
                    "num_experts_per_tok": 8,
                    "max_position_embeddings": 2048,
                },
                batch=8,
                length=2048,
                dtype=_BF16,
            ),  # fmt: skip
            TINY: Size(
                {
                    "vocab_size": 96,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "moe_intermediate_size": 16,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "head_dim": 8,
                    "num_experts": 8,
                    "num_experts_per_tok": 2,
                    "max_position_embeddings": 64,
                    "experts_implementation": "batched_mm",
                },
                batch=4,
                length=32,
            ),  # fmt: skip
        },
        norm_topk_prob=True,
        use_cache=False,
        attention_dropout=0.0,
    ),
    hf_architecture(
        "wav2vec2",
        SPEECH,
        "Wav2Vec2-base CTC: a convolutional feature encoder over raw audio, a convolutional "
        "position embedding, a post-LayerNorm encoder; CTC loss from the logits over -100-padded "
        "transcripts",
        ("Wav2Vec2Config", "Wav2Vec2ForCTC"),
        audio_batch,
        ctc_loss,
        {
            FULL: Size({}, batch=8, length=16 * 16_000, target_length=256),
            TINY: Size(
                {
                    "vocab_size": 16,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "conv_dim": (16, 16),
                    "conv_stride": (4, 2),
                    "conv_kernel": (8, 4),
                    "num_conv_pos_embeddings": 8,
                    "num_conv_pos_embedding_groups": 4,
                },
                batch=4,
                length=400,
                target_length=12,
            ),  # fmt: skip
        },
        layerdrop=0.0,
        mask_time_prob=0.0,
        mask_feature_prob=0.0,
        hidden_dropout=0.0,
        activation_dropout=0.0,
        attention_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        ctc_loss_reduction="mean",
        ctc_zero_infinity=True,
    ),
    hf_architecture(
        "mamba",
        STATE_SPACE,
        "Mamba-130m: selective state-space blocks (causal depthwise convolution, input-dependent "
        "scan) on transformers' PyTorch path, a loop over time without the CUDA kernels",
        ("MambaConfig", "MambaForCausalLM"),
        token_batch,
        lm_loss,
        {
            FULL: Size(
                {"vocab_size": 50280, "hidden_size": 768, "num_hidden_layers": 24},
                batch=8,
                length=_MAMBA_LENGTH,
            ),
            TINY: Size(
                {
                    "vocab_size": 96,
                    "hidden_size": 16,
                    "state_size": 4,
                    "num_hidden_layers": 2,
                    "time_step_rank": 4,
                },
                batch=4,
                length=8,
            ),  # fmt: skip
        },
        use_cache=False,
        tie_word_embeddings=True,
    ),
    Architecture(
        "lstm_lm",
        RNN,
        "2-layer LSTM word LM (magis.capture.models.rnn_lm): embedding, nn.LSTM, a linear head, "
        "cross-entropy on the next tokens",
        _rnn_config,
        _rnn_model,
        _next_token_batch,
        model_loss,
        {
            FULL: Size({}, batch=64, length=256),
            TINY: Size({"vocab": 50, "hidden": 16}, batch=4, length=12),
        },
    ),
    Architecture(
        "gcn",
        GNN,
        "3-layer GCN (magis.capture.models.gcn), full-graph training: messages gathered per "
        "edge (index_select) and scatter-added into the nodes (index_add); one graph per step",
        _gcn_config,
        _gcn_model,
        _graph_batch,
        model_loss,
        {
            FULL: Size({}, batch=1, length=200_000),
            TINY: Size(
                {"nodes": 40, "edges": 160, "features": 8, "hidden": 16, "classes": 5},
                batch=1,
                length=40,
            ),
        },
    ),
)
