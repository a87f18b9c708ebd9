"""Exact packing of one piece with CP-SAT (ROAM §IV-B Eq. 8, §IV-D).

A piece is a set of storages to place (variables) among storages already placed (obstacles, at
fixed offsets). Each storage is a rectangle: its lifetime on the time axis (fixed) by its slot
on the address axis (offset variable, size fixed); `AddNoOverlap2D` keeps rectangles apart, and
the objective is the height H of the tallest variable rectangle — the arena the piece needs.

Decisions:
- Bytes are counted in units of the alignment (64 B), so every solution is aligned and the
  numbers stay small.
- H never goes below `floor` (what the layout already needs elsewhere, at least the theoretical
  peak): any lower is worth nothing, and with the bound reached the solver proves optimality
  and stops at once.
- The solver starts from a greedy solution (best fit in long-lived-first order, and in
  largest-first order, whichever is lower), so its answer is never worse than the heuristic.
- Deterministic: one CP-SAT worker stopped by a deterministic time limit (`effort`), so the
  same input gives the same layout on any machine. The wall-clock `time_limit` only guards
  against a machine so slow that it binds first (then the answer may vary, never the validity).
  A portfolio of 8 workers under a 2 s wall limit found the same arenas on the seven paper
  workloads, no faster, but differed between runs on the tiny ones.
- Obstacles become holes in each variable's domain, not rectangles of the no-overlap
  constraint: with them as rectangles and a tight upper bound, CP-SAT sometimes spent 20-60 s
  inside one propagation, past its time limit; as domains it settles the same pieces in < 1 s.
- Obstacles covering the same time span at adjacent addresses are merged first: the forward
  pass's stack of activations becomes a few boxes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model
from ortools.util.python.sorted_interval_list import Domain

from magis.layout.lifetimes import ALIGNMENT, Lifetimes
from magis.layout.llfb import best_fit_offset
from magis.layout.tree import PIECE_LIMIT

# CP-SAT's deterministic time per piece (see the module docstring). 0.05 settles most pieces in
# 0.1-1.5 s of wall time; ten times more left the seven paper workloads in program order where
# they were (0-0.10% fragmentation) at up to 20 s more, and took btlm-3b in the DP scheduler's
# order from 0.34% to 0.14% at 12 s more.
EFFORT = 0.05


@dataclass(frozen=True)
class LayoutOptions:
    """How hard the exact method works; variants by `dataclasses.replace`."""

    effort: float = EFFORT  # CP-SAT deterministic seconds per piece
    time_limit: float = 10.0  # wall seconds per piece: a guard, see the module docstring
    budget: float = 30.0  # wall seconds of CP-SAT per layout; then pieces keep greedy answers
    piece_limit: int = PIECE_LIMIT  # storages a piece of the subgraph tree creates, at most


class PieceStatus(enum.Enum):
    """How a piece's offsets were found."""

    BOUND = "bound"  # the greedy solution already meets the floor: optimal, nothing to solve
    OPTIMAL = "optimal"  # CP-SAT proved no lower height exists
    FEASIBLE = "feasible"  # CP-SAT improved or kept the greedy solution within its time limit


@dataclass(frozen=True)
class PieceResult:
    offsets: np.ndarray  # bytes, one per variable (in the order given)
    height: int  # bytes: max over variables of offset + size
    greedy_height: int
    status: PieceStatus
    seconds: float


@dataclass(frozen=True)
class Boxes:
    """Rectangles on time x address: steps [start, end] inclusive, bytes [offset, offset+size)."""

    offset: np.ndarray
    size: np.ndarray
    start: np.ndarray
    end: np.ndarray

    @staticmethod
    def empty() -> Boxes:
        z = np.zeros(0, dtype=np.int64)
        return Boxes(z, z, z, z)

    def __len__(self) -> int:
        return len(self.offset)


def obstacles_for(lt: Lifetimes, placed: np.ndarray, offsets: np.ndarray, lo: int, hi: int):
    """Placed storages alive in steps [lo, hi], clipped to that span and merged (see module)."""
    keep = placed[(lt.end[placed] >= lo) & (lt.start[placed] <= hi) & (lt.size[placed] > 0)]
    start = np.maximum(lt.start[keep], lo)
    end = np.minimum(lt.end[keep], hi)
    return merge_boxes(Boxes(offsets[keep], lt.size[keep], start, end))


def merge_boxes(b: Boxes) -> Boxes:
    """Boxes with the same time span and touching address ranges, joined into one."""
    if len(b) == 0:
        return b
    order = np.lexsort((b.offset, b.end, b.start))
    off, size, s, e = b.offset[order], b.size[order], b.start[order], b.end[order]
    top = off + size
    same_span = (s[1:] == s[:-1]) & (e[1:] == e[:-1])
    touching = same_span & (off[1:] == top[:-1])
    first = np.flatnonzero(np.concatenate(([True], ~touching)))
    last = np.concatenate((first[1:] - 1, [len(off) - 1]))
    return Boxes(off[first], top[last] - off[first], s[first], e[first])


