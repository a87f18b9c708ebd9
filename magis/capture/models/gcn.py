"""A graph convolutional network in plain PyTorch: message passing by gather and scatter-add.

Kipf and Welling, "Semi-Supervised Classification with Graph Convolutional Networks", ICLR 2017
(arXiv:1609.02907), Eq. 2: H' = act(Â H W), with Â the normalized adjacency given here as a
list of edges (source, destination) and one weight per edge. Written as graph libraries run it
(PyG's `MessagePassing`, DGL's `update_all`): a linear layer on the nodes, the source node's
features gathered for every edge (`index_select`), a message per edge (the features times the
edge's weight), and the messages scatter-added into their destination nodes (`index_add_` into
zeros). The edge tensors, |E| x hidden, are what a full-graph training step's peak is made of:
at 4M edges and 200k nodes they are twenty times the node features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GCNConfig:
    """GCN sizes; the defaults are a full-graph training step at the scale of ogbn-products
    (2.4M nodes, 62M edges) cut to 200k nodes and 4M edges."""

    nodes: int = 200_000
    edges: int = 4_000_000
    features: int = 128
    hidden: int = 128
    classes: int = 47
    layers: int = 3


class GCN(nn.Module):
    """`layers` graph convolutions (ReLU between them) and a cross-entropy loss over the nodes."""

    def __init__(self, config: GCNConfig) -> None:
        super().__init__()
        c = config
        sizes = [c.features] + [c.hidden] * (c.layers - 1) + [c.classes]
        self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False))

    def forward(
        self, x: torch.Tensor, edges: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """The loss of node features `x` (nodes, features) over `edges` (2, E: source and
        destination) weighted by `weight` (E,), against `labels` (nodes,)."""
        h = x
        for i, lin in enumerate(self.lins):
            h = propagate(lin(h), edges, weight)
            if i < len(self.lins) - 1:
                h = torch.relu(h)
        return F.cross_entropy(h, labels)


# The ways graph code writes Â h: the gather is `index_select` or indexing (h[src]), the scatter
# `index_add` into zeros or into h itself (a self-loop), `scatter_add` or an accumulating
# `index_put`; each captures as a different pair of ATen ops, forward and backward.
SCATTERS = ("index_add", "self_loop", "scatter_add", "index_put", "index")


def propagate(
    h: torch.Tensor, edges: torch.Tensor, weight: torch.Tensor, how: str = "index_add"
) -> torch.Tensor:
    """Â h: each edge's message (its source's features times its weight) summed into its
    destination, written the `how` way (one of SCATTERS; "self_loop" adds h itself)."""
    src, dst = edges[0], edges[1]
    gathered = h[src] if how == "index" else h.index_select(0, src)
    messages = gathered * weight.unsqueeze(-1)
    if how == "scatter_add":
        return torch.zeros_like(h).scatter_add_(0, dst.unsqueeze(-1).expand_as(messages), messages)
    if how == "index_put":
        return torch.zeros_like(h).index_put_((dst,), messages, accumulate=True)
    if how == "self_loop":
        return h.index_add(0, dst, messages)
    return h.new_zeros(h.shape).index_add_(0, dst, messages)


def gcn_batch(config: GCNConfig, generator: torch.Generator | None = None) -> tuple:
    """Random node features, edges, edge weights and labels of `config`'s sizes."""
    c = config
    edges = torch.randint(0, c.nodes, (2, c.edges), generator=generator)
    weight = torch.rand(c.edges, generator=generator) / 8
    x = torch.randn(c.nodes, c.features, generator=generator)
    labels = torch.randint(0, c.classes, (c.nodes,), generator=generator)
    return x, edges, weight, labels
