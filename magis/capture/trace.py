"""Capture a function or a whole training step as a magis `Graph`, allocating nothing.

The step is traced with make_fx under a FakeTensorMode (tensors carry shapes and dtypes, no data:
a 3B-parameter model traces on a laptop), then traced again through `functionalize` so the graph
has no in-place ops. Input mutations come back as in-place writes into the placeholders (see
`fx_import`), so a parameter updated by the optimizer counts once, as it does in eager PyTorch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.func import functional_call, functionalize
from torch.fx.experimental.proxy_tensor import make_fx

from magis.capture.fx_import import constant_values, import_fx
from magis.errors import CaptureError, MagisError
from magis.ir import Graph, PlaceholderKind

OPTIMIZERS = ("sgd", "adam", None)


@dataclass
class Step:
    """A captured program: its graph, and the eager function it came from.

    `fn(*flat_inputs)` runs the same computation eagerly (mutating inputs in place as the graph's
    in-place writes do) and returns the graph's outputs: the reference for verification.
    """

    graph: Graph
    fn: Callable[..., tuple]
    input_names: list[str]
    input_kinds: list[PlaceholderKind]
    output_names: list[str]
    example_inputs: tuple = field(default=(), repr=False)  # fake or real, as given
    constants: tuple = field(default=(), repr=False)  # values of the CONSTANT placeholders

    def program_inputs(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What a generated program takes: the step's inputs, then its tensor constants."""
        return [
            *inputs,
            *(
                _real_like(self.graph.node(p).outputs[0], c, None, torch.Generator())
                for p, c in zip(
                    self.graph.placeholders(PlaceholderKind.CONSTANT), self.constants, strict=True
                )
            ),
        ]

    def make_inputs(self, dtype: torch.dtype | None = None, seed: int = 0) -> list[torch.Tensor]:
        """Real tensors with the shapes of the graph's placeholders (random, seeded).

        Integer placeholders (token ids, labels) are drawn in [0, 2) unless `example_inputs`
        are real, in which case those are copied: ids must stay within the vocabulary.
        """
        gen = torch.Generator().manual_seed(seed)
        tensors = []
        for i, nid in enumerate(self.graph.placeholders()[: len(self.input_names)]):
            meta = self.graph.node(nid).outputs[0]
            example = self.example_inputs[i] if i < len(self.example_inputs) else None
            tensors.append(_real_like(meta, example, dtype, gen))
        return tensors


def _real_like(meta, example, dtype: torch.dtype | None, gen: torch.Generator) -> torch.Tensor:
    tdtype = meta.torch_dtype
    if isinstance(example, torch.Tensor) and not isinstance(example, FakeTensor):
        t = example.detach().clone()
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t
    if tdtype.is_floating_point:
        out_dtype = dtype if dtype is not None else tdtype
        return torch.randn(meta.shape, generator=gen, dtype=torch.float64).to(out_dtype) * 0.1
    return torch.randint(0, 2, meta.shape, generator=gen).to(tdtype)


def _is_data_dependent(exc: BaseException) -> bool:
    names = {type(e).__name__ for e in _chain(exc)}
    markers = {
        "DataDependentOutputException",
        "GuardOnDataDependentSymNode",
        "DynamicOutputShapeException",
        "UnsupportedOperatorException",
    }
    return bool(names & markers) or "data-dependent" in str(exc).lower()


def _chain(exc: BaseException):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _trace_functional(fn: Callable, fake_args: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """make_fx, then make_fx again through functionalize (autograd already ran in the first)."""
    try:
        gm = make_fx(fn)(*fake_args)
        detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in fake_args]
        return make_fx(functionalize(gm, remove="mutations"))(*detached)
    except MagisError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises many types; classify and re-raise
        if _is_data_dependent(exc):
            raise CaptureError(
                "cannot capture a static graph: the step reads a tensor's value in Python "
                "(.item(), bool(tensor) or data-dependent control flow); make it tensor "
                "arithmetic or move it out of the step"
            ) from exc
        raise CaptureError(
            f"tracing failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        ) from exc


def _fake_mode(tensors: Sequence = ()) -> FakeTensorMode:
    """The fake mode `tensors` already live in (a model built under one), else a new one."""
    existing = detect_fake_mode([t for t in tensors if isinstance(t, torch.Tensor)])
    return existing if existing is not None else FakeTensorMode(allow_non_fake_inputs=True)


def _to_fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    return t if isinstance(t, FakeTensor) else mode.from_tensor(t)


def capture(fn: Callable, *example_args: torch.Tensor) -> Step:
    """Capture `fn(*example_args)` (tensors in, tensor or tuple of tensors out) as a Graph.

    Every argument becomes a DATA placeholder; an argument `fn` mutates in place is written in
    place by the graph too.
    """
    mode = _fake_mode(example_args)
    with mode:
        fake = [_to_fake(mode, a) for a in example_args]
        gm = _trace_functional(_as_tuple_fn(fn), fake)
    kinds = [PlaceholderKind.DATA] * len(example_args)
    names = [f"arg{i}" for i in range(len(example_args))]
    graph = import_fx(gm, kinds, names)
    outs = [f"out{i}" for i in range(len(graph.outputs))]
    return Step(
        graph, _as_tuple_fn(fn), names, kinds, outs, tuple(example_args), tuple(constant_values(gm))
    )


def _as_tuple_fn(fn: Callable) -> Callable[..., tuple]:
    def wrapped(*args):
        out = fn(*args)
        return tuple(out) if isinstance(out, list | tuple) else (out,)

    return wrapped


@dataclass(frozen=True)
class OptimizerSpec:
    """Plain SGD (p -= lr g) or Adam with bias correction at a fixed step count."""

    kind: str | None = "sgd"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    step: int = 1

    def state_per_param(self) -> int:
        return 2 if self.kind == "adam" else 0

    def update(
        self, params: list[torch.Tensor], grads: Sequence[torch.Tensor], state: list[torch.Tensor]
    ) -> None:
        """Update `params` (and `state`) in place, as torch.optim would."""
        with torch.no_grad():
            if self.kind == "sgd":
                for p, g in zip(params, grads, strict=True):
                    p.sub_(g, alpha=self.lr)
            elif self.kind == "adam":
                self._adam(params, grads, state)

    def _adam(self, params, grads, state) -> None:
        b1, b2 = self.betas
        c1, c2 = 1 - b1**self.step, 1 - b2**self.step
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            m, v = state[2 * i], state[2 * i + 1]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / c2).sqrt_().add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / c1)


