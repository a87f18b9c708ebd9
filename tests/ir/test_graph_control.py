"""Control dependencies (`Graph.add_control_dep`): shared between a graph and its copies until
one of them changes its own, and dropped from every follower when a node goes."""

from magis.ir import Graph, PlaceholderKind, Ref, TensorMeta
from magis.ir.topological import control_followers

META = TensorMeta((4,), "float32", 4)


def _chain() -> tuple[Graph, int, int, int, int]:
    g = Graph()
    x = g.add_placeholder("x", META, PlaceholderKind.DATA)
    a = g.add_op("a", "aten.relu.default", (Ref(x),), outputs=(META,))
    b = g.add_op("b", "aten.neg.default", (Ref(x),), outputs=(META,))
    c = g.add_op("c", "aten.add.Tensor", (Ref(b), Ref(x)), outputs=(META,))
    g.set_outputs([Ref(c)])
    g.add_control_dep(a, b)  # a must run before b, c (no data from a)
    g.add_control_dep(a, c)
    return g, x, a, b, c


def test_a_copys_control_dependencies_are_its_own():
    g, _, a, b, c = _chain()
    h = g.copy()
    h.add_control_dep(b, c)
    assert g.control_deps(c) == {a} and h.control_deps(c) == {a, b}
    assert h.is_valid_schedule([0, a, b, c]) and not h.is_valid_schedule([0, b, a, c])


def test_removing_a_node_drops_it_from_its_followers_only_in_that_graph():
    g, _, a, b, c = _chain()
    h = g.copy()
    h.remove_node(a)
    assert h.control_deps(b) == frozenset() and h.control_deps(c) == frozenset()
    assert h.is_valid_schedule([0, b, c])
    assert g.control_deps(b) == {a} and g.control_deps(c) == {a}  # the original keeps them
    assert not g.is_valid_schedule([0, b, a, c])


def test_a_nodes_control_followers_are_those_that_wait_for_it_and_no_data_reader():
    """`control_followers` (read off the node's successors) against its definition over
    every node with control dependencies: `d` reads `a`'s output (a data reader, no
    follower) and waits for `b`."""
    g, x, a, b, c = _chain()
    d = g.add_op("d", "aten.neg.default", (Ref(a),), outputs=(META,))
    g.add_control_dep(b, d)
    for h in (g, g.copy()):
        for n in (x, a, b, c, d):
            defined = [f for f in h.with_control_deps() if n in h.control_deps(f)]
            assert control_followers(h, n) == sorted(defined)
    assert control_followers(g, a) == [b, c] and control_followers(g, b) == [d]
    assert control_followers(g, c) == [] and control_followers(g, d) == []
