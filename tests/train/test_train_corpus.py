"""Equal training on public architectures outside the zoo (issue #15): twenty steps through
`magis.compile(..., mem_limit=0.5)` against the same twenty eager steps, float64, relative error
<= 1e-9 on every parameter, buffer and optimizer state, and on every float64 loss (the Hugging
Face LM heads compute their loss in float32: those losses are held to 1e-6)."""

from __future__ import annotations

import pytest
import torch
from train_helpers import TOL, one_thread, train_both

from magis.capture.corpus import ARCHITECTURES, build_case
from magis.train import compile

# Decoder LM with GQA, encoder-decoder with two inputs, encoder, CNN with batch norm, CNN with
# concatenations, vision transformer, GPT-2, depthwise CNN; then (issue #46) a mixture of experts,
# CTC speech, a state-space LM, an LSTM LM and a graph network.
ADAMW_MODELS = ["llama", "t5", "bert", "resnet", "mobilevit", "vit", "gpt2", "mobilenet_v2"]
ADAMW_MODELS += ["qwen3_moe", "wav2vec2", "mamba", "lstm_lm", "gcn"]
SGD_MODELS = ["qwen2", "resnet", "t5"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def compiled(case):
    def make(model, opt):
        return compile(
            model,
            opt,
            case.batch,
            loss_fn=case.loss_fn,
            mem_limit=0.5,
            time_budget=2.0,
            hardware="rtx3090",
            clip_grad_norm=1.0,
        )

    return make


def test_the_corpus_has_the_architectures_the_issue_names():
    assert set(ADAMW_MODELS) <= set(ARCHITECTURES) and len(ARCHITECTURES) >= 8
    gqa = build_case("llama").model.config
    assert gqa.num_key_value_heads < gqa.num_attention_heads
    assert len(build_case("t5").batch) == 2


@pytest.mark.parametrize("name", ADAMW_MODELS)
def test_adamw_cosine_and_clipping_train_as_eager(name):
    case = build_case(name)
    loss_err, (err, where), step = train_both(
        case.model,
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01),
        case.loss_fn,
        case.batch,
        compiled(case),
        make_sched=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 20),
    )
    assert loss_err <= TOL, name
    assert err <= TOL, (name, where)
    assert len(step.optimizer.state) == len(list(case.model.parameters()))


@pytest.mark.parametrize("name", SGD_MODELS)
def test_sgd_momentum_and_weight_decay_train_as_eager(name):
    case = build_case(name)
    loss_err, (err, where), _ = train_both(
        case.model,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
        case.loss_fn,
        case.batch,
        compiled(case),
        make_sched=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 20),
    )
    assert loss_err <= TOL, name
    assert err <= TOL, (name, where)
