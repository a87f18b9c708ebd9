"""What the exact keep / recompute / offload baseline decides over: candidate storages, their
options, and the stages of the captured order (Checkmate, Jain et al. MLSys 2020, §4, on a
fixed order; `magis.baselines.ilp` has the whole method).

A *candidate* is a non-resident storage read again long after it was made. Its reads (through
any alias) fall at positions of the program order; the largest gap between two consecutive
ones (the producer counted as the first) splits them into early reads, served by the storage
itself, and late reads, from position `late` on. The options are Checkmate's decisions for that
gap, in the form the re-materialization and swap rules (MAGIS §5.2) build them:

- keep: the storage lives from its producer to its last read (the program order);
- recompute: the storage dies after its last early read; its producer, and behind it every
  producer whose storage would otherwise be dead by then (at most `MAX_CHAIN` ops, as
  `magis.rules.remat.recompute_chain`), runs again right before the first late read, and every
  later read reads the copy (`magis.rules.recompute_trace`). Inputs of that chain dead by then
  and not recomputed are kept alive until it runs (`Recompute.extended`);
- offload: a Store right after the producer and a Load where its transfer is hidden by the
  compute before the first late read (`magis.schedule.swaps.time_swaps`); the device copy
  dies after its last early read, the Load's copy lives from the Load on.

Which storages are candidates (the model must stay tractable on graphs of thousands of nodes):
the `max_candidates` of highest `nbytes x` weighted gap, where a position of the gap weighs
what the program order holds there above the resident floor, as a fraction of the peak's: a
gap through the memory peak weighs most, one where little is live weighs nothing. This is
where the simulator's hot spots are, and smaller or shorter-lived storages move the peak by
less than the stage coarsening loses anyway.

Stages: the positions of the order cut at the ends of the options' freed intervals, at most
`max_stages` cuts chosen as byte-weighted quantiles of those ends, so that most freed
intervals are whole stages and the memory accounting of a stage is exact for them; what a stage
still hides is within it (see `Stages`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from magis.cost import CostModel
from magis.ir import Graph, Ref
from magis.ir.ops import LOAD_OP
from magis.rules import recompute_call
from magis.rules.swap import swappable
from magis.sim import SimResult, node_times

MAX_CHAIN = 4  # non-view ops one recomputation re-runs (as magis.rules.remat.MAX_CHAIN)


@dataclass(frozen=True)
class Recompute:
    """The recompute option of a candidate."""

    nodes: tuple[int, ...]  # re-run right before the first late read, in program order
    seconds: float  # compute they add
    transient_bytes: int  # bytes of their outputs other than the candidate's own
    extended: tuple[tuple[int, int], ...]  # (first position, bytes): kept alive until `late`
    reads: tuple[Ref, ...]  # storages the chain reads that are live anyway at `late`


@dataclass(frozen=True)
class Offload:
    """The offload option of a candidate."""

    load_at: int  # the position the Load's copy is live from
    transfer_s: float  # one copy, one way
    stall_s: float  # of the Load's transfer, what the compute before `late` cannot hide
    store_window: tuple[int, int]  # positions whose compute hides the Store
    load_window: tuple[int, int]  # ... and the Load


@dataclass(frozen=True)
class Candidate:
    storage: Ref
    nbytes: int
    early_end: int  # position of the last early read
    late: int  # position of the first late read
    last: int  # position of the last read
    recompute: Recompute | None
    offload: Offload | None


@dataclass(frozen=True)
class Program:
    """The captured order as arrays: positions, node times, the program-order memory."""

    graph: Graph = field(repr=False)
    order: tuple[int, ...] = field(repr=False)
    pos: dict[int, int] = field(repr=False)
    times: np.ndarray = field(repr=False)  # seconds by position
    memory: np.ndarray = field(repr=False)  # bytes live at each position (program order)
    resident_bytes: int
    written_at: dict[Ref, int] = field(repr=False)  # storage -> first in-place write position

    @staticmethod
    def build(graph: Graph, cost: CostModel, base: SimResult) -> Program:
        order = tuple(graph.program_order())
        pos = {n: i for i, n in enumerate(order)}
        by_id = node_times(graph, cost)
        times = np.array([by_id[n] for n in order], dtype=np.float64)
        return Program(
            graph, order, pos, times, base.timeline, base.resident_bytes, _written(graph, pos)
        )

    @property
    def peak(self) -> int:
        return int(self.memory.max())


def _written(graph: Graph, pos: dict[int, int]) -> dict[Ref, int]:
    """Each storage some op writes in place -> the first position it is written at."""
    smap = graph.storages()
    out: dict[Ref, int] = {}
    for nid, node in graph.nodes.items():
        hit = [node.writes_into] if node.writes_into is not None else []
        if not node.is_placeholder:
            mutated = graph.info(nid).mutates
            hit += [a for i, a in enumerate(node.args) if i in mutated and isinstance(a, Ref)]
        for ref in hit:
            s = smap.base[ref]
            out[s] = min(out.get(s, len(pos)), pos[nid])
    return out


@dataclass(frozen=True)
class ProblemOptions:
    """How large the model may grow (module docstring: why candidates and stages are few)."""

    max_candidates: int = 300
    max_stages: int = 120
    min_gap: int = 3  # positions between the early and the late reads


def candidates(program: Program, cost: CostModel, opts: ProblemOptions) -> list[Candidate]:
    """The candidates of highest weighted gap (module docstring), in program order."""
    graph, pos = program.graph, program.pos
    smap = graph.storages()
    span = max(program.peak - program.resident_bytes, 1)
    weight = np.clip((program.memory - program.resident_bytes) / span, 0.0, 1.0)
    prefix = np.concatenate([[0.0], np.cumsum(weight)])
    scored = []
    for s, nbytes in smap.nbytes.items():
        if not _may_free(graph, smap, s, nbytes, program.written_at):
            continue
        gap = _largest_gap(pos[s.node], sorted({pos[r] for r in smap.readers[s]}))
        if gap is None or gap[1] - gap[0] <= opts.min_gap:
            continue
        score = nbytes * float(prefix[gap[1]] - prefix[gap[0] + 1])
        if score > 0:
            scored.append((score, s, gap))
    scored.sort(key=lambda x: (-x[0], pos[x[1].node], x[1].index))
    out = []
    for _, s, (early, late) in scored[: opts.max_candidates]:
        last = max(pos[r] for r in smap.readers[s])
        c = Candidate(s, smap.nbytes[s], early, late, last, None, None)
        rec = recompute_option(program, c)
        off = offload_option(program, cost, c)
        if rec is not None or off is not None:
            out.append(Candidate(s, c.nbytes, early, late, last, rec, off))
    return sorted(out, key=lambda c: (pos[c.storage.node], c.storage.index))


def _may_free(graph: Graph, smap, s: Ref, nbytes: int, written: dict[Ref, int]) -> bool:
    """Whether the storage may be freed between its reads: not resident, not a step output,
    not in host memory, not written in place (a copy would miss the write), not a Load's."""
    return (
        nbytes > 0
        and s not in smap.resident
        and s not in smap.outputs
        and s not in smap.host
        and s not in written
        and graph.node(s.node).op != LOAD_OP
    )


