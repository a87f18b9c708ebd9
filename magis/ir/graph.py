"""The computation graph (MAGIS §2.1, Table 1) on rustworkx.

A node is one ATen op call (or a placeholder) with constant arguments, the values it consumes
(`Ref`s to outputs of other nodes) and its output tensors' metadata. Multi-output ops have several
outputs and consumers refer to them by index, so there are no getitem nodes.

The graph is mutable only through a few checked methods (`add_placeholder`, `add_op`,
`remove_node`, `add_control_dep`, `set_outputs`, `replace_uses`); every derived fact (storages,
topological order, the simulator's tables, the scheduling problem) is a value of one graph
version, cached under a typed `DerivedKey` and dropped by every mutation (`_invalidate`): no
code outside this module resets it.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, TypeVar

import rustworkx as rx

from magis.ir.derived import DerivedKey
from magis.ir.node import Node, NodeKind, PlaceholderKind, Ref, map_refs, refs_in
from magis.ir.ops import DEFAULT_REGISTRY, LOAD_OP, STORE_OP, OpInfo, OpRegistry
from magis.ir.order import positions
from magis.ir.storage import StorageMap
from magis.ir.tensor import TensorMeta

# An update capture keeps as a copy into the parameter (see `Graph.overwritten_placeholder`).
IN_PLACE_COPY = "aten.copy_.default"

__all__ = [
    "DerivedKey",
    "Graph",
    "GraphError",
    "Node",
    "NodeKind",
    "PlaceholderKind",
    "Ref",
    "StorageMap",
    "map_refs",
    "refs_in",
]

T = TypeVar("T")

_TOPO: DerivedKey[list[int]] = DerivedKey("ir.topological_order")
_COPY_NODES: DerivedKey[frozenset[int]] = DerivedKey("ir.copy_nodes")
_STORAGES: DerivedKey[StorageMap] = DerivedKey("ir.storages")
_PLACEHOLDERS: DerivedKey[list[int]] = DerivedKey("ir.placeholders")


class GraphError(ValueError):
    """A structural invariant of the graph is broken (a bug in a rewrite, not a user error)."""


class Graph:
    """A DAG of ATen-level nodes. Data edges go producer -> consumer; control edges order an
    in-place update after every other reader of the storage it overwrites."""

    def __init__(self, registry: OpRegistry = DEFAULT_REGISTRY) -> None:
        self.registry = registry
        self._dag = rx.PyDiGraph(check_cycle=False, multigraph=False)
        self._nodes: dict[int, Node] = {}
        # node id -> rustworkx index (rustworkx reuses the indices of removed nodes), -1 for
        # an id not in the graph: an array, copied as one block (a dict copy touched every
        # entry: a third of a 42,000-node graph's copy, once per child of a search)
        self._index = array("q")
        self._control: dict[int, frozenset[int]] = {}  # node -> what runs first (shared by copies)
        self._outputs: tuple[Ref, ...] = ()
        # placeholder -> the node writing it in place: kept as nodes come and go, because
        # every add_op consults it (a whole-graph recount there made graph building quadratic)
        self._writers: dict[int, int] = {}
        self._next_id = 0
        self._derived: dict[DerivedKey[Any], Any] = {}

    # --- construction ---------------------------------------------------------------------

    def add_placeholder(
        self, name: str, meta: TensorMeta, kind: PlaceholderKind, module: str = ""
    ) -> int:
        node = Node(
            self._next_id,
            name,
            "placeholder",
            NodeKind.PLACEHOLDER,
            outputs=(meta,),
            placeholder_kind=kind,
            module=module,
        )
        return self._insert(node)

    def add_op(
        self,
        name: str,
        op: str,
        args: tuple,
        kwargs: dict[str, Any] | None = None,
        outputs: tuple[TensorMeta, ...] = (),
        writes_into: Ref | None = None,
        module: str = "",
    ) -> int:
        kw = tuple(sorted((kwargs or {}).items()))
        inputs = tuple(dict.fromkeys([*refs_in(args), *refs_in([v for _, v in kw])]))
        for ref in inputs:
            self._check_ref(ref)
        if writes_into is not None:
            self._check_ref(writes_into)
        node = Node(
            self._next_id,
            name,
            op,
            NodeKind.OP,
            tuple(args),
            kw,
            tuple(outputs),
            writes_into=writes_into,
            inputs=inputs,
            module=module,
        )
        nid = self._insert(node)
        for ref in inputs:
            self._dag.add_edge(self._index[ref.node], self._index[nid], "data")
        self._order_before_writers(nid, {})
        return nid

    def order_before_writers(self, nids: Iterable[int]) -> None:
        """Give each of `nids` the constraint `add_op` gives a new node (see below): for nodes
        that entered through `restore_node`, which skips it."""
        roots: dict[Ref, Ref] = {}  # the parts of a split read the same values
        for nid in nids:
            self._order_before_writers(nid, roots)

    def _order_before_writers(self, nid: int, roots: dict[Ref, Ref]) -> None:
        """A node reading the old value of a placeholder that is updated in place must run
        before the update (a rewrite that adds such a reader inherits the constraint)."""
        writers = self._writers
        if not writers:
            return
        for ref in self._nodes[nid].inputs:
            root = roots.get(ref) or roots.setdefault(ref, self._alias_root(ref))
            writer = writers.get(root.node) if self._nodes[root.node].is_placeholder else None
            if writer is None or writer == nid:
                continue
            # A node that already depends on the update reads the new value: leave it be.
            if not rx.has_path(self._dag, self._index[writer], self._index[nid]):
                self.add_control_dep(nid, writer)

    def _alias_root(self, ref: Ref) -> Ref:
        while True:
            node = self._nodes[ref.node]
            if node.is_placeholder or not self.registry.lookup(node.op).is_view:
                return ref
            ref = next(refs_in(node.args))

    def overwritten_placeholder(self, nid: int) -> int | None:
        """The placeholder whose storage node `nid` overwrites in place: its `writes_into`, or
        the destination of an in-place copy (an update capture keeps as `copy_` because its
        strides differ from the parameter's). Every reader of the old value runs first."""
        node = self._nodes[nid]
        if node.writes_into is not None:
            return node.writes_into.node
        if node.op == IN_PLACE_COPY and node.args and isinstance(node.args[0], Ref):
            root = self._alias_root(node.args[0])
            if self._nodes[root.node].is_placeholder:
                return root.node
        return None

    def _insert(self, node: Node) -> int:
        self._nodes[node.id] = node
        written = self.overwritten_placeholder(node.id)
        if written is not None:
            self._writers[written] = node.id
        self._set_index(node.id, self._dag.add_node(node.id))
        self._next_id = max(self._next_id, node.id) + 1
        self._invalidate()
        return node.id

    def _set_index(self, nid: int, index: int) -> None:
        gap = nid + 1 - len(self._index)
        if gap > 0:
            self._index.extend(array("q", [-1]) * gap)
        self._index[nid] = index

    def restore_node(self, node: Node) -> int:
        """Insert a node as given, id included (loading saved graphs): inputs in, id new."""
        if node.id in self._nodes:
            raise GraphError(f"node id {node.id} is taken")
        for ref in node.inputs:
            self._check_ref(ref)
        nid = self._insert(node)
        for ref in node.inputs:
            self._dag.add_edge(self._index[ref.node], self._index[nid], "data")
        return nid

    def restore_nodes(self, nodes: Iterable[Node]) -> None:
        """`restore_node` for each of `nodes` in turn, the rustworkx graph grown by two batched
        calls (same indices and edge order): a fission rebuild copies thousands of nodes per
        split. On an error the graph is left half-built: rebuilders discard it."""
        own, index = self._nodes, self._index
        added: list[int] = []
        for node in nodes:
            if node.id in own:
                raise GraphError(f"node id {node.id} is taken")
            for ref in node.inputs:
                self._check_ref(ref)
            own[node.id] = node
            written = self.overwritten_placeholder(node.id)
            if written is not None:
                self._writers[written] = node.id
            added.append(node.id)
        for nid, ix in zip(added, self._dag.add_nodes_from(added), strict=True):
            self._set_index(nid, ix)
        self._next_id = max(self._next_id, max(added, default=-1) + 1)
        self._dag.add_edges_from(
            [(index[r.node], index[nid], "data") for nid in added for r in own[nid].inputs]
        )
        self._invalidate()

    def add_control_dep(self, before: int, after: int) -> None:
        """`after` may only run once `before` has run (no data flows)."""
        if before == after:
            return
        self._control[after] = self._control.get(after, frozenset()) | {before}
        a, b = self._index[before], self._index[after]
        if not self._dag.has_edge(a, b):
            self._dag.add_edge(a, b, "control")
        self._invalidate()

    def restride(self, nid: int, outputs: tuple[TensorMeta, ...]) -> None:
        """Record other strides for a node's outputs (same shapes and dtypes): what its op
        really returns, derived on fake tensors after a rewrite (`backend.meta_check`)."""
        node = self._nodes[nid]
        same = len(outputs) == len(node.outputs) and all(
            (a.shape, a.dtype) == (b.shape, b.dtype)
            for a, b in zip(outputs, node.outputs, strict=True)
        )
        if not same:
            raise GraphError(f"restride of {node.name} changes its outputs' shapes or dtypes")
        self._nodes[nid] = replace(node, outputs=tuple(outputs))
        self._invalidate()

    def set_outputs(self, refs: Iterable[Ref]) -> None:
        refs = tuple(refs)
        for ref in refs:
            self._check_ref(ref)
        self._outputs = refs
        self._invalidate()

    def replace_uses(self, old: Ref, new: Ref, users: Iterable[int] | None = None) -> list[int]:
        """Make `users` (default: every user of `old`, and the graph's outputs) read `new`
        instead; return the users changed.

        Nodes are immutable: a changed user is replaced by a copy with the same id, name and
        op, so schedules that name it stay meaningful.
        """
        self._check_ref(new)
        if users is None and old in self._outputs:
            self._outputs = tuple(new if r == old else r for r in self._outputs)
        targets = self.users(old.node) if users is None else list(users)
        changed = []
        for uid in targets:
            node = self._nodes[uid]
            if old not in node.inputs:
                continue
            swap = lambda r: new if r == old else r  # noqa: E731
            args = map_refs(node.args, swap)
            kwargs = tuple((k, map_refs(v, swap)) for k, v in node.kwargs)
            inputs = tuple(dict.fromkeys([*refs_in(args), *refs_in([v for _, v in kwargs])]))
            self._nodes[uid] = replace(node, args=args, kwargs=kwargs, inputs=inputs)
            self._rewire(uid, node.inputs, inputs)
            self._order_before_writers(uid, {})
            changed.append(uid)
        self._invalidate()
        return changed

    def _rewire(self, uid: int, before: tuple[Ref, ...], after: tuple[Ref, ...]) -> None:
        dst = self._index[uid]
        old_src = {r.node for r in before} - {r.node for r in after}
        for src in old_src:
            if src not in self._control.get(uid, ()) and self._dag.has_edge(self._index[src], dst):
                self._dag.remove_edge(self._index[src], dst)
        for src in {r.node for r in after}:
            if not self._dag.has_edge(self._index[src], dst):
                self._dag.add_edge(self._index[src], dst, "data")

    def copy(self) -> Graph:
        """An independent graph with the same nodes, ids and edges (nodes are shared: immutable)."""
        new = Graph(self.registry)
        new._dag = self._dag.copy()
        new._nodes = dict(self._nodes)
        new._index = self._index[:]
        new._control = dict(self._control)
        new._outputs = self._outputs
        new._writers = dict(self._writers)
        new._next_id = self._next_id
        return new

    def remove_node(self, nid: int) -> None:
        """Remove a node nobody uses (torch.fx's erase_node contract)."""
        if self.users(nid):
            raise GraphError(f"cannot remove {self._nodes[nid].name}: it still has users")
        if any(r.node == nid for r in self._outputs):
            raise GraphError(f"cannot remove {self._nodes[nid].name}: it is a graph output")
        written = self.overwritten_placeholder(nid)
        index = self._index[nid]
        self._index[nid] = -1
        # a control dependency keeps its edge (`replace_uses`): only successors can list nid
        followers = self._dag.successors(index) if self._control else ()
        self._dag.remove_node(index)
        self._nodes.pop(nid)
        if written is not None and self._writers.get(written) == nid:
            del self._writers[written]
        self._control.pop(nid, None)
        for after in followers:
            if nid in self._control.get(after, ()):
                self._control[after] -= {nid}
        self._invalidate()

    def _check_ref(self, ref: Ref) -> None:
        node = self._nodes.get(ref.node)
        if node is None or not 0 <= ref.index < len(node.outputs):
            raise GraphError(f"reference to a missing value {ref}")

    # --- queries ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, nid: int) -> bool:
        return nid in self._nodes

    def node(self, nid: int) -> Node:
        return self._nodes[nid]

    @property
    def nodes(self) -> dict[int, Node]:
        return self._nodes

    @property
    def outputs(self) -> tuple[Ref, ...]:
        return self._outputs

    @property
    def dag(self) -> rx.PyDiGraph:
        """The rustworkx graph; its node payloads are node ids."""
        return self._dag

    def rx_index(self, nid: int) -> int:
        return self._index[nid]

    def meta(self, ref: Ref) -> TensorMeta:
        return self._nodes[ref.node].outputs[ref.index]

    def info(self, nid: int) -> OpInfo:
        return self.registry.lookup(self._nodes[nid].op)

    def users(self, nid: int) -> list[int]:
        """Nodes that consume an output of `nid` (data edges), in id order.

        Read off the rustworkx successors (a control edge is not a use), so a rewrite that
        mutates the graph many times never pays for a whole-graph recount."""
        nodes = self._nodes
        succ = self._dag.successors(self._index[nid])
        return sorted(s for s in succ if any(r.node == nid for r in nodes[s].inputs))

    def control_deps(self, nid: int) -> frozenset[int]:
        return self._control.get(nid, frozenset())

    def with_control_deps(self) -> list[int]:
        """The nodes that have control dependencies, in program order."""
        return [n for n in self._nodes if n in self._control] if self._control else []

    def predecessors(self, nid: int) -> list[int]:
        """Data and control predecessors: what must run before `nid`."""
        return self._dag.predecessors(self._index[nid])  # the payloads are the node ids

    def successors(self, nid: int) -> list[int]:
        return self._dag.successors(self._index[nid])

    def placeholders(self, kind: PlaceholderKind | None = None) -> list[int]:
        nodes = self._nodes  # the ids cached: F-Tree analysis asks for them per dominator tree
        found = self.derived(_PLACEHOLDERS, lambda: [n for n in nodes if nodes[n].is_placeholder])
        return [n for n in found if kind is None or nodes[n].placeholder_kind is kind]

    def ops(self) -> list[int]:
        return [n.id for n in self._nodes.values() if not n.is_placeholder]

    @property
    def next_id(self) -> int:
        """The id the next added node gets (every id in the graph is below it)."""
        return self._next_id

    def added_since(self, parent: Graph) -> frozenset[int]:
        """Nodes of this graph (a copy of `parent`, then edited) that `parent` lacks: ids are
        never reused, so they are the ids from `parent.next_id` on (no scan of the graph)."""
        return frozenset(n for n in range(parent.next_id, self._next_id) if n in self._nodes)

    def program_order(self) -> list[int]:
        """Nodes in insertion order: the order the captured program ran them."""
        return list(self._nodes)

    def topological_order(self) -> list[int]:
        """A topological order, ties broken by program order (deterministic)."""
        return self.derived(_TOPO, self._compute_topo)

    def meta_args(self, nid: int) -> tuple[tuple, dict[str, Any]]:
        """The node's args and kwargs with every Ref replaced by its TensorMeta (cost terms)."""
        node = self._nodes[nid]
        args = map_refs(node.args, self.meta)
        kwargs = {k: map_refs(v, self.meta) for k, v in node.kwargs}
        return args, kwargs

    # --- derived facts --------------------------------------------------------------------

    def derived(self, key: DerivedKey[T], compute: Callable[[], T]) -> T:
        """The fact `key` of this version: `compute()` on first use, kept until it changes."""
        if not isinstance(key, DerivedKey):
            raise TypeError(f"derived facts are keyed by a DerivedKey, not {key!r}")
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    def known(self, key: DerivedKey[T]) -> T | None:
        """The fact `key` if this version has it (a child's is derived from it), else None."""
        return self._derived.get(key)

    def _invalidate(self) -> None:
        """Every mutation calls this: derived facts belong to the version that computed them."""
        self._derived.clear()

    def _compute_topo(self) -> list[int]:
        rank = {nid: i for i, nid in enumerate(self._nodes)}
        order = rx.lexicographical_topological_sort(self._dag, key=lambda nid: f"{rank[nid]:09d}")
        return list(order)

    def copy_nodes(self) -> frozenset[int]:
        """The Store and Load nodes (the copy stream's), once per graph version."""

        def build() -> frozenset[int]:
            return frozenset(n for n, node in self._nodes.items() if node.op in (STORE_OP, LOAD_OP))

        return self.derived(_COPY_NODES, build)

    def storages(self) -> StorageMap:
        """Storage and alias bookkeeping for the current version (see `StorageMap`)."""
        return self.derived(_STORAGES, lambda: StorageMap.build(self))

    def set_storages(self, storages: StorageMap) -> None:
        """Install `storages`, derived from a parent's (`derive_storages`: a search step touches
        a few nodes, a build walks all), as this version's; the caller vouches it is a build's."""
        self._derived[_STORAGES] = storages

    # --- checks ---------------------------------------------------------------------------

    def verify(self, nodes: Iterable[int] | None = None) -> None:
        """Check the invariants every rewrite must keep; raise GraphError naming the culprit.
        `nodes`: only these nodes' own (what a rewrite made; copies were checked before)."""
        if not rx.is_directed_acyclic_graph(self._dag):
            raise GraphError("the graph has a cycle")
        own = self._nodes
        for node in own.values() if nodes is None else (own[n] for n in nodes):
            for ref in node.inputs:
                self._check_ref(ref)
            if node.writes_into is not None:
                target = self._nodes[node.writes_into.node]
                if not target.is_placeholder:
                    raise GraphError(f"{node.name} writes into {target.name}, not a placeholder")
            if not node.is_placeholder and not node.outputs:
                raise GraphError(f"{node.name} has no outputs")
        for ref in self._outputs:
            self._check_ref(ref)

    def is_valid_schedule(self, order: list[int]) -> bool:
        """True when `order` runs every node exactly once, after all its predecessors."""
        if len(order) != len(self._nodes) or set(order) != set(self._nodes):
            return False
        pos = positions(order)
        return all(pos[p] < pos[nid] for nid in order for p in self.predecessors(nid))

    def summary(self) -> dict[str, int]:
        ops, nodes = self.ops(), len(self._nodes)
        views = sum(1 for n in ops if self.info(n).is_view)
        distinct = len({self._nodes[n].op for n in ops})
        return {"nodes": nodes, "ops": len(ops), "distinct_ops": distinct, "views": views,
                "placeholders": nodes - len(ops)}  # fmt: skip


def derive_storages(
    parent: Graph,
    child: Graph,
    added: Iterable[int],
    changed: Iterable[int],
    removed: Iterable[int] = (),
) -> StorageMap:
    """`child`'s StorageMap from `parent`'s, `child` being `parent` with `added`, `changed`
    (re-wired) and `removed` nodes. Pure: install it with `child.set_storages`."""
    smap = parent.storages()
    return StorageMap.update(smap, parent, child, set(added), set(changed), set(removed))
