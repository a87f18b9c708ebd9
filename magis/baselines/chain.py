"""The chain of blocks under a training step, and plans that keep, recompute or offload blocks.

Checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", §4) and POFO
(Beaumont et al. 2021, "Efficient Combination of Rematerialization and Offloading for Training
DNNs", MAGIS ref. [5]) both see the forward pass as a chain of blocks: a checkpoint at a block
boundary is what flows from one block to the next, and a block's *saved activations* (what its
backward reads) are either kept, recomputed from the last checkpoint, or offloaded to the host.

The chain (`find_chain`) is read off the captured step, not off module names:

- the forward is the set of ancestors of the loss (the step's first output), in program order;
  the backward is the set of its descendants (gradients and the weight update);
- a *cut* after forward position k is crossed by every non-resident storage allocated at or
  before k and read by a forward node after k (views share their base's storage); a cut crossed
  by few storages is a block boundary — ideally one, the residual stream or block output;
- boundaries are found top-down (`_split`): in a range of cuts, storages that cross the whole
  range are *carried* (a U-Net skip connection, a transformer's attention mask: part of every
  checkpoint in the range, and no help in telling blocks apart) and are not counted; the cuts
  with the fewest remaining crossing storages are boundaries (one per run of equal cuts, the
  one crossed by the fewest bytes); ranges between boundaries longer than `ChainOptions.
  split_above` are split again the same way. Storages below `tiny_fraction` of the largest
  activation are not counted either (masks, scalars), though they are checkpointed.

`build_plan` turns one decision per block into a graph and an order, the way
torch.utils.checkpoint runs it: a recomputed segment's forward nodes (those its backward needs)
are cloned and run right before the first backward node that reads them; an offloaded storage
gets a Store after its producer and a Load before its backward readers, timed by
`magis.schedule.swaps.time_swaps` (Store ASAP, Load ALAP-hidden, MAGIS §6.2).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from magis.analyze.forward_backward import forward_backward
from magis.cost import CostModel
from magis.ir import Graph, Ref
from magis.ir.graph import map_refs
from magis.ir.ops import LOAD_OP, STORE_OP
from magis.rules import recompute_call
from magis.schedule.swaps import time_swaps


class Mode(enum.Enum):
    """What a block's saved activations do between its forward and its backward."""

    KEEP = "keep"  # stay on the device (plain PyTorch)
    RECOMPUTE = "recompute"  # freed; recomputed from the segment's checkpoint (Chen et al.)
    OFFLOAD = "offload"  # copied to the host after the forward, back before the backward


@dataclass(frozen=True)
class ChainOptions:
    """Knobs of the boundary search (see the module docstring)."""

    tiny_fraction: float = 1e-3  # storages below this share of the largest one are not counted
    split_fraction: float = 1 / 16  # a range longer than this share of the forward is split
    min_split: int = 8  # ...and than this many forward nodes
    min_block_ops: int = 2  # a block has at least this many non-view forward ops


@dataclass(frozen=True)
class Segment:
    """Blocks `start` .. `stop - 1`, all in one mode. A RECOMPUTE segment is recomputed as one
    piece from the checkpoint at its start (the storages crossing the cut before `start`)."""

    start: int
    stop: int
    mode: Mode


