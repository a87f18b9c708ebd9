"""One plan for every rank of a data-parallel job (issue 44).

Ranks that run different plans issue their collectives in different orders or sizes, and a
collective that waits for a peer that never comes hangs the job (NCCL has no error for it). So
rank 0 alone searches (or loads) the plan and broadcasts it, as torchtitan's GraphTrainer does
with its solver's plan, and before the first step every rank compares the plan's hash with rank
0's: a rank that holds another plan (a `plan=` file that differs on one host) stops with a
one-line `PlanMismatchError` instead of hanging.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import torch.distributed as dist

from magis.capture.collectives import DataParallel, ParallelError
from magis.capture.sharding import ShardLayout, shard_parameters
from magis.plan import Plan

PARALLEL = ("ddp", "fsdp")


class PlanMismatchError(ParallelError):
    """The ranks of one job hold different plans."""


def plan_hash(plan: Plan) -> str:
    """SHA-256 of the plan's graph and order in their JSON form (the summary's clocks, which
    differ from search to search, are left out: two ranks running one program agree)."""
    data = plan.to_json()
    data.pop("summary", None)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def shared_plan(find: Callable[[], Plan], group) -> Plan:
    """Rank 0's plan (`find()` runs there only), on every rank of `group`."""
    src = dist.get_global_rank(group, 0)
    payload = [find().to_json() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(payload, src=src, group=group)
    return Plan.from_json(payload[0])


def check_same_plan(plan: Plan, group) -> str:
    """Every rank of `group` holds `plan` (its hash equals rank 0's); return the hash."""
    mine = plan_hash(plan)
    hashes: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hashes, mine, group=group)
    others = [r for r, h in enumerate(hashes) if h != hashes[0]]
    if others:  # every rank sees the same list, so every rank stops: none waits for the others
        raise PlanMismatchError(
            f"rank(s) {', '.join(map(str, others))} hold another plan than rank 0 "
            f"({str(hashes[others[0]])[:12]} vs {str(hashes[0])[:12]}): give every rank the same "
            "plan file, or let rank 0 search (no plan=)"
        )
    return mine


def parallel_of(parallel: str | None, process_group, bucket_bytes: int) -> DataParallel | None:
    """The ranks `magis.compile(parallel=, process_group=)` averages over, or None."""
    if parallel is None:
        if process_group is not None:
            raise ParallelError(
                "process_group= is for parallel='ddp' or 'fsdp': give both or neither"
            )
        return None
    if parallel not in PARALLEL:
        raise ParallelError(f"unknown parallel={parallel!r}; choose one of {', '.join(PARALLEL)}")
    group = process_group if process_group is not None else world_group()
    return DataParallel.of(group, bucket_bytes)


def world_group():
    """The default process group, or a one-line error when none is initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ParallelError(
            "parallel='ddp' or 'fsdp' needs torch.distributed initialized (init_process_group, "
            "as torchrun scripts do) or a process_group="
        )
    return dist.group.WORLD


def shard_model(
    model, optimizer, ranks: DataParallel, group, parallel: str
) -> tuple[ShardLayout | None, dict]:
    """For FSDP, the model's parameters replaced by this rank's pieces (`magis.capture.sharding`):
    the layout, and the full data to put back should compiling fail. For DDP, nothing."""
    if parallel != "fsdp":
        return None, {}
    if any(optimizer.state.values()):
        raise ParallelError(
            "the optimizer already has state and parallel='fsdp' shards the parameters it "
            "belongs to: call magis.compile before the optimizer's first step"
        )
    layout = ShardLayout.of(model, ranks)
    return layout, shard_parameters(model, layout, dist.get_rank(group))
