"""Eager reference loops and comparisons for the magis.compile tests."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch

from magis.backend.executor import relative_error

TOL = 1e-9
LOSS_TOL_FLOAT32 = 1e-6


@contextlib.contextmanager
def one_thread():
    """Tiny steps are a few milliseconds on one thread; on a shared two-core machine a second
    intra-op thread that is descheduled turns each matmul's barrier into a wait (seconds)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fresh_batch(example: tuple, gen: torch.Generator) -> tuple:
    """A new batch shaped like `example`: floats N(0, 1), integers below the example's max + 1."""
    out = []
    for x in example:
        if x.is_floating_point():
            out.append(torch.randn(x.shape, generator=gen, dtype=x.dtype))
        else:
            high = int(x.max()) + 1
            out.append(torch.randint(0, high, x.shape, generator=gen, dtype=x.dtype))
    return tuple(out)


def eager_step(model, optimizer, loss_fn, batch, clip: float | None) -> torch.Tensor:
    """One step as a PyTorch training loop writes it."""
    optimizer.zero_grad()
    loss = loss_fn(model, *batch)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.detach()


# Errors are relative to the tensor's own scale, but never to a scale below this: a parameter
# whose true gradient is zero (an attention key's bias: softmax ignores a shift of every key)
# moves only by rounding noise (AdamW turns a 1e-17 gradient into a 1e-12 step through its eps),
# so it stays far below 1e-4, where any reordering of floating-point sums shows as a large
# relative error of nothing. Below this floor the check is absolute: 1e-9 * 1e-4 = 1e-13 in
# float64, a thousand times the rounding of a parameter of scale one.
SCALE_FLOOR = 1e-4


def _error(a, b) -> float:
    err = relative_error(a, b)  # also: shapes, NaN, integers
    if err in (0.0, float("inf")) or not b.is_floating_point():
        return err
    diff = float((a.double() - b.double()).abs().max())
    return diff / max(float(b.double().abs().max()), SCALE_FLOOR)


def worst_difference(model_a, opt_a, model_b, opt_b) -> tuple[float, str]:
    """The largest relative error over parameters, buffers and optimizer state, and where."""
    worst, where = 0.0, ""
    pairs = [
        (f"model.{k}", a, b)
        for (k, a), b in zip(
            model_a.state_dict().items(), model_b.state_dict().values(), strict=True
        )
    ]
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for i in sb["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys(), i
        pairs += [(f"state[{i}].{k}", sa["state"][i][k], v) for k, v in sb["state"][i].items()]
    for name, a, b in pairs:
        err = _error(a, b)
        if err > worst or not where:
            worst, where = err, name
    return worst, where


def train_both(
    model,
    make_opt: Callable,
    loss_fn,
    example: tuple,
    compile_step: Callable,
    steps: int = 20,
    clip: float | None = 1.0,
    make_sched: Callable | None = None,
    seed: int = 1,
):
    """Train a copy of `model` eagerly and `model` through `compile_step(model, opt)` on the
    same batches; returns (worst loss error, worst state error and where, compiled step). The
    loss error is in units of TOL: a float32 loss is held to LOSS_TOL_FLOAT32."""
    eager = copy.deepcopy(model)
    opt, eopt = make_opt(model), make_opt(eager)
    scheds = [make_sched(o) for o in (opt, eopt)] if make_sched else []
    step = compile_step(model, opt)
    gen = torch.Generator().manual_seed(seed)
    loss_err = 0.0
    for _ in range(steps):
        batch = fresh_batch(example, gen)
        loss = step(*batch)
        ref = eager_step(eager, eopt, loss_fn, batch, clip)
        for s in scheds:
            s.step()
        # A Hugging Face LM head upcasts the logits to float32 for its loss: that loss is a
        # float32 value even in a float64 model, and a rewrite of it rounds as float32 does.
        scale = 1.0 if ref.dtype == torch.float64 else LOSS_TOL_FLOAT32 / TOL
        loss_err = max(loss_err, relative_error(loss, ref) / scale)
    return loss_err, worst_difference(model, opt, eager, eopt), step


# The Inductor tests' search and optimizer (test_inductor.py, test_torch_backend.py): ended by
# states, not seconds, so the plan (and its fixed points) is the same on a loaded machine.
STATE_SEARCH = {"time_budget": 120.0, "max_states": 20, "hardware": "rtx3090"}
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


def mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A five-layer MLP classifier and a batch of 64."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )
    gen = torch.Generator().manual_seed(0)
    return model, (torch.randn(64, 16, generator=gen), torch.randint(0, 4, (64,), generator=gen))


def mlp_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def train_adamw(model, batch: tuple, loss_fn, make: Callable):
    """`train_both` over five steps of AdamW (`ADAMW`), without clipping."""
    return train_both(
        model,
        lambda m: torch.optim.AdamW(m.parameters(), **ADAMW),
        loss_fn,
        batch,
        make,
        steps=5,
        clip=None,
    )