def _largest_gap(made: int, reads: Sequence[int]) -> tuple[int, int] | None:
    """(last early read, first late read) around the widest gap; ties: the earliest."""
    points = [made, *(r for r in reads if r > made)]
    if len(points) < 2:
        return None
    widths = np.diff(points)
    k = int(np.argmax(widths))
    return points[k], points[k + 1]


# --- the options ------------------------------------------------------------------------------


def recompute_option(program: Program, c: Candidate) -> Recompute | None:
    """The chain a recomputation of `c` before its first late read runs (module docstring),
    or None when the producer cannot run again there (random, in place, or reading a value
    written in place before then: an updated weight)."""
    graph, pos = program.graph, program.pos
    smap = graph.storages()
    if recompute_call(graph, c.storage.node) is None:
        return None
    chain: set[int] = set()
    extended: dict[Ref, int] = {}
    reads: set[Ref] = set()
    todo = [c.storage.node]
    heavy = 1
    while todo:
        nid = todo.pop(0)
        if nid in chain:
            continue
        chain.add(nid)
        for r in graph.node(nid).inputs:
            base = smap.base[r]
            if program.written_at.get(base, len(pos)) < c.late:
                return None  # the copy would read the value after its in-place update
            if base in smap.resident or r.node in chain or r.node in todo:
                continue
            dead = _dead_at(program, smap, base, c.late)
            if graph.info(r.node).is_view:
                todo.append(r.node)  # free: run again on whatever holds its base then
            elif dead and heavy < MAX_CHAIN and recompute_call(graph, r.node) is not None:
                todo.append(r.node)
                heavy += 1
            elif dead:
                extended[base] = max(pos[u] for u in smap.readers[base]) + 1
            else:
                reads.add(base)
    return _recompute_of(program, c, chain, extended, reads)


def _dead_at(program: Program, smap, s: Ref, at: int) -> bool:
    """Whether storage `s` is freed before position `at` in the program order."""
    if s in smap.outputs:
        return False
    return all(program.pos[u] < at for u in smap.readers[s])


def _recompute_of(program: Program, c: Candidate, chain, extended, reads) -> Recompute:
    graph, pos = program.graph, program.pos
    nodes = tuple(sorted(chain, key=pos.__getitem__))
    nodes = (*nodes, *_alias_views(program, c, set(nodes)))
    seconds = float(sum(program.times[pos[n]] for n in nodes))
    smap = graph.storages()
    transient = sum(
        smap.nbytes.get(Ref(n, i), 0)
        for n in nodes
        for i in range(len(graph.node(n).outputs))
        if Ref(n, i) != c.storage and smap.base[Ref(n, i)] == Ref(n, i)
    )
    ext = tuple((first, smap.nbytes[s]) for s, first in sorted(extended.items()))
    return Recompute(nodes, seconds, int(transient), ext, tuple(sorted(reads)))


