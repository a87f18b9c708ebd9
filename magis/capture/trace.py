"""Capture a function or a whole training step as a magis `Graph`, allocating nothing.

The step is traced under a FakeTensorMode (tensors carry shapes and dtypes, no data: a
3B-parameter model traces on a laptop) by `recorder.first_trace` (make_fx's graph from one
dispatch mode; make_fx itself where that declines), then its in-place ops are made out of place
(`inplace.functionalized`, or a second trace through `functionalize` where that pass declines).
Input mutations come back as in-place writes into the placeholders (see `fx_import`), so a
parameter updated by the optimizer counts once, as it does in eager PyTorch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from unittest import mock

import torch
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.func import functional_call, functionalize
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from magis.capture.collectives import AllReduceGradients, DataParallel, sink_waits
from magis.capture.fx_import import (
    constant_values,
    import_fx,
    module_paths,
    placeholder_modules,
)
from magis.capture.inplace import functionalized
from magis.capture.kernels import capture_kernels
from magis.capture.recorder import first_trace
from magis.capture.reseed import refuse_reseeding
from magis.capture.sharding import ShardLayout, unsharded
from magis.capture.source import capture_failure, fake_kernel_failures_kept
from magis.capture.specialize import (
    FAKE_ONLY,
    ValueReads,
    real_copies,
    real_step_inputs,
    refuse_random_reads,
    seeded,
    warn_specialized,
)
from magis.capture.step_kinds import OPTIMIZERS, OptimizerSpec, UpdateRule, autocast_loss
from magis.errors import CaptureError, MagisError, RandomDrawError, ValueReadError
from magis.ir import Graph, PlaceholderKind


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
    # Trainable parameters the loss does not reach: no gradient, left as they are.
    untrained: tuple[str, ...] = ()

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
            tensor = _real_like(meta, example, dtype, gen)
            if self.graph.node(nid).placeholder_kind is PlaceholderKind.OPT_STATE:
                # Adam's second moment is a running mean of squares: a negative one would make
                # its square root NaN in eager and program alike, and hide any difference.
                tensor = tensor.abs()
            tensors.append(tensor)
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


def _trace_functional(
    fn: Callable,
    fake_args: Sequence[torch.Tensor],
    root: torch.nn.Module | None = None,
    real_args: Callable[[], list] | None = None,
) -> torch.fx.GraphModule:
    """The first trace (`first_trace`), then its in-place ops made out of place (autograd already
    ran in the trace).

    With `root`, the module `fn` calls, each forward node records the stack of `root`'s
    submodules it ran in (make_fx's `record_module_stack`, which finds the modules through
    `fn._orig_mod`), and the stacks reach the final graph (`module_paths`). Where the step
    reads a tensor's value and `real_args` makes real copies of the inputs, the step is traced
    again over them, specialized to the values read (`magis.capture.specialize`)."""
    with capture_kernels(), fake_kernel_failures_kept() as logged:
        try:
            return _trace_once_or_twice(fn, fake_args, root)
        except MagisError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises many types; classify, re-raise
            rerun = partial(_trace_once_or_twice, fn, fake_args, root)
            failure = capture_failure(exc, logged, rerun)
            specializable = isinstance(failure, ValueReadError) and not isinstance(
                failure, RandomDrawError
            )
            if real_args is None and specializable:
                raise type(failure)(f"{failure}{FAKE_ONLY}") from exc
            if real_args is None or not specializable:
                raise failure from exc
    try:
        with unset_fake_temporarily(), seeded(0):  # real tensors, outside the fake mode
            gm = _trace_once_or_twice(fn, real_args(), root, real_args)
    except MagisError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code, run for real: one line
        raise capture_failure(exc) from exc
    refuse_random_reads(gm)
    warn_specialized(gm)
    return gm


def _trace_once_or_twice(
    fn: Callable,
    args: Sequence[torch.Tensor],
    root: torch.nn.Module | None,
    real_args: Callable[[], list] | None = None,
) -> torch.fx.GraphModule:
    """The trace, then `functionalized` (one pass over the graph); where its in-place ops are not
    the plain kind, the graph traced again through `functionalize`, which gives the same graph
    where both apply (`tests/capture/test_inplace.py`) at about the first trace's cost. With
    `real_args` the trace runs on real tensors, values read where the step reads them, and the
    second trace on fresh copies (the first updated its copies' weights).

    Stack traces are not recorded (`do_not_emit_stack_traces`): magis reads none, and
    make_fx's `record_module_stack` tracer would format one for every node (9% of a capture).
    Nor is the GraphModules' Python code generated (`_use_lazy_graph_module`: made when a
    module is first run or its code read): magis reads their graphs, and generating the code
    of a 29,000-node step, for make_fx's module and again for `functionalized`'s, took a ninth
    of its capture."""
    specialized = {"_error_on_data_dependent_ops": real_args is None}
    reads = contextlib.nullcontext if real_args is None else ValueReads
    patched = mock.patch.object(torch.fx.config, "do_not_emit_stack_traces", True)
    with patched, _use_lazy_graph_module(True):
        with reads(), refuse_reseeding():
            gm = first_trace(fn, args, root, specialized)
        # a real trace's metas come from many fake modes: the one-pass rewrite cannot run them
        fast = functionalized(gm) if real_args is None else None
        if fast is not None:
            return fast
        again = args if real_args is None else real_args()
        detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in again]
        # the real trace again under another seed: a read that changes depends on a draw
        with reads(), seeded(1) if real_args is not None else contextlib.nullcontext():
            if root is None and real_args is None:
                return make_fx(functionalize(gm, remove="mutations"), **specialized)(*detached)
            with fx_traceback.preserve_node_meta():
                run = torch.fx.Interpreter(gm).run
                return make_fx(functionalize(run, remove="mutations"), **specialized)(*detached)


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
        gm = _trace_functional(_as_tuple_fn(fn), fake, real_args=real_copies(example_args))
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


def training_step(
    model: torch.nn.Module,
    example_inputs: tuple | torch.Tensor,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: str | None = "sgd",
    lr: float = 1e-3,
    autocast: torch.dtype | None = None,
    parallel: DataParallel | None = None,
    sharding: ShardLayout | None = None,
) -> Step:
    """Capture forward, backward and weight update of `model` as one Graph (the zoo's step).

    Without `loss_fn`, `model(*example_inputs)` must return the loss (a scalar tensor, or an
    output with `.loss`). With `loss_fn`, the first input is the model's input and
    `loss_fn(model(example_inputs[0]), *example_inputs)` is the loss (labels are the remaining
    inputs). `optimizer` is "sgd", "adam", "adamw" or None (then the gradients are outputs).
    With `autocast` (a dtype), the forward and the loss run under `torch.autocast` (a
    `StepKind`'s precision, `magis.capture.step_kinds`); backward and update do not.
    Parameters and buffers may be real or fake; nothing is allocated either way. With
    `parallel`, the gradients are all-reduced over its ranks first (DDP); with `sharding` too,
    the parameters are pieces, gathered and reduce-scattered (FSDP, `capture_training`).
    (`magis.compile` captures a user's `loss_fn(model, *batch)` and `torch.optim` optimizer.)
    """
    if optimizer not in OPTIMIZERS:
        raise MagisError(f"unknown optimizer {optimizer!r}; use one of sgd, adam, adamw or None")
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            # FakeTensor's capture would fail on it with a TypeError about weak references
            raise CaptureError(
                f"training_step's example input {i} is a {type(x).__name__}, not a tensor: pass "
                "a tensor or a tuple of tensors (a dict batch goes through magis.compile or a "
                "model file's factory)"
            )
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    if loss_fn is None:
        loss = lambda m, *data: loss_of(m(*data))  # noqa: E731
    else:
        loss = lambda m, *data: loss_fn(m(data[0]), *data)  # noqa: E731
    rule = None if optimizer is None else OptimizerSpec(optimizer, lr)
    if rule is not None and parallel is not None and sharding is None:
        rule = AllReduceGradients(rule, parallel)
    return capture_training(
        model,
        autocast_loss(loss, autocast),
        inputs,
        rule,
        params=trained,
        data_names=[f"input{i}" for i in range(len(inputs))],
        sharding=sharding,
    )


def capture_training(
    model: torch.nn.Module,
    loss: Callable[..., torch.Tensor],
    data: Sequence[torch.Tensor],
    rule: UpdateRule | None,
    *,
    params: Sequence[str] | None = None,
    trainable: Sequence[str] | None = None,
    scalars: Sequence[torch.Tensor] = (),
    data_names: Sequence[str] | None = None,
    sharding: ShardLayout | None = None,
) -> Step:
    """Capture `loss(model, *data)`, its gradients and `rule`'s update as one Graph.

    Placeholders, in order: the parameters named in `params` (default: all; WEIGHT), every
    buffer (BUFFER), the state of each parameter in `trainable` (default: `params`; OPT_STATE),
    `rule.scalar_names()` (example values `scalars`; OPT_STATE), `data` (DATA). Gradients are
    taken for `trainable` only. With `rule` None the outputs are the loss and the gradients,
    else the loss alone; `Step.untrained` names the trainable parameters the loss does not reach
    (the rule leaves them, and their state, untouched, as torch.optim does). With `sharding`
    the model's parameters are this rank's pieces (`magis.capture.sharding.shard_parameters`):
    the step gathers them around the forward and backward and reduce-scatters their gradients,
    as FSDP2 does; the update applies to the pieces.
    """
    params = [n for n, _ in model.named_parameters()] if params is None else list(params)
    trainable = list(params) if trainable is None else list(trainable)
    buffer_names = [n for n, _ in model.named_buffers()]
    state_names = [rule.state_names(i) if rule else () for i in range(len(trainable))]
    scalar_names = list(rule.scalar_names()) if rule else []
    if len(scalars) != len(scalar_names):
        raise ValueError(f"{len(scalar_names)} scalars named, {len(scalars)} given")
    layout = _Layout(params, trainable, buffer_names, state_names, scalar_names, len(data))
    untrained: list[str] = []
    wrapper = _LossModule(model, loss)
    fn = _step_fn(wrapper, layout, rule, untrained, sharding)
    real_params = _named(model.named_parameters(), params)
    real_buffers = _named(model.named_buffers(), buffer_names)
    mode = _fake_mode([*real_params, *real_buffers, *scalars, *data])
    with mode:
        fake_params = [_to_fake(mode, p.detach()) for p in real_params]
        by_name = dict(zip(params, fake_params, strict=True))
        state = [
            torch.zeros_like(by_name[n])
            for n, s in zip(trainable, state_names, strict=True)
            for _ in s
        ]
        flat = [
            *fake_params,
            *(_to_fake(mode, b) for b in real_buffers),
            *state,
            *(_to_fake(mode, s) for s in scalars),
            *(_to_fake(mode, x) for x in data),
        ]
        real = None
        if sharding is None and not isinstance(rule, AllReduceGradients):  # no process group
            state_of = [(n, len(s)) for n, s in zip(trainable, state_names, strict=True)]
            real = real_step_inputs(
                real_params,
                real_buffers,
                dict(zip(params, real_params, strict=True)),
                state_of,
                [*scalars, *data],
            )
        gm = _trace_functional(fn, flat, root=wrapper, real_args=real)
    sink_waits(gm.graph)  # collectives waited for where they are read (data parallelism)
    names = layout.names(data_names)
    modules = {**placeholder_modules(names, layout.kinds()), **module_paths(gm, "model")}
    graph = import_fx(gm, layout.kinds(), names, modules)
    outs = ["loss"] + ([f"grad.{n}" for n in trainable] if rule is None else [])
    examples = (*real_params, *real_buffers, *([None] * len(state)), *scalars, *data)
    return Step(
        graph,
        fn,
        names,
        layout.kinds(),
        outs,
        examples,
        tuple(constant_values(gm)),
        tuple(dict.fromkeys(untrained)),
    )


@dataclass(frozen=True)
class _Layout:
    """Where each kind of input sits in a training step's flat input list."""

    params: list[str]
    trainable: list[str]
    buffers: list[str]
    state: list[tuple[str, ...]]  # per trainable parameter
    scalars: list[str]
    n_data: int

    @property
    def n_state(self) -> int:
        return sum(len(s) for s in self.state)

    def kinds(self) -> list[PlaceholderKind]:
        return (
            [PlaceholderKind.WEIGHT] * len(self.params)
            + [PlaceholderKind.BUFFER] * len(self.buffers)
            + [PlaceholderKind.OPT_STATE] * (self.n_state + len(self.scalars))
            + [PlaceholderKind.DATA] * self.n_data
        )

    def names(self, data_names: Sequence[str] | None) -> list[str]:
        data = list(data_names) if data_names else [f"input{i}" for i in range(self.n_data)]
        state = [f"{n}.{s}" for n, ss in zip(self.trainable, self.state, strict=True) for s in ss]
        return [*self.params, *self.buffers, *state, *self.scalars, *data]

    def split(self, flat: Sequence) -> tuple[list, list, list[list], list, list]:
        """(params, buffers, state per trainable parameter, scalars, data) of `flat`."""
        n_p, n_b, n_s = len(self.params), len(self.buffers), self.n_state
        it = iter(flat[n_p + n_b : n_p + n_b + n_s])
        state = [[next(it) for _ in names] for names in self.state]
        scalars_end = n_p + n_b + n_s + len(self.scalars)
        return (
            list(flat[:n_p]),
            list(flat[n_p : n_p + n_b]),
            state,
            list(flat[n_p + n_b + n_s : scalars_end]),
            list(flat[scalars_end:]),
        )


class _LossModule(torch.nn.Module):
    """`loss(model, *data)` as a module's forward, so functional_call swaps the model's tensors
    for the traced ones whatever the user's code does with the model."""

    def __init__(self, model: torch.nn.Module, loss: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *data: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model, *data)


def _named(items, names: list[str]) -> list[torch.Tensor]:
    table = dict(items)
    return [table[n] for n in names]


def _step_fn(
    wrapper: _LossModule,
    layout: _Layout,
    rule: UpdateRule | None,
    untrained: list,
    sharding: ShardLayout | None = None,
):
    trainable_at = [layout.params.index(n) for n in layout.trainable]

    def step(*flat):
        params, buffers, state, scalars, data = layout.split(flat)
        # Leaves that need gradients, whether the caller's copies asked for them or not.
        for i in trainable_at:
            if not params[i].requires_grad:
                params[i].requires_grad_()
        trained = [params[i] for i in trainable_at]
        tensors = {
            **{f"model.{n}": p for n, p in zip(layout.params, params, strict=True)},
            **{f"model.{n}": b for n, b in zip(layout.buffers, buffers, strict=True)},
        }
        grad_ctx = contextlib.nullcontext() if torch.is_grad_enabled() else torch.enable_grad()
        with grad_ctx, _gathering(sharding, wrapper, tensors) as tensors:
            loss = functional_call(wrapper, tensors, tuple(data))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise MagisError("the loss must be a tensor with one element (a scalar)")
            grads = torch.autograd.grad(loss, trained, allow_unused=True)
        untrained[:] = [n for n, g in zip(layout.trainable, grads, strict=True) if g is None]
        if rule is None:
            grads = [
                torch.zeros_like(p) if g is None else g for p, g in zip(trained, grads, strict=True)
            ]
            return (loss.detach(), *grads)
        with torch.no_grad():
            rule.update(trained, grads, state, scalars)
        return (loss.detach(),)

    return step


def _gathering(sharding: ShardLayout | None, wrapper: _LossModule, tensors: dict):
    """`tensors` as they are, or, with `sharding`, unsharded (`magis.capture.sharding`)."""
    if sharding is None:
        return contextlib.nullcontext(tensors)
    return unsharded(sharding, wrapper.model, tensors, prefix="model.")


def loss_of(out) -> torch.Tensor:
    """The loss in a model's output: the tensor itself, or its `.loss` (Hugging Face)."""
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None:
        raise MagisError(
            "the model returned no loss: pass loss_fn=, or return a scalar or an output with .loss"
        )
    return loss
