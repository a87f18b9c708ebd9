"""A plan's program replayed as one CUDA graph (issue 41).

A plan's program is static: the same ops on the same shapes in the same order every call, its
parameters and optimizer state the same tensors. On a GPU the Python that issues its thousands
of kernels (fission-heavy plans have thousands of ops) is then pure overhead, so the program is
captured once into a `torch.cuda.CUDAGraph` and replayed per call, as torchtitan's GraphTrainer
replays its whole step.

What is decided here, and why:

- **No extra training step.** Capture needs a warmed-up program (cuBLAS handles, the pinned
  host buffers of Store, lazily initialised kernels), but running a step only to warm up would
  update the model. The first call runs the program as generated code (that is the warm-up);
  the second call captures it and replays the capture, which is that call's step.
- **Static inputs.** Inputs are captured by address. The batch is copied into buffers owned
  here (the user's next batch is another tensor); every other input (parameters, buffers,
  optimizer state, the hyperparameter scalars, constants) is expected at the address it had at
  capture. If one moved (`optimizer.load_state_dict` replaces state tensors, `module.to()`
  replaces buffers) the graph is captured again: never a replay that reads freed memory.
- **Memory.** The graph allocates from a private pool while it is captured; the pool keeps the
  program's intermediates between replays. `captured_peak_bytes` is the caching allocator's peak
  during the capture (what the program allocates, as `max_memory_allocated` sees it); replays
  allocate nothing.
- **The arena is not used.** `magis.backend.arena` runs a plan inside one buffer through `out=`
  overloads; the graph's private pool already makes the allocation static, and an op without an
  `out=` overload on CUDA would add a copy. The layout's offsets stay a CPU and simulator figure.
- **Outputs** (the loss) live in the graph's pool and are overwritten by the next replay, so a
  call returns copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class GraphedProgram:
    """`program(*flat)` replayed from a CUDA graph; `data` indexes the inputs copied per call."""

    def __init__(self, program: Callable[..., tuple], data: Sequence[int]) -> None:
        self._program = program
        self._data = frozenset(data)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: list[torch.Tensor] = []
        self._outputs: tuple = ()
        self._warm = False
        self.captures = 0  # how many times the program was captured (1 unless inputs moved)
        self.captured_peak_bytes: int | None = None

    def __call__(self, *flat: torch.Tensor) -> tuple:
        if not self._warm:  # the first call is the warm-up, run as generated code
            self._warm = True
            return self._program(*flat)
        if self._graph is None or self._moved(flat):
            self._capture(flat)
        else:
            for i in self._data:
                self._static[i].copy_(flat[i])
        self._graph.replay()
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in self._outputs)

    def _moved(self, flat: Sequence[torch.Tensor]) -> bool:
        return any(
            i not in self._data and t.data_ptr() != s.data_ptr()
            for i, (t, s) in enumerate(zip(flat, self._static, strict=True))
        )

    def _capture(self, flat: Sequence[torch.Tensor]) -> None:
        self._graph, self._outputs = None, ()  # the old capture's pool goes first
        self._static = [t.clone() if i in self._data else t for i, t in enumerate(flat)]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.cuda.graph(graph):
            self._outputs = self._program(*self._static)
        torch.cuda.synchronize()
        resident = sum(t.untyped_storage().nbytes() for t in _distinct_storages(self._static))
        self.captured_peak_bytes = torch.cuda.max_memory_allocated() - before + resident
        self._graph = graph
        self.captures += 1


def _distinct_storages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(t.untyped_storage().data_ptr(), t)
    return list(seen.values())
