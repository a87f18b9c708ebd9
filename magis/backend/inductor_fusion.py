"""Inductor's fusion kept from raising a plan's peak (issue 43).

Fusing two nodes into one kernel runs them at one place. Inductor places a fused kernel at its
earliest member and moves the other members' inputs before it, so fusion can lengthen lives the
plan kept short: two consumers of one tensor fused side by side (a horizontal fusion) hold both
outputs at once where the plan stored the first before computing the second; a consumer fused
with its producer hoists a Load the plan issued later. On unet:tiny at mem_limit 0.5 (20
searched states) Inductor's fusion raised its own estimate of the segment's peak from 877,856
to 910,640 bytes.

So each segment is compiled at the first of `FUSION_LEVELS` whose fusion raises Inductor's own
estimate of the segment's peak (`torch._inductor.memory`: each buffer from its kernel to its
last reader, Store outputs left out as host memory) by at most `FUSION_TOLERANCE`, compared
before fusion (every node its own kernel: the plan's lifetimes) and after it. With buffer reuse
off (`fx_export.INDUCTOR_CONFIG`) the estimate is what the generated code holds: on
bert-base:tiny, 107,024 estimated and 106,512 measured above the resident bytes.

- `"inductor"`: Inductor's fusion as it is;
- `"in-place"`: only a producer with its consumer, and only when no input of the consumer
  is made after the producer (nothing is hoisted); nodes side by side are not fused;
- `"none"`: every node its own kernel (pointwise ops inlined at lowering still are).

A level that raises the estimate is abandoned as soon as fusion ends (its compile is not
finished) and the segment compiles again at the next.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

FUSION_LEVELS = ("inductor", "in-place", "none")
CHECK_VERSION = 4  # part of the cache key: raise it when the check or the levels change
# How much fusion may raise the estimate: issue 43 allows the measured peak 2% over the plan's
# simulated one, and fusion gets half of it (unet:tiny, 20 states: the "in-place" level's
# fusion adds 32 bytes to 877,856, where "none" would give up every fused kernel).
FUSION_TOLERANCE = 0.01


class FusionRaisedPeak(Exception):  # noqa: N818 - a signal between Inductor's passes and us
    """Raised from Inductor's post-fusion pass: this level's fusion raised the peak."""


@dataclass
class FusionCheck:
    """Inductor's estimated peak of one segment before and after fusion, in bytes."""

    before: int | None = None  # None: this torch's Inductor has no estimate to give
    after: int | None = None

    @property
    def raised(self) -> bool:
        if self.before is None or self.after is None:
            return False
        return self.after > self.before * (1 + FUSION_TOLERANCE)


def checked_fusion_config(check: FusionCheck, level: str) -> dict:
    """Inductor configuration that estimates the peak around fusion into `check` and stops the
    compile (`FusionRaisedPeak`) when fusion at `level` raised it (never at the last level).
    The passes name their level to Inductor's compiled-graph cache: a level's graph is cached
    only when its fusion kept the peak."""
    try:
        from torch._inductor.custom_graph_pass import CustomSchedulerPass
    except ImportError:  # an older torch: plain callables (its graph cache is bypassed)
        CustomSchedulerPass = object  # noqa: N806

    class Before(CustomSchedulerPass):
        def __call__(self, nodes: list) -> list:
            check.before = _estimate(nodes)
            return nodes

        def uuid(self) -> str:
            return f"magis-fusion-{level}-{CHECK_VERSION}"

    class After(Before):
        def __call__(self, nodes: list) -> list:
            check.after = _estimate(nodes)
            if check.raised and level != FUSION_LEVELS[-1]:
                raise FusionRaisedPeak(f"{check.before} -> {check.after} bytes")
            return nodes

    config = {"_pre_fusion_custom_pass": Before(), "_post_fusion_custom_pass": After()}
    if level == "none":
        config["max_fusion_size"] = 1
    return config


