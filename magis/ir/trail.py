"""The decision trail a plan keeps: one `Decision` per move that made the best M-State.

Alg. 3 (MAGIS §6.2) keeps only the best state; a user asks why it is what it is (`magis
explain`). A plan file holds its best state's trail, so the records and their JSON are part of
the plan-file schema and live here, below everything that makes or reads them: loading a plan
needs this module, not the search. The search makes the records from its rewrites, F-Tree moves
and simulations (`magis.search.decisions`).

Names, not node ids, are recorded: ids mean nothing once the graph they index is gone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from magis.errors import PlanError


class DecisionKind(enum.Enum):
    """What a move did, in the words `magis explain` shows."""

    REORDER = "re-order"
    WARM_START = "warm-start"
    FISSION = "fission"
    TASO = "taso-rewrite"
    RECOMPUTE = "recompute"
    UNDO_RECOMPUTE = "undo-recompute"
    SWAP = "swap"
    UNDO_SWAP = "undo-swap"
    COMPACTION = "compaction"
    UNDO_COMPACTION = "undo-compaction"


@dataclass(frozen=True)
class Figures:
    """A schedule's simulated figures as a decision records them; bytes and seconds."""

    peak_bytes: int
    latency_s: float
    compute_s: float  # busy time of the compute stream
    copy_s: float  # busy time of the copy stream (Store/Load)

    def to_json(self) -> list:
        return [self.peak_bytes, self.latency_s, self.compute_s, self.copy_s]

    @staticmethod
    def from_json(value: Any, where: str) -> Figures:
        if not isinstance(value, list) or len(value) != 4:
            raise PlanError(f"{where}: expected [peak bytes, latency, compute, copy]")
        peak, *times = value
        if type(peak) is not int or not all(_is_number(t) for t in times):
            raise PlanError(f"{where}: expected an integer and three numbers")
        return Figures(peak, *(float(t) for t in times))


@dataclass(frozen=True)
class Split:
    """An F-Tree node whose fission number a move changed (MAGIS §4-5: split by n along dim)."""

    tree_node: int
    dim: str  # the D-Graph component's first vertex, e.g. "input0[0]"
    size: int  # operators in the F-Trans
    n_before: int
    n_after: int  # 1: disabled

    def to_json(self) -> list:
        return [self.tree_node, self.dim, self.size, self.n_before, self.n_after]

    @staticmethod
    def from_json(value: Any, where: str) -> Split:
        if (
            not isinstance(value, list)
            or len(value) != 5
            or type(value[1]) is not str
            or not all(type(v) is int for v in (value[0], *value[2:]))
        ):
            raise PlanError(f"{where}: expected [tree node, dim, size, n before, n after]")
        return Split(*value)


@dataclass(frozen=True)
class Decision:
    """One move of the search: what it did, to which nodes, and its effect on the figures."""

    rule: str  # the rule's name ("remat", "fission:enable", "reschedule", a baseline's name)
    kind: DecisionKind
    description: str  # the rewrite's own words ("swap addmm_3 out until mm_40")
    created: tuple[str, ...]  # nodes the move created, by name
    removed: tuple[str, ...]  # nodes it removed, by name
    modules: tuple[str, ...]  # model module paths of those nodes, where capture knew them
    splits: tuple[Split, ...]  # fission only
    before: Figures  # the parent state's
    after: Figures  # the child state's

    @property
    def bytes_saved(self) -> int:
        return self.before.peak_bytes - self.after.peak_bytes

    @property
    def time_added(self) -> float:
        return self.after.latency_s - self.before.latency_s

    @property
    def compute_added(self) -> float:
        return self.after.compute_s - self.before.compute_s

    @property
    def copy_added(self) -> float:
        return self.after.copy_s - self.before.copy_s

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "kind": self.kind.value,
            "description": self.description,
            "created": list(self.created),
            "removed": list(self.removed),
            "modules": list(self.modules),
            "splits": [s.to_json() for s in self.splits],
            "before": self.before.to_json(),
            "after": self.after.to_json(),
        }

    @staticmethod
    def from_json(value: Any, where: str = "decision") -> Decision:
        """A decision from a plan file; a PlanError names the field that is wrong."""
        if not isinstance(value, dict) or set(value) != _JSON_KEYS:
            raise PlanError(f"{where}: expected an object with fields {sorted(_JSON_KEYS)}")
        for key in ("rule", "description"):
            if type(value[key]) is not str:
                raise PlanError(f"{where}.{key}: expected a string")
        kinds = {k.value: k for k in DecisionKind}
        if not isinstance(value["kind"], str) or value["kind"] not in kinds:
            raise PlanError(f"{where}.kind: unknown kind {value['kind']!r:.40}")
        return Decision(
            value["rule"],
            kinds[value["kind"]],
            value["description"],
            _strings(value["created"], f"{where}.created"),
            _strings(value["removed"], f"{where}.removed"),
            _strings(value["modules"], f"{where}.modules"),
            tuple(
                Split.from_json(s, f"{where}.splits[{i}]")
                for i, s in enumerate(_list(value["splits"], f"{where}.splits"))
            ),
            Figures.from_json(value["before"], f"{where}.before"),
            Figures.from_json(value["after"], f"{where}.after"),
        )


_JSON_KEYS = frozenset(
    {"rule", "kind", "description", "created", "removed", "modules", "splits", "before", "after"}
)


def decisions_from_json(value: Any, where: str = "decisions") -> tuple[Decision, ...]:
    """A plan file's trail; a PlanError names the entry that is wrong."""
    return tuple(Decision.from_json(d, f"{where}[{i}]") for i, d in enumerate(_list(value, where)))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise PlanError(f"{where}: expected a list")
    return value


def _strings(value: Any, where: str) -> tuple[str, ...]:
    items = _list(value, where)
    if not all(type(s) is str for s in items):
        raise PlanError(f"{where}: expected a list of strings")
    return tuple(items)
