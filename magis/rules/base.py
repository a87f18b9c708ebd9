"""The one contract every rewrite rule follows (MAGIS §5, STYLE habits 3-4).

A `Rule` is data: a name, a kind, and a `match` function that, given the current state
(`RuleContext`), yields lazy `Rewrite`s. A rewrite's `build()` produces the new graph only when
the search decides to evaluate it, and says which nodes it added or changed — what incremental
scheduling (Alg. 2) and incremental hashing need. Rules never edit the graph they match on.

Most rules are made by one of two builders: `node_rule` (one rewrite per node a predicate
accepts) and `group_rule` (one rewrite per group of nodes a finder returns). The F-Tree
mutations of §5.1 are not graph rewrites: they change a tree (rules/ftree_moves.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

from magis.ir import DerivedKey, Graph
from magis.sim import SimResult

if TYPE_CHECKING:
    from magis.cost import CostModel

G = TypeVar("G")
T = TypeVar("T")


class RuleKind(enum.Enum):
    """What a graph rewrite does (MAGIS §5: TASO's substitutions and the M-Rules of §5.2)."""

    TASO = "taso"
    REMAT = "remat"
    DEREMAT = "deremat"
    SWAP = "swap"
    DESWAP = "deswap"
    COMPACT = "compact"
    DECOMPACT = "decompact"


# The kinds whose rewrites trade time for memory; the others (their duals, TASO's
# substitutions) trade memory for time or save time outright.
SAVES_MEMORY = frozenset({RuleKind.REMAT, RuleKind.SWAP, RuleKind.COMPACT})


# Rewrites that recompute, swap or compact a few tensors, or undo that: they leave the rest of
# the graph as it was.
LOCAL_KINDS = frozenset(
    {
        RuleKind.REMAT,
        RuleKind.DEREMAT,
        RuleKind.SWAP,
        RuleKind.DESWAP,
        RuleKind.COMPACT,
        RuleKind.DECOMPACT,
    }
)


def after_local_move(rules: Iterable[Rule], history: tuple[str, ...]) -> list[Rule]:
    """`rules` without the `once_per_line` ones on a state whose trailing run of local
    rewrites (by rules that are not themselves `once_per_line`; `history` holds rule names) is
    not 0, 1, 2, 4, 8, ... long: a line of k local moves is offered the cut log2(k) times, as
    the graph drifts from where it was last offered, not k times."""
    by_name = {r.name: r for r in rules}
    run = 0
    for name in reversed(history):
        rule = by_name.get(name)
        if rule is None or rule.once_per_line or rule.kind not in LOCAL_KINDS:
            break
        run += 1
    if run & (run - 1) == 0:  # 0 or a power of two
        return list(rules)
    return [r for r in rules if not r.once_per_line]


def ordered_for(rules: Iterable[Rule], wants_memory: bool) -> list[Rule]:
    """`rules` with those that save what the objective ranks first ahead of the others (in
    their order otherwise): the first children of a state are the ones likely to improve it.
    Rules not `offered` on such a state are left out."""
    return sorted(
        (r for r in rules if r.offered(wants_memory)), key=lambda r: r.saves_memory != wants_memory
    )


@dataclass
class OrderIndex:
    """Indexes of one schedule, built on first use: node -> step (`position`) and op -> its
    nodes in schedule order (`by_op`). Contexts of one graph and `order` share one (a context
    of another order refuses it)."""

    order: tuple[int, ...] | None = None  # None: the first context's
    position: dict[int, int] | None = None
    by_op: dict[str, list[int]] | None = None


@dataclass(frozen=True)
class RuleContext:
    """What a rule may look at: the graph, its schedule and that schedule's simulation.

    `frozen` holds the nodes of enabled F-Tree regions: no rule matches across their boundary
    (MAGIS §3). `hotspots_only` is heuristic H2 (§5.2): re-materialization and swapping only
    for tensors among the memory hot-spots.
    """

    graph: Graph
    order: tuple[int, ...]
    sim: SimResult
    frozen: frozenset[int] = frozenset()
    hotspots_only: bool = True
    max_candidates: int = 16
    # The peak a rewrite that gives time back may reach (`Objective.memory_ceiling`: the
    # memory limit, or under a latency limit the state's own peak); None: the state's peak.
    ceiling: int | None = None
    # The search's cost model, for rules that weigh what a rewrite gives back in seconds.
    cost: CostModel | None = None

    # The indexes of `order`. A caller that already holds the order's positions passes them
    # (`OrderIndex(order, position)`: a 42,000-step order takes 8 ms to index again).
    index: OrderIndex = field(default_factory=OrderIndex, compare=False, repr=False)
    # What several rules derive from one state and would otherwise each rebuild (the
    # recomputed copies: re-materialization's dual and the swap trade both read them), under
    # typed keys (`derived`). Not an init field, so `dataclasses.replace` (another `frozen`)
    # starts an empty one.
    _facts: dict[DerivedKey, object] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        index = self.index
        if index.order is None:
            index.order = self.order
        elif index.order is not self.order and index.order != self.order:
            raise ValueError("a RuleContext's OrderIndex must index the context's own order")

    @property
    def position(self) -> dict[int, int]:
        """Node -> step of `order`; built once per order (every hot storage's candidate
        generation reads it, thousands of times per search)."""
        index = self.index
        if index.position is None:
            index.position = dict(zip(self.order, range(len(self.order)), strict=True))
        return index.position

    def derived(self, key: DerivedKey[T], build: Callable[[], T]) -> T:
        """The fact `key` of this context, built by `build` on first use (as `Graph.derived`
        caches a graph version's facts; keys compare by identity)."""
        facts = self._facts
        if key not in facts:
            facts[key] = build()
        return facts[key]  # type: ignore[return-value]

    def nodes_of(self, op: str) -> list[int]:
        """The nodes running `op`, in schedule order: indexed once per order, as several
        rules look for their op on every popped state (one scan of a split decoder's 49,000
        nodes per rule and state cost more than the rules' matching)."""
        index = self.index
        if index.by_op is None:
            by_op: dict[str, list[int]] = {}
            nodes = self.graph.nodes
            for n in self.order:
                by_op.setdefault(nodes[n].op, []).append(n)
            index.by_op = by_op
        return index.by_op.get(op, [])

    def nodes_of_ops(self, ops: Sequence[str]) -> list[int]:
        """The nodes running any of `ops`, in schedule order."""
        if len(ops) == 1:
            return self.nodes_of(ops[0])
        found = [n for op in ops for n in self.nodes_of(op)]
        return sorted(found, key=self.position.__getitem__)

    def without_frozen(self) -> RuleContext:
        """This context with no frozen region (what the rules other than TASO's see), sharing
        the indexes of its order: a split decoder's 42,000 steps take 8 ms to index again."""
        if not self.frozen:
            return self
        return replace(self, frozen=frozenset(), index=self.index)

    @property
    def memory_ceiling(self) -> int:
        """`ceiling`, or the state's own peak when none was given."""
        return self.sim.peak_bytes if self.ceiling is None else self.ceiling


@dataclass(frozen=True)
class Rewritten:
    """A rewrite's result: the new graph and the nodes it added, changed or removed."""

    graph: Graph
    added: frozenset[int]
    changed: frozenset[int] = frozenset()
    removed: frozenset[int] = frozenset()
    # Where the added nodes belong when the rule knows it: right before this node of the old
    # schedule, in id order (ids grow in creation order, which is topological). Re-
    # materialization and swapping know it (the first late reader); the scheduler may use the
    # hint instead of re-solving (search/optimizer.py says when).
    anchor: int | None = None
    # Or several such groups: (anchor, added nodes) pairs, each group right before its anchor
    # (one rewrite applied to several storages: repeated.py).
    placements: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # Or, for a rewrite that replaces nodes by others (an op split in two, or two merged):
    # (old nodes, new nodes) pairs, the new nodes in this order where the first of the old ran.
    in_place_of: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    # Or the new graph's whole order, for a rewrite that places many nodes at many places
    # (the min cut's recomputations, each before its first backward reader: mincut_remat.py).
    order: tuple[int, ...] | None = None

    @property
    def touched(self) -> frozenset[int]:
        """Nodes of the new graph whose position or inputs the rewrite decided (Alg. 2's input)."""
        return self.added | self.changed


@dataclass(frozen=True)
class Rewrite:
    rule: str
    kind: RuleKind
    description: str
    build: Callable[[], Rewritten] = field(compare=False)


@dataclass(frozen=True)
class Rule:
    name: str
    kind: RuleKind
    match: Callable[[RuleContext], Iterator[Rewrite]]
    # Whether its rewrites trade time for memory; None: as its kind does (SAVES_MEMORY). A
    # TASO substitution may exist for memory: a convolution backward split into dgrad and
    # wgrad lets the saved input die before the input gradient is allocated.
    memory_saving: bool | None = None
    # Offered only on a state whose objective wants what the rule gives (see `offered`).
    only_when_wanted: bool = False
    # A rewrite computed from the whole graph (the min cut): offered along a line of local
    # rewrites only at exponentially spaced depths (`after_local_move`). A child's cut is much
    # its parent's; on corpus:phi's 49,000-node split graph, 90 such cuts, 0.2 s each, took a
    # quarter of a 60 s search's worker time.
    once_per_line: bool = False

    @property
    def saves_memory(self) -> bool:
        return self.kind in SAVES_MEMORY if self.memory_saving is None else self.memory_saving

    def offered(self, wants_memory: bool | None) -> bool:
        """Whether the rule is tried on a state whose objective wants memory (True), time
        (False) or is not asked (None). A rule that only trades one resource for the other at
        the same level of the first is offered only where what it gives is wanted."""
        return (
            not self.only_when_wanted or wants_memory is None or (self.saves_memory == wants_memory)
        )


def node_rewrites(
    ctx: RuleContext,
    rule: str,
    kind: RuleKind,
    accepts: Callable[[int], bool],
    describe: Callable[[int], str],
    build: Callable[[int], Rewritten],
    nodes: Iterable[int] | None = None,
) -> Iterator[Rewrite]:
    """One rewrite per node that `accepts` (outside frozen regions), in schedule order (or in
    the order of `nodes`), at most `ctx.max_candidates`: the shape of the rules that rewrite
    one node, and of the duals that undo one node's rewrite."""
    emitted = 0
    for nid in ctx.order if nodes is None else nodes:
        if emitted >= ctx.max_candidates:
            return
        if nid in ctx.frozen or not accepts(nid):
            continue
        yield Rewrite(rule, kind, describe(nid), lambda n=nid: build(n))
        emitted += 1


def node_rule(
    name: str,
    kind: RuleKind,
    accepts: Callable[[Graph, int], bool],
    build: Callable[[Graph, int], Rewritten],
    describe: Callable[[Graph, int], str] | None = None,
    order: Callable[[RuleContext], Iterable[int]] | None = None,
    memory_saving: bool | None = None,
    ops: Sequence[str] = (),
) -> Rule:
    """A rule with one rewrite per node of the graph that `accepts(graph, node)` (see
    `node_rewrites`), built by `build(graph, node)`, described by `describe(graph, node)`
    (default: the rule's name and the node's), nodes in schedule order or in `order(ctx)`.
    `ops`: the only ops `accepts` takes, when known; then only their nodes are read (the
    same rewrites: on a split decoder's 42,000 nodes each rule's scan of every node took
    8-20 ms per popped state, and a rule matches a few hundred)."""

    def describe_node(graph: Graph, nid: int) -> str:
        if describe is not None:
            return describe(graph, nid)
        return f"{name} {graph.node(nid).name}"

    def match(ctx: RuleContext) -> Iterator[Rewrite]:
        graph = ctx.graph
        return node_rewrites(
            ctx,
            name,
            kind,
            lambda n: accepts(graph, n),
            lambda n: describe_node(graph, n),
            lambda n: build(graph, n),
            nodes=_nodes_to_read(ctx, order, ops),
        )

    return Rule(name, kind, match, memory_saving)


def _nodes_to_read(
    ctx: RuleContext, order: Callable[[RuleContext], Iterable[int]] | None, ops: Sequence[str]
) -> Iterable[int] | None:
    if order is not None:
        return order(ctx)
    return ctx.nodes_of_ops(ops) if ops else None


def group_rule(
    name: str,
    kind: RuleKind,
    find: Callable[[RuleContext], Iterable[G]],
    build: Callable[[Graph, G], Rewritten],
    describe: Callable[[Graph, G], str],
    memory_saving: bool | None = None,
) -> Rule:
    """A rule with one rewrite per group `find(ctx)` yields (parallel matmuls, pairs of
    convolution backwards, a hot storage's late reads ...), built by `build(graph, group)`.
    `find` answers for frozen regions and for how many groups it offers."""

    def match(ctx: RuleContext) -> Iterator[Rewrite]:
        graph = ctx.graph
        for group in find(ctx):
            yield Rewrite(name, kind, describe(graph, group), lambda g=group: build(graph, g))

    return Rule(name, kind, match, memory_saving)


def candidates(rules: Iterable[Rule], ctx: RuleContext) -> Iterator[Rewrite]:
    """Every rule's rewrites, rule by rule (lazy: nothing is built)."""
    for rule in rules:
        yield from rule.match(ctx)
