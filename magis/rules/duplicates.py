"""Which nodes compute the same thing: the recomputation of a node (what re-materialization
re-runs, MAGIS §5.2), its key, and the recomputed copies of a schedule that de-re-materialization
merges back (common-subexpression elimination), found from an index of the nodes that may
compute alike, which a search's child derives from its parent's (`DuplicateIndex`)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class SourceNames:
    """What `_sourced` named the values of one graph version (`values`), and a number for
    each view it named (`views`: (op, named arguments, keyword arguments, output index) ->
    int), so that a key names a view by one number, not by the nested chain of views behind
    it. The numbers mean the same for every graph version that shares `views` (a search's
    line of states: `derive_duplicate_index`); keys made with and without names never meet.
    A 100,000-node unrolled scan's chains of views made each key a deep tuple: keying its
    43,000 alike nodes took 3 s, most of it walking and hashing the chains again."""

    values: dict[Ref, object] = field(default_factory=dict)
    views: dict[tuple, int] = field(default_factory=dict)

    def next_version(self) -> SourceNames:
        """The names for a graph version derived from this one: the views' numbers kept."""
        return SourceNames({}, self.views)


def duplicate_key(
    graph: Graph, nid: int, inputs: dict[Ref, Ref] | None = None, memo: SourceNames | None = None
):
    """What `nid` computes, as a hashable key (None when a constant is unhashable). A training
    batch norm keys as its recomputation does (`recompute_call`): a recomputed copy is a
    duplicate of the original, which its dual merges back. `inputs` names values by others
    that hold the same (a copy's outputs by the original's: relax.py). `memo`: the graph
    version's `SourceNames` (a chain of views is walked once, and named by a number)."""
    node = graph.node(nid)
    call = recompute_call(graph, nid)
    args, kwargs = call if call is not None else (node.args, node.kwargs_dict)
    if inputs:
        args = mapped(args, inputs)
    args = _sourced(graph, args, memo)
    try:
        key = (node.op, _frozen(args), _frozen(tuple(sorted(kwargs.items()))))
        hash(key)
    except TypeError:  # unhashable constants: never merged
        return None
    return key


def _sourced(graph: Graph, arg, memo: SourceNames | None = None):
    """`arg` with every Ref named by what it holds: its `value_source`, and a view's value by
    the view (its op and its own arguments, so named) rather than by the node that made it:
    FSDP2 copies a block's shards in by fresh views of the same parameters before each gather,
    and two views alike hold the same values."""
    if isinstance(arg, Ref):
        if memo is not None and arg in memo.values:
            return memo.values[arg]
        ref = value_source(graph, arg)
        node = graph.node(ref.node)
        if node.is_placeholder or not graph.info(ref.node).is_view:
            named = ref
        else:
            kwargs = tuple(sorted(node.kwargs_dict.items()))
            named = ("view", node.op, _sourced(graph, node.args, memo), kwargs, ref.index)
        if memo is not None:
            named = memo.values[arg] = _numbered(named, memo.views)
        return named
    if isinstance(arg, list | tuple):
        return type(arg)(_sourced(graph, a, memo) for a in arg)
    return arg


def _storage_root(graph: Graph, ref: Ref) -> Ref:
    """The value a chain of views and identities over `ref` starts from."""
    while True:
        node = graph.node(ref.node)
        if node.is_placeholder or not graph.info(ref.node).is_view or not node.inputs:
            return ref
        ref = node.inputs[0]


def _numbered(view, views: dict[tuple, int]):
    """A view's name as ("view", its number); an unhashable name (a constant argument that
    cannot be hashed) stays as it is."""
    try:
        frozen = _frozen(view)
        return ("view", views.setdefault(frozen, len(views)))
    except TypeError:
        return view


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
    what keying every scheduled node in order finds, read from the index: only its
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
    more (`shared`: only they can hold duplicates), and the `duplicate_key` of the nodes keyed
    so far (filled on demand: `key`, `merge_key`). A search's child derives its index from its parent's
    (`derive_duplicate_index`): on a 42,000-node split decoder, deremat's scan of every node
    for its recomputed copies took 80-110 ms of every popped state, half of it the walk of
    the nodes and half keying the 8,000 nodes of the shared groups."""

    groups: Layered[tuple, tuple[int, ...]]
    shared: frozenset[tuple]
    keys: dict[int, tuple | None]
    names: SourceNames = field(default_factory=SourceNames)  # what the keys name values by

    def key(self, graph: Graph, nid: int) -> tuple | None:
        """`duplicate_key(graph, nid)` with this index's names, kept."""
        keys = self.keys
        if nid in keys:
            return keys[nid]
        key = keys[nid] = duplicate_key(graph, nid, memo=self.names)
        return key

    def merge_key(self, graph: Graph, nid: int) -> tuple | None:
        """`duplicate_key` of a node that a merge may drop (not a view, recomputable)."""
        return self.key(graph, nid) if mergeable(graph, nid) else None


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
    index = DuplicateIndex(groups.done(), frozenset(shared), keys, old.names.next_version())
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


