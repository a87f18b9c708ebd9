"""How `magis bench gpu` measures one training step, and how it puts a model back (issue 41).

`DeviceMeter.step` times one step and measures its peak the same way for eager PyTorch and for
a magis `TrainStep`: the step's resident tensors (weights, buffers, optimizer state, the batch)
plus the most it allocated on top of what was allocated when it started. Gradients left by the
previous eager step are dropped first, as `zero_grad(set_to_none=True)` would at the step's
start, so that they count inside the step that makes them.

`StateSnapshot` copies a model's weights and buffers and its optimizer's state, puts them back
in place (the same tensors, so a CUDA graph's captured addresses stay valid) and compares two
snapshots tensor by tensor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from magis.backend.executor import relative_error
from magis.backend.memory import LiveBytesTracker


def step_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The weights, buffers and optimizer state tensors, in a fixed order."""
    tensors = [*model.parameters(), *model.buffers()]
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            tensors += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return tensors


def resident_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages of `tensors` that live on `device`."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == device.type:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class DeviceMeter:
    """One step's seconds and peak bytes on `device` (CUDA events and the caching allocator's
    statistics on a GPU; the wall clock and the dispatch tracker on a CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(
        self,
        fn: Callable[[], object],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: Sequence[torch.Tensor],
    ) -> tuple[float, int]:
        for p in model.parameters():
            p.grad = None
        resident = [*step_tensors(model, optimizer), *batch]
        if self.device.type == "cuda":
            return self._cuda_step(fn, resident_bytes(resident, self.device))
        tracker = LiveBytesTracker(resident)
        start = time.perf_counter()
        with tracker:
            fn()
        return time.perf_counter() - start, tracker.peak_bytes

    def _cuda_step(self, fn: Callable[[], object], resident: int) -> tuple[float, int]:
        self.sync()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        self.sync()
        peak = torch.cuda.max_memory_allocated(self.device) - before + resident
        return start.elapsed_time(end) / 1e3, peak


@dataclass(frozen=True)
class StateSnapshot:
    """Copies of a model's and its optimizer's tensors (`step_tensors` order)."""

    tensors: tuple[torch.Tensor, ...]

    @staticmethod
    def of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StateSnapshot:
        with torch.no_grad():
            return StateSnapshot(tuple(t.detach().clone() for t in step_tensors(model, optimizer)))

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Copy the snapshot back into the same tensors (their addresses do not change)."""
        current = step_tensors(model, optimizer)
        if len(current) != len(self.tensors):
            raise RuntimeError("the optimizer's state changed shape since the snapshot")
        with torch.no_grad():
            for dst, src in zip(current, self.tensors, strict=True):
                dst.copy_(src)

    def max_rel_err(self, other: StateSnapshot) -> float:
        """The largest relative error of `other`'s tensors against this snapshot's."""
        if len(other.tensors) != len(self.tensors):
            return float("inf")
        return max(
            (relative_error(a, e) for a, e in zip(other.tensors, self.tensors, strict=True)),
            default=0.0,
        )
