"""Every capture failure is one line naming the source line where it happened: a value read in
the model's forward, a shape error, a LayerDrop draw (with the config field to set).

A value read is an error only where the step's tensors hold no values (a model built under a
fake mode, as the corpus builds large ones): with real tensors the capture specializes the step
to the value read (`tests/capture/test_specialize.py`). The tests of its message build the
model and batch fake (`_fake`)."""

import inspect

import pytest
import torch
from torch import nn

from magis.capture import capture, training_step
from magis.capture.source import display_path, failure_site, parameter_site
from magis.errors import CaptureError, TraceFailedError, ValueReadError


def _fake(make, *batch):
    """`make()` and `batch` (functions making tensors) under a fake mode: no values to read."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return make(), tuple(b() for b in batch)


class ReadsItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        scale = self.lin(x).abs().max().item()
        return (self.lin(x) / scale).sum()


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            return y.relu().sum()
        return y.tanh().sum()


class LayerDrop(nn.Module):
    """Wav2Vec2's encoder loop, reduced: a layer skipped at random while training."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.layerdrop = 0.1

    def forward(self, x):
        for layer in self.layers:
            skip_the_layer = False
            if self.training and self.layerdrop > 0.0:
                dropout_probability = torch.rand([])
                skip_the_layer = dropout_probability < self.layerdrop
            if not skip_the_layer:
                x = layer(x)
        return x.sum()


class ChoosesByConfig(nn.Module):
    """DeBERTa's classification loss, reduced: with `config.problem_type` unset the head picks
    the labelled rows by value (`nonzero`); set, it takes the static cross-entropy path."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.config = type("Config", (), {"problem_type": None})()

    def forward(self, x, labels):
        logits = self.lin(x)
        if self.config.problem_type is None:
            index = (labels >= 0).nonzero()
            logits, labels = logits[index[:, 0]], labels[index[:, 0]]
        return nn.functional.cross_entropy(logits, labels)


def _line_of(cls: type, text: str) -> str:
    """`file:N` of the line of `cls`'s source that contains `text`."""
    lines, first = inspect.getsourcelines(cls)
    n = next(i for i, line in enumerate(lines) if text in line)
    return f"{display_path(__import__('pathlib').Path(__file__).resolve())}:{first + n}"


@pytest.mark.parametrize(
    "model, text",
    [(ReadsItem, "scale = self.lin(x).abs().max().item()"), (Branches, "if y.sum() > 0:")],
)
def test_a_value_read_in_forward_names_its_line(model, text):
    module, (x,) = _fake(model, lambda: torch.randn(2, 4))
    with pytest.raises(ValueReadError) as caught:
        training_step(module, x)
    message = str(caught.value)
    assert "\n" not in message and "reads a tensor's value in Python" in message
    assert "with real weights and batch" in message
    assert f"{_line_of(model, text)} `{text}`" in message, message


@pytest.mark.parametrize("logged", [True, False])
def test_a_shape_error_names_its_line_and_op(logged, monkeypatch):
    """The op is read off the traceback, so it is named even when torch does not log the fake
    kernel's failure (it does not always, depending on what ran before in the process)."""
    import logging

    if not logged:
        monkeypatch.setattr(logging.getLogger("torch._subclasses.fake_tensor"), "disabled", True)

    def step(x):
        return (x @ torch.ones(5, 5)).sum()

    with pytest.raises(TraceFailedError) as caught:
        capture(step, torch.randn(3))
    message = str(caught.value)
    assert "\n" not in message and "`return (x @ torch.ones(5, 5)).sum()`" in message
    assert ", in aten.mm.default: RuntimeError" in message


def test_layerdrop_is_an_error_naming_the_line_and_the_field_to_set():
    """Training-only random control flow is refused (README "Coverage"): the error names the
    line that draws and the field that turns it off; with the field at 0 the step captures."""
    model = LayerDrop()
    with pytest.raises(ValueReadError) as caught:
        training_step(model, torch.randn(2, 4))
    message = str(caught.value)
    text = "if not skip_the_layer:"
    assert f"{_line_of(LayerDrop, text)} `{text}`" in message
    assert "set the probability it reads (`self.layerdrop`) to 0" in message, message
    assert "\n" not in message
    model.layerdrop = 0.0
    assert training_step(model, torch.randn(2, 4)).graph.ops()


class DrawsEvenAtZero(nn.Module):
    """OmniASR's encoder loop, reduced: the coin is drawn whatever the probability."""

    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.layerdrop = layerdrop

    def forward(self, x):
        for layer in self.layers:
            to_drop = False
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    to_drop = True
            if not to_drop:
                x = layer(x)
        return x.sum()


def test_layerdrop_at_zero_captures_though_the_coin_is_still_drawn():
    """The error says to set the probability to 0; where the model draws the coin anyway, the
    step at 0 reads a value no draw can change, and is captured for it."""
    with pytest.raises(ValueReadError, match="`self.layerdrop`"):
        training_step(DrawsEvenAtZero(0.1), torch.randn(2, 4))
    step = training_step(DrawsEvenAtZero(0.0), torch.randn(2, 4))
    guards = [n for n in step.graph.ops() if step.graph.node(n).op == "magis.expect"]
    assert [step.graph.node(g).args[2] for g in guards] == [False, False]


