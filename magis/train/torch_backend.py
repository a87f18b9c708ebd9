"""`magis.torch_backend`: magis as a torch.compile backend, for a loop that keeps its own
optimizer step (issue 43)::

    model = torch.compile(model, backend=magis.torch_backend(mem_limit=0.5))
    loss = loss_fn(model(x), y)
    loss.backward()                 # the backward magis planned
    optimizer.step()                # the user's, outside the graph

Named `torch_backend` because `magis.backend` is already the package that runs plans (a module
cannot be called). It is an AOTAutograd backend (`torch._dynamo.backends.common.aot_autograd`):
for each graph Dynamo captures, AOTAutograd traces the joint forward/backward graph and calls our
`partition_fn`, which converts it to magis IR (`magis.capture.joint`), searches a plan under the
limit (`magis.optimize`'s search, MAGIS Alg. 3: re-ordering, re-materialization, TASO
rewrites; not fission, see `search_options`)
and hands back the forward and the backward the plan implies: what the forward saves and what
the backward recomputes, each in the plan's order (`magis.backend.aot`). Both are compiled by
Inductor as `magis.compile(..., compiler="inductor")` compiles a plan.

Not searched here: fission (`search_options`), swapping (a Store in the forward and its Load in the backward would pass a
host copy between two programs) and optimizer-state offloading (no optimizer in the graph).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from magis.backend.aot import Partition, compile_module, forward_backward
from magis.capture.joint import joint_step
from magis.commands.limits import read_search_limit
from magis.commands.optimize import find_plan, setup_search
from magis.cost import CostModel
from magis.plan import Plan
from magis.search import SearchOptions
from magis.train.compile import rules_without_host_copies

# A backend's search runs when Dynamo first meets each graph: seconds, not magis.compile's
# minute (`magis.train.compile.COMPILE_TIME_BUDGET_S`), since a model may break into several.
BACKEND_TIME_BUDGET_S = 20.0


def search_options(time_budget: float, max_states: int | None = None) -> SearchOptions:
    """The search of a joint graph: without host copies, and without fission. A fission
    region that spans the forward and the backward would run each part's forward and then
    its backward, and the backward's parts must wait for every part of the forward (its
    tangents come with `backward()`); F-Tree materialization orders the parts one after the
    other without looking at control edges, which broke that order in the first tries."""
    return SearchOptions(
        time_budget=time_budget,
        max_states=max_states,
        rules=rules_without_host_copies(),
        fission=False,
    )


@dataclass
class MagisBackend:
    """What `torch_backend` returns: a torch.compile backend (called by Dynamo with each graph
    it captures) that records, per graph, the plan and the partition it handed back."""

    aot: Callable  # AOTAutograd's backend, with magis's partition and compilers
    plans: list[Plan] = field(default_factory=list)
    partitions: list[Partition] = field(default_factory=list)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        return self.aot(gm, example_inputs)


def torch_backend(
    *,
    mem_limit: str | float | None = None,
    lat_limit: str | float | None = None,
    time_budget: float = BACKEND_TIME_BUDGET_S,
    max_states: int | None = None,
    hardware: str | CostModel | None = None,
) -> MagisBackend:
    """A torch.compile backend that plans each graph's forward and backward with magis under
    exactly one of `mem_limit` (a ratio of the graph's unplanned peak, or a size such as
    "12GiB") and `lat_limit` (a ratio or a time), searched for `time_budget` seconds (and at
    most `max_states` states: the same plan on any machine) on `hardware` (default: the
    inputs' device, profiled). A limit that cannot be read is a one-line `LimitError` here,
    before anything is traced.

    (Not `magis.backend`: that name is the package that runs plans, and a module cannot be
    called.) Dynamo wraps an error raised while it compiles in `BackendCompilerFailed`, whose
    `inner_exception` is magis's one-line error; an op Inductor cannot compile is found on the
    first call and raised as it is (`InductorUnsupportedError`)."""
    from torch._dynamo.backends.common import aot_autograd

    read_search_limit(mem_limit, lat_limit)  # a typo fails now, not inside Dynamo
    plans: list[Plan] = []
    partitions: list[Partition] = []

    def partition(joint, joint_inputs, *, num_fwd_outputs, **options):
        static = options.get("static_lifetime_input_indices") or ()
        js = joint_step(joint, num_fwd_outputs, static)
        setup = setup_search(
            js.step,
            mem_limit=mem_limit,
            lat_limit=lat_limit,
            hardware=hardware if hardware is not None else _device_type(joint_inputs),
        )
        plan = find_plan(setup, search_options(time_budget, max_states))
        split = forward_backward(
            plan.graph, plan.order, js.slots, num_fwd_outputs, joint, joint_inputs
        )
        plans.append(plan)
        partitions.append(split)
        return split.forward, split.backward

    aot = aot_autograd(
        fw_compiler=compile_module, bw_compiler=compile_module, partition_fn=partition
    )
    return MagisBackend(aot, plans, partitions)


def _device_type(joint_inputs) -> str:
    from torch.utils import _pytree as pytree

    leaves = [t for t in pytree.tree_leaves(joint_inputs) if isinstance(t, torch.Tensor)]
    return leaves[0].device.type if leaves else "cpu"
