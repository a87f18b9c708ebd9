"""`TrainStep`: the callable `magis.compile` returns; one optimized training step per call.

The program is generated and compiled once, when the step is made; a call only assembles the
program's inputs and runs it. Inputs, in the captured order (`magis.capture.trace`):

- the model's own parameters, as `p.detach()` (same storage, no autograd: the program's in-place
  writes are the model's new weights) and its buffers (batch norm statistics update in place);
- the optimizer's state, read from `optimizer.state[p]` on every call and created there, as
  torch.optim creates it, when missing (so `optimizer.load_state_dict` and checkpoints work);
- the hyperparameters, read from `optimizer.param_groups` on every call (so `lr_scheduler`s
  work) into 0-dim float64 tensors on the model's device;
- the batch's tensors, checked against the example batch's shapes, dtypes and device;
- the tensor constants the trace recorded, made once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from magis.backend import compile_program, tracker_for
from magis.capture.sharding import ShardLayout, full_tensors
from magis.capture.trace import Step
from magis.errors import MagisError
from magis.ir.guards import guard_nodes
from magis.train.cuda_graph import GraphedProgram
from magis.train.optimizers import ClipGradNorm, GraphOptimizer

if TYPE_CHECKING:
    from magis.plan import Plan


class BatchError(MagisError):
    """A batch, or a model, that is not what the step was compiled for."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(t.shape), t.dtype, t.device)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(map(str, self.shape))}] on {self.device}"


@dataclass(frozen=True)
class BatchSpec:
    """The structure of `(args, kwargs)` of a call: tensors become program inputs, every other
    leaf (an int, a flag, None) is a constant of the compiled step."""

    tree: pytree.TreeSpec
    leaves: tuple[TensorSpec | Any, ...]
    names: tuple[str, ...]  # one per leaf: batch[0], labels, ...

    @staticmethod
    def of(args: tuple, kwargs: dict) -> BatchSpec:
        with_paths, tree = pytree.tree_flatten_with_path((args, kwargs))
        leaves = tuple(
            TensorSpec.of(v) if isinstance(v, torch.Tensor) else v for _, v in with_paths
        )
        return BatchSpec(tree, leaves, tuple(_leaf_name(path) for path, _ in with_paths))

    @property
    def tensor_names(self) -> list[str]:
        return [
            n for n, v in zip(self.names, self.leaves, strict=True) if isinstance(v, TensorSpec)
        ]

    def tensors(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The call's tensors in input order, or a one-line BatchError naming what differs."""
        leaves, tree = pytree.tree_flatten((args, kwargs))
        if tree != self.tree:
            raise BatchError(
                f"the step was compiled for arguments {pytree.tree_unflatten(self.names, self.tree)}; "
                f"this call has {pytree.tree_unflatten(['*'] * len(leaves), tree)}"
            )
        out = []
        for name, expected, given in zip(self.names, self.leaves, leaves, strict=True):
            if not isinstance(expected, TensorSpec):
                if given is not expected and given != expected:
                    raise BatchError(
                        f"{name} was {expected!r} when the step was compiled and is {given!r} "
                        "now: arguments that are not tensors are constants of the step"
                    )
                continue
            if not isinstance(given, torch.Tensor) or TensorSpec.of(given) != expected:
                got = TensorSpec.of(given) if isinstance(given, torch.Tensor) else repr(given)
                raise BatchError(
                    f"{name} is {got}; the step was compiled for {expected} (magis.compile "
                    "plans one batch shape and does not re-plan: compile again for this one)"
                )
            out.append(given)
        return out

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple, dict]:
        """(args, kwargs) with `tensors` in the tensor leaves, constants elsewhere."""
        it = iter(tensors)
        leaves = [next(it) if isinstance(v, TensorSpec) else v for v in self.leaves]
        return pytree.tree_unflatten(leaves, self.tree)