def test_the_innermost_frame_outside_torch_and_magis_is_the_site():
    try:
        torch.ones(2) @ torch.ones(3)  # torch raises inside its own code; this line is the site
    except RuntimeError as exc:
        site = failure_site(exc)
    assert site is not None and site.code.startswith("torch.ones(2) @ torch.ones(3)")
    assert isinstance(ValueReadError("x"), CaptureError)


def test_a_value_read_on_a_path_a_config_chooses_names_the_config_field():
    model, batch = _fake(
        ChoosesByConfig, lambda: torch.randn(4, 4), lambda: torch.tensor([0, 2, 1, 0])
    )
    with pytest.raises(ValueReadError) as caught:
        training_step(model, batch)
    message = str(caught.value)
    text = "index = (labels >= 0).nonzero()"
    assert f"{_line_of(ChoosesByConfig, text)} `{text}`" in message, message
    assert "the path it is on is chosen by `self.config.problem_type`" in message
    model.config.problem_type = "single_label_classification"
    assert training_step(model, batch).graph.ops()


class MasksInPlace(nn.Module):
    """T5Gemma 2's embedding, reduced: rows chosen by a boolean mask overwritten in place. The
    forward traces (a masked write); its backward needs `nonzero` of the mask, and no frame of
    this file is on the stack when the autograd engine runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.marker = nn.Parameter(torch.randn(4))

    def forward(self, ids):
        x = self.embed(ids)
        x[ids == 3] = self.marker
        return x.sum()


def test_a_failure_in_the_backward_names_the_forward_line_that_recorded_it():
    model, (ids,) = _fake(MasksInPlace, lambda: torch.tensor([[1, 3, 5]]))
    with pytest.raises(ValueReadError) as caught:
        training_step(model, ids)
    message = str(caught.value)
    text = "x[ids == 3] = self.marker"
    assert "\n" not in message and "the backward of" in message, message
    assert f"{_line_of(MasksInPlace, text)} `{text}`" in message, message


class ReseedsInBackward(torch.autograd.Function):
    """Reformer's reversible layer, reduced: the backward seeds the generator to replay the
    forward's dropout."""

    @staticmethod
    def forward(ctx, x):
        return torch.nn.functional.dropout(x, 0.5) * 2

    @staticmethod
    def backward(ctx, grad):
        torch.manual_seed(1234)  # replay the forward's draw
        return torch.nn.functional.dropout(grad, 0.5) * 2


class Reseeds(nn.Module):
    def __init__(self, in_backward: bool) -> None:
        super().__init__()
        self.lin, self.in_backward = nn.Linear(4, 4), in_backward

    def forward(self, x):
        if self.in_backward:
            return ReseedsInBackward.apply(self.lin(x)).sum()
        seed = int(torch.seed() % 1000)  # a fresh seed from the OS every step
        return (torch.randn(4) * self.lin(x) + seed).sum()


@pytest.mark.parametrize(
    "in_backward, text",
    [(False, "seed = int(torch.seed() % 1000)"), (True, "torch.manual_seed(1234)")],
)
def test_a_step_that_seeds_the_generator_is_refused_naming_the_line(in_backward, text):
    """A draw after a seeding inside the step comes from a stream the graph does not hold
    (`magis.capture.reseed`): the capture names the line that seeded, in the forward or the
    backward, and leaves the user's generator as it was; magis's own seeding passes."""
    from magis.errors import ReseedError

    model, x = Reseeds(in_backward), torch.randn(2, 4)
    state = torch.get_rng_state()
    with pytest.raises(ReseedError) as caught:
        training_step(model, x)
    message = str(caught.value)
    where = "forward" if not in_backward else "backward"
    owner = Reseeds if not in_backward else ReseedsInBackward
    assert f"{_line_of(owner, text)} `{text}" in message, (where, message)
    assert "\n" not in message
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.manual_seed(5) is not None  # patched only while the step is traced


def test_an_installed_library_is_named_from_its_package_even_inside_the_working_folder(
    tmp_path, monkeypatch
):
    """A virtual environment in the project folder: `transformers/...`, not `.venv/lib/...`."""
    monkeypatch.chdir(tmp_path)
    installed = tmp_path / ".venv/lib/python3.11/site-packages/transformers/models/x.py"
    assert display_path(installed) == "transformers/models/x.py"
    assert display_path(tmp_path / "train.py") == "train.py"


def test_a_parameter_is_found_on_the_line_that_declares_it():
    def forward(
        self,
        hidden_states,
        x: list[int],
        *,
        image_rotary_emb=None,
    ):
        x = hidden_states  # a later use of the name is not its declaration
        return x

    first = forward.__code__.co_firstlineno
    assert parameter_site(forward, "x").lineno == first + 3
    assert parameter_site(forward, "x").code == "x: list[int],"
    assert parameter_site(forward, "image_rotary_emb").lineno == first + 5
    assert parameter_site(forward, "missing") is None
