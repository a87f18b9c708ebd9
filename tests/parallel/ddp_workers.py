"""What each rank of the gloo tests runs (spawned by torch.multiprocessing: importable by name).

Each rank trains a float64 model with magis.compile(parallel="ddp") beside the same model in
eager DistributedDataParallel with the same AdamW, on its own batches, and writes what it saw
(losses, the largest differences, its plan's hash) to `out/rank{r}.json`.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import STEPS, batch, error_line, init_gloo, leave_group, loss_fn
from torch import nn

BUCKET_BYTES = 512  # several buckets in a tiny model: the packing and splitting are exercised


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.b = nn.Linear(12, 12)
        self.c = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def train_equal(rank: int, world: int, store: str, out: str, plan: str | None) -> None:
    """Five AdamW steps of magis beside eager DDP; the differences go to out/rank{r}.json."""
    init_gloo(rank, world, store)
    result, step = compare_with_ddp(plan)
    if rank == 0 and plan is None:
        step.plan.save(Path(out) / "plan.json")
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    leave_group()


def compare_with_ddp(plan: str | None = None) -> tuple[dict, object]:
    """In an initialized process group: five AdamW steps of magis beside eager DDP on this
    rank's batches; the largest differences, the plan's hash, and the compiled step."""
    import magis
    from magis.train.distributed import plan_hash

    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net().double()
    ref = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=0.05, weight_decay=0.1)
    limits = {"plan": plan} if plan else {"mem_limit": 0.9, "time_budget": 3.0}
    step = magis.compile(
        model,
        opt,
        batch(rank, 0),
        loss_fn=loss_fn,
        parallel="ddp",
        process_group=dist.group.WORLD,
        bucket_bytes=BUCKET_BYTES,
        hardware="a100",
        **limits,
    )
    losses, ref_losses = [], []
    for i in range(STEPS):
        x, y = batch(rank, i)
        losses.append(float(step(x, y).detach()))
        ref_opt.zero_grad()
        loss = loss_fn(ddp, x, y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(float(loss.detach()))
    states = [opt.state[p] for p in model.parameters()]
    ref_states = [ref_opt.state[p] for p in ddp.module.parameters()]
    result = {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "params": _max_diff(list(model.parameters()), list(ddp.module.parameters())),
        "exp_avg": _max_diff([s["exp_avg"] for s in states], [s["exp_avg"] for s in ref_states]),
        "exp_avg_sq": _max_diff(
            [s["exp_avg_sq"] for s in states], [s["exp_avg_sq"] for s in ref_states]
        ),
        "steps": sorted({float(s["step"]) for s in states + ref_states}),
        "moved": _max_diff(list(model.parameters()), list(Net().double().parameters())),
        "plan_hash": plan_hash(step.plan),
        "collectives": sum("c10d.all_reduce" in line for line in step.program.source.splitlines()),
    }
    return result, step


def compile_error(rank: int, world: int, store: str, out: str, plan: str) -> None:
    """magis.compile with `plan` on this rank (rank 1 may get another file): the error's line."""
    import magis

    init_gloo(rank, world, store)
    torch.manual_seed(0)
    model = Net().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    mine = (
        plan.replace(".json", f"{rank}.json")
        if os.path.exists(plan.replace(".json", f"{rank}.json"))
        else plan
    )
    line = error_line(
        lambda: magis.compile(
            model,
            opt,
            batch(rank, 0),
            loss_fn=loss_fn,
            parallel="ddp",
            process_group=dist.group.WORLD,
            bucket_bytes=BUCKET_BYTES,
            plan=mine,
        )
    )
    Path(out, f"rank{rank}.txt").write_text(line)
    leave_group()