def training_step(
    model: torch.nn.Module,
    example_inputs: tuple | torch.Tensor,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: str | None = "sgd",
    lr: float = 1e-3,
) -> Step:
    """Capture forward, backward and weight update of `model` as one Graph.

    Without `loss_fn`, `model(*example_inputs)` must return the loss (a scalar tensor, or an
    output with `.loss`). With `loss_fn`, the first input is the model's input and
    `loss_fn(model(example_inputs[0]), *example_inputs)` is the loss (labels are the remaining
    inputs). `optimizer` is "sgd", "adam" or None (then the gradients are outputs).
    Parameters and buffers may be real or fake; nothing is allocated either way.
    """
    if optimizer not in OPTIMIZERS:
        raise MagisError(f"unknown optimizer {optimizer!r}; use one of sgd, adam or None")
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    spec = OptimizerSpec(optimizer, lr)
    param_names = [n for n, p in model.named_parameters() if p.requires_grad]
    buffer_names = [n for n, _ in model.named_buffers()]
    fn = _step_fn(model, param_names, buffer_names, len(inputs), loss_fn, spec)
    mode = _fake_mode([*model.parameters(), *model.buffers(), *inputs])
    with mode:
        params = [
            _to_fake(mode, p.detach()).requires_grad_()
            for p in _named(model.named_parameters(), param_names)
        ]
        buffers = [_to_fake(mode, b) for b in _named(model.named_buffers(), buffer_names)]
        state = [torch.zeros_like(p) for p in params for _ in range(spec.state_per_param())]
        fake_inputs = [_to_fake(mode, x) for x in inputs]
        gm = _trace_functional(fn, [*params, *buffers, *state, *fake_inputs])
    kinds = (
        [PlaceholderKind.WEIGHT] * len(params)
        + [PlaceholderKind.BUFFER] * len(buffers)
        + [PlaceholderKind.OPT_STATE] * len(state)
        + [PlaceholderKind.DATA] * len(inputs)
    )
    names = (
        param_names
        + buffer_names
        + [
            f"{n}.{s}"
            for n in param_names
            for s in ("exp_avg", "exp_avg_sq")[: spec.state_per_param()]
        ]
        + [f"input{i}" for i in range(len(inputs))]
    )
    graph = import_fx(gm, kinds, names)
    outs = ["loss"] + ([f"grad.{n}" for n in param_names] if optimizer is None else [])
    examples = (
        *_named(model.named_parameters(), param_names),
        *_named(model.named_buffers(), buffer_names),
        *([None] * len(state)),
        *inputs,
    )
    return Step(graph, fn, names, kinds, outs, examples, tuple(constant_values(gm)))


def _named(items, names: list[str]) -> list[torch.Tensor]:
    table = dict(items)
    return [table[n] for n in names]


def _step_fn(model, param_names, buffer_names, n_inputs, loss_fn, spec: OptimizerSpec):
    n_p, n_b = len(param_names), len(buffer_names)
    n_s = n_p * spec.state_per_param()

    def step(*flat):
        # Leaves that need gradients, whether the caller's copies asked for them or not.
        params = [p if p.requires_grad else p.requires_grad_() for p in flat[:n_p]]
        buffers = flat[n_p : n_p + n_b]
        state = list(flat[n_p + n_b : n_p + n_b + n_s])
        inputs = flat[n_p + n_b + n_s :]
        tensors = {
            **dict(zip(param_names, params, strict=True)),
            **dict(zip(buffer_names, buffers, strict=True)),
        }
        grad_ctx = contextlib.nullcontext() if torch.is_grad_enabled() else torch.enable_grad()
        with grad_ctx:
            if loss_fn is None:
                loss = _loss_of(functional_call(model, tensors, tuple(inputs)))
            else:
                loss = loss_fn(functional_call(model, tensors, (inputs[0],)), *inputs)
            grads = torch.autograd.grad(loss, params)
        if spec.kind is None:
            return (loss.detach(), *grads)
        spec.update(params, grads, state)
        return (loss.detach(),)

    return step


def _loss_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None:
        raise MagisError("the model returned no loss: pass loss_fn=, or return a scalar / .loss")
    return loss
