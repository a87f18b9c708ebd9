"""Tests of the workload zoo: tiny variants run eagerly, paper sizes build and run under fake tensors."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from magis.capture.models import BTLM, BTLMConfig, UNet, UNetPlusPlus, alibi_slopes
from magis.capture.workloads import (
    SIZES,
    WORKLOAD_FAMILIES,
    Workload,
    get_workload,
    list_workloads,
)
from magis.errors import MagisError, UnknownWorkloadError

# parameter counts of the paper-size models (millions) and the tolerance of the check
PAPER_PARAMS_M = {
    "resnet50": 25.6,  # He et al. 2016
    "bert-base": 109.5,  # 110M incl. the tied MLM head
    "vit-base": 86.6,  # ViT-B/16 with a 1000-class head
    "unet": 31.0,  # base width 64
    "unetpp": 9.2,  # base width 32 (Zhou et al. report 9.0M)
    "gpt-neo-1.3b": 1315.6,
    "btlm-3b": 2646.3,  # "2.6B", tied embeddings
}


@pytest.fixture
def default_dtype():
    """Set the default dtype for one test and restore it afterwards."""
    previous = torch.get_default_dtype()
    yield torch.set_default_dtype
    torch.set_default_dtype(previous)


def _step(wl: Workload, model: torch.nn.Module) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    inputs = wl.make_inputs(wl.batch)
    loss = wl.loss_fn(model(inputs[0]), *inputs)
    loss.backward()
    return loss, inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("family", WORKLOAD_FAMILIES)
def test_tiny_forward_backward(family: str, dtype: torch.dtype, default_dtype) -> None:
    default_dtype(dtype)
    torch.manual_seed(0)
    wl = get_workload(f"{family}:tiny")
    assert wl.dtype == torch.float32
    model = wl.build_model()
    assert model.training
    loss, _ = _step(wl, model)
    assert loss.dim() == 0
    assert loss.dtype == dtype
    assert math.isfinite(loss.item())
    for name, param in model.named_parameters():
        assert param.dtype == dtype, name
        assert param.grad is not None, f"{name} gets no gradient"
        assert torch.isfinite(param.grad).all(), name


@pytest.mark.parametrize("family", WORKLOAD_FAMILIES)
def test_paper_size_under_fake_tensors(family: str) -> None:
    wl = get_workload(family)
    assert wl.size == "paper" and wl.name == family
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    previous = torch.get_default_dtype()
    with fake:
        model = wl.build()
        inputs = wl.make_inputs(wl.batch)
        loss = wl.loss_fn(model(inputs[0]), *inputs)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params)
    assert torch.get_default_dtype() == previous
    assert all(isinstance(p, FakeTensor) for p in model.parameters())
    assert all(isinstance(t, FakeTensor) for t in inputs)
    assert inputs[0].shape[0] == wl.batch
    assert {p.dtype for p in model.parameters()} == {wl.dtype}
    assert loss.shape == ()
    assert all(
        g.shape == p.shape and g.dtype == p.dtype for g, p in zip(grads, params, strict=True)
    )
    count = sum(p.numel() for p in model.parameters()) / 1e6
    assert count == pytest.approx(PAPER_PARAMS_M[family], rel=0.01)


def test_build_model_uses_the_ambient_dtype(default_dtype) -> None:
    wl = get_workload("btlm-3b")
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert next(wl.build(torch.float32).parameters()).dtype == torch.float32
        default_dtype(torch.bfloat16)
        assert next(wl.build_model().parameters()).dtype == torch.bfloat16
        default_dtype(torch.float64)
        assert next(wl.build_model().parameters()).dtype == torch.float64
    assert torch.get_default_dtype() == torch.float64


def test_vit_build_restores_trunc_normal() -> None:
    original = torch.nn.init._no_grad_trunc_normal_
    get_workload("vit-base:tiny").build_model()
    assert torch.nn.init._no_grad_trunc_normal_ is original


def test_paper_dtypes() -> None:
    llms = {"gpt-neo-1.3b", "btlm-3b"}
    for wl in list_workloads():
        expected = torch.bfloat16 if wl.family in llms and wl.size == "paper" else torch.float32
        assert wl.dtype == expected, wl.name


def test_paper_batches() -> None:
    batches = {name: get_workload(name).batch for name in WORKLOAD_FAMILIES}
    assert batches == {
        "resnet50": 64,
        "bert-base": 32,
        "vit-base": 64,
        "unet": 32,
        "unetpp": 16,
        "gpt-neo-1.3b": 32,
        "btlm-3b": 32,
    }


def test_list_workloads_covers_all_families_and_sizes() -> None:
    workloads = list_workloads()
    assert len(workloads) == len(WORKLOAD_FAMILIES) * len(SIZES)
    assert len({wl.name for wl in workloads}) == len(workloads)
    assert {(wl.family, wl.size) for wl in workloads} == {
        (f, s) for f in WORKLOAD_FAMILIES for s in SIZES
    }
    for wl in workloads:
        assert wl.description
        assert get_workload(wl.name).name == wl.name


def test_names_and_batch_override() -> None:
    assert get_workload("bert-base:paper").name == "bert-base"
    wl = get_workload("unet:small", batch=3)
    assert (wl.name, wl.family, wl.size, wl.batch) == ("unet:small", "unet", "small", 3)
    with pytest.raises(MagisError):
        get_workload("unet", batch=0)


@pytest.mark.parametrize("name", ["xyz", "bert-base:huge", "", "BERT-BASE", "unet:tiny:x"])
def test_unknown_workload(name: str) -> None:
    with pytest.raises(UnknownWorkloadError) as info:
        get_workload(name)
    message = str(info.value)
    assert "\n" not in message
    assert f"unknown workload '{name}'" in message
    assert "bert-base" in message and "magis workloads" in message
    assert isinstance(info.value, MagisError)


def test_inputs_are_deterministic_under_seed() -> None:
    for family in WORKLOAD_FAMILIES:
        wl = get_workload(f"{family}:tiny")
        torch.manual_seed(1)
        first = wl.make_inputs(3)
        torch.manual_seed(1)
        second = wl.make_inputs(3)
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
        assert first[0].shape[0] == 3 and first[1].shape[0] == 3
        assert first[1].dtype == torch.int64


@pytest.mark.parametrize("family", ["gpt-neo-1.3b", "btlm-3b"])
def test_language_models_are_causal(family: str) -> None:
    torch.manual_seed(0)
    wl = get_workload(f"{family}:tiny")
    model = wl.build_model().eval()
    ids, _ = wl.make_inputs(2)
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1) % 100
    with torch.no_grad():
        outputs = [model(x) for x in (ids, changed)]
    a, b = (out if isinstance(out, torch.Tensor) else out.logits for out in outputs)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_alibi_slopes() -> None:
    assert alibi_slopes(8) == [2.0**-i for i in range(1, 9)]
    assert alibi_slopes(32)[0] == pytest.approx(2.0**-0.25)
    # 6 heads: the 4-head sequence, then every other slope of the 8-head sequence
    assert alibi_slopes(6) == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]


def test_btlm_attention_bias() -> None:
    model = BTLM(BTLMConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, ffn_size=8))
    bias = model.attention_bias(4, torch.zeros(()))
    assert bias.shape == (2, 4, 4)
    assert torch.isinf(bias[:, 0, 1:]).all() and bias[0, 3, 0] == -3 * 2.0**-4
    assert (bias.diagonal(dim1=1, dim2=2) == 0).all()


def test_btlm_untied_head() -> None:
    config = BTLMConfig(
        vocab_size=16,
        hidden_size=8,
        num_layers=1,
        num_heads=2,
        ffn_size=8,
        tie_word_embeddings=False,
    )
    logits = BTLM(config)(torch.randint(0, 16, (2, 5)))
    assert logits.shape == (2, 5, 16)


@pytest.mark.parametrize("cls", [UNet, UNetPlusPlus])
def test_segmentation_output_shape(cls: type[torch.nn.Module]) -> None:
    model = cls(in_channels=3, num_classes=4, base_width=4)
    assert model(torch.randn(1, 3, 48, 32)).shape == (1, 4, 48, 32)


def test_segmentation_graph_has_upsample_ops() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(UNet(base_width=2))(torch.randn(2, 3, 16, 16)).graph
    targets = {str(node.target) for node in graph.nodes if node.op == "call_function"}
    assert any("upsample_bilinear2d" in t for t in targets)
    assert any("cat" in t for t in targets)
