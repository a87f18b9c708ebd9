"""`magis.compile`: a user's model, optimizer and loss in, a trainable step running a plan out.

The user's training loop keeps its shape (issue #15)::

    train_step = magis.compile(model, optimizer, (x, y), loss_fn=loss_fn, mem_limit=0.5)
    for x, y in data:
        loss = train_step(x, y)     # forward, backward, clipping, optimizer step: the plan
        scheduler.step()

What is decided here, and why:

- The step is captured once with fake tensors (`magis.capture.trace.capture_training`): the
  user's `loss_fn(model, *batch, **kwargs)`, its gradients for the optimizer's parameters, the
  optional clipping and the optimizer's update (`magis.train.optimizers`), with every
  hyperparameter a 0-dim input.
- Exactly one of `mem_limit` / `lat_limit` runs the search (MAGIS §6.2, `magis.optimize`);
  `plan=` (a path or a `Plan`) skips it, after checking that the plan's inputs are this step's
  (names, kinds, shapes, dtypes: the optimizer's structure and clipping are in the names).
  Neither a limit nor a plan is an error: there is no silent default limit.
- One batch shape: a batch of other shapes, dtypes or device is a one-line error, never a
  re-capture (no dynamic re-planning; compile once per shape).
- Mixed precision: called inside `torch.autocast(...)`, the forward and the loss are traced
  under the same autocast (the casts become ops of the graph); the backward and the update are
  not, as in an eager loop that wraps only the forward in autocast. An autocast inside `loss_fn`
  is traced as well.
- The hardware the search costs plans on defaults to the model's device, profiled ("cpu" or
  "cuda", `magis.cost.get_cost_model`).
- Data parallelism (`parallel="ddp"`, issue 44): the gradients are averaged over
  `process_group` inside the step, as DistributedDataParallel does
  (`magis.capture.collectives`); rank 0 searches or loads the plan and every rank runs it
  (`magis.train.distributed`). The model is not wrapped in DDP: the step is the DDP step.
  `parallel="fsdp"` shards the model's parameters as FSDP2 does, each rank keeping its pieces;
  the step all-gathers them and reduce-scatters their gradients (`magis.capture.sharding`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from magis.capture.collectives import (
    DEFAULT_BUCKET_BYTES,
    AllReduceGradients,
    DataParallel,
    check_collectives,
)
from magis.capture.sharding import ShardLayout, restore_parameters
from magis.capture.trace import Step, capture_training, loss_of
from magis.commands.optimize import optimize
from magis.cost import get_cost_model
from magis.cost.links import Interconnect, get_link
from magis.errors import CaptureError, MagisError, MagisWarning, PlanError
from magis.ir import Graph
from magis.plan import Plan
from magis.rules import OFFLOAD_STATE, RESTORE_STATE, Rule, rules_in_search_order
from magis.rules.swap import DESWAP, REMAT_TO_SWAP, SWAP
from magis.train.distributed import (
    check_same_plan,
    parallel_of,
    shard_model,
    shared_plan,
    world_group,
)
from magis.train.optimizers import ClipGradNorm, GraphOptimizer, OptimizerError
from magis.train.step import COMPILERS, BatchError, BatchSpec, TrainStep

if TYPE_CHECKING:
    from magis.cost import CostModel

# magis.compile's search runs inside the user's training script, before its first step: a
# minute, not the 3 of `magis optimize` (`magis.search.TIME_BUDGET_S`), whose plan is made once
# and saved. The one default of `compile(time_budget=)`.
COMPILE_TIME_BUDGET_S = 60.0


class CompileError(MagisError):
    """Arguments of magis.compile that do not make a training step."""


def compile(  # noqa: A001 - the name users asked for: magis.compile
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: tuple | torch.Tensor = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    mem_limit: str | float | None = None,
    lat_limit: str | float | None = None,
    time_budget: float = COMPILE_TIME_BUDGET_S,
    max_states: int | None = None,
    hardware: str | CostModel | None = None,
    plan: str | Path | Plan | None = None,
    clip_grad_norm: float | None = None,
    measure: bool = False,
    cuda_graph: bool | None = None,
    parallel: str | None = None,
    process_group=None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    link: str = "nvlink",
    compiler: str = "python",
    rules: Sequence[Rule] | None = None,
) -> TrainStep:
    """A `TrainStep` training `model` with `optimizer`: `loss = train_step(*batch, **kwargs)`.

    `loss_fn(model, *batch, **kwargs)` returns the loss; without it `model(*batch, **kwargs)`
    is the loss or has `.loss`. `example_batch` (and `example_kwargs`) fix the shapes every call
    must have. `mem_limit` (a ratio of the unoptimized peak, or a size such as "12GiB") or
    `lat_limit` (a ratio, or a time) picks the search's objective, `time_budget` its seconds,
    `hardware` its cost model; `plan=` reuses a saved plan instead. `clip_grad_norm` clips the
    gradients' global norm first (torch.nn.utils.clip_grad_norm_). `measure` records each
    call's measured peak in `train_step.last_peak_bytes`. On a GPU the program is replayed as a
    CUDA graph from the second call on (`magis.train.cuda_graph`); `cuda_graph=False` runs it
    as generated code every call. `parallel="ddp"` averages the gradients over `process_group`
    (default: the world) in all-reduces of `bucket_bytes`, priced over `link`
    (`magis.cost.links`); rank 0 plans, every rank runs its plan. `parallel="fsdp"` shards
    the parameters over the group instead (their data becomes this rank's pieces), gathering
    them around each block's forward and backward and reduce-scattering their gradients, as
    FSDP2 does (`magis.capture.sharding`). `compiler="inductor"` runs
    the plan compiled by Inductor, its memory decisions kept (`magis.backend.fx_export`).
    `max_states` ends the search after that many states too: a search that ends there, before
    its time budget, gives the same plan on any machine. `rules` are the
    search's rewrite rules (default `rules_keeping_state()`; on a CPU, where
    a Store's host copy is in the same memory, `rules_without_host_copies()` saves more).
    """
    if compiler not in COMPILERS:
        raise CompileError(f"unknown compiler={compiler!r}; choose one of {', '.join(COMPILERS)}")
    _check_limits(mem_limit, lat_limit, plan)
    _check_model_and_optimizer(model, optimizer)
    group = parallel_of(parallel, process_group, bucket_bytes)

    def prepare(sharding=None) -> PreparedStep:
        return prepare_step(
            model,
            optimizer,
            example_batch,
            example_kwargs,
            loss_fn=loss_fn,
            clip_grad_norm=clip_grad_norm,
            parallel=group,
            sharding=sharding,
        )

    def find(prepared: PreparedStep, hardware) -> Plan:
        return _plan_for(
            prepared.step,
            plan,
            mem_limit,
            lat_limit,
            time_budget,
            hardware,
            prepared.device,
            group,
            rules=rules,
            max_states=max_states,
        )

    if group is None:
        prepared = prepare()
        return prepared.train_step(find(prepared, hardware), measure, cuda_graph, compiler)
    pg = process_group if process_group is not None else world_group()
    sharding, full = shard_model(model, optimizer, group, pg, parallel)
    try:
        prepared = prepare(sharding)
        if hardware is None or isinstance(hardware, str):
            name = hardware if hardware is not None else prepared.device.type
            hardware = get_cost_model(name).with_interconnect(
                Interconnect(get_link(link), group.world_size)
            )
        chosen = (
            find(prepared, hardware)
            if plan is not None
            else shared_plan(lambda: find(prepared, hardware), pg)
        )
        check_collectives(chosen.graph, group)
        check_plan_fits(chosen, prepared.step)
        check_same_plan(chosen, pg)
        return prepared.train_step(chosen, measure, cuda_graph, compiler)
    except BaseException:
        restore_parameters(model, full)  # the model as the caller gave it
        raise


def compile_program_order(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: tuple | torch.Tensor = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    clip_grad_norm: float | None = None,
    measure: bool = False,
    cuda_graph: bool | None = None,
    compiler: str = "python",
) -> TrainStep:
    """`compile` without a search: the captured program order as its plan. The baseline of
    `magis.bench.train` (what running a plan costs beside eager PyTorch); its plan cannot be
    saved, and a user who wants no memory saving has eager PyTorch."""
    prepared = prepare_step(
        model,
        optimizer,
        example_batch,
        example_kwargs,
        loss_fn=loss_fn,
        clip_grad_norm=clip_grad_norm,
    )
    graph = prepared.step.graph
    order = ProgramOrder(graph, graph.program_order())
    return prepared.train_step(order, measure, cuda_graph, compiler)


@dataclass(frozen=True)
class ProgramOrder:
    """A captured graph in its program order, run as a plan is (`compile_program_order`)."""

    graph: Graph
    order: list[int]


@dataclass(frozen=True)
class PreparedStep:
    """A captured training step and what its TrainStep needs besides a plan (`prepare_step`)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Step
    rule: GraphOptimizer | ClipGradNorm
    batch: BatchSpec
    trainable: list[str]
    device: torch.device
    clip_grad_norm: float | None  # the norm the rule clips to (its scalar input each call)
    sharding: ShardLayout | None = None  # FSDP: how the model's parameters are sharded

    def train_step(
        self,
        plan,
        measure: bool = False,
        cuda_graph: bool | None = None,
        compiler: str = "python",
    ) -> TrainStep:
        return TrainStep(
            self.model,
            self.optimizer,
            self.step,
            plan,
            self.rule,
            self.batch,
            self.trainable,
            clip_grad_norm=self.clip_grad_norm,
            measure=measure,
            cuda_graph=cuda_graph,
            compiler=compiler,
            sharding=self.sharding,
        )


def prepare_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: tuple | torch.Tensor = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    clip_grad_norm: float | None = None,
    parallel: DataParallel | None = None,
    sharding: ShardLayout | None = None,
) -> PreparedStep:
    """Check the arguments and capture the step: everything `compile` does but the plan. Its
    `train_step(plan, ...)` makes a `TrainStep` of any plan of that step (`magis bench gpu` runs
    several plans of one capture this way). With `parallel`, the captured update averages the
    gradients over its group first (`AllReduceGradients`); with `sharding` too, the model's
    parameters are already this rank's pieces and the step gathers them and reduce-scatters
    their gradients instead (FSDP, `magis.capture.sharding`)."""
    _check_model_and_optimizer(model, optimizer)
    args = example_batch if isinstance(example_batch, tuple) else (example_batch,)
    kwargs = dict(example_kwargs or {})
    trainable = _trainable(model, optimizer)
    device = _device_of(model)
    batch = BatchSpec.of(args, kwargs)
    data = batch.tensors(args, kwargs)
    for name, t in zip(batch.tensor_names, data, strict=True):
        if t.device != device:
            raise BatchError(f"{name} is on {t.device} and the model on {device}: move one")
    graph_opt = GraphOptimizer.of(optimizer, [p for _, p in trainable])
    ranks = sharding.ranks if sharding is not None else None
    rule = graph_opt if clip_grad_norm is None else ClipGradNorm(graph_opt, ranks)
    names = [n for n, _ in trainable]
    try:
        ddp = parallel is not None and sharding is None
        traced = AllReduceGradients(rule, parallel) if ddp else rule
        step = _capture(
            model, optimizer, batch, data, loss_fn, rule, traced, names, device, sharding
        )
    except CaptureError as exc:
        if isinstance(example_batch, dict) and not kwargs:  # meant as keyword tensors, mostly
            raise CaptureError(
                f"{exc}; the example batch is a dict, passed as one positional argument: for "
                "keyword tensors (a Hugging Face model's input_ids=, labels=) pass "
                "example_kwargs= and call train_step(**batch)"
            ) from exc
        raise
    return PreparedStep(
        model, optimizer, step, rule, batch, names, device, clip_grad_norm, sharding
    )


