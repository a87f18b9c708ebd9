"""Limits as users write them (MAGIS §6.2's two modes): a memory limit as a ratio of the
unoptimized peak or a size, a latency limit as a ratio of the unoptimized latency or a time.

A limit is read in two steps, so that a typo fails before a capture that may take a while:
`read_memory_limit` / `read_latency_limit` check the text alone (syntax, > 0), and
`Limit.resolve` turns a ratio into bytes or seconds once the program order is measured. Then
`check_memory_reachable` / `check_latency_reachable` refuse a limit no plan can meet, with the
bound in the message, before the search spends its budget on it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from magis.cost import CostModel, RooflineModel
from magis.cost.base import op_key
from magis.cost.roofline import compute_dtype
from magis.errors import LimitError
from magis.ir import Graph
from magis.ir.ops import flops_of
from magis.search import MemoryFigure, Mode
from magis.sim import SimResult

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)"


@dataclass(frozen=True)
class Limit:
    """A limit as written: `amount` is a ratio of the program order's figure when `relative`,
    else bytes (memory) or seconds (latency)."""

    text: str
    amount: float
    relative: bool

    def resolve(self, program_order: float) -> float:
        return self.amount * program_order if self.relative else self.amount


def read_memory_limit(text: str | float | int) -> Limit:
    """'0.4' (a ratio of the unoptimized peak, in (0, 1]), '12GiB', '500MB' or a byte count
    (> 1024); anything else, zero included, is a one-line LimitError."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(rf"\s*{_NUMBER}\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise LimitError(
                f"cannot read memory limit {text!r}: give a ratio such as 0.4 or a size such as 12GiB"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    if not value > 0 or math.isinf(value):
        raise LimitError(
            f"memory limit {text!r} must be more than 0: a ratio such as 0.4 or a size such as 12GiB"
        )
    if unit == "" and value <= 1.0:
        return Limit(str(text), value, relative=True)
    if unit == "" and value <= 1024:  # a ratio above 1 means nothing; so few bytes neither
        raise LimitError(
            f"memory limit {text!r} is ambiguous: write a ratio <= 1 or a size with a unit"
        )
    return Limit(str(text), value * _SIZE_UNITS[unit], relative=False)


def read_latency_limit(text: str | float | int) -> Limit:
    """'1.10' (a ratio of the unoptimized latency), '250ms', '0.3s' or '900us'; it must be
    more than 0 (a ratio below 1 is allowed: TASO's rules can make a step faster)."""
    m = re.fullmatch(rf"\s*{_NUMBER}\s*(ms|s|us)?\s*", str(text))
    if not m:
        raise LimitError(
            f"cannot read latency limit {text!r}: give a ratio such as 1.10 or a time such as 250ms"
        )
    value, unit = float(m.group(1)), m.group(2)
    if not value > 0 or math.isinf(value):
        raise LimitError(
            f"latency limit {text!r} must be more than 0: a ratio such as 1.10 or a time such "
            "as 250ms"
        )
    if unit is None:
        return Limit(str(text), value, relative=True)
    return Limit(str(text), value * _TIME_UNITS[unit], relative=False)


def parse_memory_limit(text: str | float | int, unoptimized_peak: int) -> int:
    """The memory limit `text` in bytes, a ratio taken of `unoptimized_peak`."""
    return int(read_memory_limit(text).resolve(unoptimized_peak))


def parse_latency_limit(text: str | float, unoptimized_latency: float) -> float:
    """The latency limit `text` in seconds, a ratio taken of `unoptimized_latency`."""
    return read_latency_limit(text).resolve(unoptimized_latency)


def parse_memory_figure(name: str | MemoryFigure) -> MemoryFigure:
    """'theoretical' (the simulated peak) or 'arena' (resident bytes + the LLFB layout's arena)."""
    if isinstance(name, MemoryFigure):
        return name
    try:
        return MemoryFigure(name)
    except ValueError:
        choices = ", ".join(f.value for f in MemoryFigure)
        raise LimitError(f"unknown memory figure {name!r}; choose one of {choices}") from None


def check_one_limit(
    mem_limit: object, lat_limit: object, names: tuple[str, str] = ("mem_limit", "lat_limit")
) -> None:
    """A search has exactly one of the two limits (MAGIS §6.2); `names` are the two as the
    caller's user spells them (the CLI's flags, or the Python arguments)."""
    if (mem_limit is None) == (lat_limit is None):
        mem, lat = names
        raise LimitError(f"give exactly one of {mem} (e.g. 0.4 or 12GiB) and {lat} (e.g. 1.10)")


@dataclass(frozen=True)
class SearchLimit:
    """The one limit of a search (MAGIS §6.2's two modes), read from the text: which mode it
    sets and the `Limit` as written, resolved once the program order is measured."""

    mode: Mode
    limit: Limit


def read_search_limit(
    mem_limit: str | float | None,
    lat_limit: str | float | None,
    names: tuple[str, str] = ("mem_limit", "lat_limit"),
) -> SearchLimit:
    """Exactly one of `mem_limit` and `lat_limit`, read (`check_one_limit`, then
    `read_memory_limit` or `read_latency_limit`): an entry point reads its limit here once and
    hands the result on, so a typo fails before any capture."""
    check_one_limit(mem_limit, lat_limit, names)
    if mem_limit is not None:
        return SearchLimit(Mode.MEMORY_LIMIT, read_memory_limit(mem_limit))
    return SearchLimit(Mode.LATENCY_LIMIT, read_latency_limit(lat_limit))


def check_memory_reachable(
    limit_bytes: float, text: str, base: SimResult, movable: int = 0
) -> None:
    """Refuse a memory limit at or below the resident bytes of the program order that no rule
    moves off the device.

    The bound: the placeholders (weights, buffers, optimizer state, inputs) are resident from
    the first step to the last in every schedule (`magis.sim`), and no rule removes or moves
    them (swapping stores only tensors the program makes, `magis.rules.swap`) except the
    `movable` bytes of optimizer state that offloading keeps on the host
    (`magis.rules.offload`), so every plan's peak - under either memory figure - is at least
    the rest, plus the output of whichever op runs at the peak."""
    resident = base.resident_bytes - movable
    if limit_bytes <= resident:
        raise LimitError(
            f"memory limit {text} ({_size(limit_bytes)}) cannot be met: the weights, buffers, "
            f"inputs and optimizer state no rule offloads stay resident throughout and take "
            f"{_size(resident)} "
            f"({resident / base.peak_bytes:.3f} of the program order's peak); give more than that"
        )


def latency_lower_bound(graph: Graph, cost: CostModel) -> float | None:
    """Seconds below which no plan of `graph` can run on `cost`, or None where none is known.

    For a roofline model (MAGIS §2.3's analytic presets): the FLOPs of the matmul and
    convolution class ops at the hardware's peak FLOP/s. Sound because (1) the compute stream
    runs one op at a time and an op takes at least launch + FLOPs / (peak x utilization) with
    utilization <= 1 (`magis.cost.roofline`); (2) no rule lowers those FLOPs: fission splits an
    op into parts whose FLOPs add up to the whole (MAGIS §4), TASO's matmul and convolution
    rules merge or split them with the products kept, distributivity rewrites only elementwise
    products, re-materialization and swapping only add work. The sum of the op times in
    program order is no bound: merging two matmuls saves a launch and gains utilization.
    A measured (profiled) model has no peak to divide by, so it gets no bound: its limits are
    checked only for being more than 0.
    """
    if not isinstance(cost, RooflineModel):
        return None
    hw = cost.hardware
    total = 0.0
    for nid in graph.ops():
        info = graph.info(nid)
        if not info.compute_bound:
            continue
        key = op_key(graph, nid)
        flops = flops_of(info, key.args, dict(key.kwargs), key.outputs)
        dtype = compute_dtype(key.args, key.outputs)
        total += flops / max(hw.matmul_flops.of(dtype), hw.vector_flops.of(dtype))
    return total


def check_latency_reachable(
    limit_s: float, text: str, graph: Graph, cost: CostModel, base: SimResult
) -> None:
    """Refuse a latency limit under `latency_lower_bound` (see there why it is one)."""
    bound = latency_lower_bound(graph, cost)
    if bound is not None and limit_s < bound:
        raise LimitError(
            f"latency limit {text} ({limit_s * 1e3:.4g} ms) cannot be met on {cost.name}: the "
            f"matmuls and convolutions alone take at least {bound * 1e3:.4g} ms at its peak "
            f"FLOP/s ({bound / base.latency_s:.3f} of the program order) and no rule removes "
            "their FLOPs; give more than that"
        )


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f} GiB" if nbytes >= 2**26 else f"{nbytes / 2**20:.3f} MiB"