@dataclass(frozen=True)
class Chain:
    """A step's forward cut into blocks; every fact the plans need, computed once.

    `cuts[b]` is the forward position after which block b ends (blocks are
    `forward[cuts[b-1] + 1 : cuts[b] + 1]`; the last block runs to the end of the forward);
    `crossing[b]` the storages crossing `cuts[b]`: the checkpoint before block b + 1.
    """

    graph: Graph = field(repr=False)
    forward: tuple[int, ...] = field(repr=False)
    backward: frozenset[int] = field(repr=False)
    aliases: tuple[int, ...] = field(repr=False)  # views of forward values run with the forward
    cuts: tuple[int, ...]
    crossing: tuple[frozenset[Ref], ...] = field(repr=False)

    @property
    def n_blocks(self) -> int:
        return len(self.cuts) + 1

    @cached_property
    def block_of(self) -> dict[int, int]:
        """Forward node -> its block."""
        out, b = {}, 0
        for i, nid in enumerate(self.forward):
            out[nid] = b
            if b < len(self.cuts) and i == self.cuts[b]:
                b += 1
        smap = self.graph.storages()
        for nid in self.aliases:
            base = smap.storage_of(Ref(nid)).node
            if base in out:
                out[nid] = out[base]
        return out

    @cached_property
    def saved(self) -> dict[Ref, list[tuple[int, Ref]]]:
        """Forward storage -> the (backward node, value) reads of it: the saved activations."""
        smap = self.graph.storages()
        fwd = self.block_of
        out: dict[Ref, list[tuple[int, Ref]]] = {}
        for u in sorted(self.backward):
            for r in self.graph.node(u).inputs:
                if r.node in fwd:
                    s = smap.storage_of(r)
                    if s not in smap.resident:
                        out.setdefault(s, []).append((u, r))
        return out

    @cached_property
    def pinned(self) -> frozenset[Ref]:
        """Forward storages that are never recomputed: random draws (a second draw differs,
        fusion-aware-checkpointing §3.4), mutating ops, and graph outputs (the loss)."""
        smap = self.graph.storages()
        return frozenset(
            s
            for s in smap.nbytes
            if s.node in self.block_of
            and s not in smap.resident
            and (not recomputable(self.graph, s.node) or s in smap.outputs)
        )

    def checkpoint(self, start: int) -> frozenset[Ref]:
        """The storages a segment starting at block `start` is recomputed from."""
        return self.crossing[start - 1] if 0 < start < self.n_blocks else frozenset()

    def block_sizes(self) -> list[int]:
        bounds = [-1, *self.cuts, len(self.forward) - 1]
        return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


# --- finding the chain ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Intervals:
    """Per forward storage: allocation position, last forward reader position, bytes."""

    storage: tuple[Ref, ...]
    alloc: np.ndarray
    last: np.ndarray
    nbytes: np.ndarray


def _intervals(graph: Graph, forward: Sequence[int]) -> _Intervals:
    smap = graph.storages()
    pos = {n: i for i, n in enumerate(forward)}
    rows = []
    for s, nb in smap.nbytes.items():
        if s in smap.resident or s.node not in pos:
            continue
        reads = [pos[r] for r in smap.readers[s] if r in pos]
        if reads and max(reads) > pos[s.node]:
            rows.append((s, pos[s.node], max(reads), nb))
    return _Intervals(
        tuple(r[0] for r in rows),
        np.array([r[1] for r in rows], dtype=np.int64),
        np.array([r[2] for r in rows], dtype=np.int64),
        np.array([r[3] for r in rows], dtype=np.int64),
    )


def _split(
    iv: _Intervals, lo: int, hi: int, counted: np.ndarray, opts: ChainOptions, n: int
) -> list[int]:
    """Boundary cuts in the cut range [lo, hi) (cut k lies after forward position k)."""
    if hi - lo < 1:
        return []
    carried = (iv.alloc <= lo) & (iv.last > hi - 1)
    use = counted & ~carried
    ks = np.arange(lo, hi)
    cross = (iv.alloc[use][None, :] <= ks[:, None]) & (ks[:, None] < iv.last[use][None, :])
    count = cross.sum(axis=1)
    nbytes = cross.astype(np.int64) @ iv.nbytes[use]
    best = count.min()
    cuts = []
    k = 0
    while k < len(ks):
        if count[k] != best:
            k += 1
            continue
        run_end = k
        while run_end + 1 < len(ks) and count[run_end + 1] == best:
            run_end += 1
        run = np.arange(k, run_end + 1)
        # fewest bytes; ties: the latest cut (views of the block output stay in the block)
        pick = run[np.lexsort((-run, nbytes[run]))[0]]
        cuts.append(int(ks[pick]))
        k = run_end + 1
    limit = max(opts.min_split, int(n * opts.split_fraction))
    out: list[int] = []
    edges = [lo - 1, *cuts, hi]
    for a, b in zip(edges, edges[1:], strict=False):
        if b - a - 1 > limit:
            out.extend(_split(iv, a + 1, b, counted, opts, n))
        if b != hi:
            out.append(b)
    return sorted(set(out))


