"""The architectures `magis bench coverage` sweeps, and each one built tiny with a batch.

An architecture is a model class of an installed library that trains with a loss: a class of
transformers' task mappings (`TASKS`, from causal LM to audio classification), or a diffusers
model (`magis.bench.coverage_diffusers`). Each is named by its library and class, so a worker
process builds it from the name alone.

Each is built at a tiny configuration derived from its config class (`coverage_configs`):
there is no table of per-model settings, and what the derivation misses is a failure row of the
sweep.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from magis.bench.coverage_configs import (
    BATCH,
    DERIVATIONS,
    IMAGE,
    LENGTH,
    tiny_config,
    without_random_choices,
)
from magis.errors import MagisError

TRANSFORMERS, DIFFUSERS = "transformers", "diffusers"

# transformers' task mappings swept, each with the batch its head trains on
TASKS = (
    "CAUSAL_LM",
    "MASKED_LM",
    "SEQ_TO_SEQ_CAUSAL_LM",
    "SEQUENCE_CLASSIFICATION",
    "TOKEN_CLASSIFICATION",
    "IMAGE_CLASSIFICATION",
    "CTC",
    "AUDIO_CLASSIFICATION",
    "SPEECH_SEQ_2_SEQ",
)

TARGET_LENGTH, AUDIO_SAMPLES, LABEL_LENGTH = 8, 4000, 4


# the config attributes that give an audio feature's width (mel bins per frame)
# (the width of the features a conformer's projection takes first: SeamlessM4T's and
# Wav2Vec2-BERT's stack two frames of 80 bins, 160)
MEL_BINS = (
    "feature_projection_input_dim",
    "num_mel_bins",
    "input_feat_per_channel",
    "feature_size",
)
# the main inputs of floats (the others are token ids)
FEATURE_INPUTS = ("pixel_values", "input_values", "input_features")

# Heads that classify a whole input: their loss is chosen by `config.problem_type`, which left
# unset is inferred from the labels (some heads, DeBERTa's, then select the labelled rows by
# value, `nonzero`); set, every head takes the static cross-entropy path.
SINGLE_LABEL = ("SEQUENCE_CLASSIFICATION", "IMAGE_CLASSIFICATION", "AUDIO_CLASSIFICATION")


class NoTrainingHeadError(MagisError):
    """A class of a training mapping whose forward takes no labels and computes no loss (an
    inference-only head): it is counted apart, not as a failure."""


@dataclass(frozen=True)
class Architecture:
    """A model class of a library that trains with a loss, and the batch kind it takes."""

    library: str
    name: str  # the class name: BertForMaskedLM, UNet2DModel
    task: str  # a TASKS entry, or the diffusers input convention

    @property
    def label(self) -> str:
        return f"{self.library}:{self.name}"


@dataclass(frozen=True)
class Case:
    """A tiny model in training mode, its batch by keyword, and `loss_fn(model, **batch)`."""

    model: torch.nn.Module
    batch: dict[str, torch.Tensor]
    loss_fn: Callable[..., torch.Tensor] | None  # None: the model's own `.loss`


def transformers_architectures() -> list[Architecture]:
    """Every class of transformers' task mappings in `TASKS`, once (its first task)."""
    from transformers.models.auto import modeling_auto

    seen: dict[str, Architecture] = {}
    for task in TASKS:
        names = getattr(modeling_auto, f"MODEL_FOR_{task}_MAPPING_NAMES", {})
        for cls in names.values():
            for name in (cls,) if isinstance(cls, str) else cls:
                seen.setdefault(name, Architecture(TRANSFORMERS, name, task))
    return sorted(seen.values(), key=lambda a: a.name)


