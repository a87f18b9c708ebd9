"""Why a plan is what it is: the search's decisions, one row each (issue #17).

A plan (format 3) keeps its best state's decision trail from the program order
(`magis.ir.trail`, made by `magis.search.decisions`): the DP re-order that made the search's initial state (MAGIS §6.1),
a warm start when the search began from a baseline's program, every rule the search applied
along the way (Alg. 3, §5), and the final re-ordering. Each row starts where the previous one
ended, so the bytes the rows took off the peak add up to the program order's peak minus the
plan's, exactly; a row that added memory (a TASO rewrite bought for latency) counts negative.

When the plan does not meet its limit, the explanation also names the tensors live at the
plan's peak (what any further saving has to remove) and the least peak any state of the search
reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from magis.cost import get_cost_model
from magis.errors import MagisError
from magis.ir import Graph
from magis.ir.trail import Decision
from magis.sim import simulate

PREDATES_DECISIONS = (
    "this plan predates decision records (plan format 2): re-run magis optimize to see its rows"
)
BOTTLENECK_TENSORS = 10
SORTS = ("program", "bytes", "time")  # as applied, most bytes saved first, most time first


@dataclass(frozen=True)
class Row:
    """One decision of the plan, in the words and figures a person reads."""

    step: int  # 1-based, in the order the search applied the decisions
    decision: Decision

    @property
    def bytes_saved(self) -> int:
        return self.decision.bytes_saved

    @property
    def time_added(self) -> float:
        return self.decision.time_added

    @property
    def tensors(self) -> tuple[str, ...]:
        """The nodes the decision removed, then those it created."""
        return (*self.decision.removed, *self.decision.created)

    def to_json(self) -> dict[str, Any]:
        d = self.decision
        return {
            "step": self.step,
            "rule": d.rule,
            "kind": d.kind.value,
            "description": d.description,
            "created": list(d.created),
            "removed": list(d.removed),
            "modules": list(d.modules),
            "splits": [
                {"tree_node": s.tree_node, "dim": s.dim, "size": s.size, "n": s.n_after}
                for s in d.splits
            ],
            "bytes_saved": d.bytes_saved,
            "time_added_s": d.time_added,
            "compute_added_s": d.compute_added,
            "copy_added_s": d.copy_added,
            "peak_before_bytes": d.before.peak_bytes,
            "peak_after_bytes": d.after.peak_bytes,
            "latency_before_s": d.before.latency_s,
            "latency_after_s": d.after.latency_s,
        }


@dataclass(frozen=True)
class Bottleneck:
    """A tensor live at the plan's peak."""

    name: str  # the node that allocated it
    op: str
    nbytes: int
    shape: tuple[int, ...]
    category: str
    module: str  # the model's module path, where capture knew it

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "bytes": self.nbytes,
            "shape": list(self.shape),
            "category": self.category,
            "module": self.module,
        }


@dataclass(frozen=True)
class Explanation:
    """A plan's decisions (`rows`, in the order applied) with their totals; `by_bytes()` and
    `by_time()` are the sorted views. Bytes in bytes, times in seconds."""

    workload: str | None
    hardware: str
    mode: str
    limit_ratio: float
    satisfied: bool
    rows: tuple[Row, ...]
    program_order_peak_bytes: int
    peak_bytes: int
    program_order_latency_s: float
    latency_s: float
    least_peak_found_bytes: int  # the least peak of any best state the search recorded
    bottleneck: tuple[Bottleneck, ...]  # only when the limit is not met
    note: str | None  # why there are no rows

    @property
    def peak_reduction_bytes(self) -> int:
        return self.program_order_peak_bytes - self.peak_bytes

    @property
    def bytes_saved(self) -> int:
        """The rows' savings summed: the peak reduction, when the plan has its trail."""
        return sum(r.bytes_saved for r in self.rows)

    @property
    def time_added(self) -> float:
        return sum(r.time_added for r in self.rows)

    def by_bytes(self) -> tuple[Row, ...]:
        """The rows that saved most first (ties in the order applied)."""
        return tuple(sorted(self.rows, key=lambda r: (-r.bytes_saved, r.step)))

    def by_time(self) -> tuple[Row, ...]:
        """The rows that cost most time first (ties in the order applied)."""
        return tuple(sorted(self.rows, key=lambda r: (-r.time_added, r.step)))

    def sorted_rows(self, sort: str) -> tuple[Row, ...]:
        """The rows in `sort` order, one of `SORTS`."""
        views = {"program": lambda: self.rows, "bytes": self.by_bytes, "time": self.by_time}
        if sort not in views:
            raise MagisError(f"unknown sort {sort!r}: use {', '.join(SORTS)}")
        return views[sort]()

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "hardware": self.hardware,
            "mode": self.mode,
            "limit_ratio": self.limit_ratio,
            "satisfied": self.satisfied,
            "program_order_peak_bytes": self.program_order_peak_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_reduction_bytes": self.peak_reduction_bytes,
            "bytes_saved": self.bytes_saved,
            "program_order_latency_s": self.program_order_latency_s,
            "latency_s": self.latency_s,
            "time_added_s": self.time_added,
            "least_peak_found_bytes": self.least_peak_found_bytes,
            "note": self.note,
            "rows": [r.to_json() for r in self.rows],
            "bottleneck": [b.to_json() for b in self.bottleneck],
        }


class PlanLike(Protocol):
    """What explain reads of a `magis.plan.Plan` (the plan layer sits above this one, so that
    `Plan.explain()` can call down to it)."""

    graph: Graph
    order: list[int]
    summary: Any  # PlanSummary


def explain(plan: PlanLike) -> Explanation:
    """The explanation of `plan`: its rows from the trail its summary keeps, and, when its
    limit is not met, the tensors live at its peak."""
    s = plan.summary
    rows = tuple(Row(i + 1, d) for i, d in enumerate(s.decisions))
    return Explanation(
        workload=s.workload,
        hardware=s.hardware,
        mode=s.mode,
        limit_ratio=s.limit_ratio,
        satisfied=s.satisfied,
        rows=rows,
        program_order_peak_bytes=s.program_order_peak_bytes,
        peak_bytes=s.peak_bytes,
        program_order_latency_s=s.program_order_latency_s,
        latency_s=s.latency_s,
        least_peak_found_bytes=min((m for _, m, _ in s.improvements), default=s.peak_bytes),
        bottleneck=() if s.satisfied else bottleneck(plan.graph, plan.order),
        note=None if rows else PREDATES_DECISIONS,
    )


def bottleneck(graph: Graph, order: list[int], k: int = BOTTLENECK_TENSORS) -> tuple:
    """The `k` largest tensors live at the peak of `graph` run in `order` (MAGIS §2.1's memory
    hot-spots). Memory does not depend on the cost model: the unit model times the nodes."""
    sim = simulate(graph, order, get_cost_model("unit"), detail=True)
    return tuple(
        Bottleneck(
            h.name,
            h.op,
            h.nbytes,
            tuple(h.shape),
            h.category.value if h.category is not None else "",
            graph.node(h.storage.node).module,
        )
        for h in sim.top_hotspots(k)
    )
