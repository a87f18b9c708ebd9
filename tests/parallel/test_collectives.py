"""Collectives in the graph without any process: capture, costs, streams, rules, codegen."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import ddp_workers  # noqa: E402
import ranks  # noqa: E402

from magis.backend import generate  # noqa: E402
from magis.capture.collectives import (  # noqa: E402
    DataParallel,
    ParallelError,
    buckets,
    check_collectives,
    collective_calls,
)
from magis.cost import get_cost_model  # noqa: E402
from magis.cost.links import LINK_PRESETS, Interconnect, UnknownLinkError, get_link  # noqa: E402
from magis.ir.collectives import comm_nodes  # noqa: E402
from magis.ir.ops import ALL_GATHER_OP, ALL_REDUCE_OP, WAIT_OP  # noqa: E402
from magis.ir.schema import GraphSchemaError, check_op  # noqa: E402
from magis.rules.duplicates import recomputable  # noqa: E402
from magis.sim import simulate  # noqa: E402
from magis.train.compile import prepare_step  # noqa: E402


@pytest.fixture(scope="module")
def step():
    """The DDP step of the tiny net for 4 ranks, captured with no process group at all."""
    torch.manual_seed(0)
    model = ddp_workers.Net().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    parallel = DataParallel("0", 4, ddp_workers.BUCKET_BYTES)
    return prepare_step(
        model, opt, ranks.batch(0, 0), loss_fn=ranks.loss_fn, parallel=parallel
    ).step


def test_buckets_follow_ddp_reverse_order_and_cap():
    grads = [torch.zeros(10), None, torch.zeros(100), torch.zeros(5), torch.zeros(3)]
    assert buckets(grads, 40) == [[4, 3], [2], [0]]  # 32 bytes, then 400 alone, then 40
    assert buckets(grads, 10**6) == [[4, 3, 2, 0]]


def test_capture_holds_one_all_reduce_per_bucket(step):
    calls = collective_calls(step.graph)
    params = list(ddp_workers.Net().double().parameters())
    assert len(calls) == len(buckets(params, ddp_workers.BUCKET_BYTES))
    assert {(c.op, c.group_name, c.world_size) for c in calls} == {(ALL_REDUCE_OP, "0", 4)}
    assert sum(c.nbytes for c in calls) == sum(p.numel() * 8 for p in params)


def test_ring_all_reduce_time():
    link = Interconnect(get_link("infiniband"), 8)
    nbytes = 2**30
    expected = 2 * 7 / 8 * nbytes / 45e9 + 2 * 7 * 5e-6
    assert link.seconds(ALL_REDUCE_OP, nbytes) == pytest.approx(expected)
    assert link.seconds(ALL_GATHER_OP, nbytes) == pytest.approx(expected / 2)
    assert Interconnect(get_link("nvlink"), 1).seconds(ALL_REDUCE_OP, nbytes) == 0.0
    with pytest.raises(UnknownLinkError, match="choose one of nvlink"):
        get_link("carrier-pigeon")
    assert set(LINK_PRESETS) >= {"nvlink", "pcie", "infiniband"}


def test_collectives_run_on_their_own_stream(step):
    """A slow link: the step takes longer than its compute, by no more than the collectives'
    time (they overlap the compute that does not need them)."""
    g = step.graph
    fast = get_cost_model("a100").with_interconnect(Interconnect(get_link("nvlink"), 4))
    slow = get_cost_model("a100").with_interconnect(Interconnect(get_link("loopback"), 4))
    order = g.program_order()
    a, b = simulate(g, order, fast), simulate(g, order, slow)
    assert b.comm_s > a.comm_s > 0
    assert b.compute_s == pytest.approx(a.compute_s)
    assert a.compute_s < b.latency_s <= b.compute_s + b.comm_s + 1e-12
    # The last bucket is all-reduced while earlier gradients' updates run: overlap.
    assert b.latency_s < b.compute_s + b.comm_s


def test_a_model_with_another_link_is_a_copy(step):
    """`with_interconnect` leaves the caller's model and its link as they were."""
    base = get_cost_model("a100")
    slow = base.with_interconnect(Interconnect(get_link("loopback"), 4))
    order = step.graph.program_order()
    assert slow is not base and base.interconnect != slow.interconnect
    assert simulate(step.graph, order, slow).comm_s > simulate(step.graph, order, base).comm_s


def test_collectives_are_never_recomputed_nor_split(step):
    from magis.ir.dims import op_dims

    g = step.graph
    comms = comm_nodes(g)
    assert comms and not any(recomputable(g, n) for n in comms)
    for n in comms:
        args, kwargs = g.meta_args(n)
        assert op_dims(g.node(n).op, args, kwargs, g.node(n).outputs) is None


def test_program_calls_the_collectives(step):
    g = step.graph
    source = generate(g, g.program_order())
    assert source.count("c10d.all_reduce.default(") == len(comm_nodes(g))
    assert source.count("c10d.wait_tensor.default(") == len(comm_nodes(g))


def test_schema_accepts_only_the_listed_collectives():
    assert check_op(WAIT_OP, "n") is torch.ops._c10d_functional.wait_tensor.default
    with pytest.raises(GraphSchemaError, match="is not an ATen operator overload"):
        check_op("_c10d_functional.broadcast.default", "n")


def test_plan_collectives_must_be_the_groups(step):
    check_collectives(step.graph, DataParallel("0", 4))
    with pytest.raises(ParallelError, match="run on group '0' and this process group is '7'"):
        check_collectives(step.graph, DataParallel("7", 4))
    with pytest.raises(ParallelError, match="made for world size 4 and this process group has 2"):
        check_collectives(step.graph, DataParallel("0", 2))
    with pytest.raises(ParallelError, match=r"compile with parallel= and its process_group"):
        check_collectives(step.graph, None)
