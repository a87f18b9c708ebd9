"""Min-cut re-materialization: PyTorch's own partitioner, judged by our simulator (MAGIS §7.1).

The method is the one of "fusion-aware-checkpointing" (papers/fusion-aware-checkpointing.txt), as
PyTorch ships it: AOTAutograd traces the joint forward+backward graph of a step and
`torch._functorch.partitioners.min_cut_rematerialization_partition` cuts it in two, choosing what
the forward saves for the backward by a minimum cut (cheap, fusible ops are recomputed in the
backward instead of saved). Its memory-budget mode (`torch._functorch.config.
activation_memory_budget`, the knob torch.compile users turn) solves a knapsack of what to
recompute so that at most that fraction of the activations min-cut would save is saved; swept over
0..1 it draws the method's Pareto curve. `default_partition` (save what the eager autograd saves)
is available as a reference point.

Mapping onto our graph: for each partition we build ONE program, in this order: the forward
`fx.GraphModule` (its inputs are the step's parameters, buffers and data; its outputs the loss, the
updated buffers and the saved values), the tangent `ones_like(loss)`, the backward
`fx.GraphModule` (its inputs are the saved values and the tangent, its outputs the gradients), then
the SGD update `p -= lr * g` written back into each parameter, as `magis.capture.training_step`
captures it; buffers the forward updates (batch-norm statistics) are written back likewise. That
fx graph goes through our importer (`magis.capture.fx_import`), so the simulator costs exactly the
ops torch would run, in the order it runs them (each value freed after its last use, as the
generated fx code and the boxed calling convention of AOTAutograd free them).

Random ops: in budget mode torch 2.13 may recompute dropout in the backward, where it draws a
fresh mask and the gradients silently differ from eager (pytorch/pytorch#190758; budget 0 even
skips every recompute ban). By default (`PartitionSpec.save_random`) we apply the upstream fix of
pytorch/pytorch#190759 before partitioning: random ops are MUST_SAVE, dropout's output is
re-expressed from its boolean mask so only the mask need be saved, and budget 0 runs the same
knapsack as every other budget at the least positive budget. Any plan that still redraws a used
random value in the backward is refused (`RandomRecomputeError`, reported as a `Failure`).
`save_random=False` gives torch's plans as they are (and so, with dropout, that error).

Design choice: `Baseline.points(graph, cost)` receives an already-captured graph, which has lost
the model that AOTAutograd must trace again. The min-cut baselines are therefore driven by a
workload: `mincut_points(workload, cost, budgets)` is the entry point, `min_cut_baseline(workload)`
binds one to a workload as an ordinary `Baseline` (its points carry their own graph, the
partitioned program; the graph it is handed is not used), and the registered `MIN_CUT` /
`MIN_CUT_BUDGET` raise `NeedsWorkloadError` when handed a bare graph. A workload that AOTAutograd
cannot trace or partition yields a `Failure` with the error, never an exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from magis.baselines.base import Baseline, BaselinePoint, Failure, Outcome, point
from magis.baselines.joint import (
    TANGENT,
    JointCapture,
    MinCutError,
    NeedsWorkloadError,
    Partitioned,
    Partitioner,
    PartitionSpec,
    capture_joint,
    fake_call,
    partition,
    placeholders_of,
)
from magis.capture.building import default_dtype
from magis.capture.fx_import import constant_values, import_fx
from magis.capture.trace import Step, training_step
from magis.capture.workloads import get_workload
from magis.cost import CostModel
from magis.errors import MagisError, exception_line
from magis.ir import Graph

aten = torch.ops.aten

# 1.0 is the default min-cut; 0.0 saves only what cannot be recomputed.
DEFAULT_BUDGETS: tuple[float, ...] = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0)
# --- one program: forward, tangent, backward, update -----------------------------------------


def to_fx(part: Partitioned) -> fx.GraphModule:
    """The whole step as one functional fx program (see the module docstring for its order)."""
    joint = part.joint
    graph, root = fx.Graph(), torch.nn.Module()
    inputs = []
    for i, ph in enumerate(placeholders_of(part.forward)):
        node = graph.placeholder(f"primals_{i + 1}")
        node.meta = dict(ph.meta)
        inputs.append(node)
    fw_out = _inline(graph, root, part.forward, inputs, "fw")
    n_mut = len(joint.mutated_inputs)
    loss = fw_out[n_mut]
    saved = list(fw_out[joint.num_fwd_outputs :])
    _check_saved(part, saved)
    tangent = fake_call(graph, aten.ones_like.default, (loss,), name=TANGENT)
    grads = _inline(graph, root, part.backward, [*saved, tangent], "bw")
    for i, value in zip(joint.mutated_inputs, fw_out[:n_mut], strict=True):
        fake_call(graph, aten.copy_.default, (inputs[i], value))
    for p, g in zip(inputs[: joint.n_params], grads, strict=False):
        new = fake_call(graph, aten.sub.Tensor, (p, g), {"alpha": joint.lr})
        fake_call(graph, aten.copy_.default, (p, new))
    graph.output((loss,))
    return fx.GraphModule(root, graph)


def _inline(graph: fx.Graph, root: torch.nn.Module, gm: fx.GraphModule, args, prefix: str):
    """Copy `gm`'s nodes into `graph` with its placeholders bound to `args`; its outputs."""
    out = graph.graph_copy(gm.graph, dict(zip(placeholders_of(gm), args, strict=True)))
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.target.startswith(("fw_", "bw_")):
            setattr(root, f"{prefix}_{node.target}", getattr(gm, node.target))
            node.target = f"{prefix}_{node.target}"
    return list(out) if isinstance(out, list | tuple) else [out]


