"""A cost model that measures every distinct op on the local device (MAGIS §6.2; thesis §2.6).

TASO "measures the execution time of a DNN operator once for each configuration ... and estimates
the performance of a graph by summing up the measured execution time of its operators" (Jia,
thesis §2.6); MAGIS keeps such measurements in "an operator performance cache" (§6.2). Here a
configuration is an `OpKey`; its inputs are synthesized from the TensorMetas, the ATen overload
is called directly, one call at a time, and the median of a few calls is kept in SQLite.

Single calls are timed with the Python-to-ATen dispatch included, not batched: the generated
program pays the same overhead per op, and on a CPU at small sizes it is most of the time. Each
timed CPU call follows a few calls of other ops (`Disturbance`), as it does in a program. An op
that cannot run on synthetic inputs (or would read a workspace they cannot hold:
`OpInfo.reads_workspace`), or whose tensors would not fit in a quarter of the device's memory,
gets a roofline estimate instead (a generic CPU's; on a GPU the H100 preset's),
remembered like a measurement. A cached time measured while the machine ran over 3 times
slower than it runs now is measured again (`magis.cost.pace`).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from magis.cost.allocator import call_scratch_bytes
from magis.cost.base import CostModel, OpCall, OpKey, key_text, op_key
from magis.cost.links import Interconnect
from magis.cost.pace import Pace, is_stale
from magis.cost.roofline import CPU, H100, roofline_time
from magis.cost.store import MEMORY, OpTimeStore, Row, default_cache_path
from magis.ir import Graph, OpInfo
from magis.ir.ops import bytes_moved, resolve_overload
from magis.ir.tensor import TensorMeta

# Bump when the way ops are timed changes: rows timed the old way are then ignored.
PROFILER_VERSION = "3 (single calls, disturbed, lower quartile; views timed on the host)"
MEASURED = "measured"
ESTIMATED = "estimated"  # the op would not run on synthetic inputs: roofline of `CPU` instead
# On CUDA a sample is this many back-to-back calls: launches are asynchronous, so in a program
# an op costs max(dispatch, kernel), not dispatch + kernel + a synchronization.
CUDA_CALLS_PER_SAMPLE = 10
# Copies timed once to model Store/Load: a large one for bandwidth, a tiny one for latency.
_TRANSFER_PROBE_BYTES = 16 << 20
_TRANSFER_KEYS = ("transfer:latency", "transfer:bandwidth")
# An op configuration's scratch bytes are kept beside its time, under this prefix.
_SCRATCH_PREFIX = "scratch:"

ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class ProfileInfo:
    """Where a profiled model's times came from."""

    path: Path | None  # the SQLite file, None when op times are kept in memory only
    loaded: int  # op times read from the file when it was opened
    measured: int  # op configurations this instance timed
    fallbacks: tuple[str, ...]  # ops that could not run and got a roofline estimate
    # cached times measured on a machine running over `STALE_PACE` times slower than now: not
    # loaded, measured again on first use
    retaken: int = 0


def device_name(device: torch.device) -> str:
    """What the timings are valid for: the GPU model, or the CPU model and thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_model()} ({torch.get_num_threads()} threads)"


def device_memory(device: torch.device) -> float:
    """Bytes of memory the device has (physical RAM for the CPU); infinite when unknown."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return math.inf


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


# --- synthetic inputs --------------------------------------------------------------------------


