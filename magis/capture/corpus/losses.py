"""The corpus's losses, written as each library's users write them, and its example batches.

Hugging Face heads compute their own loss from `labels=` (a causal LM shifts the labels, a
masked LM predicts them in place, an encoder-decoder shifts them into decoder inputs); an image
classifier in a torchvision-style loop is `F.cross_entropy(logits, y)`; a diffusion model is
trained on the MSE between the noise it predicts and the noise that was added (diffusers'
training scripts). Batches are drawn from a seeded generator, in the default dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from magis.capture.corpus.base import Batch, Size

# --- losses ----------------------------------------------------------------------------------


def lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face causal or masked LM: the head computes the loss from `labels=`."""
    return model(input_ids=input_ids, labels=labels).loss


def seq2seq_loss(model: nn.Module, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """An encoder-decoder with two inputs: source ids, and target ids as `labels=`."""
    return model(input_ids=source, labels=target).loss


def image_classification_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the classifier's logits, as a training loop over images writes it."""
    out = model(pixel_values=x) if _is_hf(model) else model(x)
    return F.cross_entropy(out.logits if _is_hf(model) else out, y)


def labels_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """An image model's own loss from `labels=` (classification, or per-pixel segmentation)."""
    return model(pixel_values=x, labels=y).loss


def speech_seq2seq_loss(
    model: nn.Module, features: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Whisper: log-mel features in, transcript ids as `labels=` (shifted into the decoder)."""
    return model(input_features=features, labels=labels).loss


def contrastive_loss(
    model: nn.Module, input_ids: torch.Tensor, pixel_values: torch.Tensor
) -> torch.Tensor:
    """CLIP: text and images in, the symmetric contrastive loss from `return_loss=True`."""
    return model(input_ids=input_ids, pixel_values=pixel_values, return_loss=True).loss


@dataclass(frozen=True)
class DiffusionLoss:
    """DDPM training (Ho et al. 2020), as diffusers' training scripts write it: noise the clean
    sample to step t with the scheduler, predict the noise, take the MSE in float32.

    The noise and the steps are inputs of the batch (drawn by the loop, outside the step), and
    a conditional U-Net's text embeddings are one more input."""

    train_timesteps: int = 1000

    def __call__(
        self,
        model: nn.Module,
        clean: torch.Tensor,
        noise: torch.Tensor,
        timesteps: torch.Tensor,
        *condition: torch.Tensor,
    ) -> torch.Tensor:
        noisy = self.scheduler.add_noise(clean, noise, timesteps)
        if condition:
            prediction = model(noisy, timesteps, encoder_hidden_states=condition[0]).sample
        else:
            prediction = model(noisy, timesteps).sample
        return F.mse_loss(prediction.float(), noise.float())

    @functools.cached_property
    def scheduler(self) -> Any:
        """The noise schedule, made once and outside any fake or tracing mode, as a training
        script makes it before its loop: its tables are constants of the step, not ops in it."""
        from diffusers import DDPMScheduler

        with _disable_current_modes():
            return DDPMScheduler(num_train_timesteps=self.train_timesteps)


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "post_init")


# --- batches ---------------------------------------------------------------------------------


def _ids(vocab: int, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=gen)


def _floats(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(torch.get_default_dtype())


def token_batch(config: Any, size: Size, batch: int, gen: torch.Generator) -> Batch:
    """(input_ids, labels): the labels are the ids (the LM heads shift or mask as they do)."""
    ids = _ids(config.vocab_size, (batch, size.length), gen)
    return ids, ids.clone()


def seq2seq_batch(config: Any, size: Size, batch: int, gen: torch.Generator) -> Batch:
    """(source ids, target ids)."""
    src = _ids(config.vocab_size, (batch, size.length), gen)
    return src, _ids(config.vocab_size, (batch, size.target), gen)


def image_batch(config: Any, size: Size, batch: int, gen: torch.Generator) -> Batch:
    """(images in the default dtype, class labels)."""
    x = _floats((batch, config.num_channels, size.length, size.length), gen)
    return x, torch.randint(0, config.num_labels, (batch,), generator=gen)


def mask_batch(config: Any, size: Size, batch: int, gen: torch.Generator) -> Batch:
    """(images, per-pixel class ids at full resolution)."""
    x = _floats((batch, config.num_channels, size.length, size.length), gen)
    masks = torch.randint(0, config.num_labels, (batch, size.length, size.length), generator=gen)
    return x, masks


def speech_batch(config: Any, size: Size, batch: int, gen: torch.Generator) -> Batch:
    """(log-mel features (N, mels, frames): `length` frames, transcript ids of `target`)."""
    features = _floats((batch, config.num_mel_bins, size.length), gen)
    return features, _ids(config.vocab_size, (batch, size.target), gen)


def text_image_batch(config: Any, size: Size, batch: int, gen: torch.Generator) -> Batch:
    """(caption ids of `target` tokens, images of side `length`)."""
    ids = _ids(config.text_config.vocab_size, (batch, size.target), gen)
    vision = config.vision_config
    return ids, _floats((batch, vision.num_channels, size.length, size.length), gen)


def diffusion_batch(config: Any, size: Size, batch: int, gen: torch.Generator) -> Batch:
    """(clean samples, noise, steps in [0, 1000)) and, for a U-Net with cross-attention, the
    text encoder's states (`target` tokens of `cross_attention_dim`)."""
    shape = (batch, config.in_channels, size.length, size.length)
    clean, noise = _floats(shape, gen), _floats(shape, gen)
    steps = torch.randint(0, DiffusionLoss.train_timesteps, (batch,), generator=gen)
    cross = getattr(config, "cross_attention_dim", None)
    if cross is None:
        return clean, noise, steps
    return clean, noise, steps, _floats((batch, size.target, cross), gen)


# --- speech recognition (CTC) ----------------------------------------------------------------


def ctc_loss(model: nn.Module, audio: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A CTC head's loss written from its logits, as the head's own `labels=` path computes it
    (labels padded with -100, lengths from the labels >= 0, log-probabilities in float32, the
    config's reduction and zero_infinity), with the targets kept padded 2-D: the `labels=`
    path checks `labels.max()` in Python and `masked_select`s the unpadded labels, neither of
    which a static graph holds. Every frame counts (the batch's clips are all full length)."""
    config = model.config
    logits = model(input_values=audio).logits
    log_probs = F.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
    frames, batch = log_probs.shape[:2]
    input_lengths = torch.full((batch,), frames, dtype=torch.long)
    real = labels >= 0
    targets = labels.masked_fill(~real, config.pad_token_id)
    return F.ctc_loss(
        log_probs,
        targets,
        input_lengths,
        real.sum(-1),
        blank=config.pad_token_id,
        reduction=config.ctc_loss_reduction,
        zero_infinity=config.ctc_zero_infinity,
    )


def audio_batch(config: Any, size: Size, batch: int, gen: torch.Generator) -> Batch:
    """(raw audio (N, `length` samples), transcripts of `target` characters padded with -100
    after a length drawn in [target / 2, target]); characters avoid the blank (padding id)."""
    audio = _floats((batch, size.length), gen)
    chars = 1 + _ids(config.vocab_size - 1, (batch, size.target), gen)
    chars = (chars + config.pad_token_id) % config.vocab_size
    lengths = torch.randint(max(size.target // 2, 1), size.target + 1, (batch, 1), generator=gen)
    return audio, chars.masked_fill(torch.arange(size.target) >= lengths, -100)
