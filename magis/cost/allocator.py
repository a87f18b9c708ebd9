"""What the host's allocator does during a call, from the allocations and frees c10 reports to
the profiler (`profile_memory=True`).

A CPU has no allocator statistics (`torch.cuda.max_memory_allocated` has no host twin), but
every allocation and free of c10's CPU allocator is a `[memory]` event of the profiler, those
of code that allocates outside the dispatcher included: a kernel's own scratch (a transposed
convolution's backward pads its input and gradient into two buffers it frees before it
returns), Inductor's `empty_strided_cpu`. Two figures are read from those events: the peak
above the start (`allocated_peak_bytes`, what a step holds at most) and an op's scratch (what
it allocates and frees inside itself, which no tensor of the graph holds: `call_scratch_bytes`,
what `ProfiledCostModel.scratch_bytes` measures on a CPU).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any


def allocation_deltas(fn: Callable[[], Any]) -> tuple[list[int], Any]:
    """The signed bytes of every allocation (+) and free (-) of the CPU allocator during `fn()`,
    in time order, and what `fn` returned (kept alive until the events are read, so that its
    outputs count as allocated and not freed)."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr():  # kineto prints a line when a profiler starts and one when it stops
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.__enter__()
    try:
        out = fn()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    return [e.nbytes() for e in events], out


def allocated_peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes the CPU allocator held at once during `fn()`, above what it held before."""
    deltas, _ = allocation_deltas(fn)
    return _running_peak(deltas)[0]


def call_scratch_bytes(fn: Callable[[], object]) -> int:
    """Bytes `fn()` held at its peak beyond what it still holds when it returns (its outputs):
    the scratch one op call allocates and frees inside itself."""
    deltas, out = allocation_deltas(fn)
    peak, end = _running_peak(deltas)
    del out
    return max(0, peak - end)


def _running_peak(deltas: list[int]) -> tuple[int, int]:
    """(the highest running sum of `deltas`, at least 0; the sum at the end)."""
    current = peak = 0
    for d in deltas:
        current += d
        peak = max(peak, current)
    return peak, current


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null (C++ writes there directly), Python's buffer
    flushed first so that nothing of ours is lost. Kineto reads its log level only when torch
    is imported, so an environment variable set later cannot silence it."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
