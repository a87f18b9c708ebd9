"""What generated programs call besides torch.ops.aten: Store and Load (MAGIS §5.2, §6.2).

A Store copies a device tensor into host memory, a Load copies it back. On a GPU both run on a
side CUDA stream: the Store waits (by event) for the tensor to be produced, the Load's user waits
(by event) for the copy to land, so the transfer overlaps compute. On a CPU the "host pool" is
ordinary memory kept apart from the program's measured footprint: its bytes are counted here,
not by the dispatch tracker, and reported beside the device figure.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _disable_current_modes


@dataclass
class HostPool:
    """Stored tensors: where they live and how many bytes they hold at most."""

    live_bytes: int = 0
    peak_bytes: int = 0
    _copy_stream: object = None
    _ready: dict[int, object] = field(default_factory=dict)  # id(device tensor) -> cuda event

    def store(self, x: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():  # host memory is not the device footprint being measured
            host = self._to_host(x)
        nbytes = host.untyped_storage().nbytes()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(host.untyped_storage(), self._release, nbytes)
        return host

    def load(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return host.clone()
        stream = self._stream()
        with torch.cuda.stream(stream):
            out = host.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._ready[id(out)] = done
        return out

    def ready(self, x: torch.Tensor) -> None:
        """Make the compute stream wait for the Load of `x` (right before its first user)."""
        done = self._ready.pop(id(x), None)
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
            x.record_stream(torch.cuda.current_stream())

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return x.detach().clone()
        produced = torch.cuda.Event()
        produced.record()
        stream = self._stream()
        with torch.cuda.stream(stream):
            stream.wait_event(produced)
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            host.copy_(x, non_blocking=True)
            x.record_stream(stream)  # the caching allocator must not reuse x before the copy ends
        stream.synchronize()  # a Load may read it next; pinned copies are fast, keep it simple
        return host

    def _stream(self):
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        return self._copy_stream

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes
