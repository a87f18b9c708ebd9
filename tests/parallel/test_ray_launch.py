"""A data-parallel job's ranks as Ray actors (magis.train.ray_launch, issue 44): two ranks on a
local Ray, gloo, magis.compile(parallel="ddp") equal to eager DDP as under torch.multiprocessing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import ddp_workers  # noqa: E402
import ranks  # noqa: E402

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")


def _ddp_figures() -> dict:
    return ddp_workers.compare_with_ddp()[0]


def _fails_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("this rank's batch is empty\nsecond line")
    return dist.get_rank()


@pytest.fixture(scope="module")
def local_ray():
    from ray import cloudpickle

    # the test's functions travel by value: Ray's workers do not have tests/ on their path
    for module in (sys.modules[__name__], ddp_workers, ranks):
        cloudpickle.register_pickle_by_value(module)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_ray_ranks_train_as_eager_ddp(local_ray):
    from magis.train.ray_launch import run_ranks

    figures = run_ranks(_ddp_figures, 2)
    assert len(figures) == 2
    for got in figures:
        assert got["moved"] > 1e-3
        for key in ("loss", "params", "exp_avg", "exp_avg_sq"):
            assert got[key] <= 1e-9, (key, got[key])
    assert figures[0]["plan_hash"] == figures[1]["plan_hash"]


def test_a_failing_rank_is_one_line_naming_it(local_ray):
    from magis.train.ray_launch import RankFailedError, run_ranks

    with pytest.raises(RankFailedError) as info:
        run_ranks(_fails_on_rank_1, 2)
    assert str(info.value) == "rank 1 of 2 failed: ValueError: this rank's batch is empty"
