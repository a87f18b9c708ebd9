"""The decision trail of an M-State: one `Decision` per move that made it from its parent.

Alg. 3 (MAGIS §6.2) keeps only the best state; a user asks why it is what it is. Every child the
search makes records what the move did (the rule, its kind, the nodes it created and removed,
for fission the F-Tree nodes whose n changed), and the simulated figures of its parent and of
itself. Along one state's trail each decision's `before` is the previous one's `after`, so the
bytes each took off the peak add up exactly to the trail's whole reduction (`magis explain`).

Names, not node ids, are recorded: ids mean nothing once the graph they index is gone, and a
plan file keeps the trail of its best state.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from magis.errors import PlanError
from magis.ir.ops import LOAD_OP, STORE_OP

if TYPE_CHECKING:
    from magis.analyze.ftree import FTree
    from magis.ir import Graph
    from magis.rules import Rewrite
    from magis.sim import SimResult


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


COPY_OPS = (STORE_OP, LOAD_OP)

# RuleKind.value -> DecisionKind (rules/base.py names the rule kinds; search sits above rules).
_RULE_KINDS = {
    "taso": DecisionKind.TASO,
    "remat": DecisionKind.RECOMPUTE,
    "deremat": DecisionKind.UNDO_RECOMPUTE,
    "swap": DecisionKind.SWAP,
    "deswap": DecisionKind.UNDO_SWAP,
    "compact": DecisionKind.COMPACTION,
    "decompact": DecisionKind.UNDO_COMPACTION,
}


@dataclass(frozen=True)
class Figures:
    """A schedule's simulated figures as a decision records them; bytes and seconds."""

    peak_bytes: int
    latency_s: float
    compute_s: float  # busy time of the compute stream
    copy_s: float  # busy time of the copy stream (Store/Load)

    @staticmethod
    def of(sim: SimResult) -> Figures:
        return Figures(int(sim.peak_bytes), float(sim.latency_s), sim.compute_s, sim.copy_s)

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

    # --- how the search makes them ---------------------------------------------------------

    @staticmethod
    def of_rewrite(
        rewrite: Rewrite,
        parent: Graph,
        parent_sim: SimResult,
        child: Graph,
        added: Iterable[int],
        removed: Iterable[int],
        child_sim: SimResult,
    ) -> Decision:
        """A graph rewrite's decision: `added` are ids of `child`, `removed` ids of `parent`."""
        created, gone = _nodes(child, added), _nodes(parent, removed)
        return Decision(
            rewrite.rule,
            _kind_of_rewrite(rewrite.kind.value, created, gone),
            rewrite.description,
            tuple(n.name for n in created),
            tuple(n.name for n in gone),
            tuple(dict.fromkeys(_modules(child, created) + _modules(parent, gone))),
            (),
            Figures.of(parent_sim),
            Figures.of(child_sim),
        )

    @staticmethod
    def of_fission(
        rule: str,
        parent: Graph,
        parent_sim: SimResult,
        old_tree: FTree,
        new_tree: FTree,
        child: Graph,
        touched: Iterable[int],
        removed: Iterable[int],
        child_sim: SimResult,
    ) -> Decision:
        """An F-Tree mutation's decision: the tree nodes whose n changed, the nodes the
        materialization made that the parent did not have, and the parent's it dropped."""
        created = _nodes(child, (v for v in touched if v not in parent))
        gone = _nodes(parent, (v for v in removed if v in parent))
        splits = tuple(
            Split(i, b.dim, b.size, a.n, b.n)
            for i, (a, b) in enumerate(zip(old_tree.nodes, new_tree.nodes, strict=False))
            if a.n != b.n
        )
        text = ", ".join(
            f"split {s.size} ops along {s.dim} in {s.n_after}"
            if s.n_after > 1
            else f"unsplit F-Tree node {s.tree_node}"
            for s in splits
        )
        return Decision(
            rule,
            DecisionKind.FISSION,
            text or rule,
            tuple(n.name for n in created),
            tuple(n.name for n in gone),
            tuple(dict.fromkeys(_modules(child, created) + _modules(parent, gone))),
            splits,
            Figures.of(parent_sim),
            Figures.of(child_sim),
        )

    @staticmethod
    def reorder(rule: str, before: SimResult | Figures, after: SimResult | Figures) -> Decision:
        """A new schedule of the same graph: the DP scheduler's order of the program (the
        search's initial state, MAGIS §6.1) or the final re-ordering of the best state."""
        return Decision(
            rule,
            DecisionKind.REORDER,
            _REORDERS.get(rule, "the same graph in a new order"),
            (),
            (),
            (),
            (),
            _figures(before),
            _figures(after),
        )

    @staticmethod
    def warm_start(
        baseline: str,
        before: SimResult | Figures,
        after: SimResult | Figures,
        initial: Graph | None = None,
        warm: Graph | None = None,
    ) -> Decision:
        """Another method's program taken as a starting state: `before` is the search's own
        initial state, `after` the baseline's program. Given both graphs, the nodes the
        baseline's program adds (recomputations, Store/Load) and drops are named, by name."""
        created, gone, modules = [], [], ()
        if initial is not None and warm is not None:
            created, gone = _new_nodes(initial, warm), _new_nodes(warm, initial)
            modules = _modules(warm, created) + _modules(initial, gone)
        return Decision(
            baseline,
            DecisionKind.WARM_START,
            f"start from {baseline}'s program"
            + (f" ({len(created)} nodes added, {len(gone)} dropped)" if created or gone else ""),
            tuple(n.name for n in created),
            tuple(n.name for n in gone),
            tuple(dict.fromkeys(modules))[:MAX_MODULES],
            (),
            _figures(before),
            _figures(after),
        )

    # --- plan files ------------------------------------------------------------------------

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


