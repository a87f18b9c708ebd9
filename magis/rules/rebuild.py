"""Copying a graph node by node into a new one, in a chosen order (what rewrites that touch
thousands of nodes — a materialized F-Trans, the interim transformations — build on)."""

from __future__ import annotations

from collections.abc import Callable

from magis.ir import Graph, Ref, TensorMeta
from magis.ir.graph import Node, NodeKind


class _Env(dict):
    """Old Ref -> new Ref. A Ref not in it stands for itself: copies keep their node's id, and
    binding every output of every copy cost more than a split's own work."""

    __slots__ = ()

    def __missing__(self, ref: Ref) -> Ref:
        return ref


class GraphRebuilder:
    """Copies nodes of `old`, in the order asked, into a new Graph, remapping their Refs.

    The new graph's insertion order is the order of the calls, so its program order is the
    schedule the rewrite chose. `ids[old]` lists the new nodes an old node became. The new
    graph is filled by `finish` (in one batch: `Graph.restore_nodes`).
    """

    def __init__(self, old: Graph) -> None:
        self.old = old
        self.new = Graph(old.registry)
        self.env: dict[Ref, Ref] = _Env()
        self.ids: dict[int, list[int]] = {}
        # Copies keep their node's id (and, when none of their inputs moved, the very Node:
        # no remapping): a split touches a few hundred nodes of thousands, and rebuilding the
        # rest cost more than the split. Created nodes get fresh ids, in call order.
        self._next = old.next_id
        self._pending: list[Node] = []  # the new graph's nodes, in order
        self.created: list[int] = []  # nodes that are not a plain copy of an old node
        self.remapped: list[int] = []  # copies whose inputs moved (same id, new Node)

    def mapped(self, value):
        """`value` with every Ref replaced by its new Ref."""
        if isinstance(value, Ref):
            return self.env[value]
        if isinstance(value, list):
            return [self.mapped(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.mapped(v) for v in value)
        return value

    def _moved(self, node: Node) -> bool:
        env = self.env
        if not env or node.is_placeholder:
            return False
        if any(r in env and env[r] != r for r in node.inputs):
            return True
        w = node.writes_into
        return w is not None and w in env and env[w] != w

    def copy(self, nid: int) -> int:
        node = self.old.node(nid)
        self.ids[nid] = [nid]
        if not self._moved(node):
            self._pending.append(node)
            return nid
        self.remapped.append(nid)
        return self._add_node(
            node.id,
            node.name,
            node.op,
            self.mapped(node.args),
            {k: self.mapped(v) for k, v in node.kwargs},
            node.outputs,
            writes_into=self.env[node.writes_into] if node.writes_into else None,
        )

    def add_op(
        self,
        name: str,
        op: str,
        args: tuple,
        kwargs: dict | None,
        outputs: tuple[TensorMeta, ...],
        writes_into: Ref | None = None,
    ) -> int:
        """`Graph.add_op` without its per-call ordering of readers before in-place writers,
        which scans the graph each time (quadratic on 100k-node splits); `finish` orders them
        all at once. Nodes enter through `Graph.restore_nodes`, ids in call order."""
        nid = self._add_node(self._next, name, op, args, kwargs, outputs, writes_into)
        self._next += 1
        self.created.append(nid)
        return nid

    def _add_node(
        self,
        nid: int,
        name: str,
        op: str,
        args: tuple,
        kwargs: dict | None,
        outputs: tuple[TensorMeta, ...],
        writes_into: Ref | None = None,
    ) -> int:
        kw = tuple(sorted((kwargs or {}).items()))
        inputs = tuple(dict.fromkeys(_refs([v for _, v in kw], _refs(args, []))))
        node = Node(
            id=nid,
            name=name,
            op=op,
            kind=NodeKind.OP,
            args=tuple(args),
            kwargs=kw,
            outputs=tuple(outputs),
            writes_into=writes_into,
            inputs=inputs,
        )
        self._pending.append(node)
        return nid

    def bind(self, nid: int, new_ids: list[int]) -> None:
        self.ids[nid] = new_ids
        if len(new_ids) == 1 and new_ids[0] != nid:  # a copy's Refs stand for themselves
            for i in range(len(self.old.node(nid).outputs)):
                self.env.setdefault(Ref(nid, i), Ref(new_ids[0], i))

    def add(self, name: str, op: str, args: tuple, outputs: tuple[TensorMeta, ...], **kw) -> Ref:
        return Ref(self.add_op(name, op, args, kw or None, outputs))

    def finish(self) -> Graph:
        """The nodes inserted, outputs remapped, control dependencies carried to every copy,
        in-place writes ordered after every new reader (a merge may read what an update
        overwrites). Copies inherit their original's constraints and checks, so only the
        created and re-wired nodes are examined: a whole-graph pass per split would cost more
        than the split."""
        g = self.new
        g.restore_nodes(self._pending)
        self._pending = []
        g.set_outputs([self.env[r] for r in self.old.outputs])
        for after in self.old.with_control_deps():
            for before in self.old.control_deps(after):
                for b in self.ids.get(before, []):
                    for a in self.ids.get(after, []):
                        g.add_control_dep(b, a)
        g.order_before_writers(self.created)
        g.verify([*self.created, *self.remapped])
        return g


def map_slots(node: Node, fn: Callable[[int, Ref], Ref]) -> tuple[tuple, dict]:
    """The node's args and kwargs with the j-th Ref occurrence (slot j) replaced by fn(j, ref)."""
    slots = _Slots(fn)
    args = slots.walk(node.args)
    kwargs = {k: slots.walk(v) for k, v in node.kwargs}
    return args, kwargs


class _Slots:
    """`map_slots`'s walk, counting slots. A class, not a recursive closure: a closure that
    calls itself holds its own cell, a reference cycle that kept every split node's closures
    (620,000 objects for Phi-1.5's 8-way split) alive until a collection walked them."""

    __slots__ = ("fn", "slot")

    def __init__(self, fn: Callable[[int, Ref], Ref]) -> None:
        self.fn, self.slot = fn, 0

    def walk(self, value):
        if isinstance(value, Ref):
            self.slot += 1
            return self.fn(self.slot - 1, value)
        if isinstance(value, list | tuple):
            out = [self.walk(v) if isinstance(v, _NESTED) else v for v in value]
            return out if isinstance(value, list) else tuple(out)
        return value


_NESTED = (Ref, list, tuple)  # what `map_slots` and `_refs` look into


def _refs(value, out: list[Ref]) -> list[Ref]:
    """Every Ref inside `value`, appended to `out` in order (`refs_in`, without generators:
    a split makes thousands of nodes)."""
    if isinstance(value, Ref):
        out.append(value)
    elif isinstance(value, list | tuple):
        for v in value:
            if isinstance(v, _NESTED):
                _refs(v, out)
    return out


def view_chain_from(
    rb: GraphRebuilder, graph: Graph, inside: set[int], ref: Ref, suffix: str
) -> Ref | None:
    """`ref`, a value of nodes in `inside`, copied into `rb` as the chain of views it is of a
    value outside them (each copy named with `suffix`, reading the rebuilt value; the copies
    keep the original's strides), or None when a node on the way is no view."""
    chain: list[int] = []
    value = ref
    while value.node in inside:
        if not graph.info(value.node).is_view:
            return None
        chain.append(value.node)
        value = graph.node(value.node).inputs[0]  # a view aliases its first tensor argument
    if not chain:
        return None
    mapping: dict[Ref, Ref] = {}
    for v in reversed(chain):
        node = graph.node(v)
        args, kwargs = map_slots(node, lambda _, r: mapping.get(r) or rb.env[r])
        new = rb.add_op(f"{node.name}{suffix}", node.op, tuple(args), kwargs, node.outputs)
        rb.ids.setdefault(v, []).append(new)
        for k in range(len(node.outputs)):
            mapping[Ref(v, k)] = Ref(new, k)
    return mapping[ref]
