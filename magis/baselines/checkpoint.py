"""Full checkpointing at block boundaries (Chen et al. 2016, §4.1-4.2: sqrt(n) segments), as
torch.utils.checkpoint users do it.

The forward is cut into the chain of blocks of `magis.baselines.chain`; k segments of
consecutive blocks are formed so that each holds about 1/k of the saved activation bytes (Chen
et al.'s Algorithm 1 cuts where the running memory exceeds a budget; equal shares is its
fixed-k form). As `torch.utils.checkpoint.checkpoint_sequential` does, the first k - 1 segments
are checkpointed and the last runs normally: only the storages crossing a segment's first cut
(its checkpoint) are kept, every other activation its backward reads is recomputed right before
the first backward node that reads it (the hand placement torch's unpack hook makes — no
re-scheduling), except random draws (dropout masks), which are kept (fusion-aware-checkpointing
§3.4; torch replays the RNG instead). k = 1 is plain PyTorch and is not repeated here;
k = n_blocks checkpoints every block, the usual "wrap each layer" practice.

Points: every k from 2 to ceil(2 sqrt(n)), plus n (the same plan is not yielded twice).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from magis.baselines.base import Baseline, Failure, Outcome, point
from magis.baselines.chain import Chain, Mode, Segment, build_plan, find_chain
from magis.cost import CostModel
from magis.ir import Graph


def saved_bytes_per_block(chain: Chain) -> np.ndarray:
    """Bytes of the storages each block's backward reads (its saved activations)."""
    smap = chain.graph.storages()
    out = np.zeros(chain.n_blocks, dtype=np.int64)
    for s in chain.saved:
        out[chain.block_of[s.node]] += smap.nbytes[s]
    return out


def equal_segments(chain: Chain, k: int) -> tuple[Segment, ...]:
    """k segments with about equal saved bytes; all but the last recomputed."""
    n = chain.n_blocks
    k = max(1, min(k, n))
    share = np.cumsum(saved_bytes_per_block(chain)).astype(float)
    share /= max(share[-1], 1.0)
    starts = [0]
    for i in range(1, k):
        # the first block whose running share passes i/k starts a segment, as long as every
        # segment keeps at least one block
        b = int(np.searchsorted(share, i / k, side="right"))
        b = min(max(b, starts[-1] + 1), n - (k - i))
        starts.append(b)
    stops = [*starts[1:], n]
    return tuple(
        Segment(a, b, Mode.RECOMPUTE if i < k - 1 else Mode.KEEP)
        for i, (a, b) in enumerate(zip(starts, stops, strict=True))
    )


def segment_counts(n_blocks: int) -> list[int]:
    """2 .. ceil(2 sqrt(n)), and n: the range around Chen et al.'s sqrt(n)."""
    top = min(n_blocks, math.ceil(2 * math.sqrt(n_blocks)))
    return sorted({*range(2, top + 1), n_blocks} - {0, 1})


def _checkpoint_points(graph: Graph, cost: CostModel) -> Iterator[Outcome]:
    chain = find_chain(graph)
    if chain.n_blocks < 2:
        yield Failure("checkpoint", "the forward has no block boundary to checkpoint at")
        return
    seen: set[tuple[Segment, ...]] = set()
    for k in segment_counts(chain.n_blocks):
        segments = equal_segments(chain, k)
        if segments in seen:
            continue
        seen.add(segments)
        g, order = build_plan(chain, segments, cost)
        yield point("checkpoint", g, order, cost, segments=k, blocks=chain.n_blocks)


CHECKPOINT = Baseline(
    "checkpoint",
    "checkpointing at block boundaries, k segments around sqrt(n) (Chen et al. 2016)",
    _checkpoint_points,
)
