"""Diffusion U-Nets of the corpus, from diffusers' model classes and configs (random init).

`ddpm_unet` is the U-Net of diffusers' unconditional training example (`UNet2DModel`, DDPM: Ho
et al. 2020) on 64 x 64 images, b32; `sd_unet` is Stable Diffusion 1.x's `UNet2DConditionModel`
(Rombach et al. 2022) on 64 x 64 latents (512 px images), b8, with 77 CLIP text states as a
third input through cross-attention. Both are trained on the DDPM noise-prediction MSE
(`DiffusionLoss`); attention runs through diffusers' plain `AttnProcessor` (matmuls and a
softmax, not a fused SDPA kernel).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

from torch import nn

from magis.capture.corpus.base import FULL, TINY, Architecture, Size
from magis.capture.corpus.losses import DiffusionLoss, diffusion_batch

DIFFUSION = "diffusion U-Net"


def _config(**fixed: Any) -> Callable[[Mapping[str, Any]], Any]:
    def make(overrides: Mapping[str, Any]) -> Any:
        return SimpleNamespace(**{**fixed, **overrides})

    return make


def _diffusers_model(model_cls: str) -> Callable[[Any], nn.Module]:
    def make(config: Any) -> nn.Module:
        import diffusers
        from diffusers.models.attention_processor import Attention, AttnProcessor

        model = getattr(diffusers, model_cls)(**vars(config))
        for module in model.modules():
            if isinstance(module, Attention):
                module.set_processor(AttnProcessor())
        return model

    return make


_TINY_UNET = {"block_out_channels": (8, 16), "layers_per_block": 1, "norm_num_groups": 4}

DIFFUSION_MODELS: tuple[Architecture, ...] = (
    Architecture(
        "ddpm_unet",
        DIFFUSION,
        "DDPM U-Net (diffusers' UNet2DModel of its unconditional training example): ResNet "
        "blocks with group norm, SiLU and a time embedding, self-attention at 4x4 downsampling, "
        "skip concatenations",
        _config(
            in_channels=3,
            out_channels=3,
            layers_per_block=2,
            block_out_channels=(128, 128, 256, 256, 512, 512),
            down_block_types=("DownBlock2D",) * 4 + ("AttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "AttnUpBlock2D") + ("UpBlock2D",) * 4,
        ),
        _diffusers_model("UNet2DModel"),
        diffusion_batch,
        DiffusionLoss(),
        {
            FULL: Size({"sample_size": 64}, batch=32, length=64),
            TINY: Size(
                {
                    "sample_size": 8,
                    **_TINY_UNET,
                    "attention_head_dim": 4,
                    "down_block_types": ("DownBlock2D", "AttnDownBlock2D"),
                    "up_block_types": ("AttnUpBlock2D", "UpBlock2D"),
                },
                batch=2,
                length=8,
            ),  # fmt: skip
        },
    ),
    Architecture(
        "sd_unet",
        DIFFUSION,
        "Stable Diffusion 1.x U-Net (UNet2DConditionModel): cross-attention to 77 text states "
        "(a third input), transformer blocks at three resolutions, 4-channel latents",
        _config(in_channels=4, out_channels=4, cross_attention_dim=768),
        _diffusers_model("UNet2DConditionModel"),
        diffusion_batch,
        DiffusionLoss(),
        {
            FULL: Size({"sample_size": 64}, batch=8, length=64, target_length=77),
            TINY: Size(
                {
                    "sample_size": 8,
                    **_TINY_UNET,
                    "cross_attention_dim": 8,
                    "attention_head_dim": 4,
                    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
                    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
                },
                batch=2,
                length=8,
                target_length=6,
            ),  # fmt: skip
        },
    ),
)
