"""A 2-layer LSTM language model (`magis.capture.models.rnn_lm`): embedding -> nn.LSTM -> linear
-> cross-entropy.

`factory()` builds it at a training size (batch 64 x 256 tokens, hidden 1,024, 10k words) for
the command line; magis builds it under fake tensors, so nothing is allocated:

    magis analyze examples/lstm_lm.py:factory
    magis optimize examples/lstm_lm.py:factory --lat-limit 1.10 --time-budget 60

On a CPU in float32, nn.LSTM runs one fused oneDNN kernel per layer (`mkldnn_rnn_layer`, its
backward `mkldnn_rnn_layer_backward`), each keeping a training workspace of about 1 GB at this
size from the forward to the backward. `cell="gru"` builds the same model with nn.GRU, which
PyTorch runs step by step on a CPU (no fused kernel).
"""

from __future__ import annotations

import torch

from magis.capture.models.rnn_lm import RecurrentLM


def factory(
    batch: int = 64,
    seq: int = 256,
    hidden: int = 1024,
    vocab: int = 10_000,
    layers: int = 2,
    cell: str = "lstm",
):
    """The model and one batch of random tokens and targets."""
    model = RecurrentLM(vocab, hidden, layers, cell)
    tokens = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    return model, (tokens, targets)
