"""The F-Tree mutations of MAGIS §5.1 (Fig. 7): enable, lift, disable and mutate.

They change an F-Tree, not a graph: the search materializes the mutated tree
(rules/fission.py) to get the state's graph (search/fission_moves.py). A mutation is data —
`FTreeMutation(kind, match, apply)` — and `mutations` yields lazy `Mutation`s, each tree built
only when the search evaluates it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from magis.analyze import FTree


class MutationKind(enum.Enum):
    """Which of Fig. 7's mutations (not a `RuleKind`: these change a tree, not a graph)."""

    ENABLE = "enable"
    LIFT = "lift"
    DISABLE = "disable"
    MUTATE = "mutate"
    COARSEN = "coarsen"  # Fig. 7 (d) the other way: fewer parts


@dataclass(frozen=True)
class FTreeMutation:
    """One mutation rule: `match` yields the tree-node indices it applies to; `apply` returns the
    mutated tree (a new value: trees are immutable)."""

    kind: MutationKind
    match: Callable[[FTree], Iterator[int]]
    apply: Callable[[FTree, int], FTree]
    doc: str = field(default="", compare=False)


def _smallest_divisor(length: int, above: int = 1) -> int | None:
    return next((d for d in range(above + 1, length + 1) if length % d == 0), None)


def _effective_length(tree: FTree, i: int) -> int:
    """The length node i can still be split by: an enabled ancestor along the same dimension has
    already divided it."""
    length = tree.nodes[i].length
    for a in tree.ancestors(i):
        anc = tree.nodes[a]
        if anc.enabled and anc.component == tree.nodes[i].component:
            length //= anc.n
    return length


def _has_enabled_ancestor(tree: FTree, i: int) -> bool:
    return any(tree.nodes[a].enabled for a in tree.ancestors(i))


def _match_enable(tree: FTree) -> Iterator[int]:
    """A disabled leaf, or a disabled parent of an enabled node, without enabled ancestors."""
    for i, node in enumerate(tree.nodes):
        if node.enabled or _has_enabled_ancestor(tree, i):
            continue
        kids = tree.children(i)
        if (not kids or any(tree.nodes[c].enabled for c in kids)) and _smallest_divisor(
            _effective_length(tree, i)
        ):
            yield i


def _apply_enable(tree: FTree, i: int) -> FTree:
    return tree.with_n(i, _smallest_divisor(_effective_length(tree, i)))


def _match_lift(tree: FTree) -> Iterator[int]:
    """An enabled node without enabled ancestors, whose parent exists."""
    for i, node in enumerate(tree.nodes):
        if (
            node.enabled
            and node.parent is not None
            and not _has_enabled_ancestor(tree, i)
            and _smallest_divisor(tree.nodes[node.parent].length)
        ):
            yield i


def _apply_lift(tree: FTree, i: int) -> FTree:
    node = tree.nodes[i]
    p = node.parent
    length = tree.nodes[p].length
    n = node.n if length % node.n == 0 else _smallest_divisor(length)
    return tree.with_n(i, 1).with_n(p, n)


def _match_disable(tree: FTree) -> Iterator[int]:
    """An enabled node with no enabled descendant."""
    for i, node in enumerate(tree.nodes):
        if node.enabled and not any(tree.nodes[d].enabled for d in tree.descendants(i)):
            yield i


def _apply_disable(tree: FTree, i: int) -> FTree:
    return tree.with_n(i, 1)


def _match_mutate(tree: FTree) -> Iterator[int]:
    """An enabled node whose n is not yet the largest divisor of its length."""
    for i, node in enumerate(tree.nodes):
        if node.enabled and _smallest_divisor(_effective_length(tree, i), node.n):
            yield i


def _apply_mutate(tree: FTree, i: int) -> FTree:
    return tree.with_n(i, _smallest_divisor(_effective_length(tree, i), tree.nodes[i].n))


def _coarser(tree: FTree, i: int) -> int | None:
    """The largest divisor of node i's length below its n, at least 2 (None: none)."""
    length, n = _effective_length(tree, i), tree.nodes[i].n
    return max((d for d in range(2, n) if length % d == 0), default=None)


def _match_coarsen(tree: FTree) -> Iterator[int]:
    """An enabled node that can be split in fewer parts (and still in two or more).

    Fig. 7 (d) mutates n; the search also needs it to fall again. A direct enable offers n =
    8 first (the largest that may still meet the limit), and under a memory limit the first
    child that meets it is followed at once, its siblings with n = 4 and 2 never tried: on
    bert-base a whole-model split in 8 met 0.4 of the peak at 0.135, at 1.18 of the latency."""
    for i, node in enumerate(tree.nodes):
        if node.enabled and _coarser(tree, i) is not None:
            yield i


def _apply_coarsen(tree: FTree, i: int) -> FTree:
    return tree.with_n(i, _coarser(tree, i))


def _enabled_around(tree: FTree) -> tuple[list[bool], list[bool]]:
    """For every node: whether an ancestor is enabled, and whether a descendant is (one walk
    up the tree from each node; the move lists below ask both of every node, per state)."""
    above = [_has_enabled_ancestor(tree, i) for i in range(len(tree))]
    below = [False] * len(tree)
    for i, node in enumerate(tree.nodes):
        if node.enabled:
            for a in tree.ancestors(i):
                below[a] = True
    return above, below


