"""U-Net for semantic segmentation.

Ronneberger, Fischer, Brox, "U-Net: Convolutional Networks for Biomedical Image Segmentation",
MICCAI 2015 (arXiv:1505.04597).

Layout (paper Fig. 1): a contracting path of four levels, each two 3x3 convolutions followed by a
2x2 max-pool that halves the resolution while the channel count doubles; a bottleneck of two 3x3
convolutions; an expanding path of four levels, each an upsampling of the feature map followed by a
2x2 convolution ("up-convolution") that halves the channels, a concatenation with the skip feature
map of the same resolution, and two 3x3 convolutions; a final 1x1 convolution to the class scores.

Departures from the paper, all common practice: the 3x3 convolutions are padded (output size equals
input size, so no cropping of skip connections is needed) and followed by BatchNorm; the upsampling
is bilinear (`F.interpolate`), so the captured graph contains upsample ops; the 2x2 up-convolution
pads one row/column on the bottom/right to keep the size. With `base_width=64` the parameter count
(~31.0M) equals that of the transposed-convolution variant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DoubleConv(nn.Sequential):
    """Two (3x3 conv, BatchNorm, ReLU) units: the basic block of U-Net (Ronneberger 2015, Sec. 2)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=False),
            nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=False),
        )


def upsample2x(x: torch.Tensor) -> torch.Tensor:
    """Bilinear 2x upsampling of an NCHW feature map."""
    return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


class UpConv(nn.Module):
    """Upsampling followed by a 2x2 convolution that halves the channel count (the paper's up-conv)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a 2x2 kernel shrinks the map by one: pad right and bottom so the size is kept
        return self.conv(F.pad(upsample2x(x), (0, 1, 0, 1)))


class UpLevel(nn.Module):
    """One level of the expanding path: up-conv, concatenation with the skip map, DoubleConv."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.up = UpConv(in_channels, out_channels)
        self.conv = DoubleConv(2 * out_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    """U-Net with four down levels, a bottleneck and four up levels (Ronneberger 2015).

    Input `(N, in_channels, H, W)` with H and W divisible by 16; output class scores
    `(N, num_classes, H, W)`. Level i has `base_width * 2**i` channels; the bottleneck has
    `base_width * 16`.
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 2, base_width: int = 64) -> None:
        super().__init__()
        widths = [base_width * 2**i for i in range(5)]
        ins = [in_channels, *widths[:3]]
        self.downs = nn.ModuleList(DoubleConv(ins[i], widths[i]) for i in range(4))
        self.bottleneck = DoubleConv(widths[3], widths[4])
        self.ups = nn.ModuleList(UpLevel(widths[i + 1], widths[i]) for i in reversed(range(4)))
        self.head = nn.Conv2d(widths[0], num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
            x = F.max_pool2d(x, kernel_size=2)
        x = self.bottleneck(x)
        for up in self.ups:
            x = up(x, skips.pop())
        return self.head(x)
