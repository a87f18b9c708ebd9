"""Data parallelism inside the captured step: the gradient all-reduce as graph ops (issue 44).

`AllReduceGradients` wraps an update rule (`magis.capture.trace.UpdateRule`): before the update,
the gradients are averaged over the ranks as `DistributedDataParallel` averages them
(torch/csrc/distributed/c10d/reducer.cpp): packed into buckets of at most `bucket_bytes` in
reverse parameter order (the order backward makes them, DDP's `_compute_bucket_assignment_by_size`
over reversed parameters), each bucket multiplied by 1/world_size while it is packed
(`mul_out(bucket_view, grad, 1/div_factor)`), summed over the ranks by one all-reduce, and split
back. The all-reduce is c10d's functional collective (`_c10d_functional.all_reduce` and
`wait_tensor`, torch.distributed._functional_collectives), so make_fx records it as ops of the
graph: the simulator prices it on a communication stream, the rules never recompute or split it,
and the generated program calls it.

The collectives need no process group to be captured (their fake kernels only shape the
output): planning one rank of a job names the group and its size (`DataParallel`), running one
needs the group of that name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from magis.capture.step_kinds import UpdateRule
from magis.errors import MagisError
from magis.ir import Graph
from magis.ir.ops import ALL_REDUCE_OP, COLLECTIVE_OPS, WAIT_OP

# DDP's default `bucket_cap_mb` (torch.nn.parallel.DistributedDataParallel).
DEFAULT_BUCKET_BYTES = 25 * 2**20


class ParallelError(MagisError):
    """A data-parallel setting, process group or plan that does not fit the step."""


@dataclass(frozen=True)
class DataParallel:
    """The ranks a step averages its gradients over: the process group's registered name and
    its size, and the bucket size of the all-reduce."""

    group_name: str
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ParallelError(f"world size {self.world_size}: a job has at least one rank")
        if self.bucket_bytes < 1:
            raise ParallelError(f"bucket size {self.bucket_bytes} bytes: give a positive size")

    @staticmethod
    def of(process_group, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> DataParallel:
        """The group `process_group` (a `torch.distributed.ProcessGroup`) names and spans."""
        name = getattr(process_group, "group_name", None)
        if not isinstance(name, str) or not hasattr(process_group, "size"):
            raise ParallelError(
                f"process_group is a {type(process_group).__name__}, not a torch.distributed "
                "ProcessGroup: pass torch.distributed.group.WORLD or one from new_group()"
            )
        return DataParallel(name, int(process_group.size()), bucket_bytes)


def buckets(grads: Sequence[torch.Tensor | None], bucket_bytes: int) -> list[list[int]]:
    """Indices of the gradients in each bucket: reverse order, consecutive gradients of one
    dtype until the next would pass `bucket_bytes` (a larger gradient gets a bucket alone)."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i in reversed(range(len(grads))):
        g = grads[i]
        if g is None:
            continue
        nbytes = g.numel() * g.element_size()
        if not out or g.dtype != dtype or size + nbytes > bucket_bytes:
            out.append([])
            size, dtype = 0, g.dtype
        out[-1].append(i)
        size += nbytes
    return out


def all_reduce_mean(
    grads: Sequence[torch.Tensor | None], parallel: DataParallel
) -> list[torch.Tensor | None]:
    """The gradients averaged over the ranks, bucket by bucket (module docstring)."""
    out = list(grads)
    scale = 1.0 / parallel.world_size
    c10d = torch.ops._c10d_functional
    for bucket in buckets(grads, parallel.bucket_bytes):
        flat = torch.cat([grads[i].reshape(-1) * scale for i in bucket])
        summed = c10d.wait_tensor(c10d.all_reduce(flat, "sum", parallel.group_name))
        parts = torch.split(summed, [grads[i].numel() for i in bucket])
        for i, part in zip(bucket, parts, strict=True):
            out[i] = part.view(grads[i].shape)
    return out


@dataclass(frozen=True)
class AllReduceGradients:
    """An update rule whose gradients are first averaged over the ranks (DDP's all-reduce)."""

    inner: UpdateRule
    parallel: DataParallel

    def state_names(self, index: int) -> tuple[str, ...]:
        return self.inner.state_names(index)

    def scalar_names(self) -> tuple[str, ...]:
        return self.inner.scalar_names()

    def update(self, params, grads, state, scalars=()) -> None:
        self.inner.update(params, all_reduce_mean(grads, self.parallel), state, scalars)


