"""`magis analyze --ftree`, `magis run --fission`, and fission alone (MAGIS §4, §5.1)."""

import json

import pytest
import torch

from magis.capture import workload_step
from magis.commands.analyze import fission_tree
from magis.commands.run import run
from magis.cost import get_cost_model
from magis.errors import MagisError
from magis.rules import materialize
from magis.sim import simulate


def test_analyze_ftree_prints_and_writes_the_nodes(magis_cli, tmp_path):
    out = tmp_path / "a.json"
    res = magis_cli("analyze", "bert-base:tiny", "--ftree", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "F-Tree" in res.stdout
    rows = json.loads(out.read_text())["ftree"]
    assert rows and {"index", "parent", "size", "dim", "length", "score_bytes", "n"} <= set(rows[0])
    assert all(r["n"] == 1 and r["length"] % 2 == 0 for r in rows)


def test_run_fission_verifies_and_reports_the_nodes(magis_cli, tmp_path):
    out = tmp_path / "r.json"
    res = magis_cli(
        "run", "bert-base:tiny", "--fission", "0,10", "--parts", "2", "--json", str(out)
    )
    assert res.returncode == 0, res.stderr
    rep = json.loads(out.read_text())
    assert rep["verified"] and rep["peak_error"] <= 0.05
    assert [(f["index"], f["n"]) for f in rep["fission"]] == [(0, 2), (10, 2)]


def test_run_fission_errors_are_one_line(magis_cli):
    for fission, parts, words in (([999], 2, "no F-Tree node 999"), ([0], 3, "must divide")):
        with pytest.raises(MagisError, match=words) as exc:
            run("bert-base:tiny", "rtx3090", fission=fission, parts=parts)
        assert "\n" not in str(exc.value)
    res = magis_cli("run", "bert-base:tiny", "--fission", "a,b")
    assert res.returncode == 1 and "F-Tree node numbers" in res.stderr
    assert "Traceback" not in res.stderr


def test_one_ftree_node_alone_lowers_the_peak_and_runs_verified():
    """Some F-Tree node of bert-base:tiny, split in two, lowers the simulated peak of the
    program order by itself; `run --fission` of that node verifies against eager PyTorch."""
    _, step = workload_step("bert-base:tiny", dtype=torch.float64)
    cost = get_cost_model("rtx3090")
    base = simulate(step.graph, step.graph.program_order(), cost).peak_bytes
    graph, tree = fission_tree(step)
    peaks = {}
    for k in range(len(tree)):
        split = materialize(graph, tree.with_n(k, 2))
        peaks[k] = simulate(split.graph, split.order, cost).peak_bytes
    best = min(peaks, key=peaks.get)
    assert peaks[best] < base
    rep = run("bert-base:tiny", cost, fission=[best])
    assert rep.verified and [f["index"] for f in rep.fission] == [best]
