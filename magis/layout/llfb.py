"""Long-lived-first best-fit (LLFB): the heuristic baseline of ROAM §VI (Table I).

Sekiyama et al. (ROAM ref. [40]) place long-lived tensors at the lowest offsets: training keeps
most activations from the forward pass until the backward pass, and stacking them first, longest
at the bottom, leaves the space above them to short-lived tensors (ROAM Fig. 5). Each tensor, in
order of decreasing lifetime, goes into the best-fitting gap: the smallest free address range,
among the tensors already placed that are alive at some common step, that holds it (lowest
offset on ties); when none does, on top of them.

Ties in lifetime go to the larger tensor, then the earlier one, then the lower index, so the
result is deterministic. Cost: O(n) numpy work per tensor, O(n^2) in all; 2,000 storages take
about 0.1 s.
"""

from __future__ import annotations

import numpy as np

from magis.layout.lifetimes import Lifetimes


def llfb_order(lt: Lifetimes) -> np.ndarray:
    """Positions in placement order: longest lifetime first, then largest, earliest, lowest."""
    idx = np.arange(len(lt))
    return np.lexsort((idx, lt.start, -lt.size, -(lt.end - lt.start)))


def best_fit_offset(size: int, offs: np.ndarray, tops: np.ndarray) -> int:
    """The start of the smallest gap that holds `size` among occupied ranges [offs, tops).

    Past the highest occupied byte there is always room: that is the answer when no gap fits.
    """
    if len(offs) == 0:
        return 0
    order = np.argsort(offs, kind="stable")
    offs, tops = offs[order], tops[order]
    covered = np.maximum.accumulate(tops)  # highest byte in use below each range's start
    gap_lo = np.concatenate(([0], covered[:-1]))
    gap = offs - gap_lo
    fits = np.flatnonzero(gap >= size)
    if len(fits) == 0:
        return int(covered[-1])
    best = fits[np.argmin(gap[fits])]  # argmin takes the first: lowest offset on ties
    return int(gap_lo[best])


def place_greedy(
    lt: Lifetimes,
    order: np.ndarray,
    fixed_offsets: np.ndarray | None = None,
    fixed: np.ndarray | None = None,
) -> np.ndarray:
    """Offsets for every storage, placing them one by one in `order` by best fit.

    `fixed` (positions) keep `fixed_offsets` and are obstacles from the start; `order` lists
    the others.
    """
    n = len(lt)
    offsets = np.zeros(n, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    if fixed is not None and len(fixed):
        offsets[fixed] = fixed_offsets[fixed]
        placed[fixed] = True
    for i in order.tolist():
        if lt.size[i] == 0:
            placed[i] = True
            continue
        alive = placed & (lt.start <= lt.end[i]) & (lt.end >= lt.start[i]) & (lt.size > 0)
        offs = offsets[alive]
        offsets[i] = best_fit_offset(int(lt.size[i]), offs, offs + lt.size[alive])
        placed[i] = True
    return offsets


def llfb(lt: Lifetimes) -> np.ndarray:
    """LLFB offsets for every storage of `lt` (positions as in `lt`)."""
    return place_greedy(lt, llfb_order(lt))
