"""What each rank of the FSDP gloo tests runs (spawned by torch.multiprocessing: importable by
name).

Each rank trains a float64 model with magis.compile(parallel="fsdp") beside the same model
sharded by FSDP2 (`fully_shard` on each block, then on the model) with the same AdamW, on its
own batches, and writes what it saw (the largest differences of losses, full parameters and
full optimizer state, its plan's hash) to `out/rank{r}.json`.
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


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class Net(nn.Module):
    """Three blocks between an input and an output layer: four FSDP groups (the root's and one
    per block); widths 10 and 3 leave padding rows on 2 and on 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.blocks = nn.ModuleList([Block(10) for _ in range(3)])
        self.out = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _fsdp2(model: nn.Module, world: int) -> nn.Module:
    """`model` sharded by FSDP2 as magis groups it: each block, then the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[n] - b[n]).detach().abs().max()) for n in a)


def train_equal(
    rank: int,
    world: int,
    store: str,
    out: str,
    plan: str | None,
    clip: float | None = None,
    budget: float = 3.0,
) -> None:
    """Five AdamW steps of magis beside FSDP2 (both clipping the gradients' global norm to
    `clip`, if given); the differences go to out/rank{r}.json."""
    import magis
    from magis.capture.sharding import full_tensors
    from magis.train.distributed import plan_hash

    init_gloo(rank, world, store)
    torch.manual_seed(0)
    model = Net().double()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = _fsdp2(copy.deepcopy(model), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    limits = {"plan": plan} if plan else {"mem_limit": 0.6, "time_budget": budget}
    step = magis.compile(
        model,
        opt,
        batch(rank, 0),
        loss_fn=loss_fn,
        parallel="fsdp",
        process_group=dist.group.WORLD,
        hardware="a100",
        clip_grad_norm=clip,
        **limits,
    )
    losses, ref_losses, norms = [], [], []
    for i in range(STEPS):
        x, y = batch(rank, i)
        losses.append(float(step(x, y).detach()))
        ref_opt.zero_grad()
        loss = loss_fn(ref, x, y)
        loss.backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(ref.parameters(), clip).full_tensor()))
        ref_opt.step()
        ref_losses.append(float(loss.detach()))
    params = dict(model.named_parameters())
    ref_params = dict(ref.named_parameters())

    def state(key: str) -> tuple[dict, dict]:
        mine = {n: opt.state[p][key] for n, p in params.items()}
        theirs = {n: ref_opt.state[p][key].full_tensor() for n, p in ref_params.items()}
        return full_tensors(step.sharding, mine), theirs

    full = step.full_parameters()
    result = {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "params": _max_diff(full, {n: p.full_tensor() for n, p in ref_params.items()}),
        "exp_avg": _max_diff(*state("exp_avg")),
        "exp_avg_sq": _max_diff(*state("exp_avg_sq")),
        "steps": sorted({float(opt.state[p]["step"]) for p in params.values()}),
        "moved": _max_diff(full, initial),
        "local_shapes": {n: list(p.shape) for n, p in params.items()},
        "clipped": sum(n > clip for n in norms) if clip is not None else 0,
        "plan_hash": plan_hash(step.plan),
        "all_gathers": step.program.source.count("c10d.all_gather_into_tensor.default("),
        "reduce_scatters": step.program.source.count("c10d.reduce_scatter_tensor.default("),
    }
    if rank == 0 and plan is None:
        step.plan.save(Path(out) / "plan.json")
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    leave_group()


def compile_error(rank: int, world: int, store: str, out: str, plan: str) -> None:
    """magis.compile(parallel="fsdp") with `plan` (rank r loads plan{r}.json when there is
    one): the error's line, and whether the model's parameters are back in full after it."""
    import magis

    init_gloo(rank, world, store)
    torch.manual_seed(0)
    model = Net().double()
    shapes = [p.shape for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    mine = plan.replace(".json", f"{rank}.json")
    line = error_line(
        lambda: magis.compile(
            model,
            opt,
            batch(rank, 0),
            loss_fn=loss_fn,
            parallel="fsdp",
            process_group=dist.group.WORLD,
            plan=mine if os.path.exists(mine) else plan,
        )
    )
    restored = [p.shape for p in model.parameters()] == shapes
    Path(out, f"rank{rank}.txt").write_text(f"{restored}|{line}")
    leave_group()


def refusals(rank: int, world: int, store: str, out: str) -> None:
    """What magis.compile(parallel="fsdp") refuses, one line each, to out/refused.txt."""
    import magis

    init_gloo(rank, world, store)

    def attempt(model: nn.Module, opt) -> str:
        return error_line(
            lambda: magis.compile(
                model,
                opt,
                batch(rank, 0),
                loss_fn=loss_fn,
                parallel="fsdp",
                mem_limit=0.9,
                time_budget=1.0,
            )
        )

    model = Net().double()
    stepped = torch.optim.AdamW(model.parameters())
    loss_fn(model, *batch(rank, 0)).backward()
    stepped.step()
    lines = [attempt(model, stepped)]
    scaled = Net().double()
    scaled.scale = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    lines.append(attempt(scaled, torch.optim.AdamW(scaled.parameters())))
    Path(out, "refused.txt").write_text("\n".join(lines))
    leave_group()
