"""How the search records its moves: one `Decision` (`magis.ir.trail`) per move that made an
M-State from its parent.

Every child the search makes records what the move did (the rule, its kind, the nodes it
created and removed, for fission the F-Tree nodes whose n changed), and the simulated figures
of its parent and of itself. Along one state's trail each decision's `before` is the previous
one's `after`, so the bytes each took off the peak add up exactly to the trail's whole
reduction (`magis explain`). The records themselves are the plan file's, in `magis.ir.trail`:
a plan loads without the search.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from magis.ir.ops import LOAD_OP, STORE_OP
from magis.ir.trail import Decision, DecisionKind, Figures, Split
from magis.rules import RuleKind, decision_kind

if TYPE_CHECKING:
    from magis.analyze.ftree import FTree
    from magis.ir import Graph
    from magis.rules import Rewrite
    from magis.sim import SimResult

COPY_OPS = (STORE_OP, LOAD_OP)
MAX_MODULES = 8  # per decision: a fission's nodes may span a model's every layer

_REORDERS = {
    "dp-schedule": "the program re-ordered by the DP scheduler (the search's start, §6.1)",
    "reschedule": "the best graph re-ordered in full by the DP scheduler",
}


def figures_of(sim: SimResult) -> Figures:
    """A schedule's simulated figures as a decision records them."""
    return Figures(int(sim.peak_bytes), float(sim.latency_s), sim.compute_s, sim.copy_s)


def rewrite_decision(
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
        _kind_of_rewrite(rewrite.kind, created, gone),
        rewrite.description,
        tuple(n.name for n in created),
        tuple(n.name for n in gone),
        tuple(dict.fromkeys(_modules(child, created) + _modules(parent, gone))),
        (),
        figures_of(parent_sim),
        figures_of(child_sim),
    )


def fission_decision(
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
        figures_of(parent_sim),
        figures_of(child_sim),
    )


def reorder_decision(
    rule: str, before: SimResult | Figures, after: SimResult | Figures
) -> Decision:
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


def warm_start_decision(
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
    rows = [reorder_decision("dp-schedule", program, initial)]
    start = decisions[0].before if decisions else _figures(best)
    if start != initial:
        warm = next((h for h in history if h.startswith("warm-start:")), "warm-start:unknown")
        rows.append(warm_start_decision(warm.removeprefix("warm-start:"), initial, start))
    return (*rows, *decisions)


def _kind_of_rewrite(rule_kind: RuleKind, created: list, gone: list) -> DecisionKind:
    """The decision's kind from what the rewrite did. The rules that give time back share
    re-materialization's dual kind, but the trade makes swaps (`remat_to_swap`) and a
    relaxation may drop only swaps: named by what was made and dropped."""
    kind = decision_kind(rule_kind)  # the rule catalog's table
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
    return value if isinstance(value, Figures) else figures_of(value)


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
