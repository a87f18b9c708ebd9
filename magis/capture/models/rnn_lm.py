"""A recurrent language model: embedding -> nn.LSTM (or nn.GRU) -> linear -> cross-entropy.

The shape of the word-level LMs of Zaremba et al. (2014) and of PyTorch's word_language_model
example, used by `examples/lstm_lm.py` and the corpus's "lstm_lm" entry. On a CPU in float32
nn.LSTM runs one fused oneDNN kernel per layer (`mkldnn_rnn_layer`), which keeps a training
workspace from the forward to the backward; in float64, and for nn.GRU, PyTorch runs the
cells step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RecurrentLMConfig:
    """Sizes of a recurrent LM; the defaults are a 2-layer LSTM LM at hidden 1,024, 10k words."""

    vocab: int = 10_000
    hidden: int = 1024
    layers: int = 2
    cell: str = "lstm"


class RecurrentLM(nn.Module):
    """Tokens (batch, time) and next tokens -> the mean cross-entropy."""

    def __init__(self, vocab: int, hidden: int, layers: int, cell: str = "lstm") -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.rnn = rnn(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    @classmethod
    def from_config(cls, config: RecurrentLMConfig) -> RecurrentLM:
        return cls(config.vocab, config.hidden, config.layers, config.cell)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        states, _ = self.rnn(self.embed(tokens))
        logits = self.head(states)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
