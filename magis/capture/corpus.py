"""Public architectures outside the zoo, built the way their users build them (issue #15).

The zoo (`workloads.py`) reproduces the MAGIS evaluation; this corpus is what a new user brings:
Hugging Face models from their own configs, trained through their own loss code. Each entry is a
factory `build(size) -> Case(model, batch, loss_fn)`, random init, nothing downloaded, with
`loss_fn(model, *batch)` written as the library's users write it: `labels=` and `.loss` for the
Hugging Face heads, `F.cross_entropy(model(x).logits, y)` for image classifiers.

Only the ``tiny`` size exists yet (a float64 training step well under 0.5 s on one CPU core, for
the equal-training tests; depthwise convolutions in float64 run one slow kernel per channel,
so the two MobileNet-style models are kept narrow and 16 x 16). A size is a row of each entry's `sizes` table (config overrides and a
batch shape), so paper-size variants (``size="train"``) are new rows, and a ``corpus:NAME``
prefix in the workload registry can call `build_case`.

Torchvision's models (resnet18, densenet, mobilenet_v2) were the first choice; its PyPI wheel is
built against CUDA torch and does not import beside the CPU build the project pins, so their
Hugging Face counterparts stand in: ResNet (batch norm), MobileNetV2 (depthwise convolutions)
and MobileViT (a CNN whose blocks concatenate local and global features).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from magis.errors import UnknownWorkloadError

LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Case:
    """A model, an example batch for it and the loss its users write: `loss_fn(model, *batch)`."""

    name: str
    model: nn.Module
    batch: tuple[torch.Tensor, ...]
    loss_fn: LossFn


@dataclass(frozen=True)
class Size:
    """One size of an architecture: config overrides and the batch's shape."""

    config: Mapping[str, Any]
    batch: int
    length: int  # sequence length, or image side


@dataclass(frozen=True)
class Architecture:
    """A public architecture: how to build it at each size, and what it shows."""

    name: str
    description: str
    build_model: Callable[[Mapping[str, Any]], nn.Module]
    make_batch: Callable[[nn.Module, Size, torch.Generator], tuple[torch.Tensor, ...]]
    loss_fn: LossFn
    sizes: Mapping[str, Size]


# --- losses, as users write them ------------------------------------------------------------------


def lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face causal or masked LM: the head computes the loss from `labels=`."""
    return model(input_ids=input_ids, labels=labels).loss


def seq2seq_loss(model: nn.Module, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """An encoder-decoder with two inputs: source ids, and target ids as `labels=`."""
    return model(input_ids=source, labels=target).loss


def image_classification_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the classifier's logits, as a training loop over images writes it."""
    return F.cross_entropy(model(pixel_values=x).logits, y)


def labels_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """An image classifier's own loss from `labels=`."""
    return model(pixel_values=x, labels=y).loss


# --- batches --------------------------------------------------------------------------------------


def _vocab(model: nn.Module) -> int:
    return model.config.vocab_size


