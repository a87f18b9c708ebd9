"""`magis analyze --ftree`, `magis run --fission`, and the fission-alone API (MAGIS §4, §5.1)."""

import json
import os
import subprocess
import sys

import torch

from magis.api import fission_alone
from magis.capture import workload_step


def magis(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "magis", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_analyze_ftree_prints_and_writes_the_nodes(tmp_path):
    out = tmp_path / "a.json"
    res = magis("analyze", "bert-base:tiny", "--ftree", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "F-Tree" in res.stdout
    rows = json.loads(out.read_text())["ftree"]
    assert rows and {"index", "parent", "size", "dim", "length", "score_bytes", "n"} <= set(rows[0])
    assert all(r["n"] == 1 and r["length"] % 2 == 0 for r in rows)


def test_run_fission_verifies_and_reports_the_nodes(tmp_path):
    out = tmp_path / "r.json"
    res = magis("run", "bert-base:tiny", "--fission", "0,10", "--parts", "2", "--json", str(out))
    assert res.returncode == 0, res.stderr
    rep = json.loads(out.read_text())
    assert rep["verified"] and rep["peak_error"] <= 0.05
    assert [(f["index"], f["n"]) for f in rep["fission"]] == [(0, 2), (10, 2)]


def test_run_fission_errors_are_one_line():
    for args, words in (
        (("--fission", "999"), "no F-Tree node 999"),
        (("--fission", "0", "--parts", "3"), "must divide"),
        (("--fission", "a,b"), "F-Tree node numbers"),
    ):
        res = magis("run", "bert-base:tiny", *args)
        assert res.returncode == 1 and words in res.stderr and "Traceback" not in res.stderr


def test_fission_alone_finds_a_node_that_lowers_the_peak():
    _, step = workload_step("unet:tiny", dtype=torch.float64)
    rep = fission_alone(step, "unet:tiny", hardware="rtx3090", max_parts=4, top=2)
    assert rep.ftree_nodes > 0 and rep.tried
    assert rep.best["peak_ratio"] <= min(r["peak_ratio"] for r in rep.tried)
    assert rep.best_within is None or rep.best_within["latency_ratio"] <= rep.latency_limit