@dataclass(frozen=True)
class CollectiveCall:
    """One collective of a graph, as every rank must issue it: op, group, bytes, and for an
    all-reduce the world size its bucket was scaled for."""

    op: str
    group_name: str
    nbytes: int
    world_size: int | None


def collective_calls(graph: Graph, order: Sequence[int] | None = None) -> list[CollectiveCall]:
    """The collectives of `graph` in `order` (default: program order)."""
    calls = []
    for nid in graph.program_order() if order is None else order:
        node = graph.node(nid)
        if node.op in COLLECTIVE_OPS:
            # all_gather_into_tensor(x, group_size, group_name), reduce_scatter_tensor(x, op,
            # group_size, group_name): the size is the argument before the group's name
            size = _scaled_for(graph, nid) if node.op == ALL_REDUCE_OP else node.args[-2]
            calls.append(CollectiveCall(node.op, node.args[-1], node.outputs[0].nbytes, size))
    return calls


def _scaled_for(graph: Graph, nid: int) -> int | None:
    """The world size an all-reduce's bucket was packed for: 1/scale of the muls packed into it
    (`all_reduce_mean`), or None when the bucket was not packed that way."""
    src = graph.node(graph.node(nid).inputs[0].node)
    scales = {
        a
        for r in src.inputs
        for a in graph.node(r.node).args[1:]
        if graph.node(r.node).op == "aten.mul.Tensor" and isinstance(a, float) and a > 0
    }
    return round(1 / scales.pop()) if len(scales) == 1 else None


def check_collectives(graph: Graph, parallel: DataParallel | None) -> None:
    """A plan's collectives are the job's: its group, its world size; and each one's buffer is
    read by its `wait_tensor` alone (one-line errors)."""
    check_waited(graph)
    calls = collective_calls(graph)
    if parallel is None:
        if calls:
            raise ParallelError(
                f"the plan holds {len(calls)} collective(s) ({calls[0].group_name!r} group): "
                "compile with parallel= and its process_group"
            )
        return
    for call in calls:
        if call.group_name != parallel.group_name:
            raise ParallelError(
                f"the plan's collectives run on group {call.group_name!r} and this process "
                f"group is {parallel.group_name!r}: plan again for this group"
            )
        if call.world_size is not None and call.world_size != parallel.world_size:
            raise ParallelError(
                f"the plan was made for world size {call.world_size} and this process group "
                f"has {parallel.world_size} ranks: plan again for this world size"
            )


def sink_waits(graph: fx.Graph) -> None:
    """Each collective's `wait_tensor`, and what is computed from its result alone (views, an
    all-gather's copy-out, a reduce-scatter's split), moved to just before its first use.

    A stream waits for a collective where it reads the result: FSDP2 waits for a block's
    all-gather at the block's forward (`wait_for_unshard`) and for the reduce-scatters before
    the optimizer reads the gradients, DDP for a bucket's all-reduce when its gradients are
    read. The trace waits where the collective was issued, which would make the compute
    stream wait for every collective at once (`magis.sim.two_stream_makespan` starts a wait
    when its collective ends); in this order a prefetched all-gather and a reduce-scatter
    overlap the compute issued before their first use, and the copy-out's memory is taken
    there. Nodes are visited last first, so a chain lands in order before its first user."""
    nodes = list(graph.nodes)
    pos = {n: float(i) for i, n in enumerate(nodes)}
    wait = torch.ops._c10d_functional.wait_tensor.default
    sinkable: set[fx.Node] = set()
    for n in nodes:
        if n.op != "call_function":
            continue
        inputs = n.all_input_nodes
        if n.target is wait or (inputs and all(i in sinkable for i in inputs)):
            sinkable.add(n)
    for n in reversed(nodes):
        if n not in sinkable or not n.users:
            continue
        first = min(n.users, key=pos.__getitem__)
        before = first.prev
        if before is n or first.op == "output":
            continue
        first.prepend(n)
        pos[n] = (pos[before] + pos[first]) / 2


def check_waited(graph: Graph) -> None:
    """Every collective's buffer is read by its wait alone: anything else (a Store of a swap)
    would read it while the communication stream still fills it."""
    for nid in graph.program_order():
        if graph.node(nid).op not in COLLECTIVE_OPS:
            continue
        early = [u for u in graph.users(nid) if graph.node(u).op != WAIT_OP]
        if early:
            raise ParallelError(
                f"the plan reads collective {graph.node(nid).name}'s buffer before its wait "
                f"({graph.node(early[0]).name}): plan again with this magis"
            )