MAX_MODULES = 8  # per decision: a fission's nodes may span a model's every layer
_REORDERS = {
    "dp-schedule": "the program re-ordered by the DP scheduler (the search's start, §6.1)",
    "reschedule": "the best graph re-ordered in full by the DP scheduler",
}
_JSON_KEYS = frozenset(
    {"rule", "kind", "description", "created", "removed", "modules", "splits", "before", "after"}
)


def decisions_from_json(value: Any, where: str = "decisions") -> tuple[Decision, ...]:
    return tuple(Decision.from_json(d, f"{where}[{i}]") for i, d in enumerate(_list(value, where)))


def full_trail(
    program: SimResult | Figures,
    initial: SimResult | Figures,
    best: SimResult | Figures,
    decisions: Iterable[Decision],
    history: Iterable[str] = (),
) -> tuple[Decision, ...]:
    """The best state's trail from the program order: first the DP re-order that made the
    search's initial state, then, when the trail does not start from that state (a warm start
    that recorded no decision of its own), a warm-start row to where it does. Each row then
    starts where the previous one ended, and the rows' savings sum to the program order's peak
    minus the best state's."""
    decisions = tuple(decisions)
    initial = _figures(initial)
    rows = [Decision.reorder("dp-schedule", program, initial)]
    start = decisions[0].before if decisions else _figures(best)
    if start != initial:
        warm = next((h for h in history if h.startswith("warm-start:")), "warm-start:unknown")
        rows.append(Decision.warm_start(warm.removeprefix("warm-start:"), initial, start))
    return (*rows, *decisions)


def _kind_of_rewrite(rule_kind: str, created: list, gone: list) -> DecisionKind:
    """The decision's kind from what the rewrite did. The rules that give time back share
    re-materialization's dual kind, but the trade makes swaps (`remat_to_swap`) and a
    relaxation may drop only swaps: named by what was made and dropped."""
    kind = _RULE_KINDS.get(rule_kind, DecisionKind.TASO)
    if kind is not DecisionKind.UNDO_RECOMPUTE:
        return kind
    if any(n.op in COPY_OPS for n in created):
        return DecisionKind.SWAP
    if gone and all(n.op in COPY_OPS for n in gone):
        return DecisionKind.UNDO_SWAP
    return kind


def _new_nodes(old: Graph, new: Graph) -> list:
    """The nodes of `new` whose names `old` does not have, in `new`'s program order."""
    names = {old.node(n).name for n in old.program_order()}
    return [new.node(n) for n in new.program_order() if new.node(n).name not in names]


def _figures(value: SimResult | Figures) -> Figures:
    return value if isinstance(value, Figures) else Figures.of(value)


def _nodes(graph: Graph, ids: Iterable[int]) -> list:
    return [graph.node(i) for i in sorted(ids)]


def _modules(graph: Graph, nodes: list) -> tuple[str, ...]:
    """The distinct module paths of `nodes` (of `graph`), in order of first appearance; a
    node a rule made has none of its own, and stands for the module of what it reads."""
    paths = dict.fromkeys(n.module for n in nodes if n.module)
    for n in nodes:
        if not n.module:
            paths.update(dict.fromkeys(m for r in n.inputs if (m := graph.node(r.node).module)))
    return tuple(paths)[:MAX_MODULES]


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
