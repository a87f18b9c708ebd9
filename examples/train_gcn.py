"""A graph convolutional network trained on the whole graph: `magis optimize` on message passing.

`factory()` is a three-layer GCN (`magis.capture.models.gcn`) over 200,000 nodes and 4,000,000
edges with 128 hidden features, the step a full-graph GCN trains with; its peak is the edge
tensors (messages gathered per edge before they are scatter-added into the nodes), which fission
splits along the edges:

    magis optimize examples/train_gcn.py:factory --lat-limit 1.10 --time-budget 120
    magis optimize examples/train_gcn.py:factory --mem-limit 0.4 --time-budget 120

`factory(nodes=..., edges=...)` sets a smaller graph.
"""

from __future__ import annotations

import torch

from magis.capture.models.gcn import GCN, GCNConfig, gcn_batch


def factory(nodes: int = 200_000, edges: int = 4_000_000, hidden: int = 128):
    """The GCN and a random graph of `nodes` nodes and `edges` edges; the model returns the loss."""
    config = GCNConfig(nodes=nodes, edges=edges, hidden=hidden)
    return GCN(config), gcn_batch(config, torch.Generator().manual_seed(0))