def build_transformers_case(arch: Architecture, dtype: torch.dtype, seed: int = 0) -> Case:
    """The architecture at its tiny config in `dtype`, seeded, with a batch for its task: the
    first derivation and batch layout on which the training loss runs eagerly (the tiny
    derivation, then the roomy and wide ones: `DERIVATIONS`; `_layouts`), else the tiny one's
    last layout, whose error the sweep records."""
    import transformers

    cls = getattr(transformers, arch.name)
    loss = ctc_loss if arch.task == "CTC" else None
    fallback: Case | None = None
    refused: Exception | None = None
    for derivation in DERIVATIONS:
        try:
            model, config = _tiny_model(cls, arch, dtype, seed, derivation)
        except Exception as exc:  # noqa: BLE001 - a refusal: the next derivation
            refused = refused or exc
            continue
        if loss is None and not _takes_labels(model):
            raise NoTrainingHeadError(
                f"{arch.name}.forward takes no labels: an inference-only head, with no loss to "
                "train"
            )
        for layout in _layouts(model, config):
            case = Case(model, _batch(arch.task, model, config, layout, dtype, seed), loss)
            if _loss_runs(model, case.batch, loss):
                return case
            fallback = case if derivation == "tiny" else fallback
    if fallback is None:
        assert refused is not None
        raise refused
    return fallback


def _tiny_model(
    cls: type, arch: Architecture, dtype: torch.dtype, seed: int, derivation: str
) -> tuple[torch.nn.Module, Any]:
    """`cls` built seeded at the config of `derivation` in `dtype`, in training mode."""
    config = tiny_config(cls.config_class(), derivation)
    if arch.task in SINGLE_LABEL and hasattr(config, "problem_type"):
        config.problem_type = "single_label_classification"
    if arch.task == "CAUSAL_LM" and hasattr(config, "is_decoder"):
        config.is_decoder = True  # an encoder's causal-LM head trains it as a decoder (BERT's)
    without_random_choices(config)  # the sub-configs' too
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        return cls(config).to(dtype).train(), config
    finally:
        torch.set_default_dtype(previous)


@dataclass(frozen=True)
class Layout:
    """How a batch is laid out: the main input's shape (None: token ids), the sequence's
    length, and the codebooks stacked in the batch (Musicgen's decoder takes `num_codebooks`
    rows of ids per sample, its labels [batch, length, codebooks])."""

    shape: tuple[int, ...] | None
    length: int = LENGTH
    codebooks: int = 0
    extras: bool = False  # the optional inputs of `EXTRAS` the forward names, given


def _layouts(model: torch.nn.Module, config: Any) -> list[Layout]:
    """The layouts a batch may take, most common first: the main input's shapes
    (`_main_input_shapes`); for token ids, also as many as the model's positions (Perceiver's
    masked LM decodes one query per position: its logits are that long whatever the input),
    and the codebooks stacked in the batch where the config names `num_codebooks`."""
    layouts = [Layout(shape) for shape in _main_input_shapes(model, config)]
    if layouts != [Layout(None)]:
        return layouts
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and LENGTH < positions <= 4 * LENGTH:
        layouts.append(Layout(None, positions))
    codebooks = getattr(config, "num_codebooks", None)
    if isinstance(codebooks, int) and codebooks > 1:
        layouts.append(Layout(None, LENGTH, codebooks))
    if set(EXTRAS) & set(inspect.signature(model.forward).parameters):
        layouts.append(Layout(None, extras=True))
    return layouts


# Optional inputs of token models that some heads need all the same: an image beside the text
# (GIT's loss skips the image's tokens in its logits), word boxes (BROS has no default
# layout), each made by its function from the config and the generator.
EXTRAS = ("pixel_values", "bbox")


