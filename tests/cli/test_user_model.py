"""Your own model from the command line: `magis analyze|optimize path/to/model.py:factory`
(issue #17, item 4), built at full size under fake tensors as the zoo is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from magis.capture import workload_step
from magis.capture.user_model import ModelFileError, is_model_file, parse_spec
from magis.cli import main
from magis.ir import PlaceholderKind
from magis.plan import Plan

ROOT = Path(__file__).resolve().parents[2]

MODELS = '''
import torch
import torch.nn.functional as F


def factory():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return model, (x, y), lambda m, x, y: F.cross_entropy(m(x), y)


class Scored(torch.nn.Module):
    """Returns its own loss, from keyword inputs (as a Hugging Face model given labels=)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 3)

    def forward(self, features, labels):
        return F.cross_entropy(self.proj(features), labels)


def keywords(batch=4):
    return Scored(), {"features": torch.randn(batch, 6), "labels": torch.randint(0, 3, (batch,))}


def returns_int():
    return 3


def not_a_module():
    return "model", torch.randn(2, 4)


def batch_of_strings():
    return torch.nn.Linear(4, 4), ("text", torch.randn(2, 4))


def no_loss():
    return torch.nn.Linear(4, 4), torch.randn(2, 4)


def reads_a_value():
    n = int(torch.randn(512, 512).abs().sum().item()) % 5 + 2  # a large tensor's value
    return torch.nn.Linear(n, n), torch.randn(2, n)


class DropPath(torch.nn.Module):
    """Reads its rates from a linspace as it is built (PoolFormer's, Swin's constructors)."""

    def __init__(self):
        super().__init__()
        self.rates = [r.item() for r in torch.linspace(0, 0.1, 3)]
        self.wide, self.head = torch.nn.Linear(512, 512), torch.nn.Linear(512, 4)

    def forward(self, x):
        return self.head(self.wide(x) * (1 - self.rates[1]))


def reads_small_constants():
    return DropPath(), torch.randn(8, 512), lambda m, x: m(x).square().mean()


def raises():
    raise ValueError("the data folder is missing")


def shape_error():
    loss = lambda m, x: (m(x) @ torch.ones(3, 3)).sum()  # noqa: E731
    return torch.nn.Linear(4, 4), torch.randn(2, 4), loss


def data_dependent_loss():
    loss = lambda m, x: m(x).sum() * (2 if torch.rand(()) > 0.5 else 1)  # noqa: E731
    return torch.nn.Linear(4, 4), torch.randn(2, 4), loss
