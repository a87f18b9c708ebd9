"""`magis bench corpus` (issue #16 item 4): MAGIS and the best baseline on corpus models under
latency limit 1.10 and memory limit 0.4, written as CSV, JSON, a table and a figure; Ctrl-C
keeps what finished."""

from __future__ import annotations

import csv
import json

import pytest
from typer.testing import CliRunner

from magis.bench import corpus
from magis.bench.compare import BenchError
from magis.bench.corpus import CORPUS_CONSTRAINTS, FIGURE, CorpusOptions, run_corpus

MODELS = "gpt2,resnet"
FIELDS = {"memory_ratio", "latency_ratio", "satisfied", "states_explored", "seconds"}
BASELINE_FIELDS = {"baseline_method", "baseline_memory_ratio", "baseline_latency_ratio"}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    from magis.cli import app

    tmp = tmp_path_factory.mktemp("corpus")
    out, js = tmp / "out", tmp / "corpus.json"
    args = ["bench", "corpus", "--size", "tiny", "--models", MODELS, "--methods",
            "pytorch,checkpoint", "--max-states", "4", "--time-budget", "20",
            "--out", str(out), "--json", str(js)]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return res.output, out, json.loads(js.read_text())


def test_json_has_every_model_and_constraint_with_the_fields(cli_run):
    _, _, data = cli_run
    assert data["constraints"] == ["lat<=1.1", "mem<=0.4"] and not data["interrupted"]
    assert [m["model"] for m in data["models"]] == ["corpus:gpt2:tiny", "corpus:resnet:tiny"]
    for model in data["models"]:
        assert model["nodes"] > 100 and model["program_peak_bytes"] > 0
        rows = model["constraints"]
        assert [r["constraint"] for r in rows] == [c.label for c in CORPUS_CONSTRAINTS]
        for r in rows:
            assert set(r) >= FIELDS | BASELINE_FIELDS
            assert r["states_explored"] <= 4 + 1  # the budget (the root state counts too)
            # the search's speed and where its time went (issue #16, item 3)
            assert r["states_per_second"] == pytest.approx(r["states_explored"] / r["seconds"])
            assert set(r["breakdown"]) >= {"transform", "schedule", "simulate", "hash", "polish"}
            exploring = r["seconds"] - r["breakdown"]["polish"]
            assert r["exploring_states_per_second"] == pytest.approx(
                r["states_explored"] / exploring
            )
            assert all(v >= 0 for v in r["breakdown"].values())
            if r["satisfied"]:
                assert r["memory_ratio"] > 0 and r["latency_ratio"] > 0
        lat = rows[0]
        # under a latency limit the program order itself (pytorch, ratio 1.0) always fits
        assert lat["satisfied"] and lat["latency_ratio"] <= 1.1 + 1e-9
        assert lat["baseline_method"] in ("pytorch", "checkpoint")
        assert lat["baseline_memory_ratio"] <= 1.0 and lat["baseline_latency_ratio"] <= 1.1


def test_csv_table_and_figure_are_written(cli_run):
    output, out, data = cli_run
    with (out / "results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 4 and set(rows[0]) >= FIELDS | BASELINE_FIELDS
    assert (out / FIGURE).stat().st_size > 0
    table = (out / "table.md").read_text()
    assert "| corpus:gpt2:tiny |" in table and "best baseline lat<=1.1" in table
    # the table printed (its title: a narrow console wraps it, and its headers, at spaces)
    assert "memory ratio under lat<=1.1, latency overhead under mem<=0.4" in " ".join(
        output.split()
    )
    assert json.loads((out / "results.json").read_text()) == data


def test_ctrl_c_keeps_what_finished(tmp_path, monkeypatch):
    real = corpus.run_corpus_cell
    calls = []

    def interrupted_after_the_first(cell):
        calls.append(cell)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(cell)

    monkeypatch.setattr(corpus, "run_corpus_cell", interrupted_after_the_first)
    options = CorpusOptions(("opt",), "tiny", methods=("pytorch",), out=tmp_path)
    report = run_corpus(options)
    assert report.interrupted
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["interrupted"]
    rows = data["models"][0]["constraints"]  # the baselines' cell finished, MAGIS did not
    # program order fits the latency limit, never 40% of its own peak
    assert [r["baseline_method"] for r in rows] == ["pytorch", None]
    assert [r["baseline_satisfied"] for r in rows] == [True, False]
    assert all(r["memory_ratio"] is None for r in rows)
    assert len(calls) == 2  # nothing ran after Ctrl-C


def test_unknown_model_or_size_fails_before_any_work(tmp_path):
    with pytest.raises(BenchError, match="unknown corpus model 'nope'"):
        run_corpus(CorpusOptions(("nope",), out=tmp_path))
    with pytest.raises(BenchError, match="size"):
        run_corpus(CorpusOptions(("gpt2",), "small", out=tmp_path))
    assert not (tmp_path / "results.json").exists()


def test_adamw_bf16_step_with_the_resident_floor_beside_each_ratio(tmp_path):
    """`--step adamw-bf16` (issue 42): the floor (weights, AdamW state, inputs) is reported per
    model, and the part of each peak above it beside the memory ratio."""
    from magis.cli import app

    out, js = tmp_path / "out", tmp_path / "corpus.json"
    args = ["bench", "corpus", "--size", "tiny", "--models", "gpt2", "--methods", "pytorch",
            "--max-states", "3", "--step", "adamw-bf16", "--out", str(out), "--json", str(js)]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    data = json.loads(js.read_text())
    assert data["step"] == "adamw-bf16"
    (model,) = data["models"]
    floor = model["resident_bytes"] / model["program_peak_bytes"]
    assert 0 < floor < 1
    lat = model["constraints"][0]
    assert lat["resident_floor_ratio"] == pytest.approx(floor)
    above = (lat["memory_ratio"] - floor) / (1 - floor)
    assert lat["memory_above_floor_ratio"] == pytest.approx(above)
    table = (out / "table.md").read_text()
    assert "adamw-bf16 step" in table and f"| {floor:.3f} |" in table
    assert f"{lat['memory_ratio']:.3f} [{above:.3f}]" in table


def test_an_unknown_step_is_a_usage_error(tmp_path):
    from magis.cli import app

    args = ["bench", "corpus", "--size", "tiny", "--step", "adam", "--out", str(tmp_path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "adamw-bf16" in res.output


def test_the_exact_peer_is_shown_per_cell_with_its_proven_gap(tmp_path):
    """With `ilp` among the methods (issue 42), each cell shows the ILP's own point beside the
    best baseline, with the gap its solver proved; magis is at or below it where both meet
    the limit (the ILP is also a warm start of the search)."""
    from magis.cli import app

    out, js = tmp_path / "out", tmp_path / "corpus.json"
    args = ["bench", "corpus", "--size", "tiny", "--models", "resnet", "--methods", "pytorch,ilp",
            "--max-states", "4", "--out", str(out), "--json", str(js)]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    (model,) = json.loads(js.read_text())["models"]
    lat, mem = model["constraints"]
    assert lat["exact_memory_ratio"] is not None and 0 <= lat["exact_gap"] <= 1
    assert lat["memory_ratio"] <= lat["exact_memory_ratio"] + 1e-9
    if mem["exact_latency_ratio"] is not None and mem["satisfied"]:
        assert mem["latency_ratio"] <= mem["exact_latency_ratio"] + 1e-9
    table = (out / "table.md").read_text()
    assert "ilp lat<=1.1 (gap)" in table and f"(gap {lat['exact_gap']:.1%})" in table
