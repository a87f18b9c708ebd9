"""Running a plan compiled by Inductor: its segments in order (`magis.backend.fx_export`).

`InductorProgram` is called as `magis.backend.codegen.Program` is (the placeholders in graph
order, the graph's outputs back). It holds each value of the plan only until its last segment
reads it, as the generated Python drops it (`x = None`), and hands a segment its inputs in a
list that Inductor's compiled code empties, so an input dies at its last use inside the
segment. Each segment is compiled on the program's first call (see `fx_export`).

Measured (`measured=True`), the segments' buffers are allocated through the dispatcher
(`fx_export.MEASURED_CONFIG`), so `magis.backend.memory.LiveBytesTracker` counts them as it
counts the generated Python's; compiling, on the first call, runs outside any dispatch mode.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from magis.backend.fx_export import Segment, compile_segment, segments
from magis.backend.runtime import HostPool
from magis.ir import Graph, Ref
from magis.sim import tables


class InductorProgram:
    """The plan `graph` in `order` as Inductor-compiled segments on `device`."""

    def __init__(
        self,
        graph: Graph,
        order: list[int],
        device: torch.device | str = "cpu",
        measured: bool = False,
        owns_inputs: bool = False,
    ) -> None:
        self.graph = graph
        self.device = torch.device(device)
        self.measured = measured
        self.segments = segments(graph, order)
        self.host_pool = HostPool()
        self._placeholders = [Ref(p) for p in graph.placeholders()]
        on_host = tables(graph).host_resident  # as `codegen.Program.host_inputs`
        self.host_inputs = frozenset(
            i for i, ref in enumerate(self._placeholders) if ref in on_host
        )
        # A Store's output is a host copy: not device memory (`LiveBytesTracker`)
        self.host_ops = frozenset({torch.ops.magis.store.default})
        self._written = {
            Ref(nid): graph.node(nid).writes_into
            for nid in order
            if graph.node(nid).writes_into is not None
        }
        self._dead_after = _dead_after(graph, self.segments, owns_inputs)

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        return self.run(list(inputs))

    def run(self, inputs: list[torch.Tensor]) -> tuple:
        """The program on `inputs`, a list it empties: made with `owns_inputs`, it then holds
        each input only until its last reader (a backward's saved activations, which
        AOTAutograd hands over in a list of its own, `magis.backend.aot`)."""
        self.host_pool.begin_call()
        env: dict[Ref, torch.Tensor] = dict(zip(self._placeholders, inputs, strict=True))
        inputs.clear()
        for k, seg in enumerate(self.segments):
            args = [env[r] for r in seg.inputs]
            if seg.compiled is None:
                with _disable_current_modes():  # a measuring tracker counts the run, not this
                    seg.compiled = compile_segment(
                        self.graph, seg, args, self.host_pool, self.measured
                    )
            for ref in self._dead_after[k]:  # the list is then their only holder in the call
                env.pop(ref, None)
            # no name holds the returned list: a value the next segment reads last must die
            # inside it, not live on in a variable until it returns
            env.update(zip(seg.outputs, seg.compiled(args), strict=True))
            for nid in seg.nids:
                if Ref(nid) in self._written:
                    env[Ref(nid)] = env[self._written[Ref(nid)]]
        self.host_pool.join()
        return tuple(env[r] for r in self.graph.outputs)


def _dead_after(graph: Graph, steps: list[Segment], owns_inputs: bool) -> list[list[Ref]]:
    """For each segment, the values whose last reader it is (never an output; an input only
    when the program owns its inputs)."""
    last: dict[Ref, int] = {}
    for k, seg in enumerate(steps):
        for ref in seg.inputs:
            last[ref] = k
    kept = [] if owns_inputs else [Ref(p) for p in graph.placeholders()]
    for ref in [*graph.outputs, *kept]:
        last.pop(ref, None)  # the caller's inputs: dropping them here frees nothing
    dead: list[list[Ref]] = [[] for _ in steps]
    for ref, k in last.items():
        dead[k].append(ref)
    return dead
