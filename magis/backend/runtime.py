"""What generated programs call besides torch.ops.aten: Store and Load (MAGIS §5.2, §6.2).

A Store copies a device tensor into host memory, a Load copies it back. On a GPU both run on a
side CUDA stream (the simulator's copy stream) and nothing waits on the host:

- a Store's copy waits (by event) for the compute stream to reach it, so the tensor has been
  produced; `record_stream` keeps the caching allocator from reusing the tensor's block before
  the copy has read it;
- a Load's destination is allocated on the compute stream at the Load's place in the program
  (as the simulator counts it), the copy waits (by event) for the compute stream to reach that
  place, so the block is free, and the Load's first user waits (by event, `ready`) for the copy
  to land. A Load follows its Store on the same side stream, so it never reads a half-written
  host buffer;
- at the program's end the compute stream waits for the side stream (`join`), which a CUDA
  graph capture requires of every stream it forked.

Host buffers are pinned and kept by the pool, one per Store in the program's call order, and
reused on later calls: the program's shapes never change, the pinned allocation is paid once,
and a CUDA graph (`magis.train.cuda_graph`) replays copies into the very buffers it captured.

On a CPU the "host pool" is ordinary memory kept apart from the program's measured footprint:
its bytes are counted here, not by the dispatch tracker, and reported beside the device figure.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _disable_current_modes

from magis.ir.tensor import contiguous_strides, dense_layout


@dataclass
class HostPool:
    """Stored tensors: where they live and how many bytes they hold at most."""

    live_bytes: int = 0
    peak_bytes: int = 0
    _copy_stream: object = None
    _ready: dict[int, object] = field(default_factory=dict)  # id(device tensor) -> cuda event
    _pinned: list[torch.Tensor] = field(default_factory=list)  # one per Store, in call order
    _next: int = 0  # the next Store's index in `_pinned` during a call

    def begin_call(self) -> None:
        """A program call starts: its first Store takes the first pinned buffer again."""
        self._next = 0

    def store(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self._store_cuda(x)
        with _disable_current_modes():  # host memory is not the device footprint being measured
            host = torch.empty_strided(x.shape, host_strides(x), dtype=x.dtype).copy_(x.detach())
        nbytes = host.untyped_storage().nbytes()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(host.untyped_storage(), self._release, nbytes)
        return host

    def store_into(self, x: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Copy `x` into `host`, a placeholder kept in host memory (offloaded optimizer state,
        `magis.rules.offload`): on a GPU on the side stream, as `store` copies, once the
        compute stream has produced `x`. The placeholder's bytes are the caller's, not the
        pool's."""
        if not x.is_cuda or host.is_cuda:
            return host.copy_(x)
        return self._copy_to_host(x, host)

    def load(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return host.clone()
        # on the compute stream, with the stored tensor's strides (a transposed tensor comes back
        # transposed: later views depend on it)
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        reached = torch.cuda.Event()
        reached.record()
        stream = self._stream()
        with torch.cuda.stream(stream):
            stream.wait_event(reached)
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._ready[id(out)] = done
        return out

    def ready(self, x: torch.Tensor) -> None:
        """Make the compute stream wait for the Load of `x` (right before its first user)."""
        done = self._ready.pop(id(x), None)
        if done is not None:
            torch.cuda.current_stream().wait_event(done)

    def join(self) -> None:
        """The compute stream waits for every copy issued so far (a program's end)."""
        if self._copy_stream is not None:
            torch.cuda.current_stream().wait_stream(self._copy_stream)

    def _store_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return self._copy_to_host(x, self._pinned_buffer(x))

    def _copy_to_host(self, x: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Copy device tensor `x` into `host` on the side stream, once the compute stream has
        produced it."""
        produced = torch.cuda.Event()
        produced.record()
        stream = self._stream()
        with torch.cuda.stream(stream):
            stream.wait_event(produced)
            host.copy_(x, non_blocking=True)
            x.record_stream(stream)  # the caching allocator must not reuse x before the copy ends
        return host

    def _pinned_buffer(self, x: torch.Tensor) -> torch.Tensor:
        """The pinned host buffer of this call's next Store: made on the first call, reused."""
        k, self._next = self._next, self._next + 1
        if k < len(self._pinned):
            host = self._pinned[k]
            if host.shape == x.shape and host.dtype == x.dtype and host.stride() == host_strides(x):
                return host
        with _disable_current_modes():
            host = _pinned_like(x)
        if k < len(self._pinned):
            self._pinned[k] = host
        else:
            self._pinned.append(host)
        self.live_bytes = sum(h.untyped_storage().nbytes() for h in self._pinned)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return host

    def _stream(self):
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        return self._copy_stream

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


def host_strides(x: torch.Tensor) -> tuple[int, ...]:
    """The strides of `x`'s host copy: its own when they are dense (a transposed or
    channels-last tensor: later views depend on them), row-major otherwise (an expanded,
    overlapping or sliced view). Inductor's fake Store (`magis.backend.host_ops`) must give the
    same, or a compiled graph asserts on the real one's strides."""
    if dense_layout(tuple(x.shape), tuple(x.stride())):
        return tuple(x.stride())
    return contiguous_strides(tuple(x.shape))


def _pinned_like(x: torch.Tensor) -> torch.Tensor:
    """Pinned host memory for `x`, laid out by `host_strides`."""
    return torch.empty_strided(x.shape, host_strides(x), dtype=x.dtype, pin_memory=True)
