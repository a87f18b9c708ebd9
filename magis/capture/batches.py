"""The zoo's example batches and losses, written as each task's users write them.

Classification: images and class labels, cross-entropy; segmentation: images and per-pixel class
ids; language models: token ids whose labels the loss shifts (causal) or predicts in place
(masked). Losses are computed from the logits in at least float32, never by the Hugging Face
heads (whose label checks are data-dependent under fake tensors).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def image_labels(
    batch: int, *, channels: int, image_size: int, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (N, C, H, W), class labels (N,))."""
    images = torch.randn(batch, channels, image_size, image_size)
    labels = torch.randint(0, num_classes, (batch,))
    return images, labels


def image_masks(
    batch: int, *, channels: int, image_size: int, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (N, C, H, W), per-pixel class ids (N, H, W))."""
    images = torch.randn(batch, channels, image_size, image_size)
    masks = torch.randint(0, num_classes, (batch, image_size, image_size))
    return images, masks


def tokens(batch: int, *, seq_len: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids (N, T), labels (N, T)); the labels are a copy of the ids (the loss shifts them)."""
    ids = torch.randint(0, vocab_size, (batch, seq_len))
    return ids, ids.clone()


# ---------------------------------------------------------------------------------------------
# losses


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output: a tensor, or a Hugging Face ModelOutput's `.logits`."""
    logits = output if isinstance(output, torch.Tensor) else output.logits
    # losses in at least float32, as mixed-precision training does
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def cross_entropy_loss(output: Any, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits (N, C) or (N, C, H, W) against class ids (N,) or (N, H, W)."""
    del inputs
    return F.cross_entropy(logits_of(output), target)


def masked_lm_loss(output: Any, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-level cross-entropy of logits (N, T, V) against labels (N, T) at every position."""
    del input_ids
    logits = logits_of(output)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def causal_lm_loss(output: Any, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits at position t predict labels at t + 1."""
    del input_ids
    logits = logits_of(output)[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