def greedy(size, start, end, obstacles: Boxes, order: np.ndarray) -> np.ndarray:
    """Best-fit offsets for the variables placed in `order`, among the obstacles."""
    off = np.zeros(len(size), dtype=np.int64)
    p_off, p_top = list(obstacles.offset), list(obstacles.offset + obstacles.size)
    p_s, p_e = list(obstacles.start), list(obstacles.end)
    for i in order.tolist():
        if size[i] == 0:
            continue
        po, pt = np.asarray(p_off, np.int64), np.asarray(p_top, np.int64)
        ps, pe = np.asarray(p_s, np.int64), np.asarray(p_e, np.int64)
        alive = (ps <= end[i]) & (pe >= start[i])
        off[i] = best_fit_offset(int(size[i]), po[alive], pt[alive])
        p_off.append(off[i])
        p_top.append(off[i] + size[i])
        p_s.append(start[i])
        p_e.append(end[i])
    return off


def best_greedy(size, start, end, obstacles: Boxes) -> np.ndarray:
    """The lower of two greedy solutions: long-lived first, and largest first."""
    idx = np.arange(len(size))
    orders = (
        np.lexsort((idx, start, -size, -(end - start))),
        np.lexsort((idx, start, -(end - start), -size)),
    )
    best, best_h = None, None
    for order in orders:
        off = greedy(size, start, end, obstacles, order)
        h = int((off + size).max()) if len(size) else 0
        if best_h is None or h < best_h:
            best, best_h = off, h
    return best


def solve_piece(
    size: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    obstacles: Boxes,
    floor: int,
    time_limit: float,
    effort: float = EFFORT,
) -> PieceResult:
    """Offsets for variables (sizes in bytes, multiples of the alignment) minimizing the height.

    Heights at or below `floor` count as equal (see the module docstring).
    """
    t0 = time.perf_counter()
    hint = best_greedy(size, start, end, obstacles)
    greedy_h = int((hint + size).max()) if len(size) else 0
    if greedy_h <= floor or time_limit <= 0 or effort <= 0:
        status = PieceStatus.BOUND if greedy_h <= floor else PieceStatus.FEASIBLE
        return PieceResult(hint, greedy_h, greedy_h, status, time.perf_counter() - t0)
    offsets, status = _cp_sat(
        size, start, end, obstacles, floor, hint, greedy_h, effort, time_limit
    )
    height = int((offsets + size).max())
    if height <= floor:
        status = PieceStatus.OPTIMAL
    return PieceResult(offsets, height, greedy_h, status, time.perf_counter() - t0)


def _cp_sat(size, start, end, obstacles: Boxes, floor, hint, upper, effort, time_limit):
    """CP-SAT from `hint` (height `upper`); never returns anything higher than the hint."""
    u = ALIGNMENT
    su, hu, ub = size // u, hint // u, upper // u
    lb = min(max(floor // u, int(su.max())), ub)
    model = cp_model.CpModel()
    height = model.NewIntVar(lb, ub, "H")
    xs, ys, offs = [], [], []
    for i in range(len(size)):
        if su[i] == 0:
            offs.append(None)
            continue
        domain = _free_offsets(int(su[i]), int(start[i]), int(end[i]), obstacles, ub)
        o = model.NewIntVarFromDomain(domain, f"o{i}")
        model.AddHint(o, int(hu[i]))
        model.Add(o + int(su[i]) <= height)
        span = int(end[i] - start[i] + 1)
        xs.append(model.NewFixedSizeIntervalVar(int(start[i]), span, f"t{i}"))
        ys.append(model.NewFixedSizeIntervalVar(o, int(su[i]), f"a{i}"))
        offs.append(o)
    model.AddNoOverlap2D(xs, ys)
    model.Minimize(height)
    solver = cp_model.CpSolver()
    # CP-SAT's own SIGINT handler is left as SIG_DFL after a solve: a later Ctrl-C then
    # kills the process instead of raising KeyboardInterrupt (no plan saved). Ctrl-C
    # during a solve is Python's to handle once the solve returns.
    solver.parameters.catch_sigint_signal = False
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = effort
    solver.parameters.max_time_in_seconds = time_limit
    result = solver.Solve(model)
    if result not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint, PieceStatus.FEASIBLE
    offsets = np.array([0 if o is None else solver.Value(o) * u for o in offs], dtype=np.int64)
    if int((offsets + size).max()) > upper:
        return hint, PieceStatus.FEASIBLE
    status = PieceStatus.OPTIMAL if result == cp_model.OPTIMAL else PieceStatus.FEASIBLE
    return offsets, status


def _free_offsets(size: int, start: int, end: int, obstacles: Boxes, upper: int) -> Domain:
    """Offsets (in alignment units) where a slot of `size` alive over [start, end] fits under
    `upper` without touching an obstacle: obstacles become holes in the variable's domain
    rather than rectangles of the no-overlap constraint, which propagates far better."""
    u = ALIGNMENT
    domain = Domain(0, upper - size)
    alive = (obstacles.start <= end) & (obstacles.end >= start)
    if not alive.any():
        return domain
    lo = obstacles.offset[alive] // u - size + 1
    hi = (obstacles.offset[alive] + obstacles.size[alive]) // u - 1
    taken = Domain.from_intervals([[int(a), int(b)] for a, b in zip(lo, hi, strict=True)])
    return domain.intersection_with(taken.complement())