@contextlib.contextmanager
def fusion_rules(level: str) -> Iterator[None]:
    """Inductor's scheduler with the fusions `level` allows (`"in-place"`: see the module)."""
    if level != "in-place":
        yield
        return
    from torch._inductor.scheduler import Scheduler

    can_fuse = Scheduler.can_fuse

    def fuses_in_place(self, node1, node2, *args, **kwargs) -> bool:
        return _in_place(self, node1, node2) and can_fuse(self, node1, node2, *args, **kwargs)

    Scheduler.can_fuse = fuses_in_place
    try:
        yield
    finally:
        Scheduler.can_fuse = can_fuse


@contextlib.contextmanager
def one_function_per_kernel() -> Iterator[None]:
    """Inductor's C++ backend emitting each scheduled (fused) node as a function of its own.

    It otherwise gathers the kernels between two extern calls into one C++ function whose
    buffers are all allocated before it runs and freed after it: a value the plan freed before
    the next kernel's output is made then lives beside that output. The measured build's
    memory checks (a call after each kernel) cut the groups there, so the measurement missed
    it: bert-base:tiny's ordinary build held 32,784 bytes more than its measured one. GPU
    backends launch each kernel on its own anyway."""
    try:
        from torch._inductor.codegen.cpp import CppScheduling

        ready = CppScheduling.ready_to_flush
    except (ImportError, AttributeError):  # another torch's Inductor: its grouping stays
        yield
        return
    CppScheduling.ready_to_flush = lambda self: True
    try:
        yield
    finally:
        CppScheduling.ready_to_flush = ready


def _in_place(scheduler, node1, node2) -> bool:
    """Whether fusing `node1` and `node2` is a producer with its consumer whose other inputs
    are all made before the producer runs."""
    first, second = sorted((node1, node2), key=lambda n: n.min_order)
    if not first.get_operation_names() & second.ancestors:
        return False  # side by side: the later one's output would live from the earlier's place
    own = first.get_operation_names() | second.get_operation_names()
    for name in second.ancestors - own:
        made_by = scheduler.name_to_fused_node.get(name)
        if made_by is not None and made_by.max_order > first.min_order:
            return False  # it would be hoisted before the fused kernel
    return True


def _estimate(nodes: list) -> int | None:
    """`estimated_peak_bytes`, or None where this torch's Inductor lacks the memory planner's
    helpers it uses (they are internal: torch 2.13's names); the check is then skipped."""
    try:
        return estimated_peak_bytes(nodes)
    except (ImportError, AttributeError):
        return None


def estimated_peak_bytes(nodes: list) -> int:
    """Inductor's estimate of the peak bytes of its scheduler `nodes` run in this order: each
    buffer from its node to its last reader; a buffer read only inside its own fused kernel
    is never allocated (the kernel keeps it in registers)."""
    from torch._inductor import memory
    from torch._inductor.utils import OrderedSet
    from torch._inductor.virtualized import V

    graph, scheduler = V.graph, V.graph.scheduler
    outputs = OrderedSet(graph.get_output_names())
    _, freeable = memory.prepare_planning_info(
        nodes,
        scheduler.name_to_buf,
        scheduler.name_to_fused_node,
        OrderedSet(graph.graph_inputs.keys()),
        outputs,
    )
    infos, _, _ = memory.compute_memory_timeline(nodes, freeable, outputs)
    delta = [0] * (len(nodes) + 1)
    for info in infos:
        if _kernel_internal(info, outputs) or _host_copy(info.buffer):
            continue
        delta[info.start_step] += info.size_alloc
        if info.end_step != -1:
            delta[info.end_step + 1] -= info.size_free
    live = peak = 0
    for change in delta:
        live += change
        peak = max(peak, live)
    return peak


def _host_copy(buffer) -> bool:
    """Whether `buffer` is a Store's output: host memory, not the device's."""
    import torch
    from torch._inductor.ir import MultiOutput

    node = getattr(buffer, "node", None)
    while isinstance(node, MultiOutput) and node.inputs:
        node = node.inputs[0]
    return getattr(node, "op_overload", None) is torch.ops.magis.store.default


def _kernel_internal(info, outputs) -> bool:
    from torch._inductor.scheduler import SchedulerBuffer

    buffer = info.buffer
    return (
        isinstance(buffer, SchedulerBuffer)
        and buffer.get_name() not in outputs
        and not buffer.mpi_buffer.succ_nodes
    )
