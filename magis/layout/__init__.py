"""Memory layout: an offset in one arena for every storage with a lifetime (ROAM §IV-B, §IV-C).

A schedule's theoretical peak (ROAM's Tp, the most bytes alive together) is what an allocator
could reach with perfect packing; a layout is what it actually needs. `plan_layout` gives every
non-resident storage of a graph run in an order an offset, such that storages alive together
never share a byte (checked by `check_layout`), and reports the arena's size and its
fragmentation, (arena - theoretical peak) / theoretical peak.

Methods (`LayoutMethod`):
- `llfb`: long-lived-first best-fit, the heuristic baseline (ROAM Table I).
- `exact`: ROAM's subgraph tree (`tree.py`) cut into pieces of at most `piece_limit` storages,
  each packed by CP-SAT within a deterministic effort (`exact.py`), laid in time order on the
  skyline the earlier pieces left (`merge.py`); `LayoutOptions` sets the limits. Never worse
  than `llfb`: if the pieces come out higher, LLFB's layout is returned and the Layout says so.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from magis.errors import MagisError
from magis.ir import Graph, Ref
from magis.layout.check import LayoutOverlapError, check_layout, find_overlap
from magis.layout.exact import LayoutOptions, PieceStatus
from magis.layout.lifetimes import ALIGNMENT, Lifetimes, from_arrays, lifetimes
from magis.layout.llfb import llfb
from magis.layout.merge import PieceReport, concatenate
from magis.layout.tree import build_tree

DEFAULT_OPTIONS = LayoutOptions()


class UnknownLayoutMethodError(MagisError, KeyError):
    """A layout method name that is not one of `LayoutMethod`."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class LayoutMethod(enum.Enum):
    LLFB = "llfb"
    EXACT = "exact"

    @staticmethod
    def parse(name: str | LayoutMethod) -> LayoutMethod:
        if isinstance(name, LayoutMethod):
            return name
        try:
            return LayoutMethod(name)
        except ValueError:
            known = ", ".join(m.value for m in LayoutMethod)
            raise UnknownLayoutMethodError(
                f"unknown layout method {name!r}; choose one of: {known}"
            ) from None


@dataclass(frozen=True, eq=False)
class Layout:
    """Offsets (bytes into the arena) of every non-resident storage, and how good they are."""

    lifetimes: Lifetimes
    offsets: np.ndarray  # int64, one per storage of `lifetimes`, multiples of ALIGNMENT
    arena_bytes: int
    method: LayoutMethod
    seconds: float
    llfb_arena_bytes: int
    pieces: tuple[PieceReport, ...] = field(default=())
    fell_back_to_llfb: bool = False

    @property
    def theoretical_peak_bytes(self) -> int:
        return self.lifetimes.theoretical_peak

    @property
    def fragmentation(self) -> float:
        """(arena - theoretical peak) / theoretical peak; alignment padding counts as waste."""
        peak = self.theoretical_peak_bytes
        return (self.arena_bytes - peak) / peak if peak else 0.0

    @cached_property
    def offset_of(self) -> dict[Ref, int]:
        """Storage (the Ref that allocates it) -> its offset in the arena."""
        return dict(zip(self.lifetimes.storages, self.offsets.tolist(), strict=True))

    @property
    def pieces_solved(self) -> int:
        """Pieces CP-SAT was run on (the others met the bound with their greedy start)."""
        return sum(1 for p in self.pieces if p.status is not PieceStatus.BOUND)

    @property
    def pieces_optimal(self) -> int:
        """Pieces proved optimal, by CP-SAT or by meeting the floor."""
        return sum(1 for p in self.pieces if p.status is not PieceStatus.FEASIBLE)

    def to_json(self) -> dict:
        return {
            "method": self.method.value,
            "theoretical_peak_bytes": self.theoretical_peak_bytes,
            "arena_bytes": self.arena_bytes,
            "fragmentation": self.fragmentation,
            "llfb_arena_bytes": self.llfb_arena_bytes,
            "seconds": self.seconds,
            "storages": len(self.lifetimes),
            "alignment": ALIGNMENT,
            "pieces": len(self.pieces),
            "pieces_solved": self.pieces_solved,
            "pieces_optimal": self.pieces_optimal,
            "fell_back_to_llfb": self.fell_back_to_llfb,
            "piece_reports": [p.to_json() for p in self.pieces],
        }


def plan_layout(
    graph: Graph,
    order: list[int] | tuple[int, ...] | None = None,
    method: str | LayoutMethod = LayoutMethod.EXACT,
    options: LayoutOptions = DEFAULT_OPTIONS,
) -> Layout:
    """Lay out the non-resident storages of `graph` run in `order` (program order by default)."""
    method = LayoutMethod.parse(method)
    order = graph.program_order() if order is None else list(order)
    start = time.perf_counter()
    lt = lifetimes(graph, order)
    return layout_lifetimes(lt, method, options, start)


def layout_lifetimes(
    lt: Lifetimes,
    method: str | LayoutMethod = LayoutMethod.EXACT,
    options: LayoutOptions = DEFAULT_OPTIONS,
    started: float | None = None,
) -> Layout:
    """Lay out storages given as lifetimes (graph-free: tests and random instances)."""
    method = LayoutMethod.parse(method)
    start = time.perf_counter() if started is None else started
    base = llfb(lt)
    base_arena = _arena(base, lt)
    if method is LayoutMethod.LLFB:
        return Layout(lt, base, base_arena, method, time.perf_counter() - start, base_arena)
    leaves = build_tree(lt, options.piece_limit).leaves()
    offsets, pieces = concatenate(lt, leaves, options)
    arena = _arena(offsets, lt)
    fell_back = arena > base_arena
    if fell_back:
        offsets, arena = base, base_arena
    seconds = time.perf_counter() - start
    return Layout(lt, offsets, arena, method, seconds, base_arena, tuple(pieces), fell_back)


def _arena(offsets: np.ndarray, lt: Lifetimes) -> int:
    return int((offsets + lt.size).max()) if len(lt) else 0


__all__ = [
    "ALIGNMENT",
    "Layout",
    "LayoutMethod",
    "LayoutOptions",
    "LayoutOverlapError",
    "Lifetimes",
    "UnknownLayoutMethodError",
    "check_layout",
    "find_overlap",
    "from_arrays",
    "layout_lifetimes",
    "lifetimes",
    "plan_layout",
]