def _check_limits(mem_limit, lat_limit, plan) -> None:
    if plan is not None:
        if mem_limit is not None or lat_limit is not None:
            raise CompileError("plan= reuses a saved plan: give no mem_limit or lat_limit with it")
        return
    if (mem_limit is None) == (lat_limit is None):
        raise CompileError(
            "give exactly one of mem_limit (e.g. 0.5 or '12GiB') and lat_limit (e.g. 1.10), "
            "or plan= a saved plan"
        )


def _check_model_and_optimizer(model, optimizer) -> None:
    if not isinstance(model, nn.Module):
        raise CompileError(f"magis.compile takes an nn.Module, not {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptimizerError(
            f"magis.compile takes a torch.optim optimizer, not {type(optimizer).__name__}"
        )


def _trainable(model: nn.Module, optimizer) -> list[tuple[str, nn.Parameter]]:
    """The optimizer's parameters that take gradients, named, in the model's order."""
    names = {id(p): n for n, p in model.named_parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    strangers = [p for p in held if id(p) not in names]
    if strangers:
        raise OptimizerError(
            f"the optimizer holds {len(strangers)} tensor(s) that are not parameters of the "
            "model (named_parameters): build it from model.parameters()"
        )
    chosen = {id(p) for p in held if p.requires_grad}
    return [(n, p) for n, p in model.named_parameters() if id(p) in chosen]


def _device_of(model: nn.Module) -> torch.device:
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if len(devices) > 1:
        raise CompileError(
            f"the model's tensors are on {sorted(map(str, devices))}: magis.compile runs a "
            "step on one device"
        )
    return devices.pop() if devices else torch.device("cpu")


def _autocast_of(device: torch.device) -> torch.dtype | None:
    """The dtype of the autocast the caller is inside, for the model's device type, if any."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def _capture(
    model, optimizer, batch: BatchSpec, data, loss_fn, rule, traced, trainable, device, sharding
) -> Step:
    cast = _autocast_of(device)

    def loss(m: nn.Module, *tensors: torch.Tensor) -> torch.Tensor:
        a, kw = batch.rebuild(tensors)
        ctx = torch.autocast(device.type, dtype=cast) if cast else contextlib.nullcontext()
        with ctx:
            return loss_fn(m, *a, **kw) if loss_fn is not None else loss_of(m(*a, **kw))

    tag = f".autocast-{device.type}-{str(cast).removeprefix('torch.')}" if cast else ""
    scalars = [torch.tensor(v, dtype=torch.float64) for v in _first_values(rule, optimizer)]
    # Outside the caller's autocast: backward and update are not autocast (see the docstring).
    with torch.autocast(device.type, enabled=False):
        return capture_training(
            model,
            loss,
            data,
            traced,
            trainable=trainable,
            scalars=scalars,
            data_names=[n + tag for n in batch.tensor_names],
            sharding=sharding,
        )


def _first_values(rule, optimizer) -> list[float]:
    """The hyperparameters' values at a first step (examples for the capture; nothing in the
    optimizer's state is created)."""
    inner = rule.inner if isinstance(rule, ClipGradNorm) else rule
    values = inner.first_step_values(optimizer)
    return [1.0, *values] if isinstance(rule, ClipGradNorm) else values


def rules_keeping_state() -> tuple[Rule, ...]:
    """The search's rules but optimizer-state offloading (`magis.rules.offload`): the user's
    optimizer holds its state on the model's device, and a `TrainStep` runs the plan on those
    tensors, so a plan that kept the state on the host would count device memory the step
    never frees. (Moving the state to pinned host memory, as ZeRO-Offload does, is what would
    let `magis.compile` offload it; `magis optimize` plans it for the step's own inputs.)"""
    offloading = {OFFLOAD_STATE.name, RESTORE_STATE.name}
    return tuple(r for r in rules_in_search_order() if r.name not in offloading)


def rules_without_host_copies() -> tuple[Rule, ...]:
    """The search's rules but those that put tensors in host memory: swapping (and its trade
    for a recomputation) and optimizer-state offloading. For a CPU, whose host memory is the
    memory measured, and for `magis.torch_backend` (a Store in the forward and its Load in the
    backward would pass a host copy between two programs)."""
    host = {r.name for r in (SWAP, DESWAP, REMAT_TO_SWAP, OFFLOAD_STATE, RESTORE_STATE)}
    return tuple(r for r in rules_in_search_order() if r.name not in host)


def _plan_for(
    step,
    plan,
    mem_limit,
    lat_limit,
    time_budget,
    hardware,
    device,
    parallel=None,
    rules=None,
    max_states=None,
) -> Plan:
    if plan is not None:
        chosen = plan if isinstance(plan, Plan) else Plan.load(plan)
        # the job's ranks first: a plan for another world size has other shard shapes too
        check_collectives(chosen.graph, parallel)
        check_plan_fits(chosen, step)
        return chosen
    found = optimize(
        step,
        mem_limit=mem_limit,
        lat_limit=lat_limit,
        time_budget=time_budget,
        max_states=max_states,
        hardware=hardware if hardware is not None else device.type,
        rules=rules if rules is not None else rules_keeping_state(),
    )
    if not found.summary.satisfied:  # the step still trains exactly; the user should know
        s = found.summary
        warnings.warn(
            f"magis.compile: the plan found in {time_budget:g} s does not meet the limit "
            f"(memory {s.memory_ratio:.3f}, latency {s.latency_ratio:.3f} of the program "
            f"order); the step runs it anyway: give more time_budget or a looser limit",
            MagisWarning,
            stacklevel=3,
        )
    return found


def check_plan_fits(plan: Plan, step: Step) -> None:
    """A plan runs a step only if their inputs are the same: names, kinds, shapes and dtypes
    (the names carry the optimizer's structure, clipping and autocast)."""
    mine, theirs = _signature(plan.graph), _signature(step.graph)
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            raise PlanError(
                f"the plan was made for another model, optimizer or batch: its input {i} is "
                f"{_describe(a)}, this step's is {_describe(b)}"
            )
    if len(mine) != len(theirs):
        raise PlanError(
            f"the plan takes {len(mine)} inputs and this step {len(theirs)}: it was made for "
            "another model, optimizer or batch"
        )


def _signature(graph) -> list[tuple]:
    rows = []
    for nid in graph.placeholders():
        node = graph.node(nid)
        meta = node.outputs[0]
        rows.append((node.name, node.placeholder_kind.value, tuple(meta.shape), meta.dtype))
    return rows


def _describe(row: tuple) -> str:
    name, kind, shape, dtype = row
    return f"{name} ({kind}, {dtype}[{', '.join(map(str, shape))}])"
