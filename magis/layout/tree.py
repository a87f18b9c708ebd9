"""ROAM's subgraph tree (§IV-C, Algorithm 1, Fig. 10), on the time axis of a fixed schedule.

With the order fixed, a subgraph of ROAM is a span of steps, and a storage belongs to the piece
in which it is created (ROAM's CIFO choice for shared tensors; the merge in `merge.py` then
treats every storage that outlives its piece as a fixed obstacle for the pieces after it).

- Root: the whole schedule.
- Independent subgraphs (IG): spans separated by steps that no storage crosses — nothing created
  before such a step is read after it. ROAM finds them between memory-insensitive operators.
- Dependent subgraphs (DG): an IG creating more than `piece_limit` storages is split, recursively,
  at the step within its middle half (by count of storages created) that the fewest short-lived
  bytes cross. Long-lived storages (activations kept for the backward pass, gradients kept for the
  update) cross every step of a training graph alike, so they cannot guide the cut; short-lived
  ones crossing it are the temporaries a cut would separate from their neighbours, which is the
  analogue of ROAM's memory-insensitive operator (a layer boundary, where only the residual
  stream crosses). `piece_limit` plays the role of ROAM's node_limit, counted in storages
  because those are the CP-SAT variables.

The leaves, in time order, are the pieces the exact method solves.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from magis.layout.lifetimes import Lifetimes

PIECE_LIMIT = 96  # storages a piece creates; CP-SAT solves such pieces in about a second


class TreeKind(enum.Enum):
    ROOT = "root"
    INDEPENDENT = "independent"
    DEPENDENT = "dependent"


@dataclass(frozen=True)
class TreeNode:
    """Steps [lo, hi) of the schedule and the storages created there (positions in lifetimes)."""

    kind: TreeKind
    lo: int
    hi: int
    storages: np.ndarray
    children: tuple[TreeNode, ...] = ()

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def leaves(self) -> list[TreeNode]:
        """The pieces, in time order."""
        if self.is_leaf:
            return [self]
        return [leaf for c in self.children for leaf in c.leaves()]

    def depth(self) -> int:
        return 1 + max((c.depth() for c in self.children), default=0)


def build_tree(lt: Lifetimes, piece_limit: int = PIECE_LIMIT) -> TreeNode:
    """The subgraph tree of `lt` (see the module docstring)."""
    everything = np.arange(len(lt))
    segments = independent_segments(lt)
    children = tuple(
        _split(lt, TreeKind.INDEPENDENT, lo, hi, _created_in(lt, everything, lo, hi), piece_limit)
        for lo, hi in segments
    )
    if len(children) == 1:
        return TreeNode(TreeKind.ROOT, 0, lt.steps, everything, children[0].children)
    return TreeNode(TreeKind.ROOT, 0, lt.steps, everything, children)


def independent_segments(lt: Lifetimes) -> list[tuple[int, int]]:
    """Maximal spans [lo, hi) that create at least one storage and that no storage crosses."""
    if len(lt) == 0:
        return [(0, lt.steps)]
    crossing = _crossing(lt.start, lt.end, np.ones(len(lt), np.int64), 0, lt.steps)
    cuts = [c for c in range(1, lt.steps) if crossing[c] == 0]
    bounds = [0, *cuts, lt.steps]
    created = np.bincount(lt.start, minlength=lt.steps)
    made = np.concatenate(([0], np.cumsum(created)))
    segments = []
    lo = 0
    for hi in bounds[1:]:
        if made[hi] > made[lo]:
            segments.append((lo, hi))
            lo = hi
    if segments:
        segments[-1] = (segments[-1][0], lt.steps)
    return segments or [(0, lt.steps)]


def _created_in(lt: Lifetimes, idx: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return idx[(lt.start[idx] >= lo) & (lt.start[idx] < hi)]


def _crossing(start, end, weight, lo: int, hi: int) -> np.ndarray:
    """c -> total weight of storages with start < c <= end, for c in [lo, hi]."""
    diff = np.zeros(hi - lo + 2, dtype=np.int64)
    np.add.at(diff, np.clip(start + 1 - lo, 0, hi - lo + 1), weight)
    np.add.at(diff, np.clip(end + 1 - lo, 0, hi - lo + 1), -weight)
    return np.cumsum(diff)[: hi - lo + 1]


def _split(lt: Lifetimes, kind, lo: int, hi: int, idx: np.ndarray, limit: int) -> TreeNode:
    if len(idx) <= limit or hi - lo < 2:
        return TreeNode(kind, lo, hi, idx)
    cut = _best_cut(lt, idx, lo, hi)
    if cut is None:
        return TreeNode(kind, lo, hi, idx)
    left = _split(lt, TreeKind.DEPENDENT, lo, cut, idx[lt.start[idx] < cut], limit)
    right = _split(lt, TreeKind.DEPENDENT, cut, hi, idx[lt.start[idx] >= cut], limit)
    return TreeNode(kind, lo, hi, idx, (left, right))


def _best_cut(lt: Lifetimes, idx: np.ndarray, lo: int, hi: int) -> int | None:
    """The step in the middle half of the storages created in [lo, hi) that the fewest
    short-lived bytes cross; ties to the most balanced cut."""
    starts = np.sort(lt.start[idx])
    first, last = starts[len(starts) // 4], starts[(3 * len(starts)) // 4]
    if last <= first:
        return None
    s, e = lt.start[idx], np.minimum(lt.end[idx], hi - 1)
    short = (e - s) < max((hi - lo) // 4, 1)
    cost = _crossing(s, e, np.where(short, lt.size[idx], 0), lo, hi)
    candidates = np.arange(first + 1, last + 1)
    mid = (first + last) / 2
    best = np.lexsort((np.abs(candidates - mid), cost[candidates - lo]))[0]
    return int(candidates[best])
