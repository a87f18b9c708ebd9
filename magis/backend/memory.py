"""Peak live bytes of a real run, measured independently of the simulator (DESIGN principle 3).

A TorchDispatchMode sees every ATen op the program runs; each output whose storage it has not
seen is counted as allocated, and a finalizer on the storage object counts it freed the moment
its last alias dies. Storages of the inputs are counted once, as resident. On CUDA,
`torch.cuda.max_memory_allocated` is reported beside it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from magis.cost import allocator


@dataclass
class _Counter:
    live: dict[int, int] = field(default_factory=dict)  # storage data_ptr -> bytes
    current: int = 0
    peak: int = 0

    def allocate(self, ptr: int, nbytes: int) -> None:
        self.live[ptr] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def free(self, ptr: int) -> None:
        self.current -= self.live.pop(ptr, 0)


class LiveBytesTracker(TorchDispatchMode):
    """Tracks the bytes of live storages created by the ops run under it.

    `peak_bytes` = resident input bytes + the peak of storages allocated during the run.
    The outputs of `host_ops` (a program's Store as an operator, `magis.backend.host_ops`) live
    in host memory and are not counted, as the generated Python's `store` is not dispatched.
    """

    def __init__(
        self,
        resident: Sequence[torch.Tensor] = (),
        host: Sequence[torch.Tensor] = (),
        host_ops: frozenset = frozenset(),
    ) -> None:
        super().__init__()
        self._counter = _Counter()
        self._resident: set[int] = set()
        self.resident_bytes = 0
        for t in resident:
            self._mark_resident(t)
        # inputs kept in host memory (`Program.host_inputs`): neither resident nor counted
        # when a Store writes them back
        self._host = {t.untyped_storage().data_ptr() for t in host}
        self._host_ops = host_ops

    def _mark_resident(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self._resident:
            self._resident.add(ptr)
            self.resident_bytes += storage.nbytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._host_ops:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if not ptr or not nbytes or ptr in self._resident or ptr in self._counter.live:
            return
        if ptr in self._host:
            return
        self._counter.allocate(ptr, nbytes)
        weakref.finalize(storage, self._counter.free, ptr)

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self._counter.peak

    @property
    def live_bytes(self) -> int:
        return self._counter.current


def allocated_peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes the CPU allocator held at once during `fn()`, above what it held before
    (`magis.cost.allocator`): those of code that allocates outside the dispatcher included
    (Inductor's generated `empty_strided_cpu`, which `LiveBytesTracker` cannot see; Dynamo also
    runs a compiled function eagerly under a dispatch mode). On eager code it counts what the
    tracker counts, and what kernels allocate for themselves besides (an MLP's forward and
    backward: the same 12,603,416 bytes; a smaller one's: 4 KiB more,
    `tests/bench/test_train_compiled.py`)."""
    return allocator.allocated_peak_bytes(fn)


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """The bytes of the distinct storages of `tensors` (views and repeats counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
    return sum(seen.values())
