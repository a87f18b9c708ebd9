"""Vision models of the corpus: CNNs (batch norm, concatenations, depthwise convolutions),
vision transformers with and without windows, and a segmentation transformer.

Full sizes are the published ImageNet configs at a usual training batch (b64 x 224, MobileViT
at its native 256, DenseNet-121 b32 x 224, SegFormer-B0 on ADE20K crops b16 x 512), random
init, float32. Drop-path and dropout are off (the equal-training tests compare with eager).
Torchvision's wheel needs a CUDA torch, so the CNNs come from transformers, and DenseNet-121,
which transformers lacks, from `magis.capture.models.densenet`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from magis.capture.corpus.base import FULL, TINY, Architecture, Size, hf_architecture
from magis.capture.corpus.losses import (
    image_batch,
    image_classification_loss,
    labels_loss,
    mask_batch,
)

CNN, VIT, SEGMENTATION = "CNN", "vision transformer", "segmentation"
_IMAGENET = {"num_labels": 1000}


def _densenet_config(overrides: Mapping[str, Any]) -> Any:
    from magis.capture.models.densenet import DenseNetConfig

    return DenseNetConfig(**overrides)


def _densenet(config: Any) -> Any:
    from magis.capture.models.densenet import DenseNet

    return DenseNet(config)


VISION: tuple[Architecture, ...] = (
    hf_architecture(
        "vit",
        VIT,
        "ViT-B/16: patch embedding, class token, global attention; loss from labels=",
        ("ViTConfig", "ViTForImageClassification"),
        image_batch,
        labels_loss,
        {
            FULL: Size(_IMAGENET, batch=64, length=224),
            TINY: Size(
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
            ),  # fmt: skip
        },
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    hf_architecture(
        "swin",
        VIT,
        "Swin-T: attention inside shifted 7x7 windows (rolls and a window mask), patch merging",
        ("SwinConfig", "SwinForImageClassification"),
        image_batch,
        image_classification_loss,
        {
            FULL: Size(_IMAGENET, batch=64, length=224),
            TINY: Size(
                {
                    "image_size": 16,
                    "patch_size": 2,
                    "embed_dim": 16,
                    "depths": [2, 1],
                    "num_heads": [2, 4],
                    "window_size": 4,
                    "num_labels": 10,
                },
                batch=8,
                length=16,
            ),  # fmt: skip
        },
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    ),
    hf_architecture(
        "resnet",
        CNN,
        "ResNet-50: bottleneck blocks with batch norm (running statistics updated in place)",
        ("ResNetConfig", "ResNetForImageClassification"),
        image_batch,
        image_classification_loss,
        {
            FULL: Size(_IMAGENET, batch=64, length=224),
            TINY: Size(
                {
                    "embedding_size": 8,
                    "hidden_sizes": [8, 16],
                    "depths": [1, 1],
                    "layer_type": "basic",
                    "num_labels": 10,
                },
                batch=8,
                length=32,
            ),  # fmt: skip
        },
    ),
    hf_architecture(
        "regnet",
        CNN,
        "RegNetY-4GF: grouped convolutions with squeeze-and-excitation, batch norm",
        ("RegNetConfig", "RegNetForImageClassification"),
        image_batch,
        image_classification_loss,
        {
            FULL: Size(_IMAGENET, batch=64, length=224),
            TINY: Size(
                {
                    "embedding_size": 8,
                    "hidden_sizes": [8, 16],
                    "depths": [1, 1],
                    "groups_width": 8,
                    "num_labels": 10,
                },
                batch=8,
                length=16,
            ),  # fmt: skip
        },
        layer_type="y",
    ),
    Architecture(
        "densenet121",
        CNN,
        "DenseNet-121: every layer reads the concatenation of all earlier ones (growth 32, "
        "blocks 6-12-24-16, bottleneck 4k)",
        _densenet_config,
        _densenet,
        image_batch,
        image_classification_loss,
        {
            FULL: Size(_IMAGENET, batch=32, length=224),
            TINY: Size(
                {
                    "growth_rate": 4,
                    "block_config": (2, 2),
                    "num_init_features": 8,
                    "bn_size": 2,
                    "num_labels": 10,
                },
                batch=4,
                length=16,
            ),  # fmt: skip
        },
    ),
    hf_architecture(
        "mobilenet_v2",
        CNN,
        "MobileNetV2: depthwise-separable convolutions, inverted residuals, ReLU6",
        ("MobileNetV2Config", "MobileNetV2ForImageClassification"),
        image_batch,
        image_classification_loss,
        {
            FULL: Size(_IMAGENET, batch=64, length=224),
            TINY: Size(
                {
                    "depth_multiplier": 0.1,
                    "min_depth": 4,
                    "finegrained_output": False,
                    "image_size": 16,
                    "num_labels": 10,
                },
                batch=8,
                length=16,
            ),  # fmt: skip
        },
        classifier_dropout_prob=0.0,
    ),
    hf_architecture(
        "efficientnet",
        CNN,
        "EfficientNet-B0: depthwise MBConv blocks with squeeze-and-excitation and swish",
        ("EfficientNetConfig", "EfficientNetForImageClassification"),
        image_batch,
        image_classification_loss,
        {
            FULL: Size(
                {
                    **_IMAGENET,
                    "image_size": 224,
                    "width_coefficient": 1.0,
                    "depth_coefficient": 1.0,
                    "hidden_dim": 1280,
                },
                batch=64,
                length=224,
            ),  # fmt: skip
            TINY: Size(
                {
                    "image_size": 32,
                    "width_coefficient": 0.1,
                    "depth_coefficient": 0.1,
                    "hidden_dim": 128,
                    "num_labels": 10,
                },
                batch=2,
                length=32,
            ),  # fmt: skip
        },
        dropout_rate=0.0,
        drop_connect_rate=0.0,
    ),
    hf_architecture(
        "convnext",
        CNN,
        "ConvNeXt-T: 7x7 depthwise convolutions, LayerNorm, inverted bottlenecks, layer scale",
        ("ConvNextConfig", "ConvNextForImageClassification"),
        image_batch,
        image_classification_loss,
        {
            FULL: Size(_IMAGENET, batch=64, length=224),
            TINY: Size(
                {"num_stages": 2, "hidden_sizes": [8, 16], "depths": [1, 1], "num_labels": 10},
                batch=4,
                length=32,
            ),
        },
        drop_path_rate=0.0,
    ),
    hf_architecture(
        "mobilevit",
        CNN,
        "MobileViT-S: a CNN whose blocks concatenate convolutional and attention features",
        ("MobileViTConfig", "MobileViTForImageClassification"),
        image_batch,
        image_classification_loss,
        {
            FULL: Size(_IMAGENET, batch=64, length=256),
            TINY: Size(
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
            ),  # fmt: skip
        },
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    ),
    hf_architecture(
        "segformer",
        SEGMENTATION,
        "SegFormer-B0 (ADE20K, 150 classes): hierarchical encoder with reduced-key attention, "
        "MLP decoder, loss on logits upsampled to the mask",
        ("SegformerConfig", "SegformerForSemanticSegmentation"),
        mask_batch,
        labels_loss,
        {
            FULL: Size({"num_labels": 150}, batch=16, length=512),
            TINY: Size(
                {
                    "num_encoder_blocks": 2,
                    "depths": [1, 1],
                    "sr_ratios": [2, 1],
                    "hidden_sizes": [8, 16],
                    "patch_sizes": [7, 3],
                    "strides": [4, 2],
                    "num_attention_heads": [1, 2],
                    "mlp_ratios": [2, 2],
                    "decoder_hidden_size": 16,
                    "num_labels": 4,
                },
                batch=4,
                length=32,
            ),  # fmt: skip
        },
        drop_path_rate=0.0,
        classifier_dropout_prob=0.0,
    ),
)
