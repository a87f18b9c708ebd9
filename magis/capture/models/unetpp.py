"""U-Net++: U-Net with nested, dense skip pathways.

Zhou, Rahman Siddiquee, Tajbakhsh, Liang, "UNet++: A Nested U-Net Architecture for Medical Image
Segmentation", DLMIA 2018 (arXiv:1807.10165).

Nodes X^{i,j} (paper Fig. 1a, Eq. 1): i is the down-sampling level (0..depth), j the position along
the skip pathway. The backbone encoder is the column j = 0:

    X^{i,0} = H(D(X^{i-1,0}))                      (H(x) for i = 0)
    X^{i,j} = H([X^{i,0}, ..., X^{i,j-1}, U(X^{i+1,j-1})])   for j > 0

where H is the convolution block (two 3x3 conv + BatchNorm + ReLU, as in our U-Net), D a 2x2
max-pool, U a bilinear 2x upsampling and [.] channel concatenation. With depth 4 there are five
levels and the output is a 1x1 convolution on X^{0,4} (deep supervision off). Level i has
`base_width * 2**i` channels; the paper and its reference code use base width 32 (~9.0M
parameters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from magis.capture.models.unet import DoubleConv, upsample2x


def _node(i: int, j: int) -> str:
    return f"x{i}_{j}"


class UNetPlusPlus(nn.Module):
    """U-Net++ with nested dense skip pathways, one head on X^{0,depth} (Zhou 2018).

    Input `(N, in_channels, H, W)` with H and W divisible by `2**depth`; output class scores
    `(N, num_classes, H, W)`.
    """

    def __init__(
        self, in_channels: int = 3, num_classes: int = 2, base_width: int = 32, depth: int = 4
    ) -> None:
        super().__init__()
        self.depth = depth
        widths = [base_width * 2**i for i in range(depth + 1)]
        blocks: dict[str, nn.Module] = {}
        for i in range(depth + 1):
            blocks[_node(i, 0)] = DoubleConv(in_channels if i == 0 else widths[i - 1], widths[i])
        for j in range(1, depth + 1):
            for i in range(depth + 1 - j):
                blocks[_node(i, j)] = DoubleConv(j * widths[i] + widths[i + 1], widths[i])
        self.blocks = nn.ModuleDict(blocks)
        self.head = nn.Conv2d(widths[0], num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes: dict[tuple[int, int], torch.Tensor] = {(0, 0): self.blocks[_node(0, 0)](x)}
        for i in range(1, self.depth + 1):
            pooled = F.max_pool2d(nodes[(i - 1, 0)], kernel_size=2)
            nodes[(i, 0)] = self.blocks[_node(i, 0)](pooled)
        for j in range(1, self.depth + 1):
            for i in range(self.depth + 1 - j):
                inputs = [nodes[(i, k)] for k in range(j)]
                inputs.append(upsample2x(nodes[(i + 1, j - 1)]))
                nodes[(i, j)] = self.blocks[_node(i, j)](torch.cat(inputs, dim=1))
        return self.head(nodes[(0, self.depth)])
