"""DenseNet for image classification: the corpus's CNN whose layers concatenate.

Huang, Liu, van der Maaten, Weinberger, "Densely Connected Convolutional Networks", CVPR 2017
(arXiv:1608.06993). DenseNet-121 (Table 1): growth rate k = 32, dense blocks of 6, 12, 24 and 16
layers, the bottleneck variant (DenseNet-B: a 1x1 convolution to 4k channels before each 3x3)
and compression 0.5 in the transitions (DenseNet-C), a 7x7 stride-2 stem with 2k = 64 channels.

Each layer of a block reads the concatenation of the block's input and every earlier layer's k
new channels (Eq. 2, x_l = H_l([x_0, ..., x_{l-1}])), which is what makes DenseNet's activation
memory grow quadratically with depth. Normalisation is pre-activation (BN, ReLU, conv: §3,
"composite function"), as in the published model and torchvision's build of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DenseNetConfig:
    """DenseNet hyper-parameters; the defaults are DenseNet-121 on ImageNet."""

    growth_rate: int = 32
    block_config: tuple[int, ...] = (6, 12, 24, 16)
    num_init_features: int = 64
    bn_size: int = 4  # bottleneck width, in multiples of the growth rate
    compression: float = 0.5
    num_labels: int = 1000
    num_channels: int = 3


def _bn_relu_conv(channels: int, out: int, kernel: int) -> list[nn.Module]:
    return [
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.Conv2d(channels, out, kernel, padding=kernel // 2, bias=False),
    ]


class DenseLayer(nn.Module):
    """H_l: BN-ReLU-conv1x1 to bn_size*k channels, then BN-ReLU-conv3x3 to k new channels."""

    def __init__(self, channels: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        width = bn_size * growth_rate
        self.bottleneck = nn.Sequential(*_bn_relu_conv(channels, width, 1))
        self.conv = nn.Sequential(*_bn_relu_conv(width, growth_rate, 3))

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.conv(self.bottleneck(torch.cat(features, dim=1)))


class DenseBlock(nn.Module):
    """`layers` dense layers; each sees every earlier output, the block returns them all joined."""

    def __init__(self, layers: int, channels: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DenseLayer(channels + i * growth_rate, growth_rate, bn_size) for i in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, dim=1)


class Transition(nn.Sequential):
    """Between blocks: BN-ReLU-conv1x1 compressing the channels, then 2x2 average pooling."""

    def __init__(self, channels: int, out: int) -> None:
        super().__init__(*_bn_relu_conv(channels, out, 1), nn.AvgPool2d(2, stride=2))


class DenseNet(nn.Module):
    """DenseNet-BC (Huang et al. 2017, Table 1); `forward(images)` returns class logits."""

    def __init__(self, config: DenseNetConfig) -> None:
        super().__init__()
        self.config = config
        k, channels = config.growth_rate, config.num_init_features
        stages: list[nn.Module] = [
            nn.Conv2d(config.num_channels, channels, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        ]
        for i, layers in enumerate(config.block_config):
            stages.append(DenseBlock(layers, channels, k, config.bn_size))
            channels += layers * k
            if i < len(config.block_config) - 1:
                out = int(channels * config.compression)
                stages.append(Transition(channels, out))
                channels = out
        stages.append(nn.BatchNorm2d(channels))
        self.features = nn.Sequential(*stages)
        self.classifier = nn.Linear(channels, config.num_labels)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.features(images))
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
