"""The workload zoo: the training workloads of the MAGIS evaluation, at three sizes.

MAGIS (Chen et al., "MAGIS: Memory Optimization via Coordinated Graph Transformation and
Scheduling for DNN", ASPLOS 2024), Table 2: ResNet-50, BERT-base, ViT-base, U-Net, U-Net++,
GPT-Neo-1.3B and BTLM-3B. Each family comes in three sizes:

- ``paper``: the model and batch of the paper (``NAME``, or ``NAME:paper``). Meant to be built and
  traced under ``FakeTensorMode``, where nothing is allocated. The two LLMs are bfloat16, the rest
  float32.
- ``tiny`` (``NAME:tiny``): same classes and structure, a forward+backward takes milliseconds on a
  CPU; float32 (tests also run them in float64).
- ``small`` (``NAME:small``): one training step takes about a second or a few on a 2-core CPU in
  float32; for eager measurements.

Calling convention (every workload)::

    model = wl.build()                      # build_model() with default dtype wl.dtype
    inputs = wl.make_inputs(wl.batch)        # (x, y): model input, target
    output = model(inputs[0])
    loss = wl.loss_fn(output, *inputs)      # a scalar

``inputs`` is ``(images, labels)`` for classification (labels ``(N,)`` int64), ``(images, masks)``
for segmentation (masks ``(N, H, W)`` int64 class ids) and ``(token_ids, labels)`` for the language
models (``labels`` is the token ids themselves: the causal-LM loss shifts them by one, the BERT
masked-LM loss predicts every position). Images are made with ``torch.randn`` in the default dtype,
ids with ``torch.randint``; both are deterministic under ``torch.manual_seed`` and become fake
tensors inside a ``FakeTensorMode``.

``build_model()`` builds in the ambient default dtype: set ``torch.set_default_dtype(wl.dtype)``
around it (``module.to(torch.bfloat16)`` does not work on fake parameters), or call
``wl.build()``, which does that (``wl.build(torch.float64)`` for another dtype). Models are returned in
training mode with the dropout probabilities of their published configs (so dropout, where the
config has it, is captured as a random op). Hugging Face models are built from explicit configs
(random init, nothing downloaded) with eager attention, so attention captures as plain ops; the
losses are computed here from the logits, never by the HF heads (whose label checks are
data-dependent). ViT's truncated-normal initialisation uses a rejection loop that is
data-dependent under fake tensors; while a ViT is built, ``torch.nn.init``'s truncated normal is
swapped for the exact inverse-CDF method (no loop), which works in both modes. Like any
monkey-patch this is not thread-safe: do not build models concurrently from several threads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from magis.capture.batches import (
    causal_lm_loss,
    cross_entropy_loss,
    image_labels,
    image_masks,
    masked_lm_loss,
    tokens,
)
from magis.capture.building import build_for_training, default_dtype
from magis.errors import MagisError, UnknownWorkloadError

SIZES: tuple[str, ...] = ("paper", "tiny", "small")
WORKLOAD_FAMILIES: tuple[str, ...] = (
    "resnet50",
    "bert-base",
    "vit-base",
    "unet",
    "unetpp",
    "gpt-neo-1.3b",
    "btlm-3b",
)


@dataclass(frozen=True)
class Workload:
    """One training workload: a model factory, an input factory and a loss.

    See the module docstring for the calling convention.
    """

    name: str
    family: str
    size: str
    dtype: torch.dtype
    batch: int
    build_model: Callable[[], nn.Module]
    make_inputs: Callable[[int], tuple[torch.Tensor, ...]]
    loss_fn: Callable[..., torch.Tensor]
    description: str

    def build(self, dtype: torch.dtype | None = None) -> nn.Module:
        """`build_model()` with the default dtype set to `dtype` (default: `self.dtype`)."""
        with default_dtype(dtype or self.dtype):
            return self.build_model()


def get_workload(name: str, batch: int | None = None) -> Workload:
    """The workload called `name` ("FAMILY" for paper size, "FAMILY:tiny", "FAMILY:small").

    `batch` overrides the workload's batch size. Raises `UnknownWorkloadError` for an unknown name.
    `corpus:NAME` and `corpus:NAME:tiny` are the public corpus (`magis.capture.corpus`).
    """
    if name.strip().startswith("corpus:"):
        from magis.capture.corpus import workload_fields

        return _with_batch(Workload(**workload_fields(name)), batch)
    family, _, size = name.strip().partition(":")
    size = size or "paper"
    if family not in _FAMILIES or size not in SIZES:
        known = ", ".join(WORKLOAD_FAMILIES)
        raise UnknownWorkloadError(
            f"unknown workload '{name}'; known: {known} (each also as NAME:tiny or NAME:small)"
            " (run `magis workloads`), the public corpus as corpus:NAME (`magis workloads"
            " --corpus`), or your own: path/to/model.py:factory"
        )
    return _with_batch(_FAMILIES[family](size), batch)


def _with_batch(workload: Workload, batch: int | None) -> Workload:
    if batch is None:
        return workload
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise MagisError(f"batch must be a positive integer, got {batch!r}")
    return replace(workload, batch=batch)


def list_workloads() -> list[Workload]:
    """Every workload: all families, each at all sizes (paper, tiny, small)."""
    return [_FAMILIES[family](size) for family in WORKLOAD_FAMILIES for size in SIZES]


# ---------------------------------------------------------------------------------------------
# families


def _workload(family: str, size: str, **fields: Any) -> Workload:
    name = family if size == "paper" else f"{family}:{size}"
    return Workload(name=name, family=family, size=size, **fields)


def _resnet50_model(
    *, embedding_size: int, hidden_sizes: tuple[int, ...], depths: tuple[int, ...], num_classes: int
) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        num_channels=3,
        embedding_size=embedding_size,
        hidden_sizes=list(hidden_sizes),
        depths=list(depths),
        layer_type="bottleneck",
        hidden_act="relu",
        num_labels=num_classes,
    )
    return ResNetForImageClassification(config)


def _resnet50(size: str) -> Workload:
    """ResNet-50 (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016)."""
    p = {
        "paper": dict(batch=64, image=224, classes=1000, emb=64, hidden=(256, 512, 1024, 2048), depths=(3, 4, 6, 3)),
        "tiny": dict(batch=2, image=32, classes=10, emb=8, hidden=(16, 32, 64, 128), depths=(1, 1, 1, 1)),
        "small": dict(batch=16, image=128, classes=100, emb=64, hidden=(256, 512, 1024, 2048), depths=(3, 4, 6, 3)),
    }[size]  # fmt: skip
    factory = partial(
        _resnet50_model,
        embedding_size=p["emb"],
        hidden_sizes=p["hidden"],
        depths=p["depths"],
        num_classes=p["classes"],
    )
    return _workload(
        "resnet50",
        size,
        dtype=torch.float32,
        batch=p["batch"],
        build_model=partial(build_for_training, factory),
        make_inputs=partial(
            image_labels, channels=3, image_size=p["image"], num_classes=p["classes"]
        ),
        loss_fn=cross_entropy_loss,
        description=(
            f"ResNet (He et al. 2016), bottleneck depths {list(p['depths'])}, widths "
            f"{list(p['hidden'])}; image classification {p['image']}x{p['image']}, "
            f"{p['classes']} classes"
        ),
    )


def _bert_model(
    *,
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    intermediate: int,
    max_positions: int,
) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        type_vocab_size=2,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        use_cache=False,
        attn_implementation="eager",
    )
    return BertForMaskedLM(config)


def _bert_base(size: str) -> Workload:
    """BERT-base (Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers", 2019)."""
    p = {
        "paper": dict(batch=32, seq=512, vocab=30522, hidden=768, layers=12, heads=12, ffn=3072, pos=512),
        "tiny": dict(batch=2, seq=16, vocab=128, hidden=32, layers=2, heads=2, ffn=64, pos=32),
        "small": dict(batch=16, seq=128, vocab=8192, hidden=384, layers=6, heads=6, ffn=1536, pos=128),
    }[size]  # fmt: skip
    factory = partial(
        _bert_model,
        vocab_size=p["vocab"],
        hidden=p["hidden"],
        layers=p["layers"],
        heads=p["heads"],
        intermediate=p["ffn"],
        max_positions=p["pos"],
    )
    return _workload(
        "bert-base",
        size,
        dtype=torch.float32,
        batch=p["batch"],
        build_model=partial(build_for_training, factory),
        make_inputs=partial(tokens, seq_len=p["seq"], vocab_size=p["vocab"]),
        loss_fn=masked_lm_loss,
        description=(
            f"BERT masked LM (Devlin et al. 2019), {p['layers']} layers, hidden {p['hidden']}, "
            f"{p['heads']} heads, seq {p['seq']}, vocab {p['vocab']}, dropout 0.1"
        ),
    )


def _vit_model(
    *,
    image_size: int,
    patch_size: int,
    hidden: int,
    layers: int,
    heads: int,
    intermediate: int,
    num_classes: int,
) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=image_size,
        patch_size=patch_size,
        num_channels=3,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=num_classes,
        attn_implementation="eager",
    )
    return ViTForImageClassification(config)


