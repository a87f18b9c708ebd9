"""FSDP's sharding and collectives in the graph, without any process (issue 44)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_workers  # noqa: E402
import ranks  # noqa: E402

from magis.capture.collectives import (  # noqa: E402
    DataParallel,
    ParallelError,
    check_collectives,
    collective_calls,
)
from magis.capture.sharding import (  # noqa: E402
    ShardingError,
    ShardLayout,
    fsdp_blocks,
    local_piece,
    shard_parameters,
)
from magis.cost import get_cost_model  # noqa: E402
from magis.cost.links import Interconnect, get_link  # noqa: E402
from magis.ir.collectives import comm_nodes  # noqa: E402
from magis.ir.ops import ALL_GATHER_OP, REDUCE_SCATTER_OP  # noqa: E402
from magis.rules.duplicates import recomputable  # noqa: E402
from magis.sim import simulate  # noqa: E402
from magis.train.compile import prepare_step  # noqa: E402

RANKS = DataParallel("0", 4)


@pytest.fixture(scope="module")
def step():
    """Rank 3's FSDP step of the test net for 4 ranks, captured with no process group."""
    torch.manual_seed(0)
    model = fsdp_workers.Net().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    layout = ShardLayout.of(model, RANKS)
    shard_parameters(model, layout, 3)
    batch = ranks.batch(0, 0)
    return prepare_step(
        model, opt, batch, loss_fn=ranks.loss_fn, parallel=RANKS, sharding=layout
    ).step


def test_blocks_are_the_module_lists_children_else_the_models():
    assert fsdp_blocks(fsdp_workers.Net()) == ["blocks.0", "blocks.1", "blocks.2"]
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert fsdp_blocks(seq) == ["0", "2"]  # no ModuleList: the children with parameters
    layout = ShardLayout.of(fsdp_workers.Net(), RANKS)
    assert [g.module for g in layout.groups] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert [p.name for p in layout.groups[0].params] == [
        "inp.weight",
        "inp.bias",
        "out.weight",
        "out.bias",
    ]


def test_pieces_are_dim0_chunks_padded_alike_on_every_rank():
    full = torch.arange(10.0).reshape(5, 2)
    pieces = [local_piece(full, r, 4) for r in range(4)]
    assert all(p.shape == (2, 2) for p in pieces)
    assert torch.equal(torch.cat(pieces)[:5], full)
    assert not torch.cat(pieces)[5:].any()  # rank 2's second row and all of rank 3's: padding


def test_parameters_that_cannot_be_sharded_are_one_line_errors():
    model = nn.Linear(2, 2)
    model.scale = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ShardingError, match=r"'scale' is 0-dimensional .* give it shape \[1\]"):
        ShardLayout.of(model, RANKS)
    mixed = nn.Sequential(nn.Linear(2, 2))
    mixed[0].bias.data = mixed[0].bias.data.double()
    with pytest.raises(ShardingError, match="block '0' holds float32 and float64 parameters"):
        ShardLayout.of(mixed, RANKS)


def test_each_block_gathered_twice_and_reduce_scattered_once(step):
    calls = collective_calls(step.graph)
    gathers = [c for c in calls if c.op == ALL_GATHER_OP]
    scatters = [c for c in calls if c.op == REDUCE_SCATTER_OP]
    assert (len(gathers), len(scatters)) == (1 + 2 * 3, 4)
    assert {(c.group_name, c.world_size) for c in calls} == {("0", 4)}
    # a block's 10-row parameters padded to 12 rows, 3 per rank: norm weight and bias, the
    # linear's weight (3 x 10) and bias; the all-gather's output holds the 4 ranks' pieces
    piece = (3 + 3 + 30 + 3) * 8
    assert gathers[1].nbytes == 4 * piece
    assert scatters[0].nbytes == piece  # the block's piece of the gradient