def synthetic_tensor(meta: TensorMeta, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """A real tensor for `meta`: floats in [0.25, 0.75) (log, sqrt, div stay finite), integers 0
    (a valid index for embedding, nll_loss, gather), booleans False."""
    dtype = meta.torch_dtype
    if dtype.is_floating_point or dtype.is_complex:
        if gen.device.type == device.type:  # drawn on the device: a GiB of logits in ms
            return torch.rand(meta.shape, generator=gen, dtype=dtype, device=device) * 0.5 + 0.25
        t = torch.rand(meta.shape, generator=gen, dtype=dtype) * 0.5 + 0.25
        return t.to(device)
    return torch.zeros(meta.shape, dtype=dtype, device=device)


def synthetic_value(value: Any, device: torch.device, gen: torch.Generator) -> Any:
    """An argument of an `OpKey` made runnable: metas become tensors, devices the profiling one."""
    if isinstance(value, TensorMeta):
        return synthetic_tensor(value, device, gen)
    if isinstance(value, torch.device):
        return device
    if isinstance(value, tuple):
        return tuple(synthetic_value(v, device, gen) for v in value)
    return value


def time_call(
    fn: Callable[[], Any],
    warmup: int,
    repeats: int,
    before: Callable[[], None] = lambda: None,
    sync: Callable[[], None] = lambda: None,
    calls: int = 1,
) -> float:
    """Seconds per call of `fn`: lower quartile of `repeats` samples of `calls` calls each.

    `before` runs ahead of every sample, untimed; `sync` waits for the device at both ends.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(max(1, repeats)):
        before()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        sync()
        samples.append((time.perf_counter() - start) / calls)
        del out  # freed outside the timed region, as the program frees at a value's last use
    # The lower quartile, not the median: another process on a 2-core machine only ever adds
    # time, and a result lands in a persistent cache, so one busy moment must not poison it.
    return float(statistics.quantiles(samples, n=4)[0]) if len(samples) >= 4 else min(samples)


class Disturbance:
    """Calls of other ATen ops made before each timed CPU call, so that it runs "cold".

    In a program every op follows different ops (and views) that evict its dispatch path from
    the instruction cache and branch predictors; a call repeated back to back hides that. On
    bert-base:tiny (2-core CPU, ~440 non-view ops of a few us each) back-to-back timing summed to
    1.2-1.5 ms while the same ops took ~2.5 ms inside the generated program (3.1-3.4 ms with its
    ~230 views); with these eight calls before each timed one, 2.6-2.7 ms. The same disturbance
    for every key keeps measurements comparable: a split op measured later is timed under the
    conditions its unsplit parent was.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.x = torch.rand(16, 32, device=device)
        self.y = torch.rand(32, 16, device=device)

    def __call__(self) -> None:
        aten, x = torch.ops.aten, self.x
        aten.add.Tensor(x, x)
        aten.mul.Tensor(x, 2.0)
        aten.t.default(x)
        aten.view.default(x, [32, 16])
        aten.sum.dim_IntList(x, [0])
        aten.mm.default(x, self.y)
        aten.gelu.default(x)
        aten.cat.default([x, x])


# --- the model ---------------------------------------------------------------------------------


class ProfiledCostModel(CostModel):
    """Op times measured on `device` and cached in SQLite (see `magis.cost.store`)."""

    def __init__(
        self,
        device: str | torch.device = "cpu",
        cache_path: str | Path | None = None,
        warmup: int = 2,
        repeats: int = 8,
        pace: Callable[[], float] | None = None,
    ) -> None:
        """`pace`: seconds of a reference workload now (default: `magis.cost.pace.Pace` on
        `device`), stored with each measured time; one that returns 0 (no pace known) keeps
        every cached time whatever the machine's load (tests that read a cache back)."""
        super().__init__()
        self.device = torch.device(device)
        self.name = str(self.device)
        self.views_cost_time = self.device.type == "cpu"
        self.copies_overlap = self.device.type != "cpu"
        self.measures_scratch = True
        self.warmup = warmup
        self.repeats = repeats
        path = default_cache_path() if cache_path is None else cache_path
        self._store = OpTimeStore(
            path, (device_name(self.device), torch.__version__, PROFILER_VERSION)
        )
        if pace is None:  # the machine's pace: the disturbance's calls, timed as ops are
            pace = Pace(Disturbance(self.device), self._time_reference).read
        self._pace = pace
        self._retaken = self._forget_stale_times()
        # op times read (each op's scratch row beside its time is not counted again)
        self._loaded = sum(not k.startswith(_SCRATCH_PREFIX) for k in self._store.rows)
        self._measured = 0
        self._fallbacks: dict[str, str] = {}  # op -> why it did not run
        self._disturb = Disturbance()
        self._max_bytes = device_memory(self.device) / 4  # room for inputs, outputs, the rest
        # An op that cannot run here is priced by the nearest analytic model: a generic CPU, or
        # on a GPU the newest preset (an H100's roofline beats a CPU's by orders of magnitude).
        self._fallback = CPU if self.device.type == "cpu" else H100

    # --- CostModel ----------------------------------------------------------------------------

    def estimate(self, call: OpCall) -> float:
        text = key_text(call.key)
        cached = self._store.get(text)
        if cached is not None:
            return cached
        seconds, source = self._measure_or_estimate(call)
        self._put_time(text, seconds, source)
        return seconds

    def scratch_bytes(self, graph: Graph, nid: int) -> int:
        """The bytes the op allocated and freed within one call, measured once per configuration
        and kept beside its time: on a GPU the caching allocator's peak during the call over what
        stayed allocated after it, on a CPU the same read from the allocator's profiler events
        (`magis.cost.allocator`). 0 for views, copies, collectives and ops that cannot run here."""
        node = graph.node(nid)
        info = graph.info(nid)
        if node.is_placeholder or info.is_view or info.copy_stream or info.comm_stream:
            return 0
        return self.scratch_of(OpCall(op_key(graph, nid), info))

    def scratch_of(self, call: OpCall) -> int:
        """The scratch bytes of one op configuration (measured on first use, then stored)."""
        text = _SCRATCH_PREFIX + key_text(call.key)
        cached = self._store.get(text)
        if cached is None:
            cached = self._measure_scratch(call)
            self._store.put(text, float(cached), MEASURED)
        return int(cached)

    def transfer_time(self, nbytes: int) -> float:
        """One Store/Load: a copy between device and host memory, from two timed copies."""
        if nbytes <= 0:
            return 0.0
        latency, bandwidth = self._transfer_constants()
        return latency + nbytes / bandwidth

    # --- profiling ----------------------------------------------------------------------------

    def profile_graph(self, graph: Graph, progress: ProgressFn | None = None) -> int:
        """Measure every distinct op configuration of `graph` now; return how many there are.

        `progress(done, total)` is called before the first and after every configuration, so a
        caller can drive a progress bar.
        """
        calls = distinct_calls(graph, include_views=self.views_cost_time)
        if progress is not None:
            progress(0, len(calls))
        fresh: list[tuple[OpKey, OpInfo]] = []
        with self._store.batch():
            for done, (key, info) in enumerate(calls, 1):
                if self._store.get(key_text(key)) is None:
                    fresh.append((key, info))
                self.time_of(key, info)
                if not info.is_view:
                    self.scratch_of(OpCall(key, info))
                if progress is not None:
                    progress(done, len(calls))
            self._second_pass(fresh)
        return len(calls)

    def _second_pass(self, fresh: list[tuple[OpKey, OpInfo]]) -> None:
        """Measure what was just measured once more, seconds later, and keep the smaller time.

        On a shared 2-core machine another process can hold a core for a second at a time; a
        time taken then would sit in the persistent cache for good. A burst rarely covers both
        passes; sustained contention is beyond repair and only a quiet machine measures right.
        """
        for key, info in fresh:
            text = key_text(key)
            first = self._store.get(text)
            call = OpCall(key, info)
            if first is None or call.op in self._fallbacks:
                continue
            try:
                again = self._measure(call)
            except Exception:  # noqa: BLE001 - it ran once; keep that time
                continue
            if again < first:
                self._put_time(text, again, MEASURED)
                self.forget(key, text)  # recomputed from the store on next use

    def __reduce__(self) -> tuple:
        """Pickled for a search's worker processes (`magis optimize --hardware cpu --workers
        2`; the SQLite connection and the pace's tensors are this process's): the worker opens
        the same cache file again, which holds what this process measured, or gets the rows of a
        cache held in memory; the link is this model's."""
        persistent = self._store.persistent
        rows = None if persistent else dict(self._store.rows)
        path = self._store.path if persistent else None
        args = (str(self.device), path, self.warmup, self.repeats, self.interconnect, rows)
        return (ProfiledCostModel._reopened, args)

    @classmethod
    def _reopened(
        cls,
        device: str,
        path: Path | None,
        warmup: int,
        repeats: int,
        interconnect: Interconnect,
        rows: dict[str, Row] | None,
    ) -> ProfiledCostModel:
        model = cls(
            device, cache_path=path if path is not None else MEMORY, warmup=warmup, repeats=repeats
        )
        model.interconnect = interconnect
        for key, row in (rows or {}).items():
            model._store.put(key, row.seconds, row.source, row.pace)
        return model

    def profile_info(self) -> ProfileInfo:
        path = self._store.path if self._store.persistent else None
        return ProfileInfo(
            path, self._loaded, self._measured, tuple(sorted(self._fallbacks)), self._retaken
        )

    def close(self) -> None:
        """Commit and close the database (also safe to skip: every single write is committed)."""
        self._store.close()

    # --- measuring ----------------------------------------------------------------------------

    def _not_runnable(self, call: OpCall) -> str | None:
        """Why the op cannot be run here on synthetic inputs (None: it can): it is priced by
        the roofline then, and has no scratch."""
        nbytes = bytes_moved(call.info, call.args, call.kwargs, call.outputs)
        if nbytes > self._max_bytes:
            return f"{nbytes} bytes of tensors: too large to run here"
        if call.info.reads_workspace:
            return "reads another kernel's workspace: no synthetic input"
        if call.info.guard:
            return "a value guard: no kernel of torch's"
        return None

    def _measure_or_estimate(self, call: OpCall) -> tuple[float, str]:
        reason = self._not_runnable(call)
        if reason is not None:
            self._fallbacks[call.op] = reason
            return roofline_time(self._fallback, call), ESTIMATED
        try:
            seconds = self._measure(call)
        except Exception as exc:  # noqa: BLE001 - any failure of a synthetic run degrades
            self._fallbacks[call.op] = f"{type(exc).__name__}: {_first_line(exc)}"
            return roofline_time(self._fallback, call), ESTIMATED
        self._measured += 1
        return seconds, MEASURED

    def _measure(self, call: OpCall) -> float:
        """Median seconds of one call of the op on synthetic inputs (raises if it cannot run),
        and, the first time, its scratch on the same inputs (warm by then), stored beside it."""
        run = self._synthetic_call(call)
        seconds = self._time(run, touches_data=not call.info.is_view)
        text = _SCRATCH_PREFIX + key_text(call.key)
        if not call.info.is_view and self._store.get(text) is None:
            self._store.put(text, float(self._scratch(run)), MEASURED)
        return seconds

    def _measure_scratch(self, call: OpCall) -> int:
        """The scratch of one call of the op on synthetic inputs; 0 for an op that is priced
        by the roofline (it cannot run here, or would not fit)."""
        if self._not_runnable(call) is not None:
            return 0
        try:
            run = self._synthetic_call(call)
            run()  # the first call may allocate what later calls reuse
            return self._scratch(run)
        except Exception:  # noqa: BLE001 - an op that cannot run is priced by the roofline
            return 0

    def _synthetic_call(self, call: OpCall) -> Callable[[], Any]:
        """One call of the op on synthetic inputs, ready to repeat."""
        fn = resolve_overload(call.op)
        gen = torch.Generator(device=self.device).manual_seed(0)
        args = synthetic_value(call.args, self.device, gen)
        kwargs = {k: synthetic_value(v, self.device, gen) for k, v in call.key.kwargs}
        return lambda: fn(*args, **kwargs)

    def _scratch(self, fn: Callable[[], Any]) -> int:
        """Bytes one call allocates beyond what it leaves allocated (its outputs)."""
        if self.device.type != "cuda":
            return call_scratch_bytes(fn)
        self._sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        out = fn()
        peak = torch.cuda.max_memory_allocated(self.device)
        after = torch.cuda.memory_allocated(self.device)
        del out
        return max(0, peak - after)

    def _time(self, fn: Callable[[], Any], touches_data: bool = True) -> float:
        if self.device.type == "cuda":
            return time_call(
                fn, self.warmup, self.repeats, sync=self._sync, calls=CUDA_CALLS_PER_SAMPLE
            )
        # A view reads no data, so a cold cache does not slow it: no disturbance before it.
        if not touches_data:
            return time_call(fn, self.warmup, self.repeats)
        return time_call(fn, self.warmup, self.repeats, before=self._disturb)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _transfer_constants(self) -> tuple[float, float]:
        lat_key, bw_key = _TRANSFER_KEYS
        latency, bandwidth = self._store.get(lat_key), self._store.get(bw_key)
        if latency is None or bandwidth is None:
            latency, bandwidth = self._measure_transfer()
            with self._store.batch():
                self._put_time(lat_key, latency, MEASURED)
                self._put_time(bw_key, bandwidth, MEASURED)
        return latency, bandwidth

    # --- the machine's pace -------------------------------------------------------------------

    def _put_time(self, text: str, seconds: float, source: str) -> None:
        """Store a time with the pace it was measured at (an estimate has none)."""
        self._store.put(text, seconds, source, self._pace() if source == MEASURED else 0.0)

    def _forget_stale_times(self) -> int:
        """Drop from this run the cached times measured at a pace `is_stale` against now's;
        how many. (Scratch rows are bytes, which no load changes.)"""
        timed = {
            k: row.pace
            for k, row in self._store.rows.items()
            if row.pace > 0 and not k.startswith(_SCRATCH_PREFIX)
        }
        if not timed:  # no pace to compare with: the reference is not run
            return 0
        now = self._pace()
        stale = [k for k, pace in timed.items() if is_stale(pace, now)]
        self._store.forget(stale)
        return len(stale)

    def _time_reference(self, fn: Callable[[], object], samples: int) -> float:
        """The pace's timer: seconds per call of `fn` as ops are timed on this device."""
        calls = CUDA_CALLS_PER_SAMPLE if self.device.type == "cuda" else 1
        return time_call(fn, self.warmup, samples, sync=self._sync, calls=calls)

    def _measure_transfer(self) -> tuple[float, float]:
        """Latency from a one-element copy, bandwidth from a 16 MiB one (device -> host)."""
        host_kw = {"pin_memory": True} if self.device.type == "cuda" else {}
        times = []
        for nbytes in (4, _TRANSFER_PROBE_BYTES):
            src = torch.zeros(nbytes // 4, dtype=torch.float32, device=self.device)
            dst = torch.empty(nbytes // 4, dtype=torch.float32, **host_kw)
            copy = lambda s=src, d=dst: d.copy_(s)  # noqa: E731
            times.append(time_call(copy, self.warmup, self.repeats, sync=self._sync))
        small, big = times
        bandwidth = _TRANSFER_PROBE_BYTES / max(big - small, 1e-9)
        return small, bandwidth


def distinct_calls(graph: Graph, include_views: bool = False) -> list[tuple[OpKey, OpInfo]]:
    """The op configurations of `graph` that cost time, each once, in program order."""
    seen: dict[OpKey | str, tuple[OpKey, OpInfo]] = {}
    for nid in graph.program_order():
        node = graph.node(nid)
        info = graph.info(nid)
        if node.is_placeholder or info.comm_stream or (info.is_view and not include_views):
            continue  # (a collective is priced by the link, never run alone: it would hang)
        key = op_key(graph, nid)
        try:
            seen.setdefault(key, (key, graph.info(nid)))
        except TypeError:  # unhashable constant: keep it; time_of keys it by text
            seen.setdefault(key_text(key), (key, graph.info(nid)))
    return list(seen.values())