def _vit_base(size: str) -> Workload:
    """ViT-B/16 (Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021)."""
    p = {
        "paper": dict(batch=64, image=224, patch=16, hidden=768, layers=12, heads=12, ffn=3072, classes=1000),
        "tiny": dict(batch=2, image=32, patch=8, hidden=32, layers=2, heads=2, ffn=64, classes=10),
        "small": dict(batch=32, image=128, patch=16, hidden=384, layers=6, heads=6, ffn=1536, classes=100),
    }[size]  # fmt: skip
    factory = partial(
        _vit_model,
        image_size=p["image"],
        patch_size=p["patch"],
        hidden=p["hidden"],
        layers=p["layers"],
        heads=p["heads"],
        intermediate=p["ffn"],
        num_classes=p["classes"],
    )
    return _workload(
        "vit-base",
        size,
        dtype=torch.float32,
        batch=p["batch"],
        build_model=partial(build_for_training, factory, patch_trunc_normal=True),
        make_inputs=partial(
            image_labels, channels=3, image_size=p["image"], num_classes=p["classes"]
        ),
        loss_fn=cross_entropy_loss,
        description=(
            f"ViT (Dosovitskiy et al. 2021), {p['layers']} layers, hidden {p['hidden']}, "
            f"{p['heads']} heads, patch {p['patch']}; image classification "
            f"{p['image']}x{p['image']}, {p['classes']} classes"
        ),
    )


def _unet_model(*, base_width: int, num_classes: int) -> nn.Module:
    from magis.capture.models.unet import UNet

    return UNet(in_channels=3, num_classes=num_classes, base_width=base_width)


def _unetpp_model(*, base_width: int, num_classes: int) -> nn.Module:
    from magis.capture.models.unetpp import UNetPlusPlus

    return UNetPlusPlus(in_channels=3, num_classes=num_classes, base_width=base_width, depth=4)


_SEGMENTATION_CLASSES = 2


def _segmentation(family: str, size: str, sizes: Mapping[str, dict[str, int]]) -> Workload:
    """U-Net (Ronneberger et al. 2015) or U-Net++ (Zhou et al. 2018), per-pixel cross-entropy."""
    p = sizes[size]
    model = _unet_model if family == "unet" else _unetpp_model
    factory = partial(model, base_width=p["width"], num_classes=_SEGMENTATION_CLASSES)
    title = "U-Net (Ronneberger et al. 2015)" if family == "unet" else "U-Net++ (Zhou et al. 2018)"
    return _workload(
        family,
        size,
        dtype=torch.float32,
        batch=p["batch"],
        build_model=partial(build_for_training, factory),
        make_inputs=partial(
            image_masks, channels=3, image_size=p["image"], num_classes=_SEGMENTATION_CLASSES
        ),
        loss_fn=cross_entropy_loss,
        description=(
            f"{title}, base width {p['width']}; segmentation {p['image']}x{p['image']}, "
            f"{_SEGMENTATION_CLASSES} classes"
        ),
    )


def _unet(size: str) -> Workload:
    """U-Net (Ronneberger et al. 2015); paper base width 64."""
    sizes = {
        "paper": dict(batch=32, image=256, width=64),
        "tiny": dict(batch=2, image=32, width=4),
        "small": dict(batch=8, image=128, width=32),
    }
    return _segmentation("unet", size, sizes)


def _unetpp(size: str) -> Workload:
    """U-Net++ (Zhou et al. 2018); paper base width 32."""
    sizes = {
        "paper": dict(batch=16, image=256, width=32),
        "tiny": dict(batch=2, image=32, width=4),
        "small": dict(batch=8, image=128, width=16),
    }
    return _segmentation("unetpp", size, sizes)


