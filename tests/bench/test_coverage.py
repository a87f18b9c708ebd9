"""`magis bench coverage` on a fixed sample of ten architectures of the installed libraries
(decoder LMs dense and mixture-of-experts, an encoder, an encoder-decoder, vision, speech with
CTC, audio classification, diffusion UNets and a DiT): each captured and verified against eager
PyTorch, its plan verified, its simulated peak equal to the measured one; and the isolated
runner that keeps a sweep going past a hang or a crash."""

import json
import math
import os
import time

import pytest

from magis.bench.coverage import PEAK_TOLERANCE, CoverageOptions, all_architectures, run_coverage
from magis.bench.coverage_models import LENGTH, tiny_config
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
    assert f"| tried | {n} |" in table and f"| plan verified | {n} (100.0%) |" in table


def test_a_failure_is_a_row_with_its_stage_category_and_line(tmp_path):
    """A name no library has fails at build: a row, not the end of the sweep."""
    from magis.bench.coverage import Cell, run_architecture
    from magis.bench.coverage_models import Architecture

    result = run_architecture(
        Cell(Architecture("transformers", "NoSuchModel", "CAUSAL_LM"), 1, 1, "rtx3090")
    )
    assert result.failure is not None and result.failure.stage == "build"
    assert result.failure.category == "AttributeError" and "\n" not in result.failure.message


def _a_library_that_rejects_its_config(*args):
    raise KeyError("full_attention")  # as a model library's code does


def test_a_build_failure_names_the_library_line_that_raised(monkeypatch):
    from magis.bench.coverage import Cell, run_architecture
    from magis.bench.coverage_models import Architecture

    monkeypatch.setattr("magis.bench.coverage.build_case", _a_library_that_rejects_its_config)
    result = run_architecture(
        Cell(Architecture("transformers", "GPT2LMHeadModel", "CAUSAL_LM"), 1, 1, "rtx3090")
    )
    failure = result.failure
    assert failure is not None and failure.stage == "build" and failure.category == "KeyError"
    assert failure.message.startswith(
        "KeyError: 'full_attention' (at tests/bench/test_coverage.py:"
    )
    assert '`raise KeyError("full_attention")' in failure.message and "\n" not in failure.message


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


def test_tiny_configs_keep_the_relations_between_fields():
    """The 2026-11-28 sweep's build failures, by cause: each relation a config holds between
    its fields survives the caps (built through the config's own constructor)."""
    from transformers import (
        DeepseekV3Config,
        Gemma3nTextConfig,
        Mamba2Config,
        Mistral4Config,
        ReformerConfig,
        SwinConfig,
    )

    mla = tiny_config(DeepseekV3Config())  # latent attention: as many kv heads as heads
    assert mla.num_key_value_heads == mla.num_attention_heads == 4
    assert mla.qk_head_dim == mla.qk_nope_head_dim + mla.qk_rope_head_dim  # derived again
    experts, groups = mla.n_routed_experts, mla.n_group
    assert experts % groups == 0 and experts // groups >= 2 and mla.topk_group <= groups
    assert mla.use_cache is False
    mistral = tiny_config(Mistral4Config())
    assert mistral.head_dim == mistral.qk_nope_head_dim + mistral.qk_rope_head_dim
    gemma = tiny_config(Gemma3nTextConfig())  # KV-sharing layers fit in the tiny depth
    assert gemma.num_kv_shared_layers < gemma.num_hidden_layers == len(gemma.layer_types)
    assert set(gemma.layer_types) == set(Gemma3nTextConfig().layer_types)
    swin = tiny_config(SwinConfig())  # the window fits the last stage's feature map
    assert swin.window_size <= swin.image_size // swin.patch_size // 2 ** (len(swin.depths) - 1)
    ssm = tiny_config(Mamba2Config())  # heads span expand x hidden, groups divide heads
    assert ssm.num_heads * ssm.head_dim == ssm.expand * ssm.hidden_size
    assert ssm.num_heads % ssm.n_groups == 0
    reformer = tiny_config(ReformerConfig())
    assert sum(reformer.axial_pos_embds_dim) == reformer.hidden_size == 64
    assert math.prod(reformer.axial_pos_shape) == LENGTH  # training: exactly the sequence