'''


@pytest.fixture
def models(tmp_path: Path) -> Path:
    path = tmp_path / "models.py"
    path.write_text(MODELS)
    return path


def test_spec_forms():
    assert is_model_file("a/b.py:factory") and is_model_file("b.py")
    assert not is_model_file("bert-base:tiny") and not is_model_file("bert-base")
    assert parse_spec("b.py").function == "factory"
    assert parse_spec("dir/b.py:make").function == "make"
    with pytest.raises(ModelFileError, match="not a function name"):
        parse_spec("b.py:1x")


def test_a_factory_is_captured_at_full_size_on_fake_tensors(models):
    info, step = workload_step(f"{models}:factory")
    assert info.size == "paper" and info.batch == 8 and info.model_class == "Sequential"
    assert info.parameters == 16 * 32 + 32 + 32 * 4 + 4
    weights = step.graph.placeholders(PlaceholderKind.WEIGHT)
    assert len(weights) == 4
    # the zoo's SGD update: each weight is written in place, no optimizer state
    assert not step.graph.placeholders(PlaceholderKind.OPT_STATE)
    assert isinstance(step.example_inputs[0], torch._subclasses.fake_tensor.FakeTensor)


def test_a_constructor_that_reads_small_constants_is_built_on_fake_tensors(models):
    """A factory whose model reads values it computed (drop-path rates) is built again with
    small constants real; the large weight stays fake (nothing of its size allocated)."""
    from magis.capture.user_model import call_factory, load_factory

    spec = parse_spec(f"{models}:reads_small_constants")
    model, _, _ = call_factory(spec, load_factory(spec))
    fake = torch._subclasses.fake_tensor.FakeTensor
    assert isinstance(model.wide.weight, fake) and not isinstance(model.head.bias, fake)
    assert model.rates == pytest.approx([0.0, 0.05, 0.1])
    info, step = workload_step(f"{models}:reads_small_constants")
    assert info.parameters == 512 * 512 + 512 + 512 * 4 + 4
    assert len(step.graph.placeholders(PlaceholderKind.WEIGHT)) == 4


def test_dict_batch_own_loss_and_batch_override(models):
    info, step = workload_step(f"{models}:keywords", batch=5)
    assert info.batch == 5
    data = [step.graph.node(p) for p in step.graph.placeholders(PlaceholderKind.DATA)]
    assert [d.name for d in data] == ["features", "labels"]
    assert list(data[0].outputs[0].shape) == [5, 6]


def test_analyze_and_optimize_a_model_file(magis_cli, models, tmp_path):
    spec = f"{models}:factory"
    report = tmp_path / "a.json"
    res = magis_cli("analyze", spec, "--json", str(report))
    assert res.returncode == 0, res.stderr
    data = json.loads(report.read_text())
    assert data["workload"] == spec and data["nodes"] > 10 and data["peak_bytes"] > 0
    plan = tmp_path / "plan.json"
    res = magis_cli(
        "optimize", spec, "--lat-limit", "1.10", "--max-states", "20", "--save", str(plan)
    )
    assert res.returncode in (0, 3), res.stderr
    assert "Traceback" not in res.stderr
    saved = Plan.load(plan)
    assert saved.summary.workload == spec and saved.summary.states_explored > 0


def _invoke(capsys, *args: str) -> tuple[int, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("function", "words"),
    [
        ("returns_int", "must return (model, batch) or (model, batch, loss_fn); got an int"),
        ("not_a_module", "returned a str as the model; it must be a torch.nn.Module"),
        ("batch_of_strings", "batch input0 is a str; the batch must be a tensor"),
        ("no_loss", "the model returned a tensor of shape [2, 4], not a loss"),
        ("reads_a_value", "reads the value of a large tensor while building at "),
        ("reads_a_value", "models.py:44 `n = int(torch.randn(512, 512).abs().sum().item())"),
        ("raises", "raises() raised ValueError: the data folder is missing"),
        ("raises", 'models.py:65 `raise ValueError("the data folder is missing")`'),
        ("data_dependent_loss", "capturing its training step failed: cannot capture a static"),
        ("data_dependent_loss", "`loss = lambda m, x: m(x).sum() * (2 if torch.rand(()) > 0.5"),
        ("data_dependent_loss", "reads a value that depends on a random draw at"),
        ("shape_error", "capturing its training step failed: tracing failed at "),
        ("shape_error", "`loss = lambda m, x: (m(x) @ torch.ones(3, 3)).sum()"),
        ("shape_error", ", in aten.mm.default: RuntimeError"),
        ("missing", "has no function 'missing' (it defines batch_of_strings, data_dependent_loss"),
    ],
)
def test_bad_factories_are_one_line_errors(capsys, models, function, words):
    code, err = _invoke(capsys, "analyze", f"{models}:{function}")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: {models}:{function}: ") and words in lines[0], lines[0]


def test_missing_file_broken_file_and_batch_without_parameter(capsys, tmp_path, models):
    code, err = _invoke(capsys, "analyze", f"{tmp_path}/nowhere.py:factory")
    assert code == 1 and "nowhere.py not found" in err
    broken = tmp_path / "broken.py"
    broken.write_text("def factory(:\n")
    code, err = _invoke(capsys, "analyze", f"{broken}:factory")
    assert code == 1 and "loading" in err and "SyntaxError" in err and len(err.splitlines()) == 1
    exits = tmp_path / "script.py"
    exits.write_text("import sys\nsys.exit(2)\n")  # a script without a __main__ guard
    code, err = _invoke(capsys, "analyze", f"{exits}:factory")
    assert code == 1 and "loading" in err and "SystemExit: 2" in err
    code, err = _invoke(capsys, "analyze", f"{models}:factory", "--batch", "3")
    assert code == 1 and "--batch 3 needs factory() to take a `batch` parameter" in err


def test_the_drop_in_example_has_a_factory():
    """examples/train_gpt2.py:factory is GPT-2 small (124M parameters) on token ids, with the
    loss its users write (`model(input_ids=ids, labels=ids).loss`), captured without memory."""
    info, step = workload_step(f"{ROOT / 'examples' / 'train_gpt2.py'}:factory", batch=1)
    assert info.model_class == "GPT2LMHeadModel" and info.parameters > 120_000_000
    ids = step.graph.node(step.graph.placeholders(PlaceholderKind.DATA)[0]).outputs[0]
    assert list(ids.shape) == [1, 1024]


def test_a_plan_made_for_a_model_file_runs_verifies_and_explains(capsys, models, tmp_path):
    """`magis run model.py:factory --plan P` builds the model for real (it fits: checked first
    on fake tensors), runs the plan and verifies it against eager PyTorch; `magis explain P`
    reads the plan alone."""
    spec, plan = f"{models}:factory", tmp_path / "plan.json"
    code, err = _invoke(capsys, "optimize", spec, "--mem-limit", "0.9", "--max-states", "10",
                        "--save", str(plan))  # fmt: skip
    assert code in (0, 3) and plan.exists(), err
    code, err = _invoke(
        capsys, "run", spec, "--plan", str(plan), "--json", str(tmp_path / "r.json")
    )
    assert code == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["verified"] is True
    code, err = _invoke(capsys, "explain", str(plan), "--json", str(tmp_path / "e.json"))
    assert code == 0, err  # the plan holds its graph: explain needs no model file


GPT2_TINY = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def factory():
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 64, (2, 16))
    return GPT2LMHeadModel(config), (ids,), lambda m, ids: m(input_ids=ids, labels=ids).loss
"""


def test_sdpa_attention_of_a_user_model_is_known_and_splits_exactly(tmp_path):
    """Hugging Face models attend with SDPA by default; on its math backend (which fake tensors
    take for GPT-2 small, examples/train_gpt2.py:factory) it decomposes to `aten._safe_softmax`,
    which the registry knows: not opaque, and an F-Trans through it (MAGIS §4) runs equal to
    eager PyTorch in float64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from magis.commands.analyze import fission_tree, opaque_ops
    from magis.commands.run import run_fission

    path = tmp_path / "gpt2_tiny.py"
    path.write_text(GPT2_TINY)
    spec = f"{path}:factory"
    with sdpa_kernel(SDPBackend.MATH):  # real tensors: the same decomposition as fake ones
        _, step = workload_step(spec, dtype=torch.float64, real=True)
    assert opaque_ops(step) == []
    graph, tree = fission_tree(step)
    softmax = {n for n in graph.ops() if graph.node(n).op == "aten._safe_softmax.default"}
    through = [
        i for i, x in enumerate(tree.nodes) if softmax & x.ftrans.nodes and x.length % 2 == 0
    ]
    assert through
    rep = run_fission(step, spec, through[:1], 2, hardware="rtx3090")
    assert rep.verified and rep.max_rel_err < 1e-9 and rep.fission


def test_sibling_modules_import_as_under_python_model_py(tmp_path):
    """The file's folder is on sys.path while it loads, while the factory runs and while the
    step is captured (a forward that imports lazily), as `python model.py` would have it."""
    (tmp_path / "sizes_h3.py").write_text("WIDTH = 5\n")
    (tmp_path / "activation_h3.py").write_text("import torch\nact = torch.tanh\n")
    (tmp_path / "net.py").write_text(
        "import torch\n"
        "from sizes_h3 import WIDTH\n\n\n"
        "class Net(torch.nn.Linear):\n"
        "    def forward(self, x):\n"
        "        from activation_h3 import act\n\n"
        "        return act(super().forward(x)).sum()\n\n\n"
        "def factory():\n"
        "    return Net(WIDTH, WIDTH), torch.randn(3, WIDTH)\n"
    )
    info, step = workload_step(f"{tmp_path / 'net.py'}")  # NAME defaults to factory
    assert info.parameters == 5 * 5 + 5 and info.batch == 3
    assert "aten.tanh.default" in {step.graph.node(n).op for n in step.graph.ops()}
    assert str(tmp_path) not in sys.path
