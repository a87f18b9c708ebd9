"""Running a plan compiled by Inductor: its segments in order, its Store/Load between them.

`InductorProgram` is called as `magis.backend.codegen.Program` is (the placeholders in graph
order, the graph's outputs back). It holds each value of the plan only until its last segment
reads it, as the generated Python drops it (`x = None`), and hands a segment its inputs in a
list that Inductor's compiled code empties, so an input dies at its last use inside the
segment. Why the plan is cut into segments is in `magis.backend.fx_export`.
"""

from __future__ import annotations

import torch

from magis.backend.fx_export import HostCopy, Segment, compile_segment, segments
from magis.backend.runtime import HostPool
from magis.ir import Graph, Ref
from magis.ir.ops import STORE_OP


class InductorProgram:
    """The plan `graph` in `order` as Inductor-compiled segments on `device`."""

    def __init__(self, graph: Graph, order: list[int], device: torch.device | str = "cpu") -> None:
        self.graph = graph
        self.device = torch.device(device)
        self.steps = segments(graph, order)
        self.host_pool = HostPool()
        self._placeholders = [Ref(p) for p in graph.placeholders()]
        self._written = {
            Ref(nid): graph.node(nid).writes_into
            for nid in order
            if graph.node(nid).writes_into is not None
        }
        self._dead_after = _dead_after(graph, self.steps)

    @property
    def segments(self) -> list[Segment]:
        return [s for s in self.steps if isinstance(s, Segment)]

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        self.host_pool.begin_call()
        env: dict[Ref, torch.Tensor] = dict(zip(self._placeholders, inputs, strict=True))
        pending: set[Ref] = set()  # Loads whose copy may still be landing (GPU)
        for k, step in enumerate(self.steps):
            if isinstance(step, HostCopy):
                self._copy(step, env, pending)
            else:
                self._segment(step, env, pending, k)
            for ref in self._dead_after[k]:
                env.pop(ref, None)
        self.host_pool.join()
        return tuple(env[r] for r in self.graph.outputs)

    def _copy(self, step: HostCopy, env: dict, pending: set[Ref]) -> None:
        pool, x = self.host_pool, env[step.source]
        if step.into is not None:
            env[Ref(step.nid)] = pool.store_into(x, env[step.into])
        elif self.graph.node(step.nid).op == STORE_OP:
            env[Ref(step.nid)] = pool.store(x)
        else:
            env[Ref(step.nid)] = pool.load(x, self.device)
            pending.add(Ref(step.nid))

    def _segment(self, seg: Segment, env: dict, pending: set[Ref], k: int) -> None:
        for ref in seg.inputs:
            if ref in pending:
                self.host_pool.ready(env[ref])
                pending.discard(ref)
        args = [env[r] for r in seg.inputs]
        if seg.compiled is None:
            seg.compiled = compile_segment(self.graph, seg, args)
        for ref in self._dead_after[k]:  # the list is then their only holder inside the call
            env.pop(ref, None)
        outs = seg.compiled(args)
        env.update(zip(seg.outputs, outs, strict=True))
        for nid in seg.nids:
            ref = Ref(nid)
            if ref in self._written:
                env[ref] = env[self._written[ref]]


def _dead_after(graph: Graph, steps: list) -> list[list[Ref]]:
    """For each step, the values whose last reader it is (never the graph's outputs)."""
    last: dict[Ref, int] = {}
    for k, step in enumerate(steps):
        if isinstance(step, Segment):
            reads = list(step.inputs)
            for nid in step.nids:
                reads.extend(Ref(nid, i) for i in range(len(graph.node(nid).outputs)))
        else:
            reads = [step.source, Ref(step.nid), *([step.into] if step.into else [])]
        for ref in reads:
            last[ref] = k
    for ref in [*graph.outputs, *(Ref(p) for p in graph.placeholders())]:
        last.pop(ref, None)  # placeholders are the caller's: dropping them frees nothing
    dead: list[list[Ref]] = [[] for _ in steps]
    for ref, k in last.items():
        dead[k].append(ref)
    return dead