def _extras(
    model: torch.nn.Module, config: Any, dtype: torch.dtype, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """The inputs of `EXTRAS` the model's forward names."""
    names = inspect.signature(model.forward).parameters
    extras: dict[str, torch.Tensor] = {}
    if "pixel_values" in names:
        vision = getattr(config, "vision_config", None) or config
        side = getattr(vision, "image_size", IMAGE)
        side = side if isinstance(side, int) else IMAGE
        channels = getattr(vision, "num_channels", 3)
        shape = (BATCH, channels, side, side)
        extras["pixel_values"] = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if "bbox" in names:  # (x0, y0, x1, y1) in 0..1000, each box's corners in order
        corners = torch.randint(0, 1001, (BATCH, LENGTH, 2, 2), generator=gen).sort(dim=2)
        extras["bbox"] = corners.values.transpose(2, 3).reshape(BATCH, LENGTH, 4)
    return extras


def _batch(
    task: str, model: torch.nn.Module, config: Any, layout: Layout, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """The seeded batch of `layout` for a head of `task`."""
    generator = torch.Generator().manual_seed(seed)
    inputs = _main_input(model, config, layout, dtype, generator)
    if layout.extras:
        inputs.update(_extras(model, config, dtype, generator))
    return task_batch(task, model, config, inputs, generator, layout)


def _loss_runs(model: torch.nn.Module, batch: dict[str, Any], loss: Callable | None) -> bool:
    """Whether the training loss runs eagerly on `batch` (without gradients)."""
    if loss is None:
        return runs_eagerly(model, batch)
    try:
        with torch.no_grad():
            loss(model, **batch)
    except Exception:  # noqa: BLE001 - any failure: the next layout
        return False
    return True


def _takes_labels(model: torch.nn.Module) -> bool:
    """Whether the forward names `labels` (a head with a loss names it; an inference-only head,
    such as DeiT's with a teacher, takes only `**kwargs` besides its inputs)."""
    return "labels" in inspect.signature(model.forward).parameters


def ctc_loss(model: torch.nn.Module, labels: torch.Tensor, **inputs) -> torch.Tensor:
    """The CTC loss written from the logits, as a training loop writes it: every frame and every
    label counted (tensor lengths, as the libraries pass them). The heads' own `labels=` path
    checks the labels' values in Python and selects the unpadded ones (`masked_select`), which
    no static graph holds."""
    log_probs = model(**inputs).logits.log_softmax(-1).transpose(0, 1)
    steps, batch = log_probs.shape[:2]
    input_lengths = torch.full((batch,), steps, dtype=torch.long)
    target_lengths = torch.full((batch,), labels.shape[1], dtype=torch.long)
    blank = getattr(model.config, "pad_token_id", None) or 0
    return F.ctc_loss(log_probs, labels, input_lengths, target_lengths, blank, zero_infinity=True)


def _ids(generator: torch.Generator, high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, max(high, 1), shape, generator=generator)


def task_batch(
    task: str,
    model: torch.nn.Module,
    config: Any,
    inputs: dict[str, torch.Tensor],
    gen: torch.Generator,
    layout: Layout | None = None,
) -> dict[str, torch.Tensor]:
    """The keyword batch a head of `task` trains on, with `labels=` so it returns `.loss`:
    the main `inputs`, and what the task adds to them (labels as long as `layout`'s sequence,
    one per codebook where it stacks codebooks)."""
    layout = layout or Layout(None)
    vocab = getattr(config, "vocab_size", None) or 2
    labels = getattr(config, "num_labels", 2)
    if task in ("CAUSAL_LM", "MASKED_LM"):
        codebooks = (layout.codebooks,) if layout.codebooks else ()
        return {**inputs, "labels": _ids(gen, vocab, BATCH, layout.length, *codebooks)}
    if task in ("SEQ_TO_SEQ_CAUSAL_LM", "SPEECH_SEQ_2_SEQ"):
        # ids from 1: 0 is often the padding id, which the decoder's masks treat apart; the
        # decoder's inputs are given, as a config need not name the id that starts them
        # a decoder-only model of these mappings (a multimodal LM given text only) predicts
        # its own input, so its labels are as long as the input
        takes = "decoder_input_ids" in inspect.signature(model.forward).parameters
        if not takes and "input_ids" in inputs:
            return {**inputs, "labels": _ids(gen, vocab, BATCH, layout.length)}
        target = 1 + _ids(gen, vocab - 1, BATCH, TARGET_LENGTH)
        decoder = {"decoder_input_ids": 1 + _ids(gen, vocab - 1, BATCH, TARGET_LENGTH)}
        return {**inputs, **(decoder if takes else {}), "labels": target}
    if task == "TOKEN_CLASSIFICATION":
        return {**inputs, "labels": _ids(gen, labels, BATCH, layout.length)}
    if task == "CTC":  # anything but the blank (the padding id)
        blank = getattr(config, "pad_token_id", None) or 0
        ids = (blank + 1 + _ids(gen, vocab - 1, BATCH, LABEL_LENGTH)) % vocab
        return {**inputs, "labels": ids}
    return {**inputs, "labels": _ids(gen, labels, BATCH)}


def _main_input(
    model: torch.nn.Module,
    config: Any,
    layout: Layout,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    """The model's main input (`model.main_input_name`) laid out as `layout`."""
    name = getattr(model, "main_input_name", "input_ids")
    if layout.shape is None:
        return {name: _token_ids(config, gen, BATCH * max(layout.codebooks, 1), layout.length)}
    return {name: torch.randn(layout.shape, generator=gen, dtype=torch.float64).to(dtype)}


def _main_input_shapes(model: torch.nn.Module, config: Any) -> list[tuple[int, ...] | None]:
    """The shapes the main input may take, at the sweep's sizes: None for token ids; audio
    features in either layout a library uses ([batch, mel bins, frames] as Whisper's, [batch,
    frames, mel bins] as the conformers'; raw samples, or frames of mel bins as the audio
    spectrogram transformers'), of which the first the step runs on is taken. A main input of
    a generic name (`inputs`: Perceiver, the speech encoder-decoder) takes the kind of input
    its head's mapping trains on."""
    name = getattr(model, "main_input_name", "input_ids")
    if name not in (*FEATURE_INPUTS, "input_ids"):
        kind = _mapped_input(type(model).__name__)
        return list(_feature_shapes(kind, config)) if kind else [None]
    if name not in FEATURE_INPUTS:
        return [None]
    return list(_feature_shapes(name, config))


# the input a class of these mappings trains on, where its main input's name does not say
MAPPED_INPUTS = {
    "IMAGE_CLASSIFICATION": "pixel_values",
    "SPEECH_SEQ_2_SEQ": "input_values",  # raw samples: the speech encoder-decoder's Wav2Vec2
    "CTC": "input_values",
    "AUDIO_CLASSIFICATION": "input_values",
}


def _mapped_input(name: str) -> str | None:
    """The kind of input (`FEATURE_INPUTS`) the class `name` takes by its mapping, if any."""
    from transformers.models.auto import modeling_auto

    for task, kind in MAPPED_INPUTS.items():
        names = getattr(modeling_auto, f"MODEL_FOR_{task}_MAPPING_NAMES", {}).values()
        if name in {n for v in names for n in ((v,) if isinstance(v, str) else v)}:
            return kind
    return None


def _feature_shapes(name: str, config: Any) -> list[tuple[int, ...]]:
    """The shapes a main input of floats may take, most common first."""
    mel = next(
        (v for k in MEL_BINS if isinstance(v := getattr(config, k, None), int) and v > 1), None
    )
    if name == "pixel_values":
        side = getattr(config, "image_size", IMAGE)
        height, width = (side, side) if isinstance(side, int) else tuple(side)[:2] or (IMAGE, IMAGE)
        return [(BATCH, getattr(config, "num_channels", 3), height, width)]
    if name == "input_values":
        frames = getattr(config, "max_length", None)
        spectrogram = (
            [(BATCH, frames, mel)] if isinstance(mel, int) and isinstance(frames, int) else []
        )
        return [(BATCH, AUDIO_SAMPLES), (BATCH, 1, AUDIO_SAMPLES), *spectrogram]
    frames = 2 * getattr(config, "max_source_positions", LENGTH)
    mel = mel if isinstance(mel, int) else 16
    # frames stacked in twos or fours (Granite Speech's encoder projects 4 x mel bins)
    stacked = [(BATCH, frames, k * mel) for k in (2, 4)]
    return [(BATCH, mel, frames), (BATCH, frames, mel), *stacked]


def runs_eagerly(model: torch.nn.Module, inputs: dict[str, Any]) -> bool:
    """Whether `model(**inputs)` runs (without gradients): how the sweep tells which of an
    input's layouts a model takes."""
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception:  # noqa: BLE001 - any failure: the next layout
        return False
    return True


def _token_ids(config: Any, gen: torch.Generator, rows: int, length: int) -> torch.Tensor:
    """Token ids, each row ending as a sentence does, with the end-of-sequence id."""
    vocab = getattr(config, "vocab_size", None) or 2
    ids = _ids(gen, vocab, rows, length)
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, int) and 0 <= eos < vocab:
        ids[:, -1] = eos
    return ids
