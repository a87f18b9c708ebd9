"""`magis optimize --parallel`: one rank of a data-parallel job planned without processes."""

from __future__ import annotations

import json

import pytest

from magis.capture import workload_step
from magis.capture.collectives import ParallelError, collective_calls
from magis.capture.sharding import PlannedJob
from magis.ir.ops import ALL_GATHER_OP, ALL_REDUCE_OP, REDUCE_SCATTER_OP
from magis.plan import Plan


def test_optimize_plans_one_rank_of_an_fsdp_job(magis_cli, tmp_path):
    out, saved = tmp_path / "out.json", tmp_path / "plan.json"
    res = magis_cli(
        "optimize", "corpus:llama:tiny", "--parallel", "fsdp", "--world-size", "8",
        "--hardware", "h100", "--lat-limit", "1.10", "--max-states", "30",
        "--json", str(out), "--save", str(saved),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "one rank of FSDP x 8 (h100)" in res.stdout
    fsdp2, ac, plan = json.loads(out.read_text())["ranks"]
    assert [fsdp2["name"], ac["name"], plan["name"]] == ["FSDP2", "FSDP2 + full AC", "magis plan"]
    assert ac["peak_bytes"] < fsdp2["peak_bytes"] and ac["step_s"] > fsdp2["step_s"]
    assert plan["step_s"] <= 1.10 * fsdp2["step_s"] and plan["peak_bytes"] < fsdp2["peak_bytes"]
    assert 0 < fsdp2["overlap"] <= 1 and fsdp2["comm_s"] == plan["comm_s"] > 0
    calls = collective_calls(Plan.load(saved).graph)
    assert {(c.op, c.world_size) for c in calls} == {(ALL_GATHER_OP, 8), (REDUCE_SCATTER_OP, 8)}


def test_a_ddp_job_all_reduces_and_a_bad_kind_is_one_line():
    _, step = workload_step("corpus:llama:tiny", job=PlannedJob("ddp", 4))
    assert {(c.op, c.world_size) for c in collective_calls(step.graph)} == {(ALL_REDUCE_OP, 4)}
    with pytest.raises(ParallelError, match="unknown parallel 'zero'; choose one of ddp, fsdp"):
        PlannedJob("zero", 8)
    with pytest.raises(ParallelError, match="world size 0: a job has at least one rank"):
        PlannedJob("fsdp", 0)
