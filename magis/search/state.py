"""M-State (MAGIS §3, §6.2): a graph, its schedule, that schedule's simulation, the rules applied."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from magis.ir import Graph
from magis.ir.trail import Decision
from magis.search.fission_moves import Lineage
from magis.search.hashing import GraphHash
from magis.sim import SimResult


class Mode(enum.Enum):
    """The two optimization modes of §6.2."""

    MEMORY_LIMIT = "mem-limit"  # least latency whose peak fits the memory limit
    LATENCY_LIMIT = "lat-limit"  # least memory whose latency fits the latency limit


@dataclass(frozen=True)
class MState:
    graph: Graph = field(repr=False)
    order: tuple[int, ...] = field(repr=False)
    sim: SimResult = field(repr=False)
    hash: GraphHash = field(repr=False)
    history: tuple[str, ...] = ()  # rule names applied, oldest first
    frozen: frozenset[int] = frozenset()  # nodes of enabled F-Tree regions
    # The F-Tree and the graph it was built on, while every rule applied since the analysis
    # was an F-Tree mutation: then `graph` is the lineage's base with the tree's enabled nodes
    # materialized, and a mutation re-materializes from the base. Any other rule ends this.
    fission: Lineage | None = field(default=None, repr=False)
    # What each move did and its figures before and after, oldest first (`decisions.py`):
    # `history` in full, for `magis explain`.
    decisions: tuple[Decision, ...] = field(default=(), repr=False)

    @property
    def memory(self) -> int:
        return self.sim.peak_bytes

    @property
    def latency(self) -> float:
        return self.sim.latency_s

    @property
    def nodes(self) -> int:
        return len(self.graph)

    @property
    def in_lineage(self) -> bool:
        return self.fission is not None


@dataclass(frozen=True)
class Objective:
    """BetterThan of Alg. 3 (lines 1-4) for either mode, as a sort key: smaller is better.

    Memory-limit mode: states within the limit come first, by latency then memory; the others by
    memory then latency. Latency-limit mode is the mirror image.
    """

    mode: Mode
    limit: float  # bytes (memory mode) or seconds (latency mode)

    def satisfied(self, s: MState) -> bool:
        value = s.memory if self.mode is Mode.MEMORY_LIMIT else s.latency
        return value <= self.limit

    def key(self, s: MState) -> tuple:
        if self.mode is Mode.MEMORY_LIMIT:
            return (0, s.latency, s.memory) if self.satisfied(s) else (1, s.memory, s.latency)
        return (0, s.memory, s.latency) if self.satisfied(s) else (1, s.latency, s.memory)

    def wants_memory(self, s: MState) -> bool:
        """Whether memory is what ranks `s` first (a latency limit it meets, or a memory limit
        it misses): then the moves that save memory are the ones to try first."""
        return (self.mode is Mode.LATENCY_LIMIT) == self.satisfied(s)

    def memory_ceiling(self, s: MState) -> int:
        """The peak a move that gives time back may reach from `s`: the memory limit, or
        under a latency limit `s`'s own peak (`rules.relax`)."""
        return int(self.limit) if self.mode is Mode.MEMORY_LIMIT else s.memory

    def better(self, a: MState, b: MState) -> bool:
        return self.key(a) < self.key(b)

    def worth_pushing(self, s: MState, best: MState, delta: float) -> bool:
        """The relaxed test of Alg. 3: not worse than the best by more than a factor `delta` in
        what the comparison ranks first."""
        ks, kb = self.key(s), self.key(best)
        if ks[0] != kb[0]:
            return ks[0] < kb[0]
        return ks[1] <= delta * kb[1]
