"""Lifetimes of the storages a layout places: the memory model of the simulator, as intervals.

ROAM §III-B: a tensor is an edge of size `size_e` alive over a range of timesteps; Tp(v_i), the
theoretical peak at step i, sums the sizes of the tensors alive at i. We take the lifetimes from
`magis.sim.memory_timeline`, the one lifetime model of magis (DESIGN principle 2): a storage lives
from its producer's step to the last reader of any alias, inclusive; graph outputs to the end.

Decisions:
- Only non-resident storages are placed: placeholders (weights, buffers, optimizer state, data)
  are the caller's tensors and live throughout, outside the arena.
- Sizes are rounded up to `ALIGNMENT` bytes, so every offset is aligned; the theoretical peak is
  measured on the *unrounded* sizes, so alignment padding counts against the layout (strict).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from magis.ir import Graph, Ref
from magis.sim.simulator import memory_timeline
from magis.sim.tables import tables as _tables

ALIGNMENT = 64  # bytes: a cache line, and more than any dtype or vector load needs


def align(nbytes: np.ndarray | int, alignment: int = ALIGNMENT):
    """`nbytes` rounded up to a multiple of `alignment`."""
    return -(-nbytes // alignment) * alignment


@dataclass(frozen=True)
class Lifetimes:
    """Intervals [start, end] (steps, inclusive) and sizes of the storages to place."""

    storages: tuple[Ref, ...]
    nbytes: np.ndarray  # int64, exact bytes of each storage
    size: np.ndarray  # int64, bytes rounded up to the alignment: the slot each one gets
    start: np.ndarray  # int64, step of the producer
    end: np.ndarray  # int64, last step alive (inclusive)
    steps: int  # length of the schedule

    def __len__(self) -> int:
        return len(self.storages)

    def live_bytes(self, aligned: bool = False) -> np.ndarray:
        """Bytes alive at each step (exact sizes, or slot sizes when `aligned`)."""
        sizes = self.size if aligned else self.nbytes
        diff = np.zeros(self.steps + 1, dtype=np.int64)
        np.add.at(diff, self.start, sizes)
        np.add.at(diff, self.end + 1, -sizes)
        return np.cumsum(diff[: self.steps])

    @property
    def theoretical_peak(self) -> int:
        """ROAM's Tp(G, s): the most bytes ever alive together; no layout can use less."""
        live = self.live_bytes()
        return int(live.max()) if len(live) else 0

    @property
    def aligned_peak(self) -> int:
        """The lower bound on the arena once every slot is aligned."""
        live = self.live_bytes(aligned=True)
        return int(live.max()) if len(live) else 0

    def subset(self, index: np.ndarray) -> Lifetimes:
        """The storages at positions `index`, same time axis."""
        return Lifetimes(
            tuple(self.storages[i] for i in index),
            self.nbytes[index],
            self.size[index],
            self.start[index],
            self.end[index],
            self.steps,
        )


def lifetimes(graph: Graph, order: list[int] | tuple[int, ...], alignment: int = ALIGNMENT):
    """The non-resident storages of `graph` run in `order`, with their lifetimes and slots."""
    _, start, end = memory_timeline(graph, order)
    tables = _tables(graph)
    return from_arrays(tables.nbytes, start, end, len(order), tables.storages, alignment)


def from_arrays(
    nbytes, start, end, steps: int, storages: tuple[Ref, ...] | None = None, alignment=ALIGNMENT
) -> Lifetimes:
    """Lifetimes from plain arrays (tests, random instances); storages default to Ref(i)."""
    nbytes = np.asarray(nbytes, dtype=np.int64)
    if storages is None:
        storages = tuple(Ref(i) for i in range(len(nbytes)))
    return Lifetimes(
        tuple(storages),
        nbytes,
        align(nbytes, alignment),
        np.asarray(start, dtype=np.int64),
        np.asarray(end, dtype=np.int64),
        int(steps),
    )
