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

from magis.capture.collectives import ParallelError
from magis.plan import Plan


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