def token_batch(model: nn.Module, size: Size, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(input_ids, labels): the labels are the ids (the LM heads shift or mask as they do)."""
    ids = torch.randint(0, _vocab(model), (size.batch, size.length), generator=gen)
    return ids, ids.clone()


def seq2seq_batch(model: nn.Module, size: Size, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(source ids, target ids): the target half as long as the source."""
    src = torch.randint(0, _vocab(model), (size.batch, size.length), generator=gen)
    tgt = torch.randint(0, _vocab(model), (size.batch, max(size.length // 2, 1)), generator=gen)
    return src, tgt


def image_batch(model: nn.Module, size: Size, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(images in the default dtype, class labels)."""
    channels = model.config.num_channels
    x = torch.randn(size.batch, channels, size.length, size.length, generator=gen)
    y = torch.randint(0, model.config.num_labels, (size.batch,), generator=gen)
    return x.to(torch.get_default_dtype()), y


# --- models ---------------------------------------------------------------------------------------

# Dropout off: the equal-training tests compare twenty steps with eager PyTorch (dropout itself is
# covered by the zoo's verification, where both sides draw the same masks).
_NO_DROPOUT = {"attention_dropout": 0.0}


def _hf(config_cls: str, model_cls: str, **fixed: Any) -> Callable[[Mapping[str, Any]], nn.Module]:
    def build(overrides: Mapping[str, Any]) -> nn.Module:
        import transformers

        config = getattr(transformers, config_cls)(**{**fixed, **overrides})
        config._attn_implementation = "eager"  # attention as plain ops, not a fused SDPA kernel
        model = getattr(transformers, model_cls)(config)
        return model.train()

    return build


_TINY_LM = {"vocab_size": 96, "max_position_embeddings": 64}

ARCHITECTURES: Mapping[str, Architecture] = MappingProxyType(
    {
        a.name: a
        for a in (
            Architecture(
                "llama",
                "decoder LM with grouped-query attention (4 heads, 2 key/value heads), RoPE",
                _hf("LlamaConfig", "LlamaForCausalLM", **_NO_DROPOUT),
                token_batch,
                lm_loss,
                {
                    "tiny": Size(
                        {
                            **_TINY_LM,
                            "hidden_size": 32,
                            "intermediate_size": 64,
                            "num_hidden_layers": 2,
                            "num_attention_heads": 4,
                            "num_key_value_heads": 2,
                        },
                        batch=4,
                        length=32,
                    )
                },
            ),
            Architecture(
                "qwen2",
                "decoder LM with grouped-query attention and biased q/k/v projections",
                _hf("Qwen2Config", "Qwen2ForCausalLM", **_NO_DROPOUT),
                token_batch,
                lm_loss,
                {
                    "tiny": Size(
                        {
                            **_TINY_LM,
                            "hidden_size": 32,
                            "intermediate_size": 64,
                            "num_hidden_layers": 2,
                            "num_attention_heads": 4,
                            "num_key_value_heads": 1,
                            "tie_word_embeddings": True,
                        },
                        batch=4,
                        length=32,
                    )
                },
            ),
            Architecture(
                "gpt2",
                "GPT-2: decoder LM, tied input and output embeddings",
                _hf(
                    "GPT2Config",
                    "GPT2LMHeadModel",
                    resid_pdrop=0.0,
                    embd_pdrop=0.0,
                    attn_pdrop=0.0,
                    bos_token_id=0,
                    eos_token_id=0,
                ),
                token_batch,
                lm_loss,
                {
                    "tiny": Size(
                        {
                            "vocab_size": 96,
                            "n_positions": 64,
                            "n_embd": 32,
                            "n_layer": 2,
                            "n_head": 4,
                        },
                        batch=4,
                        length=32,
                    )
                },
            ),
            Architecture(
                "t5",
                "T5: encoder-decoder, two inputs (source ids, target ids as labels)",
                _hf(
                    "T5Config",
                    "T5ForConditionalGeneration",
                    dropout_rate=0.0,
                    decoder_start_token_id=0,
                    pad_token_id=0,
                ),
                seq2seq_batch,
                seq2seq_loss,
                {
                    "tiny": Size(
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
                    )
                },
            ),
            Architecture(
                "bert",
                "BERT masked LM: a bidirectional encoder",
                _hf(
                    "BertConfig",
                    "BertForMaskedLM",
                    hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0,
                ),
                token_batch,
                lm_loss,
                {
                    "tiny": Size(
                        {
                            **_TINY_LM,
                            "hidden_size": 32,
                            "intermediate_size": 64,
                            "num_hidden_layers": 2,
                            "num_attention_heads": 4,
                        },
                        batch=4,
                        length=32,
                    )
                },
            ),
            Architecture(
                "vit",
                "vision transformer (patch embedding, class token), loss from labels=",
                _hf(
                    "ViTConfig",
                    "ViTForImageClassification",
                    hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0,
                ),
                image_batch,
                labels_loss,
                {
                    "tiny": Size(
                        {
                            "image_size": 16,
                            "patch_size": 4,
                            "hidden_size": 32,
                            "intermediate_size": 64,
                            "num_hidden_layers": 2,
                            "num_attention_heads": 4,
                            "num_labels": 10,
                        },
                        batch=8,
                        length=16,
                    )
                },
            ),
            Architecture(
                "resnet",
                "ResNet: a CNN with batch norm (running statistics updated in place)",
                _hf("ResNetConfig", "ResNetForImageClassification"),
                image_batch,
                image_classification_loss,
                {
                    "tiny": Size(
                        {
                            "embedding_size": 8,
                            "hidden_sizes": [8, 16],
                            "depths": [1, 1],
                            "layer_type": "basic",
                            "num_labels": 10,
                        },
                        batch=8,
                        length=32,
                    )
                },
            ),
            Architecture(
                "mobilenet_v2",
                "MobileNetV2: depthwise-separable convolutions, inverted residuals, ReLU6",
                _hf(
                    "MobileNetV2Config",
                    "MobileNetV2ForImageClassification",
                    classifier_dropout_prob=0.0,
                ),
                image_batch,
                image_classification_loss,
                {
                    "tiny": Size(
                        {
                            "depth_multiplier": 0.1,
                            "min_depth": 4,
                            "finegrained_output": False,
                            "image_size": 16,
                            "num_labels": 10,
                        },
                        batch=8,
                        length=16,
                    )
                },
            ),
            Architecture(
                "mobilevit",
                "MobileViT: a CNN whose blocks concatenate convolutional and attention features",
                _hf(
                    "MobileViTConfig",
                    "MobileViTForImageClassification",
                    hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0,
                    classifier_dropout_prob=0.0,
                ),
                image_batch,
                image_classification_loss,
                {
                    "tiny": Size(
                        {
                            "image_size": 16,
                            "patch_size": 2,
                            "hidden_sizes": [16, 24, 32],
                            "neck_hidden_sizes": [8, 8, 16, 16, 24, 32, 64],
                            "num_attention_heads": 2,
                            "expand_ratio": 2.0,
                            "num_labels": 10,
                        },
                        batch=16,
                        length=16,
                    )
                },
            ),
        )
    }
)

CORPUS_NAMES: tuple[str, ...] = tuple(ARCHITECTURES)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_case(
    name: str, size: str = "tiny", dtype: torch.dtype = torch.float64, seed: int = 0
) -> Case:
    """Architecture `name` at `size`: a freshly initialised model (seeded), a batch, the loss.

    The model is built with `dtype` as the default dtype (float64 for the equal-training tests).
    Raises `UnknownWorkloadError` for an unknown name or size.
    """
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise UnknownWorkloadError(
            f"unknown corpus architecture '{name}'; known: {', '.join(CORPUS_NAMES)}"
        )
    if size not in arch.sizes:
        raise UnknownWorkloadError(
            f"corpus architecture '{name}' has no size '{size}'; sizes: {', '.join(arch.sizes)}"
        )
    with _default_dtype(dtype):
        torch.manual_seed(seed)
        model = arch.build_model(arch.sizes[size].config)
        batch = arch.make_batch(model, arch.sizes[size], torch.Generator().manual_seed(seed + 1))
    return Case(name, model, batch, arch.loss_fn)
