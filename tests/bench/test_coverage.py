"""`magis bench coverage` on a fixed sample of ten architectures of the installed libraries
(decoder LMs dense and mixture-of-experts, an encoder, an encoder-decoder, vision, speech with
CTC, audio classification, diffusion UNets and a DiT): each captured and verified against eager
PyTorch, its plan verified, its simulated peak equal to the measured one; and the isolated
runner that keeps a sweep going past a hang or a crash."""

import json
import os
import time

import pytest

from magis.bench.coverage import PEAK_TOLERANCE, CoverageOptions, all_architectures, run_coverage
from magis.bench.coverage_models import tiny_config
from magis.bench.parallel import CellFailure, IsolatedRunner

SAMPLE = (
    "GPT2LMHeadModel",  # decoder LM
    "Qwen3MoeForCausalLM",  # mixture of experts: grouped matmul, float32 on a CPU
    "BertForMaskedLM",  # encoder
    "BartForConditionalGeneration",  # encoder-decoder
    "ViTForImageClassification",  # vision transformer
    "ResNetForImageClassification",  # CNN
    "Wav2Vec2ForCTC",  # speech, CTC loss (magis's fake kernel), LayerDrop off
    "HubertForSequenceClassification",  # audio classification
    "UNet2DModel",  # diffusion UNet
    "DiTTransformer2DModel",  # diffusion transformer
)


@pytest.fixture(scope="module")
def sample_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("coverage")
    options = CoverageOptions(
        only=SAMPLE,
        max_states=2,
        isolate=False,  # in this process: the isolated runner is tested below
        warm_start=False,
        json_path=out / "coverage.json",
        markdown_path=out / "coverage.md",
    )
    return run_coverage(options), out


def test_the_sample_is_ten_architectures_of_both_libraries():
    names = {a.name: a for a in all_architectures()}
    assert all(name in names for name in SAMPLE)
    assert {names[n].library for n in SAMPLE} == {"transformers", "diffusers"}


def test_every_sampled_architecture_captures_verifies_and_measures_its_peak(sample_report):
    report, _ = sample_report
    assert len(report.results) == len(SAMPLE)
    for r in report.results:
        assert r.failure is None, r.failure
        assert r.captured_verified and r.plan_verified and r.peak_equal, r
        assert abs(r.simulated_peak_bytes - r.measured_peak_bytes) <= (
            PEAK_TOLERANCE * r.measured_peak_bytes
        )
    moe = next(r for r in report.results if r.architecture.endswith("Qwen3MoeForCausalLM"))
    assert moe.dtype == "float32" and "verified in float32" in moe.notes[0]
    assert {r.dtype for r in report.results} == {"float64", "float32"}


def test_the_json_and_the_table_hold_the_counts(sample_report):
    report, out = sample_report
    data = json.loads((out / "coverage.json").read_text())
    n = len(SAMPLE)
    assert data["architectures"] == data["captured_verified"] == n
    assert data["plan_verified"] == data["peak_equal"] == n and data["failures"] == []
    table = (out / "coverage.md").read_text()
    assert f"| tried | {n} |" in table and f"| plan verified | {n} (100%) |" in table


def test_a_failure_is_a_row_with_its_stage_category_and_line(tmp_path):
    """A name no library has fails at build: a row, not the end of the sweep."""
    from magis.bench.coverage import Cell, run_architecture
    from magis.bench.coverage_models import Architecture

    result = run_architecture(
        Cell(Architecture("transformers", "NoSuchModel", "CAUSAL_LM"), 1, 1, "rtx3090")
    )
    assert result.failure is not None and result.failure.stage == "build"
    assert result.failure.category == "AttributeError" and "\n" not in result.failure.message


def test_tiny_configs_are_derived_from_the_config_class():
    from transformers import BertConfig, Wav2Vec2Config

    bert = tiny_config(BertConfig())
    assert (bert.num_hidden_layers, bert.hidden_size, bert.vocab_size) == (2, 64, 512)
    assert bert.hidden_size % bert.num_attention_heads == 0
    speech = tiny_config(Wav2Vec2Config())
    assert speech.layerdrop == 0.0 and speech.mask_time_prob == 0.0
    assert max(speech.conv_dim) <= 32 and speech.num_hidden_layers == 2


def test_the_isolated_runner_survives_a_hang_and_a_crash():
    runner = IsolatedRunner(jobs=2, timeout_s=3.0)
    start = time.monotonic()
    got = {f.index: f.result for f in runner.run([30, 1], time.sleep)}
    assert isinstance(got[0], CellFailure) and "timed out after 3 s" in got[0].reason
    assert got[1] is None and time.monotonic() - start < 20
    crashed = list(IsolatedRunner(jobs=1, timeout_s=30.0).run([3], os._exit))
    assert isinstance(crashed[0].result, CellFailure)
    assert "exit code 3" in crashed[0].result.reason