def _drop_small_blocks(graph: Graph, forward: Sequence[int], cuts: list[int], min_ops: int):
    """Merge blocks with fewer than `min_ops` non-view ops into their predecessor."""
    heavy = np.cumsum([0 if graph.info(n).is_view else 1 for n in forward])
    kept: list[int] = []
    prev = -1
    for c in cuts:
        done = heavy[c] - (heavy[prev] if prev >= 0 else 0)
        if done >= min_ops:
            kept.append(c)
            prev = c
    while kept and heavy[-1] - heavy[kept[-1]] < min_ops:
        kept.pop()
    return kept


def _crossing(iv: _Intervals, cut: int) -> frozenset[Ref]:
    hit = np.flatnonzero((iv.alloc <= cut) & (cut < iv.last))
    return frozenset(iv.storage[i] for i in hit)


def find_chain(graph: Graph, options: ChainOptions | None = None) -> Chain:
    """The forward of `graph` cut into blocks at few-tensor boundaries (module docstring)."""
    opts = options or ChainOptions()
    forward, backward, aliases = forward_backward(graph)
    n = len(forward)
    iv = _intervals(graph, forward)
    big = int(iv.nbytes.max()) if len(iv.nbytes) else 0
    counted = iv.nbytes >= big * opts.tiny_fraction
    cuts = _split(iv, 0, max(n - 1, 0), counted, opts, n) if n > 1 else []
    cuts = _drop_small_blocks(graph, forward, cuts, opts.min_block_ops)
    crossing = tuple(_crossing(iv, c) for c in cuts)
    return Chain(graph, tuple(forward), backward, aliases, tuple(cuts), crossing)


def recomputable(graph: Graph, nid: int) -> bool:
    """What re-materialization may recompute (`magis.rules.duplicates.recompute_call`: training batch
    norms included, without their running statistics)."""
    return recompute_call(graph, nid) is not None


# --- building a plan --------------------------------------------------------------------------


@dataclass
class _Builder:
    """One plan under construction: the copied graph and what was added to it."""

    chain: Chain
    modes: dict[int, Mode]  # block -> mode
    kept: frozenset[Ref]  # saved storages that stay on the device whatever their block's mode
    graph: Graph = field(init=False)
    clones: dict[int, int] = field(default_factory=dict)  # forward node -> its recompute copy
    clone_segment: dict[int, int] = field(default_factory=dict)  # copy -> segment start
    loads: dict[Ref, int] = field(default_factory=dict)  # storage -> its Load
    stores: dict[int, list[int]] = field(default_factory=dict)  # producer -> Stores after it
    load_views: dict[tuple[int, Ref], int] = field(default_factory=dict)  # (node, storage)->copy
    # inserted node -> the group it is placed with: ("segment", start) or ("load", storage)
    group: dict[int, tuple] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.graph = self.chain.graph.copy()

    def mode_of(self, storage: Ref) -> Mode:
        block = self.chain.block_of.get(storage.node)
        if block is None or storage in self.kept:
            return Mode.KEEP
        return self.modes[block]

    def source(self, ref: Ref, segment: dict[int, int]) -> Ref:
        """What a backward reader of `ref` reads in the plan."""
        s = self.chain.graph.storages().storage_of(ref)
        mode = self.mode_of(s)
        if mode is Mode.RECOMPUTE:
            return self._recomputed(ref, segment)
        if mode is Mode.OFFLOAD:
            return self._loaded(ref, s)
        return ref

    def _recomputed(self, ref: Ref, segment: dict[int, int]) -> Ref:
        smap = self.chain.graph.storages()
        if ref.node not in self.chain.block_of or smap.storage_of(ref) in smap.resident:
            return ref
        if self.mode_of(smap.storage_of(ref)) is not Mode.RECOMPUTE:
            return ref
        nid = ref.node
        if nid not in self.clones:
            node = self.chain.graph.node(nid)
            remap = lambda r: self._recomputed(r, segment)  # noqa: E731
            call_args, call_kwargs = recompute_call(self.chain.graph, nid)
            args = map_refs(call_args, remap)
            kwargs = {k: map_refs(v, remap) for k, v in call_kwargs.items()}
            twin = self.graph.add_op(f"{node.name}_recompute", node.op, args, kwargs, node.outputs)
            self.clones[nid] = twin
            block = self.chain.block_of[smap.storage_of(ref).node]
            self.group[twin] = ("segment", segment[block])
        return Ref(self.clones[nid], ref.index)

    def _loaded(self, ref: Ref, storage: Ref) -> Ref:
        if storage not in self.loads:
            meta = self.graph.meta(storage)
            name = self.graph.node(storage.node).name
            store = self.graph.add_op(f"{name}_store", STORE_OP, (storage,), outputs=(meta,))
            load = self.graph.add_op(f"{name}_load", LOAD_OP, (Ref(store),), outputs=(meta,))
            self.stores.setdefault(storage.node, []).append(store)
            self.loads[storage] = load
            self.group[load] = ("load", storage)
        if ref == storage:
            return Ref(self.loads[storage])
        return self._loaded_view(ref, storage)

    def _loaded_view(self, ref: Ref, storage: Ref) -> Ref:
        """A view of an offloaded storage, made again on top of its Load."""
        key = (ref.node, storage)
        if key not in self.load_views:
            smap = self.chain.graph.storages()
            node = self.chain.graph.node(ref.node)
            remap = (  # noqa: E731
                lambda r: self._loaded(r, storage) if smap.storage_of(r) == storage else r
            )
            args = map_refs(node.args, remap)
            kwargs = {k: map_refs(v, remap) for k, v in node.kwargs}
            twin = self.graph.add_op(f"{node.name}_reload", node.op, args, kwargs, node.outputs)
            self.load_views[key] = twin
            self.group[twin] = ("load", storage)
        return Ref(self.load_views[key], ref.index)


