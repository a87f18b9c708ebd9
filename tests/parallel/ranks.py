"""What the gloo tests' ranks and their drivers share: the loss, the process group, each
rank's batches, spawning ranks and reading what they wrote, and a plan another rank may hold."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

STEPS = 5


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def init_gloo(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def leave_group() -> None:
    """Every rank at its teardown before any destroys its group: a rank that tore gloo down while
    its peer was still in its own teardown aborted the peer now and then (SIGABRT, "terminate
    called without an active exception": 1 run in 6 to 8 of the plan-mismatch test)."""
    dist.barrier()
    dist.destroy_process_group()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step`: five rows of six float64 features, three classes."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (5,), generator=gen)


def error_line(call: Callable[[], object]) -> str:
    """`call()`'s MagisError as `Name: message`, or "no error"."""
    import magis

    try:
        call()
    except magis.MagisError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def spawn(fn, world: int, tmp: Path, *args) -> None:
    """`fn(rank, world, store, out, *args)` on `world` processes, writing into `tmp`."""
    mp.spawn(fn, args=(world, str(tmp / "store"), str(tmp), *args), nprocs=world)


def results(tmp: Path, world: int) -> list[dict]:
    """What each rank wrote to rank{r}.json."""
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def other_order(plan):
    """The same plan with its first two inputs swapped in the order: another valid plan."""
    from magis.plan import Plan

    order = list(plan.order)
    assert all(plan.graph.node(n).is_placeholder for n in order[:2])
    order[0], order[1] = order[1], order[0]
    return Plan(plan.graph, order, plan.summary)