def test_forward_gathers_die_before_the_backward(step):
    """Reshard after forward: nothing a block's forward all-gather made is read after the
    block's backward all-gather, except by the root group (gathered once, FSDP2's root)."""
    g = step.graph
    order = g.program_order()
    at = {n: i for i, n in enumerate(order)}
    gathers = [n for n in order if g.node(n).op == ALL_GATHER_OP]
    backward_start = at[gathers[4]]  # blocks 0..2 forward after the root's: the 5th is backward
    users = {n: [] for n in g.nodes}
    for n in order:
        for r in g.node(n).inputs:
            users[r.node].append(n)

    def last_use(n: int, seen: set[int]) -> int:
        seen.add(n)
        last = at[n]
        for u in users[n]:
            last = max(last, at[u])
            if g.info(u).is_view and u not in seen:
                last = max(last, last_use(u, seen))
        return last

    def copies_out(gather: int) -> list[int]:  # all-gather -> wait -> view -> slice -> clone
        return [c for w in users[gather] for v in users[w] for s in users[v] for c in users[s]]

    block_ends = []
    for forward in gathers[1:4]:
        copies = copies_out(forward)
        block_ends += [last_use(c, set()) for c in copies]
        assert len(copies) == 4 and max(block_ends) < backward_start
    # the root's parameters (FSDP2 does not reshard the root) live on into the backward
    assert max(last_use(c, set()) for c in copies_out(gathers[0])) > max(block_ends)


def test_collectives_are_never_recomputed_and_overlap(step):
    g = step.graph
    assert comm_nodes(g) and not any(recomputable(g, n) for n in comm_nodes(g))
    slow = get_cost_model("a100").with_interconnect(Interconnect(get_link("loopback"), 4))
    sim = simulate(g, g.program_order(), slow)
    assert sim.comm_s > 0
    # the waits sit where the results are read (sink_waits): prefetched all-gathers and the
    # reduce-scatters overlap the compute issued before that
    assert sim.compute_s < sim.latency_s < sim.compute_s + sim.comm_s


def test_reduce_scatter_world_size_is_checked(step):
    check_collectives(step.graph, RANKS)
    with pytest.raises(ParallelError, match="made for world size 4 and this process group has 8"):
        check_collectives(step.graph, DataParallel("0", 8))


def test_checkpointed_blocks_gather_in_the_recomputation_and_hold_less():
    """FSDP2 with full activation checkpointing, captured: the recomputed forward of each
    block all-gathers it again (no other all-gather in the backward) and the peak drops."""
    peaks, counts = [], []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = fsdp_workers.Net().double()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        layout = ShardLayout.of(model, RANKS, checkpoint_blocks=checkpointed)
        shard_parameters(model, layout, 0)
        x = torch.randn(64, 6, dtype=torch.float64)
        batch = (x, torch.randint(0, 3, (64,)))
        g = prepare_step(
            model, opt, batch, loss_fn=ranks.loss_fn, parallel=RANKS, sharding=layout
        ).step.graph
        counts.append([c.op for c in collective_calls(g)])
        peaks.append(simulate(g, g.program_order(), get_cost_model("unit")).peak_bytes)
    assert counts[0] == counts[1]
    assert peaks[1] < peaks[0]


def test_plans_wait_for_a_collective_before_reading_its_buffer(step):
    """No rule reads a collective's buffer but its wait (a swap's Store of it read it half
    filled, and the wait on the Loaded copy waited for nothing): searched plans pass the
    check, and a Store of an all-gather's buffer is refused."""
    from magis.commands.optimize import optimize
    from magis.ir import Ref
    from magis.ir.ops import STORE_OP
    from magis.rules.swap import swappable
    from magis.train.compile import rules_keeping_state

    plan = optimize(
        step, mem_limit=0.5, max_states=40, hardware="a100", rules=rules_keeping_state()
    )
    check_collectives(plan.graph, RANKS)
    g = step.graph.copy()
    gather = next(n for n in g.program_order() if g.node(n).op == ALL_GATHER_OP)
    assert not swappable(g, Ref(gather))
    g.add_op("bad_store", STORE_OP, (Ref(gather),), outputs=(g.meta(Ref(gather)),))
    with pytest.raises(ParallelError, match=r"buffer before its wait \(bad_store\)"):
        check_collectives(g, RANKS)