def _gpt_neo_model(
    *,
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    window: int,
    max_positions: int,
) -> nn.Module:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        attention_types=[[["global", "local"], layers // 2]],
        window_size=window,
        max_position_embeddings=max_positions,
        intermediate_size=None,  # 4 * hidden
        activation_function="gelu_new",
        embed_dropout=0.0,
        attention_dropout=0.0,
        resid_dropout=0.0,
        layer_norm_epsilon=1e-5,
        use_cache=False,
        tie_word_embeddings=True,
        bos_token_id=vocab_size - 1,  # <|endoftext|> is the last GPT-2 token (50256)
        eos_token_id=vocab_size - 1,
        attn_implementation="eager",
    )
    return GPTNeoForCausalLM(config)


def _gpt_neo(size: str) -> Workload:
    """GPT-Neo 1.3B (Black et al. 2021), the config of EleutherAI/gpt-neo-1.3B."""
    p = {
        "paper": dict(batch=32, seq=512, vocab=50257, hidden=2048, layers=24, heads=16, window=256, pos=2048),
        "tiny": dict(batch=2, seq=16, vocab=128, hidden=32, layers=2, heads=2, window=8, pos=32),
        "small": dict(batch=8, seq=256, vocab=8192, hidden=384, layers=6, heads=6, window=64, pos=512),
    }[size]  # fmt: skip
    dtype = torch.bfloat16 if size == "paper" else torch.float32
    factory = partial(
        _gpt_neo_model,
        vocab_size=p["vocab"],
        hidden=p["hidden"],
        layers=p["layers"],
        heads=p["heads"],
        window=p["window"],
        max_positions=p["pos"],
    )
    return _workload(
        "gpt-neo-1.3b",
        size,
        dtype=dtype,
        batch=p["batch"],
        build_model=partial(build_for_training, factory),
        make_inputs=partial(tokens, seq_len=p["seq"], vocab_size=p["vocab"]),
        loss_fn=causal_lm_loss,
        description=(
            f"GPT-Neo causal LM (Black et al. 2021), {p['layers']} layers alternating "
            f"global/local (window {p['window']}) attention, hidden {p['hidden']}, "
            f"{p['heads']} heads, seq {p['seq']}, vocab {p['vocab']}, {_dtype_name(dtype)}"
        ),
    )


def _btlm_model(**config: Any) -> nn.Module:
    from magis.capture.models.btlm import BTLM, BTLMConfig

    return BTLM(BTLMConfig(**config))


def _btlm(size: str) -> Workload:
    """BTLM-3B-8K (Dey et al. 2023): ALiBi, SwiGLU, 32 layers, hidden 2560."""
    p = {
        "paper": dict(batch=32, seq=512, vocab=50257, hidden=2560, layers=32, heads=32, ffn=6826),
        "tiny": dict(batch=2, seq=16, vocab=128, hidden=32, layers=2, heads=4, ffn=86),
        "small": dict(batch=8, seq=256, vocab=8192, hidden=384, layers=6, heads=6, ffn=1024),
    }[size]  # fmt: skip
    dtype = torch.bfloat16 if size == "paper" else torch.float32
    factory = partial(
        _btlm_model,
        vocab_size=p["vocab"],
        hidden_size=p["hidden"],
        num_layers=p["layers"],
        num_heads=p["heads"],
        ffn_size=p["ffn"],
    )
    return _workload(
        "btlm-3b",
        size,
        dtype=dtype,
        batch=p["batch"],
        build_model=partial(build_for_training, factory),
        make_inputs=partial(tokens, seq_len=p["seq"], vocab_size=p["vocab"]),
        loss_fn=causal_lm_loss,
        description=(
            f"BTLM causal LM (Dey et al. 2023), ALiBi + SwiGLU, {p['layers']} layers, hidden "
            f"{p['hidden']}, {p['heads']} heads, FFN {p['ffn']}, seq {p['seq']}, "
            f"vocab {p['vocab']}, {_dtype_name(dtype)}"
        ),
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_FAMILIES: Mapping[str, Callable[[str], Workload]] = MappingProxyType(
    {
        "resnet50": _resnet50,
        "bert-base": _bert_base,
        "vit-base": _vit_base,
        "unet": _unet,
        "unetpp": _unetpp,
        "gpt-neo-1.3b": _gpt_neo,
        "btlm-3b": _btlm,
    }
)