def _segment_starts(chain: Chain, segments: Sequence[Segment]) -> dict[int, int]:
    return {b: seg.start for seg in segments for b in range(seg.start, seg.stop)}


def kept_storages(chain: Chain, segments: Sequence[Segment]) -> frozenset[Ref]:
    """Saved storages on the device whatever their block's mode: pinned ones, the
    checkpoints recomputed segments start from, and what they hand to the next segment (the
    output of torch.utils.checkpoint is a plain tensor, never recomputed)."""
    kept = set(chain.pinned)
    for seg in segments:
        if seg.mode is Mode.RECOMPUTE:
            kept |= chain.checkpoint(seg.start) | chain.checkpoint(seg.stop)
    return frozenset(kept)


def _check_segments(chain: Chain, segments: Sequence[Segment]) -> None:
    covered = [b for seg in segments for b in range(seg.start, seg.stop)]
    if covered != list(range(chain.n_blocks)):
        raise ValueError(f"segments must cover blocks 0..{chain.n_blocks - 1} in order")


def build_plan(
    chain: Chain, segments: Sequence[Segment], cost: CostModel
) -> tuple[Graph, list[int]]:
    """The step with each segment's saved activations kept, recomputed or offloaded, and the
    order that runs it (module docstring); the chain's graph is not changed."""
    _check_segments(chain, segments)
    modes = {b: seg.mode for seg in segments for b in range(seg.start, seg.stop)}
    builder = _Builder(chain, modes, kept_storages(chain, segments))
    starts = _segment_starts(chain, segments)
    anchor: dict[tuple, int] = {}  # group -> the first backward node reading it
    pos = {n: i for i, n in enumerate(chain.graph.program_order())}
    for storage in sorted(chain.saved, key=lambda s: pos[s.node]):
        for user, ref in chain.saved[storage]:
            new = builder.source(ref, starts)
            if new == ref:
                continue
            builder.graph.replace_uses(ref, new, [user])
            key = builder.group[new.node]
            if pos[user] < anchor.get(key, len(pos)):
                anchor[key] = pos[user]
    order = _placement(builder, anchor, pos)
    if builder.loads:
        order = time_swaps(builder.graph, order, cost)
    return builder.graph, order


def _placement(builder: _Builder, anchor: dict[tuple, int], pos: dict[int, int]) -> list[int]:
    """Program order, each recomputed segment and each Load (with the views rebuilt on it)
    right before the first backward node that reads it, each Store right after its producer."""
    before: dict[int, list[int]] = {}
    program = builder.chain.graph.program_order()
    # inserted nodes in creation order: a copy is created after the copies it reads
    inserted = sorted(builder.group, key=lambda n: n)
    for nid in inserted:
        before.setdefault(program[anchor[builder.group[nid]]], []).append(nid)
    order: list[int] = []
    for nid in program:
        order.extend(before.get(nid, ()))
        order.append(nid)
        order.extend(builder.stores.get(nid, ()))
    return order
