"""A step that reads tensor values in Python is captured for the values read, each one guarded
(`magis.capture.specialize`): it runs exactly as eager PyTorch does on those values, a plan of it
verifies, and a run that reads another value stops with a one-line error naming the line."""

import inspect
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from magis.backend import compile_program
from magis.backend.meta_check import check_graph
from magis.capture import capture, training_step
from magis.capture.source import display_path
from magis.commands.run import run_step
from magis.errors import PlanError, RandomDrawError, ValueGuardError
from magis.ir.guards import guard_nodes
from magis.ir.ops import EXPECT_OP
from magis.ir.serialize import content_digest, graph_from_json, graph_to_json


class ReadsValues(nn.Module):
    """The reads real models make: an assert on a value (XLM, I-BERT), a count taken into
    Python (Lumina 2), a boolean-mask index (X-MOD, BART's EOS rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x, mask):
        y = torch.tanh(self.lin(x))
        assert not y.isnan().any(), "NaN in the activations"
        count = int(mask.sum().item())
        picked = self.head(y[mask])
        return picked.sum() / count


class DrawsAndReads(nn.Module):
    """A layer skipped on a coin drawn each step, with no config field naming it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if torch.rand(()) < 0.5:
            x = self.lin(x)
        return x.sum()


def _line(text: str) -> str:
    lines, first = inspect.getsourcelines(ReadsValues)
    n = next(i for i, line in enumerate(lines) if text in line)
    return f"{display_path(Path(__file__).resolve())}:{first + n}"


def _batch(mask: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(len(mask), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return x, torch.tensor(mask)


MASK = [True, False, True, True, False, True]


@pytest.fixture(scope="module")
def step():
    torch.manual_seed(0)
    return training_step(ReadsValues().double(), _batch(MASK))


def test_each_read_is_a_guard_at_its_line(step):
    reads = {
        step.graph.node(g).args[3]: step.graph.node(g).args[1:3] for g in guard_nodes(step.graph)
    }
    assert reads == {
        _line("assert not y.isnan()"): ([], False),
        _line("count = int(mask.sum().item())"): ([], 4),
        _line("picked = self.head(y[mask])"): ([4, 4], None),
    }


def test_the_specialized_step_computes_what_eager_does(step):
    ran = run_step(step, "reads", "cpu", repeats=1)
    assert ran.verified and ran.max_rel_err == 0.0
    assert check_graph(step.graph).ok  # the mask index's shape is the guard's to check


def test_a_run_reading_another_value_stops_naming_the_line(step):
    program = compile_program(step.graph, step.graph.program_order())
    inputs = step.program_inputs(step.make_inputs())
    mask_at = step.input_names.index("input1")
    inputs[mask_at] = torch.tensor([True, True, True, False, False, False])
    with pytest.raises(ValueGuardError) as caught:
        program(*inputs)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(_line("count = int(mask.sum().item())"))
    assert "read the value 3 where it was captured with 4" in message


def test_a_plan_of_it_verifies(step):
    from magis.commands.optimize import find_plan, setup_search
    from magis.search import SearchOptions

    setup = setup_search(step, mem_limit=0.7, hardware="rtx3090")
    plan = find_plan(setup, SearchOptions(time_budget=5, max_states=60))
    assert len(guard_nodes(plan.graph)) == 3
    ran = run_step(step, "reads", setup.cost, repeats=1, graph=plan.graph, order=plan.order)
    assert ran.verified


def test_guards_survive_a_plan_file_and_a_hostile_site_is_refused(step):
    data = graph_to_json(step.graph)
    again = graph_from_json(json.loads(json.dumps(data)))
    assert [again.node(g).args[1:] for g in guard_nodes(again)] == [
        step.graph.node(g).args[1:] for g in guard_nodes(step.graph)
    ]
    guard = next(n for n in data["nodes"] if n["op"] == EXPECT_OP)
    guard["args"][3] = "x.py:1'); import os; ('"
    data["digest"] = content_digest(data)  # as a hostile file would
    with pytest.raises(PlanError, match="magis.expect takes"):
        graph_from_json(data)


def test_a_read_of_a_random_draw_is_refused_and_the_generator_left_alone():
    torch.manual_seed(3)
    model, x = DrawsAndReads(), torch.randn(2, 4)
    before = torch.random.get_rng_state()
    with pytest.raises(RandomDrawError) as caught:
        training_step(model, x)
    message = str(caught.value)
    assert "\n" not in message and "depends on a random draw" in message
    assert "test_specialize.py" in message
    assert torch.equal(torch.random.get_rng_state(), before)


def test_a_function_capture_specializes_too():
    def step_fn(x):
        return x * 2 if x.sum() > 0 else x * 3

    x = torch.ones(3)
    step = capture(step_fn, x)
    assert len(guard_nodes(step.graph)) == 1
    program = compile_program(step.graph, step.graph.program_order())
    assert torch.equal(program(x)[0], x * 2)
    with pytest.raises(ValueGuardError):
        program(-x)


MODEL_FILE = """
import torch
from torch import nn


class Picks(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, keep):
        return self.lin(x)[keep].sum()


def factory():
    keep = torch.zeros(16, dtype=torch.bool)
    keep[::3] = True
    return Picks(), (torch.randn(16, 8), keep)
"""


def test_a_model_file_that_reads_values_is_built_for_real_and_specialized(tmp_path):
    """A model file is built on fake tensors; a step that reads a value is built again for real
    (it fits) and captured for the value read."""
    from magis.capture.user_model import model_file_step

    path = tmp_path / "picks.py"
    path.write_text(MODEL_FILE)
    _, step = model_file_step(f"{path}:factory")
    guards = [step.graph.node(g).args for g in guard_nodes(step.graph)]
    assert [g[1] for g in guards] == [[6, 8]] and guards[0][3].endswith("picks.py:12")
    assert run_step(step, "picks", "cpu", repeats=1).verified
