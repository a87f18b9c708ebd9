"""What a captured training step does besides forward and backward: its update rule and the
precision its forward runs in.

`UpdateRule` is the contract an optimizer in tensor ops fulfils (the zoo's `OptimizerSpec`
here, `magis.compile`'s `torch.optim` mirrors in `magis.train.optimizers`). `StepKind` is the
one list of the steps the command line captures (`--step`, issue 42): `sgd`, plain SGD in the
workload's dtype (the zoo's step since the start), and `adamw-bf16`, the step people train
with: forward and loss under `torch.autocast(bfloat16)` (the casts of weights and activations
become ops of the graph), float32 master weights, and AdamW (decoupled weight decay, two
float32 state tensors per weight, resident inputs updated in place, bias-corrected at a fixed
step count).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from magis.errors import MagisError

OPTIMIZERS = ("sgd", "adam", "adamw", None)


class UpdateRule(Protocol):
    """What a captured training step does with its gradients: an optimizer in tensor ops.

    `state_names(i)` names the state tensors that trainable parameter i carries (each becomes an
    OPT_STATE placeholder shaped like the parameter); `scalar_names()` names the 0-dim inputs the
    update reads (hyperparameters: OPT_STATE placeholders, so that a learning-rate schedule is a
    new input value rather than a new graph). `update` writes the new parameters and state in
    place, as torch.optim does; a gradient is None for a parameter the loss does not reach.
    """

    def state_names(self, index: int) -> tuple[str, ...]: ...

    def scalar_names(self) -> tuple[str, ...]: ...

    def update(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        state: Sequence[Sequence[torch.Tensor]],
        scalars: Sequence[torch.Tensor],
    ) -> None: ...


@dataclass(frozen=True)
class OptimizerSpec:
    """The zoo's fixed optimizer: plain SGD (p -= lr g), or Adam / AdamW at a fixed step count.

    Its hyperparameters are constants of the graph and it has no scalar inputs: it describes one
    step for analysis (`magis analyze`, `optimize`, `run` on the zoo). Training with a
    `torch.optim` optimizer, a schedule and a real step count goes through `magis.compile`.
    """

    kind: str | None = "sgd"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    step: int = 1
    weight_decay: float = 0.01  # AdamW's (torch.optim.AdamW's default); Adam and SGD have none

    def state_names(self, index: int) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") if self.kind in ("adam", "adamw") else ()

    def scalar_names(self) -> tuple[str, ...]:
        return ()

    def update(self, params, grads, state, scalars=()) -> None:
        """Update `params` (and `state`) in place, as torch.optim would."""
        with torch.no_grad():
            for p, g, s in zip(params, grads, state, strict=True):
                if g is None:
                    continue
                if self.kind == "sgd":
                    p.sub_(g, alpha=self.lr)
                elif self.kind == "adam":
                    self._adam(p, g, *s)
                elif self.kind == "adamw":
                    self._adamw(p, g, *s)

    def _adam(self, p, g, m, v) -> None:
        b1, b2 = self.betas
        c1, c2 = 1 - b1**self.step, 1 - b2**self.step
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v / c2).sqrt_().add_(self.eps)
        p.addcdiv_(m, denom, value=-self.lr / c1)

    def _adamw(self, p, g, m, v) -> None:
        """torch.optim.AdamW's `_single_tensor_adam` op for op (decoupled decay first), so a
        step equals torch's on the same state: the verification's reference is torch's rule."""
        b1, b2 = self.betas
        p.mul_(1 - self.lr * self.weight_decay)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        step_size = self.lr / (1 - b1**self.step)
        denom = (v.sqrt() / (1 - b2**self.step) ** 0.5).add_(self.eps)
        p.addcdiv_(m, denom, value=-step_size)


class StepKind(enum.Enum):
    """The training steps the commands capture (`--step`); one definition of the names."""

    SGD = "sgd"
    ADAMW_BF16 = "adamw-bf16"

    @property
    def optimizer(self) -> str:
        """The `OptimizerSpec` kind of the update."""
        return {StepKind.SGD: "sgd", StepKind.ADAMW_BF16: "adamw"}[self]

    @property
    def autocast(self) -> torch.dtype | None:
        """The dtype the forward and the loss run in under autocast; None: no autocast."""
        return torch.bfloat16 if self is StepKind.ADAMW_BF16 else None

    @property
    def keeps_master_dtype(self) -> bool:
        """Whether the weights must stay float32: autocast casts float32 tensors only (a
        float64 weight is left as it is, so a float64 `:tiny` capture would hold no bf16)."""
        return self.autocast is not None


DEFAULT_STEP = StepKind.SGD
STEP_NAMES = tuple(k.value for k in StepKind)


class StepKindError(MagisError):
    """A `--step` that names no step kind."""


def read_step_kind(value: str | StepKind) -> StepKind:
    """`value` as a StepKind; an unknown name is a one-line error listing the known ones."""
    if isinstance(value, StepKind):
        return value
    try:
        return StepKind(value)
    except ValueError:
        raise StepKindError(
            f"unknown step {value!r}: choose one of {', '.join(STEP_NAMES)}"
        ) from None


def autocast_loss(
    loss: Callable[..., torch.Tensor], dtype: torch.dtype | None
) -> Callable[..., torch.Tensor]:
    """`loss(model, *data)` run under `torch.autocast(dtype)` for the model's device type (the
    forward and the loss, as an eager loop wraps them; backward and update stay outside)."""
    if dtype is None:
        return loss

    def cast(model: torch.nn.Module, *data: torch.Tensor) -> torch.Tensor:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        ctx = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with ctx:
            return loss(model, *data)

    return cast
