"""`torch.optim` optimizers as updates inside the captured graph (issue #15).

A `GraphOptimizer` has two halves that must agree:

- the graph half (an `UpdateRule`, see `magis.capture.trace`): tensor ops that update every
  parameter and its state in place, reading every hyperparameter from a 0-dim float64 input;
- the host half, run on every call: it reads the user's optimizer (`param_groups`, so a
  `torch.optim.lr_scheduler` works; `state`, for Adam's step count), returns the values of those
  inputs, creates missing state as torch.optim would, and afterwards records what torch.optim
  records (`momentum_buffer`, `step`), so `optimizer.state_dict()` round-trips.

Supported: `torch.optim.SGD` (momentum, dampening, nesterov, weight_decay), `Adam` and `AdamW`
(without amsgrad), none of them with maximize. The values of the hyperparameters are inputs;
whether a term exists at all (weight decay or momentum zero or not, nesterov) is structure, fixed
when the step is compiled, exactly where torch.optim branches on it.

The arithmetic is torch.optim's single-tensor code op for op, the host computing Adam's bias
corrections from the real step count as torch does: in float64 on a CPU the updates are
torch's to the bit.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from magis.capture.collectives import DataParallel
from magis.errors import MagisError

SUPPORTED = "torch.optim.SGD, torch.optim.Adam and torch.optim.AdamW"


class OptimizerError(MagisError):
    """An optimizer, or a setting of one, that magis.compile cannot put into the graph."""


class Kind(enum.Enum):
    SGD = "SGD"
    ADAM = "Adam"
    ADAMW = "AdamW"


_TYPES = {torch.optim.SGD: Kind.SGD, torch.optim.Adam: Kind.ADAM, torch.optim.AdamW: Kind.ADAMW}


@dataclass(frozen=True)
class GroupShape:
    """What is structure in a param group: which terms of the update exist."""

    weight_decay: bool
    momentum: bool = False  # SGD
    nesterov: bool = False  # SGD
    decoupled: bool = False  # Adam: AdamW's decay of the weights, not of the gradient

    @property
    def tag(self) -> str:
        flags = ("momentum", "nesterov", "weight_decay", "decoupled")
        flags = [f for f in flags if getattr(self, f)]
        return "-".join(flags) or "plain"


def group_shape(kind: Kind, group: dict) -> GroupShape:
    """The structure of `group`, or an OptimizerError for a setting the graph cannot follow."""
    if group.get("maximize", False):
        raise OptimizerError(f"{kind.value} with maximize=True is not supported; use {SUPPORTED}")
    decay = float(group["weight_decay"]) != 0
    if kind is Kind.SGD:
        return GroupShape(decay, float(group["momentum"]) != 0, bool(group["nesterov"]))
    if group.get("amsgrad", False):
        raise OptimizerError(
            f"{kind.value} with amsgrad=True is not supported; use it without, or {SUPPORTED}"
        )
    # AdamW is Adam with decoupled_weight_decay=True in its groups (torch >= 2.6)
    decoupled = bool(group.get("decoupled_weight_decay", kind is Kind.ADAMW))
    return GroupShape(decay, decoupled=decoupled and decay)


def _scalar_dtype(fused: bool = False) -> torch.dtype:
    """The dtype torch.optim gives Adam's `step` (torch.optim.optimizer._get_scalar_dtype)."""
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@dataclass(frozen=True)
class GraphOptimizer:
    """A torch.optim optimizer over the trainable parameters of a step, as graph and host code.

    `group_of[i]` is the param group of trainable parameter i; `shapes[g]` the structure of
    group g, fixed at compile time (a call that finds it changed is an OptimizerError).
    """

    kind: Kind
    shapes: tuple[GroupShape, ...]
    group_of: tuple[int, ...]

    @staticmethod
    def of(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> GraphOptimizer:
        """The graph form of `optimizer` over `params`, the trainable parameters among its
        groups' (the step's order)."""
        kind = _TYPES.get(type(optimizer))
        if kind is None:
            raise OptimizerError(
                f"magis.compile cannot run {type(optimizer).__name__}; it supports {SUPPORTED}"
            )
        group_index = {
            id(p): g for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]
        }
        shapes = tuple(group_shape(kind, grp) for grp in optimizer.param_groups)
        return GraphOptimizer(kind, shapes, tuple(group_index[id(p)] for p in params))

    # --- the graph half (magis.capture.trace.UpdateRule) -----------------------------------------

    def state_names(self, index: int) -> tuple[str, ...]:
        if self.kind is Kind.SGD:
            return ("momentum_buffer",) if self.shapes[self.group_of[index]].momentum else ()
        return ("exp_avg", "exp_avg_sq")

    def scalar_names(self) -> tuple[str, ...]:
        return tuple(
            f"optimizer.group{g}.{self.kind.value}.{shape.tag}.{name}"
            for g, shape in enumerate(self.shapes)
            for name in self._hyper_names(shape)
        )

    def _hyper_names(self, shape: GroupShape) -> tuple[str, ...]:
        if self.kind is Kind.SGD:
            names = ["neg_lr"]
            names += ["weight_decay"] if shape.weight_decay else []
            names += ["momentum", "grad_weight"] if shape.momentum else []
            return tuple(names)
        decay = (["decay" if shape.decoupled else "weight_decay"]) if shape.weight_decay else []
        return (
            *decay,
            "one_minus_beta1",
            "beta2",
            "one_minus_beta2",
            "bias_correction2_sqrt",
            "eps",
            "neg_step_size",
        )

    def update(self, params, grads, state, scalars) -> None:
        """Update each parameter with a gradient, and its state, in place (torch.optim's math)."""
        per_group = self._split(scalars)
        for p, g, s, group in zip(params, grads, state, self.group_of, strict=True):
            if g is None:
                continue  # torch.optim skips a parameter without .grad
            h = per_group[group]
            if self.kind is Kind.SGD:
                _sgd(p, g, s, h, self.shapes[group])
            else:
                _adam(p, g, s, h, self.shapes[group])

    def _split(self, scalars: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        out, it = [], iter(scalars)
        for shape in self.shapes:
            out.append({name: next(it) for name in self._hyper_names(shape)})
        return out

    # --- the host half ---------------------------------------------------------------------------

    def check_structure(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer still has the groups and terms this step was compiled with."""
        if len(optimizer.param_groups) != len(self.shapes):
            raise OptimizerError(
                f"the optimizer has {len(optimizer.param_groups)} param groups, the compiled step "
                f"{len(self.shapes)}: compile again after add_param_group"
            )
        for g, (grp, shape) in enumerate(zip(optimizer.param_groups, self.shapes, strict=True)):
            now = group_shape(self.kind, grp)
            if now != shape:
                raise OptimizerError(
                    f"param group {g} changed from {shape.tag} to {now.tag} (weight decay or "
                    "momentum turned on or off, or nesterov): compile again"
                )

    def ensure_state(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor],
        trained: Sequence[bool],
    ) -> tuple[list[list[torch.Tensor]], list[bool]]:
        """Each trainable parameter's state tensors (graph order), created as torch.optim would
        create them, and for each group whether this is its first momentum step (SGD).

        A parameter the loss does not reach (`trained` False) gets no state in the optimizer,
        as in torch.optim; it is handed zeros the graph never touches."""
        out: list[list[torch.Tensor]] = []
        first: dict[int, set[bool]] = {}
        for p, group, ok in zip(params, self.group_of, trained, strict=True):
            names = self.state_names(len(out))
            if not ok or not names:  # (optimizer.state is a defaultdict: no lookup, no entry)
                out.append([torch.zeros_like(p) for _ in names])
                continue
            st = optimizer.state[p]
            if self.kind is Kind.SGD:
                first.setdefault(group, set()).add("momentum_buffer" not in st)
                # torch.optim's first momentum step copies the gradient: 0 * momentum + 1 * g
                st_buf = st.get("momentum_buffer")
                out.append([torch.zeros_like(p) if st_buf is None else st_buf])
                continue
            if self.kind is not Kind.SGD and not st:
                _init_adam_state(st, p, optimizer.param_groups[group])
            out.append([st[n] for n in names])
        mixed = [g for g, flags in first.items() if len(flags) > 1]
        if mixed:
            raise OptimizerError(
                f"param group {mixed[0]} has momentum buffers for some parameters only: "
                "load a complete optimizer state_dict"
            )
        return out, [True in first.get(g, ()) for g in range(len(self.shapes))]

    def scalar_values(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor],
        trained: Sequence[bool],
        first: Sequence[bool],
    ) -> list[float]:
        """The inputs' values for this call, from the groups as they are now."""
        values: list[float] = []
        for g, (grp, shape) in enumerate(zip(optimizer.param_groups, self.shapes, strict=True)):
            if self.kind is Kind.SGD:
                values += _sgd_scalars(grp, shape, first[g])
            else:
                step = self._next_step(optimizer, params, trained, g)
                values += _adam_scalars(grp, shape, step)
        return values

    def first_step_values(self, optimizer: torch.optim.Optimizer) -> list[float]:
        """The inputs' values at a first step, from the groups alone (no state is created)."""
        values: list[float] = []
        for grp, shape in zip(optimizer.param_groups, self.shapes, strict=True):
            if self.kind is Kind.SGD:
                values += _sgd_scalars(grp, shape, True)
            else:
                values += _adam_scalars(grp, shape, 1.0)
        return values

    def _next_step(self, optimizer, params, trained, group: int) -> float:
        steps = {
            float(optimizer.state[p]["step"])
            for p, g, ok in zip(params, self.group_of, trained, strict=True)
            if g == group and ok
        }
        if len(steps) > 1:
            raise OptimizerError(
                f"the parameters of param group {group} are at different Adam steps "
                f"({sorted(steps)}): magis.compile updates a group together"
            )
        return (steps.pop() if steps else 0.0) + 1.0

    def record_step(
        self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], state, trained
    ) -> None:
        """After a step: the state torch.optim keeps (Adam's count, SGD's momentum buffer)."""
        for p, s, ok in zip(params, state, trained, strict=True):
            if not ok or not s:
                continue
            if self.kind is Kind.SGD:
                optimizer.state[p]["momentum_buffer"] = s[0]
            else:
                optimizer.state[p]["step"] += 1


def _init_adam_state(st: dict, p: torch.Tensor, group: dict) -> None:
    """Adam's lazy state initialization, as `torch.optim.Adam._init_group` does it."""
    fused = bool(group.get("fused"))
    if fused or bool(group.get("capturable")):
        st["step"] = torch.zeros((), dtype=_scalar_dtype(fused), device=p.device)
    else:
        st["step"] = torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# --- graph arithmetic ----------------------------------------------------------------------------


def _sgd(p, g, state, h, shape: GroupShape) -> None:
    """torch.optim.SGD's `_single_tensor_sgd` with tensor hyperparameters.

    `add(x, alpha=a)` becomes `addcmul(., x, a)`: the same product and sum, so in float64 on a
    CPU the result is torch's to the bit."""
    if shape.weight_decay:
        g = torch.addcmul(g, p, h["weight_decay"])  # g + wd * p
    if shape.momentum:
        (buf,) = state
        buf.mul_(h["momentum"]).addcmul_(g, h["grad_weight"])  # buf * m + (1 - dampening) * g
        g = torch.addcmul(g, buf, h["momentum"]) if shape.nesterov else buf
    p.addcmul_(g, h["neg_lr"])


def _adam(p, g, state, h, shape: GroupShape) -> None:
    """torch.optim.Adam's `_single_tensor_adam` (AdamW: decoupled decay), tensor hyperparameters.

    Op for op as torch computes it, where a `value=` that must be a number is multiplied into
    an operand first (value * t1 * t2 == (value * t1) * t2): float64 results on a CPU are
    torch's to the bit, which the equal-training tests rely on (a parameter whose gradient is
    rounding noise, such as a key bias under softmax, would amplify any other rounding).
    """
    exp_avg, exp_avg_sq = state
    if shape.weight_decay:
        if shape.decoupled:
            p.mul_(h["decay"])
        else:
            g = torch.addcmul(g, p, h["weight_decay"])
    exp_avg.lerp_(g, h["one_minus_beta1"])
    exp_avg_sq.mul_(h["beta2"]).addcmul_(g * h["one_minus_beta2"], g)
    denom = (exp_avg_sq.sqrt() / h["bias_correction2_sqrt"]).add_(h["eps"])
    p.addcdiv_(exp_avg * h["neg_step_size"], denom)


# --- host arithmetic -----------------------------------------------------------------------------


def _sgd_scalars(group: dict, shape: GroupShape, first: bool) -> list[float]:
    values = [-float(group["lr"])]
    if shape.weight_decay:
        values.append(float(group["weight_decay"]))
    if shape.momentum:
        values += [float(group["momentum"]), 1.0 if first else 1.0 - float(group["dampening"])]
    return values


def _adam_scalars(group: dict, shape: GroupShape, step: float) -> list[float]:
    """As `_single_tensor_adam` computes them in Python from the step count."""
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    values = []
    if shape.weight_decay:
        values.append(1 - lr * wd if shape.decoupled else wd)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    return [*values, 1 - beta1, beta2, 1 - beta2, bias_correction2_sqrt, eps, -step_size]


@dataclass(frozen=True)
class ClipGradNorm:
    """Gradient clipping by global norm in front of an optimizer, as
    `torch.nn.utils.clip_grad_norm_` computes it: coef = min(max_norm / (norm + 1e-6), 1)."""

    inner: GraphOptimizer
    # FSDP: the gradients are this rank's pieces, the norm is the whole model's: the squares
    # summed over the ranks (an all-reduce, as clip_grad_norm_ on FSDP2's DTensors does)
    sharded_over: DataParallel | None = None

    def state_names(self, index: int) -> tuple[str, ...]:
        return self.inner.state_names(index)

    def scalar_names(self) -> tuple[str, ...]:
        return ("clip_grad_norm.max_norm", *self.inner.scalar_names())

    def update(self, params, grads, state, scalars) -> None:
        present = [g for g in grads if g is not None]
        norms = [torch.linalg.vector_norm(g, 2.0) for g in present]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        if self.sharded_over is not None:
            c10d = torch.ops._c10d_functional
            name = self.sharded_over.group_name
            total = torch.sqrt(c10d.wait_tensor(c10d.all_reduce(total * total, "sum", name)))
        # max_norm / t is Tensor.__rtruediv__ in torch: reciprocal(t) * max_norm
        coef = torch.clamp(torch.reciprocal(total + 1e-6) * scalars[0], max=1.0)
        clipped = [None if g is None else g * coef for g in grads]
        self.inner.update(params, clipped, state, scalars[1:])
