"""Random graphs for testing schedulers and for the incremental-scheduling experiment (MAGIS §7.3).

* `random_dag`: small DAGs with the features that make the memory model subtle — views sharing a
  storage, multi-output ops, in-place updates into placeholders ordered after every reader of the
  old value by control edges, graph outputs.
* `nasnet_dag`: stacked NASNet cells (Zoph et al. 2018): each cell reads the outputs of the two
  previous cells; 5 blocks each apply an op to two hidden states (the cell inputs or earlier
  blocks' results) and add them; the blocks' results are concatenated and projected back.
* `random_rewrite`: one random valid rewrite of the kinds MAGIS's search applies (§5.2 and TASO
  rules): re-computation inserted or removed, a node split in two halves, two parallel nodes
  merged. It returns the new graph and the old nodes it touched (Alg. 2's S_old).

Everything is drawn from one `numpy.random.Generator`; the same seed gives the same graph.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from magis.ir import Graph, PlaceholderKind, Ref, TensorMeta
from magis.ir.ops import LOAD_OP, STORE_OP


def f32(*shape: int) -> TensorMeta:
    return TensorMeta(tuple(int(s) for s in shape), "float32", 4)


def random_dag(
    rng: np.random.Generator,
    n_ops: int,
    n_inputs: int = 2,
    n_updates: int = 0,
    p_view: float = 0.15,
    p_multi: float = 0.1,
    p_swap: float = 0.0,
    p_random: float = 0.0,
) -> Graph:
    """A random DAG of `n_ops` ops (plus `n_updates` in-place updates) over a few placeholders;
    a fraction `p_swap` of the ops is a Store/Load pair (swapping, §5.2), a fraction `p_random`
    draws from the random generator (dropout's bernoulli)."""
    g = Graph()
    values: list[Ref] = []
    weights = []
    for i in range(n_inputs):
        values.append(Ref(g.add_placeholder(f"x{i}", _vec(rng), PlaceholderKind.DATA)))
    for i in range(max(n_updates, 1)):
        w = g.add_placeholder(f"w{i}", _vec(rng), PlaceholderKind.WEIGHT)
        weights.append(w)
        values.append(Ref(w))
    for i in range(n_ops):
        draw = rng.random()
        if draw < p_random:
            src = values[-1 - int(rng.integers(min(len(values), 8)))]
            mask = g.add_op(f"bernoulli{i}", "aten.bernoulli.default", (src,), outputs=(_vec(rng),))
            values.append(Ref(mask))
        elif draw < p_random + p_swap:
            src = values[-1 - int(rng.integers(min(len(values), 8)))]
            st = g.add_op(f"store{i}", STORE_OP, (src,), outputs=(g.meta(src),))
            values.append(Ref(g.add_op(f"load{i}", LOAD_OP, (Ref(st),), outputs=(g.meta(src),))))
        else:
            values.extend(_random_op(g, rng, values, f"op{i}", p_view, p_multi))
    # An update's operand is never a view of a weight: two updates, each reading a view of
    # what the other writes, would each have to run before the other.
    smap = g.storages()
    ops = [Ref(n) for n in g.ops() if smap.base[Ref(n)] not in smap.resident]
    for i, w in enumerate(weights[:n_updates]):
        src = ops[int(rng.integers(len(ops)))] if ops else Ref(w)
        readers = list(g.storages().readers[Ref(w)])
        upd = g.add_op(
            f"update{i}",
            "aten.sub.Tensor",
            (Ref(w), src),
            outputs=(g.meta(Ref(w)),),
            writes_into=Ref(w),
        )
        for r in readers:
            g.add_control_dep(r, upd)
    sinks = [n for n in g.ops() if not g.users(n) and g.node(n).writes_into is None]
    g.set_outputs([Ref(sinks[-1])] if sinks else [])
    g.verify()
    return g


def _vec(rng: np.random.Generator) -> TensorMeta:
    return f32(int(rng.integers(1, 65)))


def _random_op(
    g: Graph, rng: np.random.Generator, values: list[Ref], name: str, p_view: float, p_multi: float
) -> list[Ref]:
    recent = values[-8:]  # prefer recent values: graphs with depth, not a flat fan-out
    pool = recent if rng.random() < 0.7 else values
    kind = rng.random()
    if kind < p_view:
        src = pool[int(rng.integers(len(pool)))]
        nid = g.add_op(name, "aten.view.default", (src, [-1]), outputs=(g.meta(src),))
        return [Ref(nid)]
    k = int(rng.integers(1, min(3, len(pool)) + 1))
    picks = [pool[int(i)] for i in rng.choice(len(pool), size=k, replace=False)]
    if kind < p_view + p_multi:
        outs = (_vec(rng), _vec(rng))
        nid = g.add_op(name, "aten.var_mean.correction", (picks[0], [0]), outputs=outs)
        return [Ref(nid, 0), Ref(nid, 1)]
    op = ("aten.relu.default", "aten.add.Tensor", "aten.cat.default")[k - 1]
    args: tuple = ([*picks], 0) if k == 3 else tuple(picks)
    return [Ref(g.add_op(name, op, args, outputs=(_vec(rng),)))]


# --- NASNet-shaped graphs ---------------------------------------------------------------------


@dataclass(frozen=True)
class NasnetShape:
    cells: int = 8
    blocks: int = 5
    batch: int = 256  # activations, not the weights, dominate the peak
    channels: tuple[int, int] = (16, 96)  # each cell draws its width in this range


def nasnet_dag(rng: np.random.Generator, shape: NasnetShape = NasnetShape()) -> Graph:
    """Stacked NASNet cells over (batch, channels) activations (see the module docstring)."""
    g = Graph()
    width = int(rng.integers(*shape.channels))
    x = g.add_placeholder("input", f32(shape.batch, width), PlaceholderKind.DATA)
    prev2 = prev1 = Ref(x)
    for c in range(shape.cells):
        out_width = int(rng.integers(*shape.channels))
        prev2, prev1 = prev1, _cell(g, rng, f"c{c}", prev2, prev1, out_width, shape)
    loss = g.add_op("loss", "aten.sum.default", (prev1,), outputs=(f32(),))
    g.set_outputs([Ref(loss)])
    g.verify()
    return g


def _cell(g, rng, name, h0: Ref, h1: Ref, width: int, shape: NasnetShape) -> Ref:
    states = [_project(g, f"{name}.in0", h0, width), _project(g, f"{name}.in1", h1, width)]
    for b in range(shape.blocks):
        picks = rng.choice(len(states), size=2, replace=True)
        left = _block_op(g, rng, f"{name}.b{b}.l", states[int(picks[0])], width)
        right = _block_op(g, rng, f"{name}.b{b}.r", states[int(picks[1])], width)
        states.append(
            Ref(g.add_op(f"{name}.b{b}", "aten.add.Tensor", (left, right), outputs=(g.meta(left),)))
        )
    hidden = states[2:]
    batch = g.meta(hidden[0]).shape[0]
    cat = g.add_op(
        f"{name}.cat", "aten.cat.default", (hidden, 1), outputs=(f32(batch, width * len(hidden)),)
    )
    return _project(g, f"{name}.out", Ref(cat), width)


def _project(g: Graph, name: str, x: Ref, width: int) -> Ref:
    """A 1x1 convolution: x @ W, W a weight placeholder."""
    batch, cin = g.meta(x).shape
    w = g.add_placeholder(f"{name}.w", f32(cin, width), PlaceholderKind.WEIGHT)
    return Ref(g.add_op(name, "aten.mm.default", (x, Ref(w)), outputs=(f32(batch, width),)))


def _block_op(g: Graph, rng: np.random.Generator, name: str, x: Ref, width: int) -> Ref:
    """One of NASNet's block ops on a (batch, width) state: separable conv, pooling, identity."""
    kind = int(rng.integers(4))
    if kind == 0:  # separable convolution: ReLU, conv, ReLU, conv
        h = Ref(g.add_op(f"{name}.relu", "aten.relu.default", (x,), outputs=(g.meta(x),)))
        h = _project(g, f"{name}.conv1", h, width)
        h = Ref(g.add_op(f"{name}.relu2", "aten.relu.default", (h,), outputs=(g.meta(h),)))
        return _project(g, f"{name}.conv2", h, width)
    if kind == 1:  # a wider intermediate (expansion), then back
        wide = _project(g, f"{name}.expand", x, width * 4)
        wide = Ref(g.add_op(f"{name}.relu", "aten.relu.default", (wide,), outputs=(g.meta(wide),)))
        return _project(g, f"{name}.reduce", wide, width)
    if kind == 2:  # pooling
        return Ref(g.add_op(f"{name}.pool", "aten.mul.Tensor", (x, 0.5), outputs=(g.meta(x),)))
    return Ref(g.add_op(f"{name}.id", "aten.clone.default", (x,), outputs=(g.meta(x),)))


# --- rewrites -----------------------------------------------------------------------------------


class RewriteKind(enum.Enum):
    REMAT = "recompute-insert"  # MAGIS Fig. 8 (a)(b)
    DEREMAT = "recompute-remove"  # Fig. 8 (c)(d)
    SPLIT = "split"  # a node computed as two halves and concatenated
    MERGE = "merge"  # two parallel mm sharing an input fused into one


@dataclass(frozen=True)
class Rewrite:
    kind: RewriteKind
    graph: Graph  # the new graph
    changed: frozenset[int]  # old nodes the rewrite touched (Alg. 2's S_old)


def random_rewrite(
    graph: Graph, rng: np.random.Generator, focus: frozenset[int] = frozenset()
) -> Rewrite | None:
    """One valid rewrite of a kind drawn at random (others tried when it has no site); None if
    no kind applies. Sites among the `focus` nodes are preferred when there are any (MAGIS §5.2
    applies rules around memory hot-spots)."""
    kinds = list(RewriteKind)
    for i in rng.permutation(len(kinds)):
        site = _REWRITES[kinds[int(i)]](graph, _Picker(rng, focus))
        if site is not None:
            site.graph.verify()
            return site
    return None


@dataclass(frozen=True)
class _Picker:
    """Draws a rewrite site, from the focus nodes when any site is one."""

    rng: np.random.Generator
    focus: frozenset[int]

    def pick(self, sites: list, key: Callable = lambda s: s):
        near = [s for s in sites if key(s) in self.focus]
        pool = near or sites
        return pool[int(self.rng.integers(len(pool)))]


def _computes(graph: Graph, nid: int) -> bool:
    node = graph.node(nid)
    return not node.is_placeholder and node.writes_into is None and not graph.info(nid).is_view


def _remat(graph: Graph, pick: _Picker) -> Rewrite | None:
    """A user B of a node A with several users gets its own copy A' of A."""
    sites = [n for n in graph.ops() if _computes(graph, n) and len(graph.users(n)) >= 2]
    if not sites:
        return None
    a = pick.pick(sites)
    users = graph.users(a)
    b = users[int(pick.rng.integers(1, len(users)))]
    g = graph.copy()
    node = g.node(a)
    copy = g.add_op(f"{node.name}.re", node.op, node.args, node.kwargs_dict, node.outputs)
    for i in range(len(node.outputs)):
        g.replace_uses(Ref(a, i), Ref(copy, i), users=[b])
    return Rewrite(RewriteKind.REMAT, g, frozenset({a, b}))


def _deremat(graph: Graph, pick: _Picker) -> Rewrite | None:
    """Two nodes of the same op on the same inputs become one (the dual of `_remat`)."""
    seen: dict[tuple, int] = {}
    pairs = []
    for n in graph.topological_order():
        if not _computes(graph, n) or graph.control_deps(n):
            continue
        node = graph.node(n)
        key = (node.op, repr(node.args), node.kwargs, node.outputs)
        if key in seen and not any(r.node == n for r in graph.outputs):
            pairs.append((seen[key], n))
        else:
            seen.setdefault(key, n)
    if not pairs:
        return None
    keep, drop = pick.pick(pairs, key=lambda pair: pair[0])
    g = graph.copy()
    users = g.users(drop)
    for i in range(len(g.node(drop).outputs)):
        g.replace_uses(Ref(drop, i), Ref(keep, i))
    g.remove_node(drop)
    return Rewrite(RewriteKind.DEREMAT, g, frozenset({keep, drop, *users}))


def _split(graph: Graph, pick: _Picker) -> Rewrite | None:
    """A 2-D elementwise node computed as two row halves, then concatenated (fission, n = 2)."""
    sites = [
        n
        for n in graph.ops()
        if _computes(graph, n)
        and graph.node(n).op in ("aten.relu.default", "aten.mul.Tensor", "aten.clone.default")
        and len(graph.node(n).inputs) == 1
        and len(graph.node(n).outputs[0].shape) == 2
        and graph.node(n).outputs[0].shape[0] % 2 == 0
        and not any(r.node == n for r in graph.outputs)
    ]
    if not sites:
        return None
    a = pick.pick(sites)
    g = graph.copy()
    node = g.node(a)
    src = node.inputs[0]
    rows, cols = node.outputs[0].shape
    halves = []
    for h in range(2):
        part = g.add_op(
            f"{node.name}.in{h}",
            "aten.slice.Tensor",
            (src, 0, h * rows // 2, (h + 1) * rows // 2),
            outputs=(f32(rows // 2, cols),),
        )
        args = (Ref(part), *node.args[1:])
        halves.append(
            Ref(g.add_op(f"{node.name}.h{h}", node.op, args, outputs=(f32(rows // 2, cols),)))
        )
    cat = g.add_op(f"{node.name}.cat", "aten.cat.default", (halves, 0), outputs=node.outputs)
    users = g.users(a)
    g.replace_uses(Ref(a), Ref(cat))
    g.remove_node(a)
    return Rewrite(RewriteKind.SPLIT, g, frozenset({a, *users}))


def _merge(graph: Graph, pick: _Picker) -> Rewrite | None:
    """mm(X, W1) and mm(X, W2) become mm(X, cat(W1, W2)) read through two column slices (TASO)."""
    by_input: dict[Ref, list[int]] = {}
    for n in graph.ops():
        node = graph.node(n)
        weight = node.args[1] if node.op == "aten.mm.default" else None
        # weights must be placeholders: a computed one could depend on the other mm (a cycle)
        if weight is not None and graph.node(weight.node).is_placeholder:
            by_input.setdefault(node.args[0], []).append(n)
    sites = [v for v in by_input.values() if len(v) >= 2]
    if not sites:
        return None
    group = pick.pick(sites, key=lambda group: group[0])
    m1, m2 = (group[int(i)] for i in pick.rng.choice(len(group), size=2, replace=False))
    g = graph.copy()
    n1, n2 = g.node(m1), g.node(m2)
    w1, w2 = n1.args[1], n2.args[1]
    k, c1 = g.meta(w1).shape
    c2 = g.meta(w2).shape[1]
    rows = n1.outputs[0].shape[0]
    wcat = g.add_op(
        f"{n1.name}.wcat", "aten.cat.default", ([w1, w2], 1), outputs=(f32(k, c1 + c2),)
    )
    mm = g.add_op(
        f"{n1.name}.merged",
        "aten.mm.default",
        (n1.args[0], Ref(wcat)),
        outputs=(f32(rows, c1 + c2),),
    )
    s1 = g.add_op(f"{n1.name}.part", "aten.slice.Tensor", (Ref(mm), 1, 0, c1), outputs=n1.outputs)
    s2 = g.add_op(
        f"{n2.name}.part", "aten.slice.Tensor", (Ref(mm), 1, c1, c1 + c2), outputs=n2.outputs
    )
    users = {*g.users(m1), *g.users(m2)}
    outs = [Ref(s1) if r == Ref(m1) else Ref(s2) if r == Ref(m2) else r for r in g.outputs]
    g.replace_uses(Ref(m1), Ref(s1))
    g.replace_uses(Ref(m2), Ref(s2))
    g.set_outputs(outs)
    g.remove_node(m1)
    g.remove_node(m2)
    return Rewrite(RewriteKind.MERGE, g, frozenset({m1, m2, *users}))


_REWRITES: dict[RewriteKind, Callable[[Graph, _Picker], Rewrite | None]] = {
    RewriteKind.REMAT: _remat,
    RewriteKind.DEREMAT: _deremat,
    RewriteKind.SPLIT: _split,
    RewriteKind.MERGE: _merge,
}


def random_topological_order(graph: Graph, rng: random.Random) -> list[int]:
    """A valid order of `graph` drawn by Kahn's algorithm with a random ready node each step
    (tests: orders a scheduler would not give)."""
    indegree = {n: len(graph.predecessors(n)) for n in graph.nodes}
    ready = [n for n, d in indegree.items() if d == 0]
    order = []
    while ready:
        n = ready.pop(rng.randrange(len(ready)))
        order.append(n)
        for s in graph.successors(n):
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    return order