def _leaf_name(path) -> str:
    """batch.0 for the first positional tensor, labels for a keyword one (a node name: letters,
    digits, '_', '.', '-')."""
    where, *rest = path  # (args, kwargs) first
    parts = ["batch"] if where.idx == 0 else []
    for key in rest:
        part = getattr(key, "idx", getattr(key, "key", getattr(key, "name", key)))
        parts.append(re.sub(r"[^\w\-]", "_", str(part)))
    return ".".join(parts)


class TrainStep:
    """`loss = train_step(*batch, **kwargs)`: one training step of `model` by `optimizer`,
    run as the plan's generated program. Built by `magis.compile`; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        step: Step,
        plan: Plan,
        rule: GraphOptimizer | ClipGradNorm,
        batch: BatchSpec,
        trainable: Sequence[str],
        clip_grad_norm: float | None = None,
        measure: bool = False,
        cuda_graph: bool | None = None,
        compiler: str = "python",
        sharding: ShardLayout | None = None,
    ) -> None:
        self.model, self.optimizer, self.step, self.batch = model, optimizer, step, batch
        self.sharding = sharding  # FSDP: the model's parameters are this rank's pieces
        self._plan = plan
        self._rule = rule
        self._optim = rule.inner if isinstance(rule, ClipGradNorm) else rule
        self.clip_grad_norm = clip_grad_norm
        self.measure = measure
        self.last_peak_bytes: int | None = None  # measured, when `measure` is on
        self.last_host_peak_bytes: int | None = None  # swapped-out bytes, when `measure` is on
        self._params = [p for _, p in model.named_parameters()]  # the step's WEIGHT inputs
        self._trainable = [model.get_parameter(n) for n in trainable]
        self._trained = [n not in step.untrained for n in trainable]
        self._buffers = [_owner(model, n) for n, _ in model.named_buffers()]
        self._training = model.training
        self.device = self._params[0].device if self._params else torch.device("cpu")
        n_scalars = len(rule.scalar_names())
        self._scalars = torch.zeros(n_scalars, dtype=torch.float64, device=self.device)
        self._scalar_views = [self._scalars[i] for i in range(n_scalars)]
        self._constants = [c.to(self.device) for c in step.program_inputs([])]
        self.compiler = compiler
        self.program = _program(plan, self.device, compiler, measure)
        # A CUDA graph replays the program (magis.train.cuda_graph): on by default on a GPU;
        # `measure` needs the program's ops dispatched one by one, so it runs without one.
        on_gpu = self.device.type == "cuda"
        if cuda_graph and not on_gpu:
            raise BatchError(
                f"cuda_graph=True needs a model on a GPU; this one is on {self.device}"
            )
        guarded = bool(guard_nodes(plan.graph))
        if cuda_graph and guarded:
            raise BatchError(
                "cuda_graph=True: this step reads tensor values in Python (captured for the "
                "values read, guarded), and a CUDA graph cannot read a value; pass "
                "cuda_graph=None or False"
            )
        # Inductor's segments are not captured as one CUDA graph here (yet); a guard reads a
        # value on the host, which a CUDA graph cannot.
        self.cuda_graph = on_gpu and cuda_graph is not False and not measure and not guarded
        self.cuda_graph = self.cuda_graph and compiler == "python"
        self._graphed: GraphedProgram | None = None

    @property
    def plan(self) -> Plan:
        """The plan this step runs (`.save(path)`, then `magis.compile(..., plan=path)`)."""
        return self._plan

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The model's parameters by name, in full: under FSDP (`sharding`) all-gathered from
        every rank's pieces (every rank must call it, as FSDP2's `full_tensor()`), else the
        model's own."""
        named = {n: p.detach() for n, p in self.model.named_parameters()}
        return named if self.sharding is None else full_tensors(self.sharding, named)

    @property
    def captured_peak_bytes(self) -> int | None:
        """Under a CUDA graph, the allocator's peak while the program was captured (resident
        inputs included): what each replay holds. None before the capture (the second call)."""
        return self._graphed.captured_peak_bytes if self._graphed is not None else None

    @property
    def simulated_peak_bytes(self) -> int:
        """The plan's peak by the simulator: what `last_peak_bytes` measures on a CPU (through
        Inductor, at most this: fused intermediates are never allocated)."""
        from magis.cost import get_cost_model
        from magis.sim import simulate

        return simulate(self._plan.graph, self._plan.order, get_cost_model("unit")).peak_bytes

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        data = self.batch.tensors(args, kwargs)
        self._check_model()
        self._optim.check_structure(self.optimizer)
        for p in self._trainable:
            p.grad = None  # gradients live inside the program; a stale one must not be applied
        # Through optimizer.step: its hooks run and an lr_scheduler sees the step taken. With no
        # parameter holding a .grad, torch.optim's own update loop skips every parameter.
        return self.optimizer.step(lambda: self._step(data))

    def _step(self, data: list[torch.Tensor]) -> torch.Tensor:
        opt = self._optim
        state, first = opt.ensure_state(self.optimizer, self._trainable, self._trained)
        values = opt.scalar_values(self.optimizer, self._trainable, self._trained, first)
        if isinstance(self._rule, ClipGradNorm):
            values = [self._max_norm(), *values]
        self._scalars.copy_(torch.tensor(values, dtype=torch.float64))
        flat = [
            *(p.detach() for p in self._params),
            *(getattr(module, name) for module, name in self._buffers),
            *(t for s in state for t in s),
            *self._scalar_views,
            *data,
            *self._constants,
        ]
        with torch.no_grad():
            out = self._run(flat, len(data))
        opt.record_step(self.optimizer, self._trainable, state, self._trained)
        return out[0]

    def _run(self, flat: list[torch.Tensor], n_data: int) -> tuple:
        if self.cuda_graph:
            if self._graphed is None:
                first = len(flat) - len(self._constants) - n_data
                self._graphed = GraphedProgram(self.program, range(first, first + n_data))
            return self._graphed(*flat)
        if not self.measure:
            return self.program(*flat)
        tracker = tracker_for(self.program, flat)
        self.program.host_pool.peak_bytes = self.program.host_pool.live_bytes
        with tracker:
            out = self.program(*flat)
        self.last_peak_bytes = tracker.peak_bytes
        self.last_host_peak_bytes = self.program.host_pool.peak_bytes
        return out

    def _max_norm(self) -> float:
        if self.clip_grad_norm is None:
            raise BatchError("this step was compiled with clip_grad_norm: give it a number")
        return float(self.clip_grad_norm)

    def _check_model(self) -> None:
        if self._params and self._params[0].device != self.device:
            raise BatchError(
                f"the model moved from {self.device} to {self._params[0].device} after "
                "magis.compile: compile again on its new device"
            )
        if self.model.training != self._training:
            mode = "training" if self._training else "eval"
            raise BatchError(
                f"the step was compiled in {mode} mode and the model is no longer in it: "
                f"call model.{'train' if self._training else 'eval'}() or compile again"
            )

    def __repr__(self) -> str:
        return (
            f"TrainStep({type(self.model).__name__}, {type(self.optimizer).__name__}, "
            f"{len(self.plan.order)} nodes on {self.device})"
        )


COMPILERS = ("python", "inductor")


def _program(plan: Plan, device: torch.device, compiler: str, measured: bool = False):
    """The plan's program: generated Python (`magis.backend.codegen`) or Inductor-compiled
    segments (`magis.backend.inductor`, compiled on the first call; `measured`: with their
    buffers allocated where the tracker sees them)."""
    if compiler == "python":
        return compile_program(plan.graph, plan.order, device)
    if compiler == "inductor":
        from magis.backend.inductor import InductorProgram

        return InductorProgram(plan.graph, plan.order, device, measured)
    raise BatchError(f"unknown compiler={compiler!r}; choose one of {', '.join(COMPILERS)}")


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that holds buffer `name`, and the buffer's name there (looked up on every
    call: `module.to()` replaces buffer tensors, unlike parameters)."""
    prefix, _, leaf = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), leaf