def copies_in_order(
    graph: Graph,
    position: Mapping[int, int],
    frozen: frozenset[int],
    eligible: Callable[[Graph, int], bool],
) -> list[tuple[int, int]]:
    """(original, copy) for every scheduled node outside `frozen` and `eligible` that computes
    what an earlier one does, its inputs taken up to copies (`duplicate_key` with the copies'
    outputs named by the originals'), views included, in the copies' schedule order: what
    keying every scheduled node in order finds, found from the graph's `DuplicateIndex` by
    keying only the nodes that can be copies or their originals.

    A node reading no copy has its own key (the index keeps it), and nodes of one key share
    their (op, first input) group: so among such nodes, copies are in the shared groups'
    classes of two or more nodes of a key. A node reading a copy (a copy's successor, found on
    the way) is keyed with its inputs named by the originals; the nodes of its group whose own
    key is that one are its class: the earlier ones are registered first, in schedule order
    (none of them can be a copy: nothing with their key came before them), and the later ones
    join the nodes to visit. Everything is visited in schedule order (a sorted list and a heap
    of what is found on the way). On Mamba's 100,000-node unrolled step, a scan of every node
    took 2.8 s for every state relaxed: 43,630 of its nodes share a group, 46 a key."""
    index = duplicate_index(graph)
    nodes = graph.nodes
    same: dict[Ref, Ref] = {}

    def wanted(m: int) -> bool:
        return m not in frozen and m in position and eligible(graph, m)

    classes: dict[tuple, list[int]] = {}
    for g in index.shared:
        for m in index.groups[g]:
            if wanted(m) and (key := index.key(graph, m)) is not None:
                classes.setdefault(key, []).append(m)
    alike = sorted((position[m], m) for ms in classes.values() if len(ms) > 1 for m in ms)
    opened = {key for key, ms in classes.items() if len(ms) > 1}  # every member is visited
    first: dict[tuple, int] = {}
    heap: list[tuple[int, int]] = []
    given: set[int] = set()
    pairs = []
    k = 0
    while k < len(alike) or heap:
        if heap and (k == len(alike) or heap[0] < alike[k]):
            at, nid = heapq.heappop(heap)
        else:
            at, nid = alike[k]
            k += 1
        if nid in given:
            continue
        given.add(nid)
        node = nodes[nid]
        if not any(r in same for r in node.inputs):
            key = index.key(graph, nid)
        else:
            key = duplicate_key(graph, nid, same, index.names)
            if key is not None and key not in opened:
                opened.add(key)
                for m in _class_of(graph, index, node, key, same, wanted, position):
                    if m in given:
                        continue
                    if position[m] < at:  # the first of its key: an original
                        given.add(m)
                        first.setdefault(key, m)
                    else:
                        heapq.heappush(heap, (position[m], m))
        if key is None or (original := first.setdefault(key, nid)) == nid:
            continue
        for i in range(len(node.outputs)):
            same[Ref(nid, i)] = Ref(original, i)
        if not graph.info(nid).is_view:
            pairs.append((original, nid))
        for u in graph.successors(nid):
            if u not in given and wanted(u):
                heapq.heappush(heap, (position[u], u))
    return pairs


def _class_of(
    graph: Graph,
    index: DuplicateIndex,
    node: Node,
    key: tuple,
    same: dict[Ref, Ref],
    wanted: Callable[[int], bool],
    position: Mapping[int, int],
) -> list[int]:
    """The `wanted` nodes whose own key is `key` (the key of `node`, a reader of a copy, with
    its inputs named as `same` names them), in schedule order: they are in the group of
    `node`'s op and its first input so named."""
    head = node.inputs[0] if node.inputs else None
    group = _group_key(graph, node.op, same.get(head, head) if head else None)
    members = (m for m in index.groups.get(group, ()) if wanted(m) and index.key(graph, m) == key)
    return sorted(members, key=position.__getitem__)
