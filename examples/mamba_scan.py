"""Mamba-130m through transformers' PyTorch path: a step of about 100,000 ATen ops.

Without the `mamba_ssm` CUDA kernels, transformers runs Mamba's selective scan as a Python loop
over the sequence, so the captured step unrolls it: about 760 nodes per token for the 24 layers
(forward and backward). At the default 8 x 124 tokens that is a 100,000-node step (issue 46's
"long unrolled loops"); the corpus's `corpus:mamba` is the same model at 32 tokens.

    magis analyze examples/mamba_scan.py:factory
    magis optimize examples/mamba_scan.py:factory --lat-limit 1.10 --time-budget 60

magis builds it under fake tensors (random init, nothing downloaded, nothing allocated).
"""

from __future__ import annotations

import torch
from transformers import MambaConfig, MambaForCausalLM


def factory(batch: int = 8, seq: int = 124, layers: int = 24):
    """Mamba-130m (hidden 768, vocabulary 50,280, tied embeddings) and a batch of tokens; the
    model's own next-token loss (`labels=`)."""
    config = MambaConfig(
        vocab_size=50280,
        hidden_size=768,
        num_hidden_layers=layers,
        use_cache=False,
        tie_word_embeddings=True,
    )
    model = MambaForCausalLM(config)
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    return model, {"input_ids": tokens, "labels": tokens}
