"""BTLM-3B: a GPT-style decoder-only language model with ALiBi and SwiGLU.

Dey et al., "BTLM-3B-8K: 7B Parameter Performance in a 3B Parameter Model", Cerebras 2023
(arXiv:2309.11568), Sec. 2: a GPT-3-style decoder with 32 layers, hidden size 2560, 32 heads,
SwiGLU feed-forward of width 6826 (Shazeer, "GLU Variants Improve Transformer", arXiv:2002.05202),
ALiBi position biases instead of learned positions (Press, Smith, Lewis, "Train Short, Test Long",
arXiv:2108.12409), the GPT-2 vocabulary of 50257 tokens and tied input/output embeddings
(~2.6B parameters). muP scaling of the paper is left out: it changes multipliers, not the graph
structure.

Attention is written with plain matmul/softmax (no fused SDPA kernel) so that it captures as
ordinary ATen ops; the causal mask and ALiBi bias are built from shapes (`arange`, `ones().triu`),
with no data-dependent Python control flow, so the model traces under `make_fx`/`FakeTensorMode`.
Tensors made in `forward` take their dtype from the activations, never a hard-coded float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BTLMConfig:
    """Hyper-parameters of BTLM; the defaults are BTLM-3B-8K (Dey et al. 2023, Table 1)."""

    vocab_size: int = 50257
    hidden_size: int = 2560
    num_layers: int = 32
    num_heads: int = 32
    ffn_size: int = 6826
    layer_norm_eps: float = 1e-5
    dropout: float = 0.0
    bias: bool = True
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )


def alibi_slopes(num_heads: int) -> list[float]:
    """Per-head ALiBi slopes (Press et al. 2022, Sec. 3).

    For n heads, n a power of two, the slopes are the geometric sequence starting at and with ratio
    2^(-8/n). Otherwise the n' = 2^floor(log2 n) slopes are followed by every other slope of the
    2n' sequence, as in the reference implementation.
    """

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return geometric(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return geometric(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with an additive bias (ALiBi + causal mask)."""

    def __init__(self, config: BTLMConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.bias)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        """`x`: (B, T, C); `attn_bias`: (H, T, T) added to the scores (-inf where masked)."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.num_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim)) + attn_bias
        probs = self.attn_dropout(torch.softmax(scores, dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(b, t, c)
        return self.resid_dropout(self.proj(y))


class SwiGLU(nn.Module):
    """SwiGLU feed-forward: W3(SiLU(x W1) * (x W2)) (Shazeer 2020)."""

    def __init__(self, config: BTLMConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.ffn_size, bias=config.bias)
        self.w2 = nn.Linear(config.hidden_size, config.ffn_size, bias=config.bias)
        self.w3 = nn.Linear(config.ffn_size, config.hidden_size, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w3(F.silu(self.w1(x)) * self.w2(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer decoder block."""

    def __init__(self, config: BTLMConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), attn_bias)
        return x + self.mlp(self.ln2(x))


class BTLM(nn.Module):
    """BTLM decoder-only LM: token ids (B, T) -> next-token logits (B, T, vocab)."""

    def __init__(self, config: BTLMConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or BTLMConfig()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # slopes as a buffer (an input of the captured graph, not a baked-in constant)
        slopes = torch.tensor(alibi_slopes(config.num_heads)).view(-1, 1, 1)
        self.register_buffer("alibi_slopes", slopes, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 style initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def attention_bias(self, seq_len: int, like: torch.Tensor) -> torch.Tensor:
        """ALiBi bias -slope * (i - j) for key j <= query i, -inf above the diagonal: (H, T, T)."""
        pos = torch.arange(seq_len, device=like.device)
        distance = (pos.view(1, -1) - pos.view(-1, 1)).to(like.dtype)  # j - i
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=like.device).triu(1)
        bias = self.alibi_slopes.to(like.dtype) * distance
        return bias.masked_fill(causal, float("-inf"))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(input_ids))
        attn_bias = self.attention_bias(input_ids.shape[1], x)
        for block in self.blocks:
            x = block(x, attn_bias)
        x = self.ln_f(x)
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight)
