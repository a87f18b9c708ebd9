"""Which nodes compute the same thing: the recomputation of a node (what re-materialization
re-runs, MAGIS §5.2), its key, and the recomputed copies of a schedule that de-re-materialization
merges back (common-subexpression elimination), found by a scan of the schedule
(`DuplicateScan`) or read from an index a search's child derives from its parent's
(`DuplicateIndex`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from magis.ir import DerivedKey, Graph, Node, Ref
from magis.ir.storage import Layered
from magis.rules.base import RuleContext


def recomputable(graph: Graph, nid: int) -> bool:
    node = graph.node(nid)
    info = graph.info(nid)
    return not (
        node.is_placeholder
        or info.is_random
        or info.copy_stream
        or info.comm_stream  # a collective again on one rank only would hang the others
        or info.mutates
        or node.writes_into is not None
    )


_BATCH_NORM = "aten.native_batch_norm.default"

# Ops whose output holds its input's values unchanged: what reads one reads what its input
# holds. Activation checkpointing saves a block's input detached, so the block's recomputation
# reads `detach(x)` where the forward read `x` (FSDP2 + full AC on Llama: none of the
# recomputed block was found a copy of the forward's without this).
IDENTITY_OPS = frozenset({"aten.detach.default", "aten.alias.default"})


def value_source(graph: Graph, ref: Ref) -> Ref:
    """The value `ref` holds, named by the first node up its chain of `IDENTITY_OPS` that is
    not one (`ref` itself when it is no identity's output)."""
    node = graph.node(ref.node)
    while node.op in IDENTITY_OPS and isinstance(node.args[0], Ref):
        ref = node.args[0]
        node = graph.node(ref.node)
    return ref


def mergeable(graph: Graph, nid: int) -> bool:
    """Whether a later node that computes what an earlier one does may be dropped for it
    (de-re-materialization, MAGIS §5.2's dual): any that may be recomputed, and a collective
    (a collective of the same values gives the same result; every rank runs one plan, so every
    rank drops it: FSDP's re-gather of a block's weights for its backward, kept from the
    forward's gather instead). Never a view: it merges with the value it views."""
    if graph.info(nid).is_view:
        return False
    return recompute_call(graph, nid) is not None or graph.info(nid).comm_stream


def recompute_call(graph: Graph, nid: int) -> tuple[tuple, dict] | None:
    """(args, kwargs) of a recomputation of `nid`, or None when it cannot be recomputed.

    A training-mode batch norm updates its running statistics in place (so `recomputable`
    refuses it), but its outputs depend on the batch alone: recomputed without the running
    statistics it gives the same outputs and updates nothing. Convolution nets are mostly
    batch norms; without this, nothing between two convolutions could be recomputed. DTR
    recomputes batch norms too (ResNet is one of its benchmarks).
    """
    node = graph.node(nid)
    if recomputable(graph, nid):
        return node.args, node.kwargs_dict
    if node.op == _BATCH_NORM and not node.kwargs and len(node.args) == 8 and node.args[5]:
        return (*node.args[:3], None, None, *node.args[5:]), {}
    return None


def mapped(arg, mapping: dict[Ref, Ref]):
    """`arg` with every Ref that `mapping` names replaced (lists and tuples kept)."""
    if isinstance(arg, Ref):
        return mapping.get(arg, arg)
    if isinstance(arg, list | tuple):
        return type(arg)(mapped(a, mapping) for a in arg)
    return arg


def duplicate_key(graph: Graph, nid: int, inputs: dict[Ref, Ref] | None = None):
    """What `nid` computes, as a hashable key (None when a constant is unhashable). A training
    batch norm keys as its recomputation does (`recompute_call`): a recomputed copy is a
    duplicate of the original, which its dual merges back. `inputs` names values by others
    that hold the same (a copy's outputs by the original's: relax.py)."""
    node = graph.node(nid)
    call = recompute_call(graph, nid)
    args, kwargs = call if call is not None else (node.args, node.kwargs_dict)
    if inputs:
        args = mapped(args, inputs)
    args = _sourced(graph, args)
    try:
        key = (node.op, _frozen(args), _frozen(tuple(sorted(kwargs.items()))))
        hash(key)
    except TypeError:  # unhashable constants: never merged
        return None
    return key


def _sourced(graph: Graph, arg):
    """`arg` with every Ref named by what it holds: its `value_source`, and a view's value by
    the view (its op and its own arguments, so named) rather than by the node that made it:
    FSDP2 copies a block's shards in by fresh views of the same parameters before each gather,
    and two views alike hold the same values."""
    if isinstance(arg, Ref):
        ref = value_source(graph, arg)
        node = graph.node(ref.node)
        if node.is_placeholder or not graph.info(ref.node).is_view:
            return ref
        kwargs = tuple(sorted(node.kwargs_dict.items()))
        return ("view", node.op, _sourced(graph, node.args), kwargs, ref.index)
    if isinstance(arg, list | tuple):
        return type(arg)(_sourced(graph, a) for a in arg)
    return arg


def _storage_root(graph: Graph, ref: Ref) -> Ref:
    """The value a chain of views and identities over `ref` starts from."""
    while True:
        node = graph.node(ref.node)
        if node.is_placeholder or not graph.info(ref.node).is_view or not node.inputs:
            return ref
        ref = node.inputs[0]


def _frozen(value):
    """`value` with lists as tuples (a view's shape argument is a list)."""
    if isinstance(value, list | tuple):
        return (type(value).__name__, *map(_frozen, value))
    return value


def recomputed_pairs(ctx: RuleContext) -> list[tuple[int, int]]:
    """(keep, drop) pairs in schedule order: a non-view node outside frozen regions computing
    what an earlier one does (a recomputed copy, mostly), and the earliest such node. Read
    once per state (`RuleContext.derived`), from the graph's `DuplicateIndex`."""
    return ctx.derived(
        RECOMPUTED_PAIRS, lambda: duplicate_pairs(ctx.graph, ctx.position, ctx.frozen)
    )


def duplicate_pairs(
    graph: Graph, position: Mapping[int, int], frozen: frozenset[int] = frozenset()
) -> list[tuple[int, int]]:
    """(keep, drop) pairs of the scheduled nodes (`position`: node -> step) outside `frozen`:
    what a scan of the schedule with a `DuplicateScan` finds, read from the index: only its
    shared groups are keyed, each in schedule order, and the pairs sorted by the copy's step."""
    index = duplicate_index(graph)
    first: dict = {}
    pairs = []
    for group in index.shared:
        members = [n for n in index.groups[group] if n not in frozen and n in position]
        if len(members) < 2:
            continue
        for n in sorted(members, key=position.__getitem__):
            key = index.merge_key(graph, n)
            if key is not None and (keep := first.setdefault(key, n)) != n:
                pairs.append((keep, n))
    pairs.sort(key=lambda p: position[p[1]])
    return pairs


def _group_of(graph: Graph, node: Node) -> tuple:
    """`_group_key` of a node and its first input."""
    return _group_key(graph, node.op, node.inputs[0] if node.inputs else None)


def _group_key(graph: Graph, op: str, head: Ref | None) -> tuple:
    """(op, the value the first input's views start from) as ints: two nodes that compute the
    same thing share both (a Ref is a dataclass, hashed in Python, and this runs on every
    node of a graph)."""
    if head is None:
        return (op, -1, 0)
    head = _storage_root(graph, head)
    return (op, head.node, head.index)


_INDEX: DerivedKey[DuplicateIndex] = DerivedKey("rules.duplicate_index")
# A context's (keep, drop) pairs (`recomputed_pairs`), read by several rules.
RECOMPUTED_PAIRS: DerivedKey[list[tuple[int, int]]] = DerivedKey("rules.recomputed_pairs")


@dataclass(frozen=True)
class DuplicateIndex:
    """A graph version's nodes by (op, first input) (`_group_of`), the groups of two nodes or
    more (`shared`: only they can hold duplicates), and the `merge_key` of the nodes keyed so
    far (filled on demand). A search's child derives its index from its parent's
    (`derive_duplicate_index`): on a 42,000-node split decoder, deremat's scan of every node
    for its recomputed copies took 80-110 ms of every popped state, half of it the walk of
    the nodes and half keying the 8,000 nodes of the shared groups."""

    groups: Layered[tuple, tuple[int, ...]]
    shared: frozenset[tuple]
    keys: dict[int, tuple | None]

    def merge_key(self, graph: Graph, nid: int) -> tuple | None:
        """`duplicate_key` of a node that a merge may drop (not a view, recomputable)."""
        if nid in self.keys:
            return self.keys[nid]
        key = self.keys[nid] = duplicate_key(graph, nid) if mergeable(graph, nid) else None
        return key


def duplicate_index(graph: Graph) -> DuplicateIndex:
    """The graph version's index (built on first use, unless derived from its parent's)."""
    return graph.derived(_INDEX, lambda: _build_index(graph))


def _build_index(graph: Graph) -> DuplicateIndex:
    groups: dict[tuple, list[int]] = {}
    for nid, node in graph.nodes.items():
        groups.setdefault(_group_of(graph, node), []).append(nid)
    shared = frozenset(g for g, members in groups.items() if len(members) > 1)
    return DuplicateIndex(Layered({g: tuple(m) for g, m in groups.items()}), shared, {})


def derive_duplicate_index(
    parent: Graph, child: Graph, touched: set[int], removed: set[int]
) -> None:
    """Install on `child` (`parent` with `touched` nodes added or re-wired and `removed` ones
    gone; its other nodes keep their parent's Node objects) its index, from the parent's when
    the parent has one; else it is built if it is ever read."""
    old = parent.known(_INDEX)
    if old is None:
        return
    groups, shared, keys = old.groups.draft(), set(old.shared), dict(old.keys)
    # A node reading a touched view may read another value now (a reader that no longer
    # reads it in the child was re-wired: touched itself).
    touched = touched | _view_readers(child, touched)
    for n in touched | removed:
        keys.pop(n, None)
        if n in parent:
            group = _group_of(parent, parent.node(n))
            members = tuple(m for m in groups[group] if m != n)
            if members:
                groups[group] = members
            else:
                groups.pop(group)
            if len(members) < 2:
                shared.discard(group)
    for n in touched:
        if n in child:
            group = _group_of(child, child.node(n))
            members = groups[group] + (n,) if group in groups else (n,)
            groups[group] = members
            if len(members) > 1:
                shared.add(group)
    index = DuplicateIndex(groups.done(), frozenset(shared), keys)
    child.derived(_INDEX, lambda: index)


def _view_readers(graph: Graph, nodes: set[int]) -> set[int]:
    """The nodes of `graph` that read one of `nodes` that is a view (an identity included),
    through chains of views: their group and key name the views' values (`_sourced`)."""
    out: set[int] = set()
    stack = [n for n in nodes if n in graph and graph.info(n).is_view]
    while stack:
        for u in graph.successors(stack.pop()):
            if u not in out:
                out.add(u)
                if graph.info(u).is_view:
                    stack.append(u)
    return out


_PENDING = object()  # a DuplicateScan group whose nodes have no key yet


class DuplicateScan:
    """Which earlier node computes what a node does (`duplicate_key`, inputs named by
    `same`), over nodes given in schedule order. Two such nodes share their op and their
    first input, so a node's key is built only once another shares both: on a graph of
    40,000 nodes (a split decoder) building every key took most of a scan, and few nodes
    share both. `same` may grow during the scan, by values of nodes already given (a
    scheduled node's inputs are made before it: its key does not change afterwards)."""

    def __init__(self, graph: Graph, same: dict[Ref, Ref] | None = None) -> None:
        self.graph = graph
        self.same = same
        self._groups: dict = {}  # (op, first input) -> nodes without a key yet, or _PENDING
        self._first: dict = {}  # key -> the first node with it
        self._nodes = graph.nodes  # read once per node of a 40,000-node scan

    def first_alike(self, nid: int, eligible: Callable[[Graph, int], bool]) -> int:
        """The first node given so far (`nid` included) that computes what `nid` does;
        `nid` itself when it is the first, has no key, or is not `eligible`."""
        same = self.same
        node = self._nodes[nid]
        head = node.inputs[0] if node.inputs else None
        if same and head is not None:
            head = same.get(head, head)
        group_key = _group_key(self.graph, node.op, head)
        group = self._groups.setdefault(group_key, [])
        if group is not _PENDING:
            if not group:  # alone so far: nothing earlier can compute the same
                group.append(nid)
                return nid
            for m in group:
                self._keyed(m, eligible)
            self._groups[group_key] = _PENDING
        return self._keyed(nid, eligible)

    def _keyed(self, nid: int, eligible: Callable[[Graph, int], bool]) -> int:
        if not eligible(self.graph, nid):
            return nid
        key = duplicate_key(self.graph, nid, self.same)
        return nid if key is None else self._first.setdefault(key, nid)
