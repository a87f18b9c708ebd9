"""The public corpus (issue #16 item 1): twenty-odd architectures of transformers, diffusers
and DenseNet-121, each at its family's usual training size (captured under fake tensors) and
tiny (executed in float64 against eager PyTorch), trained through the loss its users write."""

from __future__ import annotations

import pytest
import torch

from magis.backend import compile_program, verify
from magis.capture import get_workload, workload_step
from magis.capture.corpus import (
    ARCHITECTURES,
    CORPUS_NAMES,
    FULL,
    TINY,
    build_case,
    workload_names,
)
from magis.capture.corpus.base import UserLoss
from magis.capture.models import DenseNet, DenseNetConfig
from magis.errors import UnknownWorkloadError
from magis.ir import PlaceholderKind


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small float64 kernels: threads only add overhead
    yield
    torch.set_num_threads(threads)


def test_at_least_twenty_architectures_spanning_the_families():
    assert len(ARCHITECTURES) >= 20
    families = {a.family for a in ARCHITECTURES.values()}
    assert {
        "decoder LM",
        "encoder",
        "encoder-decoder",
        "CNN",
        "vision transformer",
        "diffusion U-Net",
        "multi-input",
    } <= families
    assert sum(a.family == "decoder LM" for a in ARCHITECTURES.values()) >= 4
    assert sum(a.family == "CNN" for a in ARCHITECTURES.values()) >= 5
    for arch in ARCHITECTURES.values():
        assert set(arch.sizes) == {FULL, TINY}, arch.name


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_tiny_captures_and_runs_as_eager_in_float64(name):
    wl, step = workload_step(f"corpus:{name}:tiny", float64_when_tiny=True)
    assert wl.size == TINY and wl.loss_fn is None
    assert any(k is PlaceholderKind.WEIGHT for k in step.input_kinds)
    program = compile_program(step.graph, step.graph.program_order())
    result = verify(step, program, step.make_inputs())
    assert result.verified, (name, result)


def test_the_workload_is_the_users_loss_on_the_users_model():
    wl = get_workload("corpus:t5:tiny")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = wl.build(torch.float64)
    batch = wl.make_inputs(wl.batch)
    assert isinstance(model, UserLoss) and len(batch) == 2  # source ids, target ids
    expected = model.model(input_ids=batch[0], labels=batch[1]).loss
    assert torch.equal(model(*batch), expected)


def test_names_sizes_and_batch_override():
    full = get_workload("corpus:gpt2")
    assert (full.name, full.size, full.batch) == ("corpus:gpt2", "paper", 8)
    tiny = get_workload("corpus:gpt2:tiny", batch=3)
    assert (tiny.name, tiny.size, tiny.batch) == ("corpus:gpt2:tiny", TINY, 3)
    assert tiny.make_inputs(3)[0].shape == (3, 32)
    assert len(workload_names()) == 2 * len(CORPUS_NAMES)
    assert get_workload("corpus:llama").dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["corpus:nope", "corpus:gpt2:small", "corpus:"])
def test_unknown_corpus_names_are_one_line_errors(name):
    with pytest.raises(UnknownWorkloadError, match="corpus"):
        get_workload(name)


# full size: the published configs at training batch, under fake tensors (nothing allocated)
FULL_SIZE = {
    # name: (DATA shapes, plausible node range, parameters in millions)
    "gpt2": ([(8, 1024), (8, 1024)], (1500, 3000), 124.4),  # tied: untied would be 163.0
    "bart": ([(16, 512), (16, 128)], (2500, 4500), 139.4),
    "resnet": ([(64, 3, 224, 224), (64,)], (800, 1500), 25.6),
}


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_full_size_captures_under_fake_tensors(name):
    shapes, (low, high), params_m = FULL_SIZE[name]
    _, step = workload_step(f"corpus:{name}")
    graph = step.graph
    data = [graph.node(n).outputs[0] for n in graph.placeholders(PlaceholderKind.DATA)]
    assert [tuple(d.shape) for d in data] == shapes
    assert low <= len(graph.program_order()) <= high
    weights = [graph.node(n).outputs[0] for n in graph.placeholders(PlaceholderKind.WEIGHT)]
    count = sum(torch.Size(w.shape).numel() for w in weights)
    assert count / 1e6 == pytest.approx(params_m, rel=0.01)


def test_densenet121_is_the_published_network():
    with torch.device("meta"):
        model = DenseNet(DenseNetConfig())
    # 7,978,856 parameters (Huang et al. 2017, DenseNet-121 on ImageNet)
    assert sum(p.numel() for p in model.parameters()) == 7_978_856
    blocks = [len(m.layers) for m in model.modules() if hasattr(m, "layers")]
    assert blocks == [6, 12, 24, 16] and model.classifier.in_features == 1024


def test_build_case_keeps_the_training_api():
    case = build_case("sd_unet")
    assert len(case.batch) == 4  # clean latents, noise, steps, text states
    loss = case.loss_fn(case.model, *case.batch)
    assert loss.dim() == 0 and loss.dtype == torch.float32  # diffusers' MSE in float32
