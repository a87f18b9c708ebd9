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
from torch.utils._python_dispatch import TorchDispatchMode

from magis.backend.executor import relative_error
from magis.backend.memory import LiveBytesTracker, allocated_peak_bytes
from magis.bench.train import workload_loss
from magis.capture.building import default_dtype
from magis.capture.user_model import is_model_file
from magis.capture.workloads import get_workload


def named_step_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[str, torch.Tensor]]:
    """The weights, buffers and optimizer state tensors, named, in a fixed order."""
    tensors = [*model.named_parameters()]
    tensors += [(f"{n}:buffer", b) for n, b in model.named_buffers()]
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            owner = names.get(id(p), "?")
            tensors += [
                (f"{owner}:{k}", state[k])
                for k in sorted(state)
                if isinstance(state[k], torch.Tensor)
            ]
    return tensors


def step_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The weights, buffers and optimizer state tensors, in a fixed order."""
    return [t for _, t in named_step_tensors(model, optimizer)]


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
        compiled: bool = False,
    ) -> tuple[float, int]:
        """`compiled`: the step runs code Inductor generated, whose buffers a CPU's dispatch
        tracker cannot see: there the peak is the CPU allocator's (`allocated_peak_bytes`, under
        the profiler, whose overhead the time then includes)."""
        for p in model.parameters():
            p.grad = None
        resident = [*step_tensors(model, optimizer), *batch]
        if self.device.type == "cuda":
            return self._cuda_step(fn, resident_bytes(resident, self.device))
        if compiled:
            start = time.perf_counter()
            peak = allocated_peak_bytes(fn)
            return time.perf_counter() - start, peak + resident_bytes(resident, self.device)
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
    """Copies of a model's and its optimizer's tensors (`named_step_tensors` order)."""

    tensors: tuple[torch.Tensor, ...]
    names: tuple[str, ...] = ()

    @staticmethod
    def of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StateSnapshot:
        named = named_step_tensors(model, optimizer)
        with torch.no_grad():
            copies = tuple(t.detach().clone() for _, t in named)
        return StateSnapshot(copies, tuple(n for n, _ in named))

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Copy the snapshot back into the same tensors (their addresses do not change)."""
        current = step_tensors(model, optimizer)
        if len(current) != len(self.tensors):
            raise RuntimeError("the optimizer's state changed shape since the snapshot")
        with torch.no_grad():
            for dst, src in zip(current, self.tensors, strict=True):
                dst.copy_(src)

    def errors_by_kind(self, other: StateSnapshot) -> dict[str, tuple[float, str]]:
        """For each kind of tensor (parameters, buffers, each optimizer state key), the largest
        relative error of `other`'s against this snapshot's, and the tensor it is in."""
        if len(other.tensors) != len(self.tensors):
            return {"structure": (float("inf"), "the optimizer's state differs")}
        worst: dict[str, tuple[float, str]] = {}
        for name, a, e in zip(self.names, other.tensors, self.tensors, strict=True):
            kind = name.split(":", 1)[1] if ":" in name else "param"
            err = relative_error(a, e)
            if kind not in worst or err > worst[kind][0]:
                worst[kind] = (err, name)
        return worst


class OpWorkspaces(TorchDispatchMode):
    """The bytes each op allocates and frees before it returns (a convolution's cuDNN
    workspace, a sort's scratch): what the simulator, which counts tensors, does not see.

    Per op: the caching allocator's peak during the call minus what is allocated after it.
    The largest is kept with its op. Allocator statistics are host-side bookkeeping, so no
    synchronization is needed; the peak statistic is reset per op, so run this apart from a
    measured step."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.largest_bytes = 0
        self.largest_op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        torch.cuda.reset_peak_memory_stats(self.device)
        out = func(*args, **(kwargs or {}))
        scratch = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(
            self.device
        )
        if scratch > self.largest_bytes:
            self.largest_bytes, self.largest_op = scratch, str(func)
        return out


# --- a workload's model, optimizer and batch on the device ------------------------------------


@dataclass
class Case:
    """A workload's model, optimizer, batch and loss on the device."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, ...]
    loss_fn: Callable[..., torch.Tensor]

    def eager_step(self) -> torch.Tensor:
        return self.loop_step(self.model)

    def loop_step(self, module: torch.nn.Module) -> torch.Tensor:
        """One step of the user's loop through `module` (the model, or torch.compile's wrapper
        of it): `zero_grad`, forward and loss, `backward`, `optimizer.step()`."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(module, *self.batch)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def build_case(name: str, device: torch.device) -> Case:
    if is_model_file(name):
        return user_case(name, device)
    wl = get_workload(name)
    with default_dtype(torch.float32):
        torch.manual_seed(0)
        model = wl.build(torch.float32).to(device)
        batch = tuple(t.to(device) for t in wl.make_inputs(wl.batch))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    return Case(name, model, optimizer, batch, workload_loss(wl))


def user_case(name: str, device: torch.device) -> Case:
    """A model file's `factory()` (`path/to/model.py:factory`), built for real in float32."""
    from magis.capture.trace import loss_of
    from magis.capture.user_model import call_factory, check_result, load_factory, parse_spec

    spec = parse_spec(name)
    made = check_result(
        spec, call_factory(spec, load_factory(spec), dtype=torch.float32, real=True)
    )
    model = made.model.to(device)
    batch = tuple(t.to(device) for t in made.data)
    user_loss, names, keywords = made.loss_fn, made.names, made.keywords

    def loss_fn(m: torch.nn.Module, *data: torch.Tensor) -> torch.Tensor:
        args, kwargs = ((), dict(zip(names, data, strict=True))) if keywords else (data, {})
        return user_loss(m, *args, **kwargs) if user_loss else loss_of(m(*args, **kwargs))

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    return Case(name, model, optimizer, batch, loss_fn)
