"""magis.compile(parallel="fsdp") on gloo against FSDP2's `fully_shard` (issue 44).

FSDP2 runs on CPUs with gloo in torch 2.13 (`init_device_mesh("cpu", ...)`), so the reference
is FSDP2 itself: losses, full parameters and full AdamW state equal to 1e-9 after five steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_workers  # noqa: E402
import ranks  # noqa: E402

from magis.plan import Plan  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Two ranks, rank 0 searching the plan: each rank's figures in rank{r}.json."""
    tmp = tmp_path_factory.mktemp("fsdp")
    ranks.spawn(fsdp_workers.train_equal, 2, tmp, None)
    return tmp


def _check_equal_to_fsdp2(results: list[dict], world: int) -> None:
    for r, got in enumerate(results):
        assert got["moved"] > 1e-3  # the parameters were trained at all
        for key in ("loss", "params", "exp_avg", "exp_avg_sq"):
            assert got[key] <= 1e-9, (r, key, got[key])
        assert got["steps"] == [float(ranks.STEPS)]
        # each rank holds ceil(rows / world) rows of each parameter, padded alike on every rank
        assert got["local_shapes"]["out.bias"] == [-(-3 // world)]
        assert got["local_shapes"]["inp.weight"] == [-(-10 // world), 6]
        # root + 3 blocks: the root gathered once, each block before its forward and, as
        # FSDP2 does, again before its backward unless the plan keeps its forward's gather
        # (de-re-materialization may merge a re-gather); one reduce-scatter per group
        assert 4 <= got["all_gathers"] <= 7
        assert got["reduce_scatters"] == 4
    assert len({got["plan_hash"] for got in results}) == 1  # one plan on every rank


def test_two_ranks_train_as_fsdp2(trained):
    _check_equal_to_fsdp2(ranks.results(trained, 2), 2)


def test_four_ranks_clipping_train_as_fsdp2(tmp_path):
    """Four ranks, with a rank whose piece of out.bias holds padding only, clipping the
    gradients' global norm (an all-reduce of the pieces' squares) as clip_grad_norm_ does on
    FSDP2's DTensors."""
    ranks.spawn(fsdp_workers.train_equal, 4, tmp_path, None, 0.5, 1.0)  # a 1 s search
    results = ranks.results(tmp_path, 4)
    _check_equal_to_fsdp2(results, 4)
    assert results[0]["clipped"] >= 2  # the norm was above 0.5 on most steps: clipping ran


def test_a_rank_with_another_plan_stops_every_rank(trained, tmp_path):
    plan = Plan.load(trained / "plan.json")
    plan.save(tmp_path / "p.json")
    ranks.other_order(plan).save(tmp_path / "p1.json")  # rank 1 loads p1.json
    ranks.spawn(fsdp_workers.compile_error, 2, tmp_path, str(tmp_path / "p.json"))
    for r in range(2):
        restored, line = (tmp_path / f"rank{r}.txt").read_text().split("|")
        assert line.startswith("PlanMismatchError: rank(s) 1 hold another plan"), line
        assert restored == "True"  # the model's parameters are whole again


def test_a_plan_for_two_ranks_refuses_a_group_of_one(trained, tmp_path):
    ranks.spawn(fsdp_workers.compile_error, 1, tmp_path, str(trained / "plan.json"))
    restored, line = (tmp_path / "rank0.txt").read_text().split("|")
    assert line == (
        "ParallelError: the plan was made for world size 2 and this process group has 1 "
        "ranks: plan again for this world size"
    )
    assert restored == "True"


def test_what_cannot_be_sharded_is_refused_in_one_line(tmp_path):
    ranks.spawn(fsdp_workers.refusals, 1, tmp_path)
    stepped, scalar = (tmp_path / "refused.txt").read_text().split("\n")
    assert stepped.startswith("ParallelError: the optimizer already has state")
    assert scalar == (
        "ShardingError: parameter 'scale' is 0-dimensional and FSDP shards parameters on dim 0: "
        "give it shape [1] (torch.nn.Parameter(value.reshape(1)))"
    )


def test_a_plan_keeping_the_forward_gathers_trains_as_fsdp2(trained, tmp_path):
    """De-re-materialization merges each block's re-gather for its backward into its forward's
    gather (the same shards, viewed alike: `rules.duplicates`), as FSDP2 without resharding
    after the forward would run; one plan on both ranks, equal to FSDP2."""
    from magis.ir import positions
    from magis.rules.duplicates import duplicate_pairs
    from magis.rules.remat import merge_all_duplicates

    plan = Plan.load(trained / "plan.json")
    pos = positions(plan.order)
    gathers = [
        (k, d)
        for k, d in duplicate_pairs(plan.graph, pos)
        if plan.graph.info(d).comm_stream or plan.graph.node(d).op == "aten.cat.default"
    ]
    merged = merge_all_duplicates(plan.graph, gathers, pos)
    order = [n for n in plan.order if n in merged.graph]
    assert merged.graph.is_valid_schedule(order)
    Plan(merged.graph, order, plan.summary).save(tmp_path / "kept.json")
    ranks.spawn(fsdp_workers.train_equal, 2, tmp_path, str(tmp_path / "kept.json"))
    for got in ranks.results(tmp_path, 2):
        for key in ("loss", "params", "exp_avg", "exp_avg_sq"):
            assert got[key] <= 1e-9, (key, got[key])
        assert got["moved"] > 1e-3
        assert (got["all_gathers"], got["reduce_scatters"]) == (4, 4)  # one gather per group
