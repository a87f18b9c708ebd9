"""The rules that size a diffusers denoiser's forward inputs and tiny constructor arguments
(`coverage_diffusers_inputs`, `coverage_diffusers.tiny_init`), on stand-in configs and
forwards: each rule applies to any model with the parameter, so a stand-in is enough."""

from __future__ import annotations

import pytest
import torch

from magis.bench.coverage_diffusers import tiny_init
from magis.bench.coverage_diffusers_inputs import (
    TEXT_TOKENS,
    Inputs,
    Layout,
    forward_inputs,
    layouts,
)

FrozenDict = pytest.importorskip("diffusers.configuration_utils").FrozenDict


IMAGE = Layout()


def _inputs(layout: Layout = IMAGE, **config) -> Inputs:
    config = FrozenDict({"in_channels": 4, "sample_size": 8, **config})
    return Inputs(config, torch.float64, torch.Generator().manual_seed(0), layout, True)


class _Packed(torch.nn.Module):
    def forward(
        self,
        hidden_states: torch.Tensor,
        img_shapes: list[tuple[int, int, int]],
        position_ids: torch.Tensor,
        text_lens: torch.Tensor,
    ) -> torch.Tensor:
        return hidden_states


class _PerSampleShapes(torch.nn.Module):
    def forward(self, hidden_states, img_shapes: list[list[tuple[int, int, int]]]):
        return hidden_states


def test_packed_inputs_follow_the_latent_grid():
    batch = forward_inputs(_Packed(), _inputs(Layout(packed=True), axes_dims_rope=(2, 2, 4)))
    assert batch["hidden_states"].shape == (2, 64, 4)
    assert batch["img_shapes"] == [(1, 8, 8)] * 2
    ids = batch["position_ids"]  # the text's zeros, then each token's (0, row, column)
    assert ids.shape == (TEXT_TOKENS + 64, 3)
    assert not ids[:TEXT_TOKENS].any()
    assert ids[TEXT_TOKENS + 9].tolist() == [0, 1, 1]
    assert batch["text_lens"].tolist() == [TEXT_TOKENS] * 2


def test_img_shapes_nest_as_the_annotation_does():
    batch = forward_inputs(_PerSampleShapes(), _inputs(Layout(packed=True)))
    assert batch["img_shapes"] == [[(1, 8, 8)]] * 2


def test_an_input_no_rule_sizes_is_named_with_its_declaring_line():
    # an image layout has no token grid to give: the packed one is tried next
    with pytest.raises(ValueError, match="forward's `img_shapes`") as raised:
        forward_inputs(_Packed(), _inputs())
    line = _Packed.forward.__code__.co_firstlineno + 3  # the signature's third parameter
    assert f"test_coverage_diffusers_inputs.py:{line} `img_shapes: " in str(raised.value)
    assert "coverage_diffusers_inputs.py sizes it; add one there" in str(raised.value)


def test_stacked_text_layers_only_where_the_config_counts_them():
    assert Layout(text_layers=3) not in layouts(FrozenDict({}))
    assert layouts(FrozenDict({"num_text_layers": 3}))[-1] == Layout(True, 3)


def test_token_ids_are_drawn_under_the_codebook():
    class Prior(torch.nn.Module):
        def forward(self, hidden_states, prior_token_id, prior_token_drop):
            return hidden_states

    batch = forward_inputs(Prior(), _inputs(patch_size=2, prior_codebook_size=5))
    assert batch["prior_token_id"].shape == (2, 16)  # one per 2x2 patch of an 8x8 latent
    assert int(batch["prior_token_id"].max()) < 5
    assert not batch["prior_token_drop"].any()


def test_rotary_axes_left_none_split_the_head_in_two():
    class Model:
        def __init__(self, hidden_size: int = 1792, num_heads: int = 28, axes_dim=None):
            pass

    init = tiny_init(Model)
    assert init["axes_dim"] == [8, 8]  # hidden 32 over 2 heads
    assert sum(init["axes_dim"]) == init["hidden_size"] // init["num_heads"]


def test_one_block_width_is_not_a_level_count():
    class Model:
        def __init__(self, block_out_channels: int = 768, down_block_types=("A", "B", "C")):
            pass

    init = tiny_init(Model)
    assert init["block_out_channels"] == 32  # capped as one level's width
    assert "down_block_types" not in init  # no levels to cut the tuple to