def test_the_sweep_2026_11_29_build_failures_fit_a_tiny_config():
    """A default the model needs is chosen from the config's choices (X-MOD's language); the
    roomy derivation keeps the hidden size's odd factors and the fractions of it (LayoutLMv3's
    box embeddings: six of them make the hidden size) and each repeated layer kind twice
    (Zamba's shared transformer needs two layers to share it)."""
    from transformers import LayoutLMv3Config, XmodConfig, ZambaConfig

    assert tiny_config(XmodConfig()).default_language == XmodConfig().languages[0]
    layout = tiny_config(LayoutLMv3Config(), derivation="roomy")
    assert layout.hidden_size == 96 == 4 * layout.coordinate_size + 2 * layout.shape_size
    zamba = tiny_config(ZambaConfig(), derivation="roomy")
    assert zamba.layers_block_type.count("hybrid") == 2 == zamba.num_hidden_layers // 2


@pytest.mark.parametrize("name", ["WhisperForConditionalGeneration", "LasrForCTC"])
def test_audio_features_are_given_in_the_layout_the_model_takes(name):
    """Whisper takes [batch, mel bins, frames], the conformers [batch, frames, mel bins]."""
    import torch

    from magis.bench.coverage import build_case

    arch = next(a for a in all_architectures() if a.name == name)
    case = build_case(arch, torch.float64)
    features = case.batch["input_features"]
    mel_first = features.shape[1] == 16
    assert mel_first == (name == "WhisperForConditionalGeneration"), features.shape
    with torch.no_grad():
        loss = (
            case.loss_fn(case.model, **case.batch)
            if case.loss_fn
            else case.model(**case.batch).loss
        )
    assert torch.isfinite(loss)


def test_excluded_architectures_are_counted_apart():
    """A model that needs a library not installed here, or whose head has no loss, is listed
    apart: the shares are of the architectures counted."""
    from magis.bench.coverage import NOT_INSTALLABLE, ArchResult
    from magis.bench.coverage_report import CoverageReport, Failure, table_markdown

    ok = ArchResult("transformers:A", "CAUSAL_LM", captured_verified=True, plan_verified=True)
    failed = ArchResult("transformers:B", "CAUSAL_LM")
    failed.failure = Failure("transformers:B", "capture", "ValueReadError", "reads a value")
    missing = ArchResult("transformers:C", "CAUSAL_LM", excluded=NOT_INSTALLABLE)
    missing.failure = Failure("transformers:C", "build", "ImportError", "requires the natten")
    report = CoverageReport(1.0, None, 0.5, 0.05, [ok, failed, missing])
    data = report.to_json()
    assert data["architectures"] == 3 and data["counted"] == 2
    assert data["not_installable_here"] == 1 and data["captured_verified"] == 1
    assert [f["architecture"] for f in data["failures"]] == ["transformers:B"]
    assert data["excluded"][0]["architecture"] == "transformers:C"
    table = table_markdown(report)
    assert "| excluded: not installable here | 1 |" in table
    assert "| plan verified | 1 (50.0%) |" in table


def test_only_a_sweeps_json_reruns_its_failures(tmp_path):
    from magis.bench.coverage import CoverageInputError, select

    path = tmp_path / "coverage.json"
    path.write_text(json.dumps({"failures": [{"architecture": "transformers:BertForMaskedLM"}]}))
    chosen = select(CoverageOptions(only=(f"@{path}", "UNet2DModel")), all_architectures())
    assert sorted(a.label for a in chosen) == [
        "diffusers:UNet2DModel",
        "transformers:BertForMaskedLM",
    ]
    with pytest.raises(CoverageInputError, match="no coverage JSON"):
        select(CoverageOptions(only=(f"@{tmp_path / 'missing.json'}",)), all_architectures())
