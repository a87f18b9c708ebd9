"""`magis layout` and `magis run --layout`: JSON fields, one-line errors."""

import json


def test_layout_json_fields(magis_cli, tmp_path):
    out = tmp_path / "layout.json"
    res = magis_cli("layout", "unetpp:tiny", "--method", "llfb", "--json", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    for key in ("theoretical_peak_bytes", "arena_bytes", "fragmentation", "seconds", "method"):
        assert key in data
    assert data["method"] == "llfb" and data["arena_bytes"] >= data["theoretical_peak_bytes"]


def test_run_in_an_arena_json_fields(magis_cli, tmp_path):
    out = tmp_path / "run.json"
    res = magis_cli("run", "bert-base:tiny", "--layout", "--json", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert data["verified"]
    assert data["measured_nonresident_bytes"] == data["arena_bytes"] + data["transient_bytes"]


def test_bad_method_and_paper_size_run_are_one_line_errors(magis_cli):
    for args in (("layout", "bert-base:tiny", "--method", "ilp"), ("run", "bert-base", "--layout")):
        res = magis_cli(*args)
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 1 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
