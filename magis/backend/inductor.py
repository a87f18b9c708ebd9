"""Running a plan compiled by Inductor: its segments in order (`magis.backend.fx_export`).

`InductorProgram` is called as `magis.backend.codegen.Program` is (the placeholders in graph
order, the graph's outputs back). It holds each value of the plan only until its last segment
reads it, as the generated Python drops it (`x = None`), and hands a segment its inputs in a
list that Inductor's compiled code empties, so an input dies at its last use inside the
segment. Each segment is compiled on the program's first call (see `fx_export`).
"""

from __future__ import annotations

import torch

from magis.backend.fx_export import Segment, compile_segment, segments
from magis.backend.runtime import HostPool
from magis.ir import Graph, Ref


class InductorProgram:
    """The plan `graph` in `order` as Inductor-compiled segments on `device`."""

    def __init__(self, graph: Graph, order: list[int], device: torch.device | str = "cpu") -> None:
        self.graph = graph
        self.device = torch.device(device)
        self.segments = segments(graph, order)
        self.host_pool = HostPool()
        self._placeholders = [Ref(p) for p in graph.placeholders()]
        self._written = {
            Ref(nid): graph.node(nid).writes_into
            for nid in order
            if graph.node(nid).writes_into is not None
        }
        self._dead_after = _dead_after(graph, self.segments)

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        self.host_pool.begin_call()
        env: dict[Ref, torch.Tensor] = dict(zip(self._placeholders, inputs, strict=True))
        for k, seg in enumerate(self.segments):
            args = [env[r] for r in seg.inputs]
            if seg.compiled is None:
                seg.compiled = compile_segment(self.graph, seg, args, self.host_pool)
            for ref in self._dead_after[k]:  # the list is then their only holder in the call
                env.pop(ref, None)
            outs = seg.compiled(args)
            env.update(zip(seg.outputs, outs, strict=True))
            for nid in seg.nids:
                if Ref(nid) in self._written:
                    env[Ref(nid)] = env[self._written[Ref(nid)]]
        self.host_pool.join()
        return tuple(env[r] for r in self.graph.outputs)


def _dead_after(graph: Graph, steps: list[Segment]) -> list[list[Ref]]:
    """For each segment, the values whose last reader it is (never an output or an input)."""
    last: dict[Ref, int] = {}
    for k, seg in enumerate(steps):
        for ref in seg.inputs:
            last[ref] = k
    for ref in [*graph.outputs, *(Ref(p) for p in graph.placeholders())]:
        last.pop(ref, None)  # placeholders are the caller's: dropping them frees nothing
    dead: list[list[Ref]] = [[] for _ in steps]
    for ref, k in last.items():
        dead[k].append(ref)
    return dead
