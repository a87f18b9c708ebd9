"""AOTAutograd's joint forward+backward capture of a training step, and its partitions.

The first half of the min-cut baseline (mincut.py): AOTAutograd traces the joint graph under
fake tensors, and a partitioner (`default_partition`, or PyTorch's
`min_cut_rematerialization_partition` of the fusion-aware checkpointing paper, optionally under
an activation memory budget) cuts it into a forward and a backward graph. Random ops are made
MUST_SAVE before partitioning (the upstream fix of pytorch/pytorch#190759; see mincut.py).
"""

from __future__ import annotations

import contextlib
import enum
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from functorch.compile import aot_function, default_partition, min_cut_rematerialization_partition
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy

from magis.errors import MagisError
from magis.ir import PlaceholderKind

aten = torch.ops.aten

TANGENT = "tangents_1"  # the name of the ones_like(loss) node: the forward/backward boundary


class MinCutError(MagisError):
    """AOTAutograd could not trace or partition the step."""


class RandomRecomputeError(MinCutError):
    """The partition recomputes a random op in the backward: the step it runs is not the step."""


class NeedsWorkloadError(MagisError):
    """A min-cut baseline was handed a bare graph: it must re-trace the model."""


class Partitioner(enum.Enum):
    DEFAULT = "default"  # save what eager autograd saves
    MIN_CUT = "min-cut"  # min_cut_rematerialization_partition, under a memory budget


@dataclass(frozen=True)
class PartitionSpec:
    """Which partitioner, and for min-cut the activation memory budget (1.0: plain min-cut)."""

    partitioner: Partitioner = Partitioner.MIN_CUT
    budget: float = 1.0
    save_random: bool = True  # keep random ops out of recomputation (see `partition`)
    label: str | None = None  # the method name its points carry (a sweep names them all alike)

    @property
    def torch_budget(self) -> float:
        """The value given to torch: budget 0 takes an early return in torch that skips every
        recompute ban, random ops included; the least positive budget runs the same knapsack
        that every other budget runs, with the bans (and so a correct program)."""
        if self.save_random and self.budget == 0.0:
            return math.ulp(0.0)
        return self.budget

    @property
    def method(self) -> str:
        if self.label is not None:
            return self.label
        if self.partitioner is Partitioner.DEFAULT:
            return "default-partition"
        return "min-cut" if self.budget == 1.0 else "min-cut-budget"

    def params(self) -> dict[str, float | str]:
        if self.partitioner is Partitioner.DEFAULT:
            return {"partitioner": "default"}
        return {"partitioner": "min-cut", "budget": self.budget}


@dataclass(frozen=True)
class JointCapture:
    """The joint forward+backward graph AOTAutograd traced for a loss, and how to read it.

    Inputs are the parameters, buffers and data, in that order (as `training_step` orders them).
    """

    joint: fx.GraphModule = field(repr=False)
    num_fwd_outputs: int  # updated buffers, then the loss
    static_inputs: tuple[int, ...]
    mutated_inputs: tuple[int, ...]  # inputs the forward updates (batch-norm statistics)
    names: tuple[str, ...]
    kinds: tuple[PlaceholderKind, ...]
    lr: float

    @property
    def n_params(self) -> int:
        return self.kinds.count(PlaceholderKind.WEIGHT)


@dataclass(frozen=True)
class Partitioned:
    """A forward and a backward `fx.GraphModule` cut from one `JointCapture`."""

    forward: fx.GraphModule = field(repr=False)
    backward: fx.GraphModule = field(repr=False)
    spec: PartitionSpec
    joint: JointCapture = field(repr=False)

    def saved_nodes(self) -> list[fx.Node]:
        """Backward inputs that the forward hands over (everything but the tangent)."""
        return [n for n in placeholders_of(self.backward) if not n.name.startswith("tangents")]

    def saved_activation_bytes(self) -> int:
        """Bytes of the saved values that are not step inputs (what torch logs as activations)."""
        return sum(_nbytes(n.meta["val"]) for n in self.saved_nodes() if n.name not in self._inputs)

    def saved_storage_bytes(self) -> int:
        """The same, counting each storage once (torch's sum counts a view beside its base)."""
        storages = {}
        for n in self.saved_nodes():
            if n.name not in self._inputs and isinstance(n.meta["val"], torch.Tensor):
                storage = n.meta["val"].untyped_storage()
                storages[StorageWeakRef(storage)] = storage.nbytes()
        return sum(storages.values())

    @property
    def _inputs(self) -> set[str]:
        return {n.name for n in placeholders_of(self.forward)}


# --- tracing ---------------------------------------------------------------------------------