def _check_saved(part: Partitioned, saved: list[fx.Node]) -> None:
    expected = part.saved_nodes()
    if len(saved) != len(expected):
        raise MinCutError(
            f"the forward hands {len(saved)} values to a backward that takes {len(expected)}"
        )


def to_graph(part: Partitioned) -> tuple[Graph, tuple]:
    """Our Graph of the partitioned step, and the values of its CONSTANT placeholders."""
    gm = to_fx(part)
    graph = import_fx(gm, part.joint.kinds, part.joint.names)
    return graph, tuple(constant_values(gm))


# --- running the partitioned graphs as torch does --------------------------------------------


def _boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` called with one list it empties, so an input dies at its last use there
    (AOTAutograd's boxed calling convention for saved values)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(fx.graph._BoxedCodeGen())
    return fx.GraphModule(gm, graph)


def run_partitioned(part: Partitioned, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """One training step with real tensors: forward graph, backward graph, SGD update.

    Updates parameters and buffers in `inputs` in place; returns the loss.
    """
    joint = part.joint
    n_mut, n_fwd = len(joint.mutated_inputs), joint.num_fwd_outputs
    outs = _boxed(part.forward)(list(inputs))
    for i, value in zip(joint.mutated_inputs, outs[:n_mut], strict=True):
        inputs[i].copy_(value)
    loss = outs[n_mut]
    bw_args = [*outs[n_fwd:], torch.ones_like(loss)]
    del outs
    grads = list(_boxed(part.backward)(bw_args))
    with torch.no_grad():
        for i in range(joint.n_params):
            inputs[i].sub_(grads[i], alpha=joint.lr)
            grads[i] = None
    return loss.detach()


# --- workloads and points --------------------------------------------------------------------


@dataclass(frozen=True)
class MinCutWorkload:
    """A workload's joint graph, and the step magis itself captures (for eager reference)."""

    name: str
    joint: JointCapture = field(repr=False)
    step: Step | None = field(default=None, repr=False)

    def program(self, part: Partitioned) -> Step:
        """`part` as a Step: its graph with the eager step of `step` as the reference."""
        if self.step is None:
            raise MinCutError(f"{self.name}: traced without its eager step (with_step=False)")
        graph, constants = to_graph(part)
        return replace(self.step, graph=graph, constants=constants)


def trace_workload(
    name: str,
    dtype: torch.dtype | None = None,
    real: bool | None = None,
    seed: int = 0,
    with_step: bool = False,
) -> MinCutWorkload:
    """Build workload `name` as `magis.capture.workload_step` does and trace it through
    AOTAutograd (SGD, lr 1e-3); `with_step` also captures magis's own step of the same model."""
    wl = get_workload(name)
    real = wl.size != "paper" if real is None else real
    mode = contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True)
    with default_dtype(dtype or wl.dtype), mode:
        torch.manual_seed(seed)
        model = wl.build_model()
        inputs = wl.make_inputs(wl.batch)
    try:
        joint = capture_joint(model, inputs, wl.loss_fn)
    except MagisError:
        raise
    except Exception as exc:  # noqa: BLE001 - AOTAutograd raises many types; report, don't crash
        raise MinCutError(f"{name}: AOTAutograd failed: {exception_line(exc)}") from exc
    step = training_step(model, inputs, loss_fn=wl.loss_fn) if with_step else None
    return MinCutWorkload(name, joint, step)


def partition_point(joint: JointCapture, spec: PartitionSpec, cost: CostModel) -> Outcome:
    """The simulated point of one partition of `joint`, or a Failure saying why there is none."""
    try:
        part = partition(joint, spec)
        graph, _ = to_graph(part)
    except MagisError as exc:
        return Failure(spec.method, str(exc), spec.params())
    except Exception as exc:  # noqa: BLE001 - the partitioner raises many types
        return Failure(spec.method, f"partition failed: {exception_line(exc)}", spec.params())
    params = {
        **spec.params(),
        "saved_activation_bytes": part.saved_activation_bytes(),
        "saved_storage_bytes": part.saved_storage_bytes(),
    }
    return point(spec.method, graph, graph.program_order(), cost, **params)


def specs(
    budgets: Iterable[float], include_default: bool = False, label: str | None = None
) -> list[PartitionSpec]:
    """The default partition (if asked), then min-cut at each budget, in the order given;
    `label` names the min-cut points (default: "min-cut" at 1.0, "min-cut-budget" below)."""
    out = [PartitionSpec(Partitioner.DEFAULT)] if include_default else []
    return out + [PartitionSpec(Partitioner.MIN_CUT, float(b), label=label) for b in budgets]


def mincut_points(
    workload: str,
    cost: CostModel,
    budgets: Iterable[float] = DEFAULT_BUDGETS,
    include_default: bool = False,
    label: str | None = None,
) -> Iterator[Outcome]:
    """One point per budget (1.0 is plain min-cut) for `workload`, lazily; with
    `include_default`, the default partition first. `label`: see `specs`.

    If AOTAutograd cannot trace the workload, yields one Failure per setting.
    """
    wanted = specs(budgets, include_default, label)
    try:
        joint = trace_workload(workload).joint
    except MagisError as exc:
        yield from (Failure(s.method, str(exc), s.params()) for s in wanted)
        return
    for spec in wanted:
        yield partition_point(joint, spec, cost)


def saved_bytes_simulated(p: BaselinePoint) -> int:
    """Non-resident bytes live when the backward starts, by our simulator (saved values + loss)."""
    tangent = next(n for n in p.order if p.graph.node(n).name == TANGENT)
    return int(p.sim.timeline[p.order.index(tangent)]) - p.sim.resident_bytes


def min_cut_baseline(workload: str, budgets: Sequence[float] | None = None) -> Baseline:
    """A `Baseline` bound to `workload`: plain min-cut, or the budget sweep if `budgets` given.

    Its points carry their own graph (the partitioned program); the graph passed is not used.
    """
    chosen = (1.0,) if budgets is None else tuple(budgets)
    name = "min-cut" if budgets is None else "min-cut-budget"

    def points(_graph: Graph, cost: CostModel) -> Iterator[Outcome]:
        return mincut_points(workload, cost, chosen, label=name)

    return Baseline(name, f"PyTorch min-cut partitioner on {workload}", points)


def _needs_workload(name: str, _graph: Graph, _cost: CostModel) -> Iterator[Outcome]:
    raise NeedsWorkloadError(
        f"{name} re-traces the model through AOTAutograd: call "
        f"magis.baselines.mincut.mincut_points(workload, cost) or min_cut_baseline(workload)"
    )


MIN_CUT = Baseline(
    "min-cut",
    "PyTorch's min-cut re-materialization partitioner (AOTAutograd); needs the workload",
    partial(_needs_workload, "min-cut"),
)
MIN_CUT_BUDGET = Baseline(
    "min-cut-budget",
    "min-cut under activation_memory_budget 1.0 .. 0.0; needs the workload",
    partial(_needs_workload, "min-cut-budget"),
)
