"""magis.compile(parallel="ddp") on gloo against eager DistributedDataParallel (issue 44)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import ddp_workers  # noqa: E402
import ranks  # noqa: E402

from magis.plan import Plan  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Two ranks, rank 0 searching the plan: each rank's figures in rank{r}.json."""
    tmp = tmp_path_factory.mktemp("ddp")
    ranks.spawn(ddp_workers.train_equal, 2, tmp, None)
    return tmp


def test_two_ranks_train_as_eager_ddp(trained):
    for r, got in enumerate(ranks.results(trained, 2)):
        assert got["moved"] > 1e-3  # the parameters were trained at all
        for key in ("loss", "params", "exp_avg", "exp_avg_sq"):
            assert got[key] <= 1e-9, (r, key, got[key])
        assert got["steps"] == [float(ranks.STEPS)]
        assert got["collectives"] >= 2  # several buckets, each one all-reduce in the program


def test_every_rank_runs_rank_0s_plan(trained):
    hashes = {got["plan_hash"] for got in ranks.results(trained, 2)}
    assert len(hashes) == 1


def test_a_rank_with_another_plan_stops_every_rank(trained, tmp_path):
    plan = Plan.load(trained / "plan.json")
    plan.save(tmp_path / "p.json")
    ranks.other_order(plan).save(tmp_path / "p1.json")  # rank 1 loads p1.json
    ranks.spawn(ddp_workers.compile_error, 2, tmp_path, str(tmp_path / "p.json"))
    for r in range(2):
        line = (tmp_path / f"rank{r}.txt").read_text()
        assert line.startswith("PlanMismatchError: rank(s) 1 hold another plan"), line
        assert "\n" not in line


def test_a_plan_for_two_ranks_refuses_a_group_of_one(trained, tmp_path):
    ranks.spawn(ddp_workers.compile_error, 1, tmp_path, str(trained / "plan.json"))
    line = (tmp_path / "rank0.txt").read_text()
    assert line == (
        "ParallelError: the plan was made for world size 2 and this process group has 1 "
        "ranks: plan again for this world size"
    )


def test_ddp_without_a_process_group_is_one_line():
    import magis

    model = ddp_workers.Net().double()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(magis.MagisError, match="needs torch.distributed initialized"):
        magis.compile(
            model,
            opt,
            ranks.batch(0, 0),
            loss_fn=ranks.loss_fn,
            parallel="ddp",
            mem_limit=0.5,
        )
    with pytest.raises(magis.MagisError, match="unknown parallel='zero'"):
        magis.compile(
            model,
            opt,
            ranks.batch(0, 0),
            loss_fn=ranks.loss_fn,
            parallel="zero",
            mem_limit=0.5,
        )
