"""`magis bench train --compiler inductor`'s parts that decide its figures: the bisection of
torch.compile's activation_memory_budget to magis's measured peak, and the allocator's peak
that every variant is measured by (issue 43)."""

from __future__ import annotations

import torch
from torch import nn

from magis.backend.memory import LiveBytesTracker, allocated_peak_bytes, storage_bytes
from magis.bench.train_compiled import BISECTION_STEPS, _chosen, _tune_budget, training_setup


def test_bisection_finds_the_largest_budget_within_the_target():
    def peak(budget: float) -> int:  # monotone: 100 bytes at budget 0, 200 at budget 1
        return int(100 + 100 * budget)

    tried = _tune_budget(peak, 160, lambda _: None)
    budget, found = _chosen(tried, 160)
    assert len(tried) == 2 + BISECTION_STEPS
    assert found <= 160 and found == peak(budget)
    assert 0.6 - 1 / 2**BISECTION_STEPS <= budget <= 0.6


def test_bisection_reports_an_unreachable_target_and_a_reachable_default():
    unreachable = _tune_budget(lambda b: 500, 160, lambda _: None)
    assert sorted(unreachable) == [0.0, 1.0]
    assert _chosen(unreachable, 160)[1] > 160  # the row says it cannot reach the peak
    easy = _tune_budget(lambda b: 100, 160, lambda _: None)
    assert list(easy) == [1.0] and _chosen(easy, 160) == (1.0, 100)


def test_the_allocator_peak_agrees_with_the_tracker_on_eager_code():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    x = torch.randn(128, 64)
    resident = [*model.parameters(), x]

    def step() -> None:
        model(x).sum().backward()
        for p in model.parameters():
            p.grad = None

    step()  # the first backward sets up autograd's engine
    tracker = LiveBytesTracker(resident)
    with tracker:
        step()
    allocated = allocated_peak_bytes(step)
    assert allocated > 128 * 256 * 4  # at least the hidden activation
    # The allocator also sees what kernels allocate for themselves (a few KiB here), never less
    # than the tensors the dispatcher hands out.
    total = storage_bytes(resident) + allocated
    assert tracker.peak_bytes <= total <= 1.01 * tracker.peak_bytes, (total, tracker.peak_bytes)


def test_a_model_file_is_set_up_as_the_user_built_it(tmp_path):
    """`magis bench train --compiler inductor path/to/model.py:factory`: the user's model,
    batch and loss, built for real."""
    path = tmp_path / "model.py"
    path.write_text(
        "import torch\n"
        "import torch.nn.functional as F\n\n\n"
        "def factory():\n"
        "    model = torch.nn.Linear(6, 3)\n"
        "    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))\n"
        "    return model, (x, y), lambda m, x, y: F.cross_entropy(m(x), y)\n"
    )
    setup = training_setup(f"{path}:factory", "sgd")
    assert isinstance(setup.model, nn.Linear) and setup.model.weight.device.type == "cpu"
    x, y = setup.batch
    assert x.shape == (4, 6) and y.dtype == torch.int64
    expected = torch.nn.functional.cross_entropy(setup.model(x), y)
    assert torch.equal(setup.loss_fn(setup.model, *setup.batch), expected)
    assert isinstance(setup.make_opt(setup.model.parameters()), torch.optim.SGD)
