"""The recorder (one dispatch mode over the fake mode) gives make_fx's graph, node for node, and
hands to make_fx what it does not cover."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import magis.capture.recorder as recorder
from magis.capture.recorder import NotRecorded, record
from magis.capture.steps import workload_step
from magis.ir.serialize import graph_to_json


def _document(step) -> dict:
    doc = graph_to_json(step.graph)
    doc.pop("digest", None)
    return doc


def _recorded_or_traced(monkeypatch) -> list[str]:
    """Which tracer made each first trace: 'recorder', or 'make_fx' where it declined."""
    used: list[str] = []
    real = recorder.record

    def watching(fn, args, root=None):
        try:
            gm = real(fn, args, root)
        except NotRecorded:
            used.append("make_fx")
            raise
        used.append("recorder")
        return gm

    monkeypatch.setattr(recorder, "record", watching)
    return used


def _refuse(*args, **kwargs):
    raise NotRecorded("make_fx for the comparison")


# RoBERTa's LM head calls an activation module built in its forward (not a submodule: the
# node's module is its caller's, as in make_fx); T5 holds in-place ops on views (the second
# trace through `functionalize` follows the recorder's graph); Mamba's scan is a Python loop;
# the MoE's experts, AdamW's state and bf16 autocast casts (the autocast cache is off).
@pytest.mark.parametrize(
    ("workload", "kind"),
    [
        ("corpus:roberta:tiny", "sgd"),
        ("corpus:t5:tiny", "sgd"),
        ("corpus:mamba:tiny", "sgd"),
        ("corpus:qwen3_moe:tiny", "adamw-bf16"),
    ],
)
def test_recorder_gives_make_fxs_graph(monkeypatch, workload, kind):
    used = _recorded_or_traced(monkeypatch)
    _, recorded = workload_step(workload, step=kind)
    assert used == ["recorder"]
    monkeypatch.setattr(recorder, "record", _refuse)
    _, traced = workload_step(workload, step=kind)
    assert _document(recorded) == _document(traced)


def _names_ops_and_layouts(gm) -> list[tuple]:
    rows = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        layout = (tuple(val.shape), val.stride()) if isinstance(val, torch.Tensor) else None
        args = torch.fx.node.map_arg(n.args, lambda a: a.name)
        rows.append((n.op, n.name, str(n.target), args, layout))
    return rows


def test_constants_metadata_mutation_and_value_reads_as_make_fx():
    """A `torch.tensor` constant (an attribute, lifted by `lift_fresh_copy`), its value read
    (not recorded), an in-place `transpose_` (the value before it keeps its strides), a
    multi-output op (a `getitem` per output) and a backward that saves an output."""

    def step(*args):  # varargs, as the steps magis traces: placeholders named by position
        (x,) = args
        scale = torch.tensor(2.0)
        y = torch.relu(x * scale)
        if scale.item() > 1.0:
            y = y + 1
        values, indices = torch.max(y, 1)
        z = y.clone()
        z.transpose_(0, 1)
        (grad,) = torch.autograd.grad((z.sum() + values.sum()) * 3, [x])
        return z, grad, indices

    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(3, 4, requires_grad=True)
        traced = make_fx(step)(x)
        recorded = record(step, [x])
    assert _names_ops_and_layouts(recorded) == _names_ops_and_layouts(traced)
    clone = next(n for n in recorded.graph.nodes if n.name == "clone")
    assert clone.meta["val"].stride() == (4, 1)  # as made, not as transposed later


def test_tensor_subclass_is_left_to_make_fx():
    class Tagged(torch.Tensor):
        """A wrapper subclass with its own dispatch (as DTensor and async collectives have)."""

        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

        def __init__(self, inner):
            self.inner = inner

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda t: t.inner if isinstance(t, Tagged) else t  # noqa: E731
            args = torch.utils._pytree.tree_map(unwrap, args)
            kwargs = torch.utils._pytree.tree_map(unwrap, kwargs or {})
            return func(*args, **kwargs)

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(2, 2))
        tagged = Tagged(torch.randn(2, 2))
        with pytest.raises(NotRecorded, match="subclass"):
            record(lambda *a: (a[0] + tagged,), [x])


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_recorder_gives_make_fxs_graph_with_collectives(monkeypatch, kind):
    """One rank of a data-parallel job: functional collectives (all-gather, reduce-scatter,
    all-reduce and their waits) are recorded as make_fx records them."""
    from magis.capture.sharding import PlannedJob

    used = _recorded_or_traced(monkeypatch)
    _, recorded = workload_step("corpus:llama:tiny", job=PlannedJob(kind, 4))
    assert used == ["recorder"]
    monkeypatch.setattr(recorder, "record", _refuse)
    _, traced = workload_step("corpus:llama:tiny", job=PlannedJob(kind, 4))
    assert _document(recorded) == _document(traced)
