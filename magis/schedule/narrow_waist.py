"""Narrow-waist values and the partition of a scheduling problem into segments (MAGIS §6.1).

nw(v) = |V| - |anc(v)| - |des(v)| - 1 counts the nodes independent of v: in every topological
order v's position lies in a window of nw(v) + 1 places. A node with nw = 0 has a fixed place and
splits the problem into two independent ones (ROAM's memory-insensitive operators); MAGIS's
GraphPartition also cuts at nw = 1.

Taken literally on a training graph almost no node has nw <= 1 (NOTES.md): a weight gradient or
update hangs off the backward chain, a recomputation in a backward formula (GELU's pow) hangs
between the forward and the backward, and each such *floater* is independent of everything in
its long window. We work on units (placeholders and views folded away, see `problem`) and peel
floaters off before cutting: nodes whose window is wider than a threshold leave the core, the
threshold halves from |V|/2 down to `min_window`, and nw is recomputed after each round, so a few
long floaters do not drag their neighbours along. The core is cut at nw <= 1; each floater then
joins a segment that its dependencies allow (`placement`). `partition` does this only as far as
needed to bring segments within reach of the DP.

Ancestor and descendant sets are Python-int bitsets over a topological order: one OR per edge
and a popcount per node, about 10 ms for 2,000 units. The peeling asks nw among a shrinking core
of every unit many times over; those counts run on the same bitsets as numpy words (one AND and
popcount per word), since in Python they were a tenth of a search's time on the 7,000-node
corpus graphs, whose fission children reschedule a few thousand units at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from magis.schedule.problem import Problem


@dataclass(frozen=True)
class Closure:
    """Ancestor and descendant bitsets of units (bit i = units[i]) within a unit subset."""

    units: tuple[int, ...]  # topological order
    anc: tuple[int, ...]
    des: tuple[int, ...]

    @functools.cached_property
    def index(self) -> dict[int, int]:
        """unit -> its bit."""
        return {u: i for i, u in enumerate(self.units)}

    @functools.cached_property
    def unit_array(self) -> np.ndarray:
        """`units` as an int64 array (read per cut: converting the tuple is the closure's size)."""
        return np.asarray(self.units, dtype=np.int64)

    @functools.cached_property
    def width(self) -> int:
        """64-bit words per bitset."""
        return max(1, (len(self.units) + 63) // 64)

    @functools.cached_property
    def anc_words(self) -> np.ndarray:
        """`anc` as a (units, width) array of uint64 words, lowest bits first."""
        return self._as_words(self.anc)

    @functools.cached_property
    def des_words(self) -> np.ndarray:
        """`des` as a (units, width) array of uint64 words, lowest bits first."""
        return self._as_words(self.des)

    def words(self, mask: int) -> np.ndarray:
        """One bitset over `units` as uint64 words."""
        return np.frombuffer(mask.to_bytes(self.width * 8, "little"), dtype="<u8")

    def _as_words(self, sets: tuple[int, ...]) -> np.ndarray:
        nbytes = self.width * 8
        raw = b"".join(m.to_bytes(nbytes, "little") for m in sets)
        return np.frombuffer(raw, dtype="<u8").reshape(len(sets), self.width)

    def nw(self) -> list[int]:
        """nw(v) = |V| - |anc(v)| - |des(v)| - 1 for each unit, aligned with `units`."""
        n = len(self.units)
        return [
            n - a.bit_count() - d.bit_count() - 1 for a, d in zip(self.anc, self.des, strict=True)
        ]


def closure(problem: Problem, units: Sequence[int]) -> Closure:
    """Bitset closures of the sub-DAG induced by `units` (given in topological order)."""
    local = {u: i for i, u in enumerate(units)}
    anc: list[int] = [0] * len(units)
    for i, u in enumerate(units):
        a = 0
        for p in problem.preds[u]:
            j = local.get(p)
            if j is not None:
                a |= anc[j] | (1 << j)
        anc[i] = a
    des: list[int] = [0] * len(units)
    for i in range(len(units) - 1, -1, -1):
        d = 0
        for s in problem.succs[units[i]]:
            j = local.get(s)
            if j is not None:
                d |= des[j] | (1 << j)
        des[i] = d
    return Closure(tuple(units), tuple(anc), tuple(des))


def nw_values(problem: Problem, units: Sequence[int]) -> dict[int, int]:
    """nw of every unit of the sub-DAG induced by `units` (MAGIS §6.1)."""
    c = closure(problem, units)
    return dict(zip(c.units, c.nw(), strict=True))


def window_above(clo: Closure, core: int, tau: int) -> int:
    """Bit mask of the units of `core` whose nw among `core` exceeds `tau` (floaters at tau).
    Reachability is the whole set's, so two core units joined through a floater stay ordered."""
    members = np.asarray(bits(core), dtype=np.int64)
    return _mask(members[core_nw(clo, core, members) > tau])


def core_nw(clo: Closure, core: int, members: np.ndarray) -> np.ndarray:
    """nw among `core` of each of its `members` (its bit indices, ascending)."""
    words = clo.words(core)
    span = _word_span(members)
    anc = _counts_within(clo.anc_words, members, words, below=True, span=span)
    des = _counts_within(clo.des_words, members, words, below=False, span=span)
    return core.bit_count() - anc - des - 1


def _word_span(members: np.ndarray) -> tuple[int, int]:
    """The words that hold `members`' bits (ascending): a mask of them is zero elsewhere, so
    an AND with it reads only these (a segment of a 100,000-unit closure is a few words of
    its 1,563)."""
    if not len(members):
        return 0, 0
    return int(members[0]) // 64, int(members[-1]) // 64 + 1


ROW_BLOCK = 1024  # rows per step of `_counts_within`: a few MB of words, within the cache


def _counts_within(
    sets: np.ndarray,
    members: np.ndarray,
    mask: np.ndarray,
    below: bool,
    span: tuple[int, int] | None = None,
) -> np.ndarray:
    """popcount(sets[i] & mask) for each i of `members` (ascending). Over a topological order
    an ancestor's bit is below its descendant's, so a block of rows needs only the words up
    to its last row (`below`: ancestor sets) or from its first (descendant sets): half the
    words of the whole square, taken a block at a time instead of as one copy of it (on a
    42,000-node split decoder the square is 60 MB, and the final re-ordering asks it ~30 times).
    `span`: the words outside which `mask` is zero (`_word_span`), none read."""
    lo, hi = span if span is not None else (0, sets.shape[1])
    out = np.empty(len(members), dtype=np.int64)
    for start in range(0, len(members), ROW_BLOCK):
        rows = members[start : start + ROW_BLOCK]
        if below:
            cols = slice(lo, min(hi, int(rows[-1]) // 64 + 1))
        else:
            cols = slice(max(lo, int(rows[0]) // 64), hi)
        block = sets[rows, cols] & mask[cols]
        out[start : start + len(rows)] = np.bitwise_count(block).sum(axis=1, dtype=np.int64)
    return out


def cut_segments(clo: Closure, core: int) -> tuple[dict[int, int], list[int]]:
    """(segment of each core unit, cut units): cut at nw <= 1 among the core (GraphPartition).

    A cut unit starts a segment; any other core unit joins the segment of its latest cut
    ancestor, so every path goes from a segment to the same or a later one (cuts are totally
    ordered by reachability, up to an nw = 1 pair, and are numbered by position). With nw = 0
    cuts this loses nothing; an nw = 1 cut fixes which side its one independent unit runs on.
    """
    members = np.asarray(bits(core), dtype=np.int64)
    if not len(members):
        return {}, []
    is_cut = core_nw(clo, core, members) <= 1
    cut_local = members[is_cut]
    # a cut's rank is its place among the cuts (1 up); a unit's latest cut ancestor is among
    # the core's words, so only those are read (`_word_span`): per call, the core's size,
    # not the closure's
    lo, hi = _word_span(members)
    cut_words = clo.words(_mask(cut_local))[lo:hi]
    latest = _highest_bits(clo.anc_words[members, lo:hi] & cut_words)
    latest_rank = np.where(latest >= 0, np.searchsorted(cut_local, latest + 64 * lo) + 1, 0)
    seg = np.where(is_cut, np.cumsum(is_cut), latest_rank)
    units = clo.unit_array
    return (
        dict(zip(units[members].tolist(), seg.tolist(), strict=True)),
        units[cut_local].tolist(),
    )


def _highest_bits(rows: np.ndarray) -> np.ndarray:
    """Index of the highest set bit of each row of uint64 words; -1 for a row with none."""
    nonzero = rows != 0
    last = rows.shape[1] - 1 - np.argmax(nonzero[:, ::-1], axis=1)
    word = rows[np.arange(len(rows)), last]
    high, low = (word >> np.uint64(32)).astype(np.float64), (word & np.uint64(0xFFFFFFFF))
    # frexp's exponent is a float's bit length, exact below 2**53 (each half has 32 bits)
    top = np.where(high > 0, 32 + np.frexp(high)[1], np.frexp(low.astype(np.float64))[1]) - 1
    return np.where(nonzero.any(axis=1), last * 64 + top, -1)


def _mask(indices: np.ndarray) -> int:
    """The bitset with the given bit indices set."""
    if not len(indices):
        return 0
    flags = np.zeros(int(indices.max()) + 1, dtype=np.uint8)
    flags[indices] = 1
    return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")


def bits(mask: int) -> list[int]:
    """Indices of the set bits of `mask`, ascending."""
    if mask.bit_length() > 256:  # big ints: one numpy pass instead of a copy per bit
        raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
        return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