def placeholders_of(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _nbytes(val) -> int:
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _loss_fn(model: torch.nn.Module, names: Sequence[str], n_tensors: int, loss_fn: Callable):
    def loss(*flat):
        tensors = dict(zip(names, flat[:n_tensors], strict=True))
        inputs = flat[n_tensors:]
        if loss_fn is None:  # the model's forward is the loss (a corpus workload's UserLoss)
            return functional_call(model, tensors, tuple(inputs))
        return loss_fn(functional_call(model, tensors, (inputs[0],)), *inputs)

    return loss


def _copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy the partitioner may mutate (it eliminates dead code and re-tags nodes in place)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def capture_joint(
    model: torch.nn.Module, inputs: tuple, loss_fn: Callable, lr: float = 1e-3
) -> JointCapture:
    """Trace `loss_fn(model(inputs[0]), *inputs)` through AOTAutograd and keep its joint graph.

    Parameters, buffers and inputs may be real or fake (a model built under a FakeTensorMode).
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    buffers = list(model.named_buffers())
    names = [n for n, _ in params] + [n for n, _ in buffers]
    seen: dict[str, object] = {}

    def keep_joint(joint, joint_inputs, **kw):
        seen["joint"], seen["kw"] = _copy_module(joint), kw
        return default_partition(joint, joint_inputs, **kw)

    def identity(gm, _example_inputs):
        return gm

    compiled = aot_function(
        _loss_fn(model, names, len(names), loss_fn),
        fw_compiler=identity,
        bw_compiler=identity,
        partition_fn=keep_joint,
    )
    mode = detect_fake_mode([t for _, t in params + buffers] + list(inputs))
    ctx = TracingContext(mode)
    with tracing(ctx), mode if mode is not None else contextlib.nullcontext():
        leaves = [p.detach().requires_grad_() for _, p in params]
        compiled(*leaves, *(b for _, b in buffers), *inputs)
    return _joint_capture(seen, ctx.fw_metadata, params, buffers, len(inputs), lr)


def _joint_capture(seen, meta, params, buffers, n_inputs: int, lr: float) -> JointCapture:
    if meta.num_intermediate_bases or meta.num_outputs != 1 or meta.tokens:
        raise MinCutError("the traced loss is not a single plain output (aliases or effects)")
    kinds = (
        [PlaceholderKind.WEIGHT] * len(params)
        + [PlaceholderKind.BUFFER] * len(buffers)
        + [PlaceholderKind.DATA] * n_inputs
    )
    names = [n for n, _ in params] + [n for n, _ in buffers]
    names += [f"input{i}" for i in range(n_inputs)]
    return JointCapture(
        seen["joint"],
        seen["kw"]["num_fwd_outputs"],
        tuple(seen["kw"].get("static_lifetime_input_indices") or ()),
        tuple(meta.mutated_inp_runtime_indices),
        tuple(names),
        tuple(kinds),
        lr,
    )


def partition(joint: JointCapture, spec: PartitionSpec) -> Partitioned:
    """Cut `joint` into a forward and a backward graph with the partitioner `spec` names."""
    module = _copy_module(joint.joint)
    kw = {
        "num_fwd_outputs": joint.num_fwd_outputs,
        "static_lifetime_input_indices": list(joint.static_inputs),
    }
    if spec.partitioner is Partitioner.DEFAULT:
        fw, bw = default_partition(module, [], **kw)
    else:
        if spec.save_random and spec.budget < 1.0:  # plain min-cut bans random ops itself
            _must_save_random(module)
        with torch._functorch.config.patch(activation_memory_budget=spec.torch_budget):
            fw, bw = min_cut_rematerialization_partition(module, [], **kw)
    redrawn = _random_ops(bw)
    if redrawn:
        raise RandomRecomputeError(
            f"{spec.method} at budget {spec.budget} recomputes {redrawn[0]} in the backward: a "
            "fresh random draw, so the gradients differ (pytorch/pytorch#190758)"
        )
    return Partitioned(fw, bw, spec, joint)


def _is_random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in tags


def _random_ops(gm: fx.GraphModule) -> list[str]:
    """Random ops whose draw is used (the default partition leaves dead, impure copies)."""
    return [str(n.target) for n in gm.graph.nodes if _is_random(n) and n.users]


def _must_save_random(module: fx.GraphModule) -> None:
    """Mark every random op MUST_SAVE, so the budget's knapsack cannot trade it back into
    recomputation (the fix proposed upstream in pytorch/pytorch#190759).

    Dropout's output is then re-expressed from its saved boolean mask, `x * mask * scale`
    (bitwise what native_dropout computes in float32/64; one extra bfloat16 rounding), so the
    partitioner may save the 1-byte mask and recompute the output, as it would recompute it
    from a replayed RNG state, rather than keep the whole output alive.
    """
    for node in list(module.graph.nodes):
        if _is_random(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        if node.target is aten.native_dropout.default:
            _dropout_from_mask(module.graph, node)


def _dropout_from_mask(graph: fx.Graph, node: fx.Node) -> None:
    outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    if 0 not in outs or 1 not in outs:
        return
    x, p = node.args[0], node.args[1]
    with graph.inserting_after(max(outs.values(), key=_position)):
        masked = fake_call(graph, aten.mul.Tensor, (x, outs[1]))
    with graph.inserting_after(masked):
        out = fake_call(graph, aten.mul.Tensor, (masked, 1.0 / (1.0 - p)))
    outs[0].replace_all_uses_with(out)


def _position(node: fx.Node) -> int:
    return next(i for i, n in enumerate(node.graph.nodes) if n is node)


def fake_call(
    graph: fx.Graph, target, args: tuple, kwargs=None, name: str | None = None
) -> fx.Node:
    """A call node whose meta value is computed under the fake mode of its arguments."""
    node = graph.create_node("call_function", target, args, kwargs or {}, name=name)
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode(vals) or FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        node.meta["val"] = target(*vals, **(kwargs or {}))
    return node