def _alias_views(program: Program, c: Candidate, chain: set[int]) -> list[int]:
    """The views of the candidate run before its first late read that a late read goes
    through (a transformer's backward reads its activations through `view`s), in program
    order: run again on the copy, so that nothing late reads the original."""
    graph, pos = program.graph, program.pos
    smap = graph.storages()
    out: set[int] = set()
    for u in smap.readers[c.storage]:
        if pos[u] < c.late:
            continue
        for r in graph.node(u).inputs:
            node = r.node
            while (
                smap.base[r] == c.storage
                and node not in chain
                and pos[node] < c.late
                and graph.info(node).is_view
            ):
                out.add(node)
                r = graph.node(node).inputs[0]
                node = r.node
    return sorted(out, key=pos.__getitem__)


def offload_option(program: Program, cost: CostModel, c: Candidate) -> Offload | None:
    """The Store right after the producer and the Load placed as `time_swaps` places it: moved
    back from the first late read over compute ops until their time covers the transfer;
    None when the Load would then be live before the early reads end (nothing freed)."""
    graph = program.graph
    if not swappable(graph, c.storage):
        return None
    transfer = cost.transfer_time(c.nbytes)
    made = program.pos[c.storage.node]
    load_at, covered = _covering_back(program.times, c.late, made, transfer)
    if load_at <= c.early_end + 1:
        return None
    store_end, _ = _covering_forward(program.times, made + 1, len(program.times), transfer)
    return Offload(
        load_at,
        transfer,
        max(0.0, transfer - covered),
        (made + 1, store_end),
        (load_at, c.late),
    )


def _covering_back(times: np.ndarray, at: int, floor: int, need: float) -> tuple[int, float]:
    """The latest position x in (floor, at] with the compute of [x, at) covering `need`, or
    floor + 1 with what that covers."""
    covered, x = 0.0, at
    while x - 1 > floor and covered < need:
        x -= 1
        covered += float(times[x])
    return x, covered


def _covering_forward(times: np.ndarray, start: int, stop: int, need: float) -> tuple[int, float]:
    covered, x = 0.0, start
    while x < stop and covered < need:
        covered += float(times[x])
        x += 1
    return max(x, start + 1), covered


# --- stages -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stages:
    """The order's positions cut into stages `[lo[k], hi[k]]`.

    What the model knows of a stage: the most the program order holds at any of its positions
    (`memory`), its compute seconds (`compute`). A freed interval counts in a stage only when it
    covers the whole stage, an added one whenever it touches it: every figure the model
    computes for a stage bounds the simulator's from above at each of its positions."""

    lo: np.ndarray
    hi: np.ndarray
    memory: np.ndarray
    compute: np.ndarray

    @property
    def n(self) -> int:
        return len(self.lo)

    def covered(self, first: int, last: int) -> range:
        """Stages wholly inside positions [first, last]."""
        a = int(np.searchsorted(self.lo, first, side="left"))
        b = int(np.searchsorted(self.hi, last, side="right"))
        return range(a, b)

    def touched(self, first: int, last: int) -> range:
        """Stages with a position in [first, last]."""
        if last < first:
            return range(0)
        a = int(np.searchsorted(self.hi, first, side="left"))
        b = int(np.searchsorted(self.lo, last, side="right"))
        return range(a, b)


def make_stages(program: Program, cands: Sequence[Candidate], max_stages: int) -> Stages:
    """Stages cut at the ends of the candidates' freed intervals (module docstring)."""
    n = len(program.order)
    ends: list[tuple[int, int]] = []
    for c in cands:
        ends.append((c.early_end + 1, c.nbytes))
        if c.recompute is not None:
            ends.append((c.late, c.nbytes))
        if c.offload is not None:
            ends.append((c.offload.load_at, c.nbytes))
    cuts = _chosen_cuts(ends, max_stages - 1, n)
    lo = np.array([0, *cuts], dtype=np.int64)
    hi = np.array([*(k - 1 for k in cuts), n - 1], dtype=np.int64)
    memory = np.array([program.memory[a : b + 1].max() for a, b in zip(lo, hi, strict=True)])
    prefix = np.concatenate([[0.0], np.cumsum(program.times)])
    compute = prefix[hi + 1] - prefix[lo]
    return Stages(lo, hi, memory.astype(np.int64), compute)


def _chosen_cuts(ends: list[tuple[int, int]], most: int, n: int) -> list[int]:
    """Every distinct end when they are few, else byte-weighted quantiles of them."""
    distinct = sorted({p for p, _ in ends if 0 < p < n})
    if len(distinct) <= most:
        return distinct
    ends = sorted((p, b) for p, b in ends if 0 < p < n)
    weights = np.cumsum([b for _, b in ends], dtype=np.float64)
    marks = (np.arange(1, most + 1) - 0.5) / most * weights[-1]
    picks = np.searchsorted(weights, marks)
    return sorted({ends[int(i)][0] for i in picks})