def _enableable(tree: FTree, under_split: bool) -> Iterator[int]:
    """Disabled nodes with nothing enabled below them, inside an enabled ancestor or not
    (`under_split`), whose length the ancestors' splits leave divisible."""
    above, below = _enabled_around(tree)
    for i, node in enumerate(tree.nodes):
        if node.enabled or below[i] or above[i] != under_split:
            continue
        if _smallest_divisor(_effective_length(tree, i)):
            yield i


def directly_enableable(tree: FTree) -> Iterator[int]:
    """Disabled nodes with nothing enabled above or below them: what enabling a leaf of their
    subtree and lifting it up to them (Fig. 7 (a), then (b) repeatedly) reaches."""
    return _enableable(tree, under_split=False)


def nested_enableable(tree: FTree) -> Iterator[int]:
    """Disabled nodes inside an enabled ancestor, with nothing enabled below them and a length
    the ancestors' splits leave divisible: a region split again within each part of an
    enclosing split. Fig. 7 reaches such a nesting only from the inside out (a parent of an
    enabled node enabled); a search that first split the whole step along the batch could
    never split its loss block within the parts (Qwen2 under 1.10 on an RTX 3090: the whole
    step in 2 holds 0.533 of the peak, with the loss block in 4 inside each part 0.415)."""
    return _enableable(tree, under_split=True)


def enclosing_enableable(tree: FTree) -> Iterator[int]:
    """Disabled nodes without enabled ancestors that hold an enabled node: a split enclosing
    one already made, which Fig. 7 reaches only a level at a time (a parent of an enabled node
    enabled, then lifted), each step a materialization. A search that first split GPT-2's
    loss block (the densest move) could then no longer split the whole step along the batch
    in one move, and under memory 0.4 held the attention probabilities whole (1.068 of the
    latency in 60 s, where the whole step split first gave 1.040)."""
    above, below = _enabled_around(tree)
    for i, node in enumerate(tree.nodes):
        if not node.enabled and not above[i] and below[i] and _smallest_divisor(node.length):
            yield i


def enable_directly(tree: FTree, i: int, n: int | None = None) -> FTree:
    """Node i enabled with fission number `n` (default: its smallest; see
    `directly_enableable`). Enabled nodes inside it along the same dimension keep as many
    parts as the length its n leaves them allows (the largest divisor of it not above their
    n), and are disabled where it leaves none (`enclosing_enableable`)."""
    if n is None:
        return _apply_enable(tree, i)
    length = _effective_length(tree, i)
    if n < 2 or length % n:
        raise ValueError(f"n = {n} does not divide the length {length} of tree-node {i}")
    tree = tree.with_n(i, n)
    for d in tree.descendants(i):
        node = tree.nodes[d]
        if node.enabled:
            left = _effective_length(tree, d)
            tree = tree.with_n(d, max(k for k in range(1, node.n + 1) if left % k == 0))
    return tree


def direct_fission_numbers(tree: FTree, i: int, wanted: Sequence[int]) -> list[int]:
    """For each of `wanted`, the largest divisor of node i's length not above it (distinct,
    ascending): the fission numbers a one-step enable offers."""
    length = _effective_length(tree, i)
    found = set()
    for w in wanted:
        best = max((d for d in range(2, min(w, length) + 1) if length % d == 0), default=None)
        if best is not None:
            found.add(best)
    return sorted(found)


FTREE_MUTATIONS: tuple[FTreeMutation, ...] = (
    FTreeMutation(MutationKind.ENABLE, _match_enable, _apply_enable, "Fig. 7 (a)"),
    FTreeMutation(MutationKind.LIFT, _match_lift, _apply_lift, "Fig. 7 (b)"),
    FTreeMutation(MutationKind.DISABLE, _match_disable, _apply_disable, "Fig. 7 (c)"),
    FTreeMutation(MutationKind.MUTATE, _match_mutate, _apply_mutate, "Fig. 7 (d)"),
    FTreeMutation(MutationKind.COARSEN, _match_coarsen, _apply_coarsen, "Fig. 7 (d), fewer"),
)


@dataclass(frozen=True)
class Mutation:
    """A lazy mutation: `build()` makes the new tree only when asked. `kind` names the move
    (a `MutationKind`'s value, or a macro move's: "enable-direct", "enable-level", ...): the
    search records its child under "fission:<kind>"; `target` is the tree-node it applies to
    (a level's number for a level-wide move)."""

    kind: str
    target: int
    build: Callable[[], FTree]

    @property
    def description(self) -> str:
        return f"{self.kind} {self.target}"


def mutations(tree: FTree, rules: Sequence[FTreeMutation] = FTREE_MUTATIONS) -> Iterator[Mutation]:
    """Every applicable mutation of `tree`, rule by rule, nodes in index order."""
    for rule in rules:
        for i in rule.match(tree):
            yield Mutation(rule.kind.value, i, lambda rule=rule, i=i: rule.apply(tree, i))
