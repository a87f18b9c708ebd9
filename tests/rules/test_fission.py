"""Fission (MAGIS §4-§5.1): the paper's worked examples, the F-Tree rules, and every F-Tree node of
the seven tiny workloads executed, verified against eager PyTorch and measured."""

from __future__ import annotations

import functools

import pytest
import rustworkx as rx
import torch
import torch.nn.functional as F

from magis.analyze import (
    FTrans,
    FTree,
    InputKind,
    OutputKind,
    build_ftree,
    check,
    dgraph,
    dominator_tree,
    get_scores,
    node_dims,
)
from magis.backend import compile_program, measure, verify
from magis.capture import WORKLOAD_FAMILIES, workload_step
from magis.cost import UnitCostModel
from magis.ir import Graph, Ref
from magis.ir.builder import GraphBuilder
from magis.rules import (
    FissionError,
    MutationKind,
    check_shapes,
    materialize,
    mutations,
    prepare,
)
from magis.rules.fission import split_graph
from magis.sim import simulate

# --- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def one_thread():
    """Tiny programs run faster on one thread, and the suite runs two workers on two cores."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _run(graph: Graph, inputs: list[torch.Tensor]) -> tuple:
    program = compile_program(graph, graph.program_order())
    return program(*[t.clone() for t in inputs])


def _random_inputs(graph: Graph, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(graph.node(p).outputs[0].shape, generator=gen, dtype=torch.float64)
        for p in graph.placeholders()
    ]


def _named(graph: Graph) -> dict[str, int]:
    return {graph.node(v).name: v for v in graph.nodes}


def _node_of(tree: FTree, nodes: set[int]) -> int:
    return next(i for i, x in enumerate(tree.nodes) if x.ftrans.nodes == frozenset(nodes))


# --- Fig. 5: F-Trans of an MLP training graph ---------------------------------------------------


def fig5_graph() -> Graph:
    """Fig. 5 (a), simplified from an MLP's training graph: a linear layer with a squared-error
    loss, forward and backward. v0 = x, v1 = W (a weight), v2 = the label; S = v3..v8."""
    b = GraphBuilder(torch.float64)
    v0 = b.input("v0", (8, 4))
    v1 = b.weight("v1", (4, 4))
    v2 = b.input("v2", (8, 4))
    v3 = b.mm(v0, v1, name="v3")  # prediction
    v4 = b.sub(v3, v2, name="v4")  # residual = d loss / d prediction
    v5 = b.mul(v4, v4, name="v5")
    v6 = b.sum(v5, [1], name="v6")  # per-sample loss
    v7 = b.mm(v4, b.t(v1, name="v1_t"), name="v7")  # gradient of x
    v8 = b.mm(b.t(v0, name="v0_t"), v4, name="v8")  # gradient of W: a sum over the batch
    b.output(v6, v7, v8)
    return b.build()


def test_fig5_ftrans_classifies_inputs_and_outputs():
    g = fig5_graph()
    ids = _named(g)
    S = {ids[f"v{i}"] for i in range(3, 9)} | {ids["v0_t"]}
    dg = dgraph(g)
    batch = dg.component_of(ids["v0"], 0)
    # D: the batch dimension of S's activations; v8 is split along a reduce axis (<v8, -1>)
    split = {}
    for v in S:
        (a,) = [a for a in range(4) if dg.component_of(v, a) == batch]
        split[v] = a
    info = check(g, FTrans(tuple(sorted(split.items())), 2))
    assert info, info
    kinds = {g.node(r.node).name: k for r, k in info.inputs.items()}
    assert kinds == {
        "v0": InputKind.SLICED,
        "v2": InputKind.SLICED,
        "v1": InputKind.SHARED,
        "v1_t": InputKind.SHARED,  # the weight, transposed outside S: a view of v1
    }
    merges = {g.node(r.node).name: m.kind for r, m in info.outputs.items()}
    assert merges == {"v6": OutputKind.CONCAT, "v7": OutputKind.CONCAT, "v8": OutputKind.SUM}
    from magis.analyze import node_dims

    assert node_dims(g)[ids["v8"]].is_reduce(split[ids["v8"]])


def test_fig5_algorithm1_finds_s_and_the_split_graph_computes_the_same():
    g = fig5_graph()
    ids = _named(g)
    tree = build_ftree(g)
    S = {ids[f"v{i}"] for i in range(3, 9)} | {ids["v0_t"]}
    i = _node_of(tree, S)
    assert tree.nodes[i].dominator == ids["v0"]  # the entry dominates the whole MLP
    m = materialize(g, tree.with_n(i, 2))
    ops = [m.graph.node(v).op for v in m.order]
    assert ops.count("aten.slice.Tensor") == 4  # v0 and v2, for each of the two parts
    assert ops.count("aten.cat.default") == 2  # v6, v7
    assert ops.count("aten.add.Tensor") == 1  # v8 = part 0 + part 1
    inputs = _random_inputs(g)
    for want, got in zip(_run(g, inputs), _run(m.graph, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# --- Fig. 6: F-Tree construction with L = 5 -----------------------------------------------------

# Fig. 6 is a drawing; the slides give its heat and score table for nodes 0, 1, 2, 3, 4, 10, 11,
# 12. This graph is reconstructed to reproduce those numbers exactly: every tensor has size 1
# (here 2 float32 elements, 8 bytes), H is given, n = 2.
FIG6_TABLE = {0: (12, 6), 1: (11, 5.5), 2: (10, 5), 3: (5, 2.5), 4: (3, 1.5), 10: (3, 1.5)}
FIG6_TABLE |= {11: (3, 0.5), 12: (2, 1)}
FIG6_HOT = (0, 1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 14)


def fig6_graph() -> Graph:
    b = GraphBuilder(torch.float32)
    v = {0: b.input("v0", (2,))}
    for i, src in ((1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (6, 5)):
        v[i] = b.relu(v[src], name=f"v{i}")
    v[7] = b.add(v[3], v[5], name="v7")
    v[8] = b.relu(v[7], name="v8")
    v[9] = b.add(v[6], v[8], name="v9")
    for i, src in ((10, 2), (11, 10), (12, 11), (13, 12)):
        v[i] = b.relu(v[src], name=f"v{i}")
    v[14] = b.add(v[9], v[13], name="v14")
    b.output(v[14])
    return b.build()


def _fig6():
    g = fig6_graph()
    ids = _named(g)
    hot = [Ref(ids[f"v{i}"]) for i in FIG6_HOT]
    return g, ids, hot


def test_fig6_heat_and_score_match_the_slides():
    g, ids, hot = _fig6()
    tree = dominator_tree(g, sorted(g.nodes))
    scores = get_scores(g, tree, frozenset(hot), n=2)
    for i, (heat, score) in FIG6_TABLE.items():
        assert scores.of(ids[f"v{i}"]) == (heat * 8, score * 8), f"v{i}"


def test_fig6_ftree_with_five_levels():
    g, ids, hot = _fig6()
    tree = build_ftree(g, max_level=5, hotspots=hot)
    doms = {g.node(x.dominator).name: x for x in tree.nodes}
    # intervals [0.2, 0.4): v4, v10; [0.4, 0.6): v3; [0.8, 1): v2 (v1 has v2 below it); [1, 1.2): v0
    assert {k: x.level for k, x in doms.items()} == {"v0": 5, "v2": 4, "v3": 2, "v4": 1, "v10": 1}
    name = {i: g.node(x.dominator).name for i, x in enumerate(tree.nodes)}
    parents = {name[i]: name.get(x.parent) for i, x in enumerate(tree.nodes)}
    assert parents == {"v0": None, "v2": "v0", "v3": "v2", "v4": "v3", "v10": "v2"}
    assert doms["v4"].ftrans.nodes == {ids["v5"], ids["v6"]}
    assert doms["v10"].ftrans.nodes == {ids["v11"], ids["v12"], ids["v13"]}


# --- F-Tree mutation rules (§5.1, Fig. 7) -------------------------------------------------------


def _kinds(tree: FTree) -> dict[MutationKind, list[int]]:
    out: dict[MutationKind, list[int]] = {k: [] for k in MutationKind}
    for c in mutations(tree):
        out[MutationKind(c.kind)].append(c.target)
    return out


def test_mutation_rules_follow_fig7():
    g, _, hot = _fig6()
    tree = build_ftree(g, max_level=5, hotspots=hot)
    name = {g.node(x.dominator).name: i for i, x in enumerate(tree.nodes)}
    leaves = sorted([name["v4"], name["v10"]])
    assert _kinds(tree) == {
        MutationKind.ENABLE: leaves,
        **{k: [] for k in MutationKind if k.value != "enable"},
    }
    # (a) enable a leaf with the smallest divisor
    t1 = tree.with_n(name["v4"], 2)
    got = _kinds(t1)
    assert name["v3"] in got[MutationKind.ENABLE]  # the parent of an enabled node
    assert got[MutationKind.DISABLE] == [name["v4"]] and got[MutationKind.LIFT] == [name["v4"]]
    assert got[MutationKind.MUTATE] == []  # length 2: n = 2 is already the largest divisor
    # (b) lift: the parent takes over
    lift = next(c for c in mutations(t1) if c.description == f"lift {name['v4']}").build()
    assert lift.nodes[name["v4"]].n == 1 and lift.nodes[name["v3"]].n == 2
    # (c) disable: only a node without enabled descendants
    both = t1.with_n(name["v3"], 2)
    assert _kinds(both)[MutationKind.DISABLE] == [name["v4"]]
    # enabling never goes below an enabled ancestor's subtree root
    assert name["v10"] not in _kinds(tree.with_n(name["v2"], 2))[MutationKind.ENABLE]


def test_mutate_rule_steps_to_the_next_divisor():
    g = fig5_graph()
    tree = build_ftree(g)
    i = max(range(len(tree)), key=lambda j: tree.nodes[j].size)
    assert tree.nodes[i].length == 8
    t = tree.with_n(i, 2)
    steps = []
    while True:
        mut = [c for c in mutations(t) if c.description == f"mutate {i}"]
        if not mut:
            break
        t = mut[0].build()
        steps.append(t.nodes[i].n)
    assert steps == [4, 8]
    back = []  # and down again, never below 2 (that is disabling)
    while mut := [c for c in mutations(t) if c.description == f"coarsen {i}"]:
        t = mut[0].build()
        back.append(t.nodes[i].n)
    assert back == [4, 2]


# --- dimension rules, checked by execution ------------------------------------------------------


def test_matmul_dimension_rule_is_the_papers_example():
    """§4.1: c[m, n] = sum_k a[m, k] b[k, n] links <a,1>-<c,1>, <a,2>-<c,-1>, <b,1>-<c,-1>,
    <b,2>-<c,2>."""
    b = GraphBuilder()
    a, w = b.input("a", (4, 6)), b.input("b", (6, 8))
    c = b.mm(a, w, name="c")
    b.output(c)
    g = b.build()
    dg = dgraph(g)
    comp = {
        (g.node(int(v)).name, int(x)): int(k)
        for v, x, k in zip(dg.vertex_node, dg.vertex_axis, dg.component, strict=True)
    }
    assert comp[("a", 0)] == comp[("c", 0)]  # m
    assert comp[("a", 1)] == comp[("c", 2)] == comp[("b", 0)]  # k: c's reduce axis
    assert comp[("b", 1)] == comp[("c", 1)]  # n
    assert len({comp[("a", 0)], comp[("a", 1)], comp[("b", 1)]}) == 3


def test_view_rule_joins_leading_dims_of_factor_groups():
    b = GraphBuilder()
    x = b.input("x", (2, 3, 8))
    y = b.view(x, [6, 2, 4], name="y")
    b.output(y)
    g = b.build()
    from magis.analyze import node_dims

    d = node_dims(g)[_named(g)["y"]]
    # groups: [2, 3] <-> [6] and [8] <-> [2, 4]; only leading dims correspond
    assert d.inputs[0] == (d.outputs[0][0], None, d.outputs[0][1])


@functools.cache
def _tiny(family: str):
    _, step = workload_step(f"{family}:tiny", dtype=torch.float64)
    return step


def _split_call(op, args, kwargs, dims, axis):
    """Run an op call as two parts along `axis`; where an output summed along it adds into an
    argument (`accumulates`), the second part adds into the first part's output instead."""
    from magis.ir.dims import split_shape

    carry = {j: k for k, j in dims.accumulates if (k, axis) in dims.sums}
    parts = []
    for i in range(2):
        slot = iter(range(1 << 20))

        def cut(x, i=i, slot=slot):
            if isinstance(x, torch.Tensor):
                j = next(slot)
                if i and j in carry:
                    return parts[-1][carry[j]].clone()
                d = dims.input_dim(j, axis)
                if d is None:
                    return x.clone()
                step = x.shape[d] // 2
                return x.narrow(d, i * step, step).clone()
            if isinstance(x, list):
                return [cut(v) for v in x]
            if isinstance(x, tuple):
                return tuple(cut(v) for v in x)
            return x

        a = list(cut(args))
        kw = {k: cut(v) for k, v in kwargs.items()}
        for p, k, *one in dims.shape_args:
            d = dims.output_dim(k, axis)
            if d is None:
                continue
            if one:  # an int spelling one dimension (group norm's N)
                a[p] = a[p] // 2 if one[0] == d else a[p]
            else:
                a[p] = list(split_shape(tuple(a[p]), d, 2))
        out = op(*a, **kw)
        parts.append(list(out) if isinstance(out, list | tuple) else [out])
    return parts


def _rule_cases(family: str):
    """Every op call of a tiny workload with a rule, with its real arguments (an eager run)."""
    return _call_cases(_tiny(family))


def _call_cases(step):
    """Every op call of a captured step with a rule, with its real arguments (an eager run)."""
    from magis.analyze import node_dims
    from magis.ir.ops import resolve_overload

    g = prepare(step.graph)
    dims = node_dims(g)
    inputs = step.program_inputs(step.make_inputs())
    env, cases, seen = {}, [], set()
    torch.manual_seed(0)
    for nid in g.program_order():
        node = g.node(nid)
        if node.is_placeholder:
            env[Ref(nid)] = inputs[g.placeholders().index(nid)]
            continue

        def val(x):
            if isinstance(x, Ref):
                return env[x]
            if isinstance(x, list | tuple):
                return type(x)(val(v) for v in x)
            return x

        op = resolve_overload(node.op)
        args, kwargs = val(node.args), {k: val(v) for k, v in node.kwargs}
        out = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        outs = list(out) if isinstance(out, list | tuple) else [out]
        for k in range(len(node.outputs)):
            env[Ref(nid, k)] = outs[k]
        key = (node.op, tuple(str(m.shape) for m in node.outputs))
        uninitialized = ".empty" in node.op or ".new_empty" in node.op  # nothing to compare
        if nid in dims and key not in seen and node.writes_into is None and not uninitialized:
            seen.add(key)
            cases.append((node.name, op, args, kwargs, outs, dims[nid]))
    return cases


# A corpus model whose ops the zoo lacks: group norm, baddbmm and the MSE loss (a diffusion U-Net).
RULE_FAMILIES = (*WORKLOAD_FAMILIES, "corpus:sd_unet")


@pytest.mark.parametrize("family", RULE_FAMILIES)
def test_dimension_rules_by_splitting_real_calls(family, one_thread):
    """DESIGN principle 1 for the rules: each call of the workload, split in two along every
    splittable axis the rule claims, merged by concatenation or sum, equals the whole call."""
    assert _checked_splits(_rule_cases(family)) > 20


class _RelativePositions(torch.nn.Module):
    """DeBERTa's disentangled attention in small: scores gathered by relative position (its
    backward a scatter_add) and a tiled projection input (repeat)."""

    def __init__(self, width: int = 8, length: int = 6) -> None:
        super().__init__()
        self.q, self.k = torch.nn.Linear(width, width), torch.nn.Linear(width, 2 * length)
        self.out = torch.nn.Linear(2 * width, width)
        pos = torch.arange(length)
        self.register_buffer("rel", (pos[:, None] - pos[None, :]).clamp(0, 2 * length - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.k(self.q(x))  # (B, T, 2T): a score per relative position
        index = self.rel.expand(x.shape[0], -1, -1)
        c2p = torch.gather(scores, -1, index).softmax(-1)
        return self.out((c2p @ x).repeat(1, 1, 2)).square().sum()


def test_gather_backward_and_repeat_split_as_their_rules_say(one_thread):
    from magis.capture.trace import training_step

    torch.manual_seed(0)
    model = _RelativePositions().double()
    step = training_step(model, (torch.randn(4, 6, 8, dtype=torch.float64),))
    cases = _call_cases(step)
    new = [c for c in cases if c[1].__name__.split(".")[0] in ("scatter_add", "repeat")]
    assert {c[1].__name__.split(".")[0] for c in new} == {"scatter_add", "repeat"}
    assert _checked_splits(new) >= 4  # batch and rows of each


class _FusedAttention(torch.nn.Module):
    """`F.scaled_dot_product_attention` (Hugging Face's default attention) with a padding mask
    and causally, a vector norm, indexing, and pointwise ops the workloads lack (rsub ...)."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.qkv, self.heads = torch.nn.Linear(width, 3 * width), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, w // self.heads).unbind(2)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        keep = torch.ones(b, 1, t, t, dtype=torch.bool).tril()
        padded = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = (1.0 - padded).exp2() + torch.atan2(causal, padded.abs() + 1) + causal.remainder(0.5)
        y = y + torch.hypot(causal, padded) + torch.xlogy(padded.abs(), causal.abs() + 1)
        y = y / (torch.linalg.vector_norm(y, dim=(1, 2), keepdim=True) + 1)  # ConvNeXt-V2's GRN
        picked = torch.tensor([2, 0])
        y = y[:, :, picked] + y.index_select(2, picked)  # index's and index_select's backward
        return (y.log2().abs() + y.erfc() + y.tan().atan()).sum()


def test_fused_attention_and_more_pointwise_ops_split_as_their_rules_say(one_thread):
    from magis.capture.trace import training_step

    torch.manual_seed(0)
    step = training_step(_FusedAttention().double(), (torch.randn(4, 6, 8).double(),))
    cases = _call_cases(step)
    ops = {c[1].__name__.split(".")[0] for c in cases}
    fused = "_scaled_dot_product_flash_attention_for_cpu"
    assert {fused, f"{fused}_backward", "rsub", "atan2", "linalg_vector_norm"} <= ops
    assert {"index", "index_put", "index_select", "index_add"} <= ops
    indexing = [c for c in cases if c[1].__name__.startswith("index")]
    assert _checked_splits(indexing) >= 12  # batch and heads of each of four calls
    checked = [c for c in cases if "attention" in c[1].__name__]
    assert _checked_splits(checked) >= 12  # batch, heads (and queries) of four calls
    assert _checked_splits(cases) > 60
    g = prepare(step.graph)  # and the batch split of the whole step runs as eager does
    tree = build_ftree(g)
    i = max(range(len(tree)), key=lambda k: tree.nodes[k].size)
    assert f"aten.{fused}_backward.default" in {g.node(v).op for v in tree.nodes[i].ftrans.nodes}
    m = materialize(g, tree.with_n(i, 2))
    v = verify(step, compile_program(m.graph, m.order), step.make_inputs())
    assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"


def test_a_gather_backward_no_longer_stops_the_batch_split(one_thread):
    """Gather's backward scatters into `grad.new_zeros(...)`: with `new_*` creations detached
    by `prepare` (they read only a dtype) and scatter_add's rule, the batch split covers the
    step (forward, loss and backward, the scatter included) and runs as eager PyTorch does."""
    from magis.capture.trace import training_step

    torch.manual_seed(0)
    step = training_step(_RelativePositions().double(), (torch.randn(4, 6, 8).double(),))
    assert any(step.graph.node(v).op == "aten.new_zeros.default" for v in step.graph.ops())
    g = prepare(step.graph)
    assert not any(g.node(v).op.startswith("aten.new_") for v in g.ops())
    tree = build_ftree(g)
    i = max(range(len(tree)), key=lambda k: tree.nodes[k].size)
    ops = {g.node(v).op for v in tree.nodes[i].ftrans.nodes}
    assert {"aten.gather.default", "aten.scatter_add.default", "aten.repeat.default"} <= ops
    m = materialize(g, tree.with_n(i, 2))
    v = verify(step, compile_program(m.graph, m.order), step.make_inputs())
    assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"


class _TransposedState(torch.nn.Module):
    """A linear attention's running state made by `zeros_like` / `full_like` of a transposed
    projection (preserve_format: the creations take its transposed strides)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.k = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kt = self.k(x).transpose(1, 2)
        state = torch.zeros_like(kt) + kt.cumsum(-1)
        return (state * torch.full_like(kt, 0.5) + kt).square().sum()


def test_prepare_makes_a_transposed_creation_with_its_strides(one_thread):
    """`prepare` detaches a `*_like` creation laid out as its transposed input as a creation of
    the permuted shape and a permute back: the meta check holds (the recorded strides exactly),
    no creation reads a tensor, and the step runs as eager PyTorch does."""
    from magis.backend.meta_check import check_graph
    from magis.capture.trace import training_step
    from magis.ir.tensor import dense_permutation

    torch.manual_seed(0)
    step = training_step(_TransposedState().double(), (torch.randn(4, 6, 8).double(),))
    likes = [v for v in step.graph.ops() if step.graph.node(v).op.endswith("_like.default")]
    assert any(not step.graph.node(v).outputs[0].is_row_major for v in likes)
    g = prepare(step.graph)
    assert not any(g.node(v).op.endswith("_like.default") for v in g.ops())
    assert check_graph(g).ok, check_graph(g).mismatches[:1]
    v = verify(step, compile_program(g, g.program_order()), step.make_inputs())
    assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"
    assert dense_permutation((4, 8, 6), (48, 1, 8)) == [0, 2, 1]
    assert dense_permutation((4, 8, 6), (96, 1, 8)) is None  # gapped: kept as captured


def _checked_splits(cases) -> int:
    """Split each call in two along each splittable axis its rule claims, merge the parts as
    the rule says and compare with the whole call; the number of outputs compared."""
    checked = 0
    for name, op, args, kwargs, outs, dims in cases:
        for axis in sorted(dims.splittable):
            if dims.lengths[axis] % 2:
                continue
            if any(
                (d := dims.input_dim(j, axis)) is not None and t.shape[d] % 2
                for j, t in enumerate(_tensors(args, kwargs))
            ):
                continue
            parts = _split_call(op, args, kwargs, dims, axis)
            for k, want in enumerate(outs):
                if not isinstance(want, torch.Tensor) or not want.numel():
                    continue
                d = dims.output_dim(k, axis)
                if d is not None:
                    got = torch.cat([p[k] for p in parts], d)
                elif (k, axis) in dims.sums and dims.accumulated_slot(k) is not None:
                    got = parts[1][k]  # the second part added into the first
                elif (k, axis) in dims.sums:
                    got = parts[0][k] + parts[1][k]
                else:
                    continue
                # GPT-Neo's attention runs in float32 even in a float64 step
                tol = {"rtol": 1e-9, "atol": 1e-12} if want.dtype == torch.float64 else {}
                msg = f"{name} axis {axis} out {k}"
                torch.testing.assert_close(got, want, **tol, msg=msg)
                checked += 1
    return checked


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    walk(args)
    walk(list(kwargs.values()))
    return out


# --- every F-Tree node of the seven tiny workloads, executed ------------------------------------


@functools.cache
def _tiny_tree(family: str):
    step = _tiny(family)
    g = prepare(step.graph)
    return step, g, build_ftree(g)


def _largest_divisor_upto(length: int, k: int) -> int:
    return max(d for d in range(2, k + 1) if length % d == 0)


@pytest.mark.parametrize("choice", ["2", "largest<=8"])
@pytest.mark.parametrize("family", WORKLOAD_FAMILIES)
def test_every_ftree_node_executes_and_verifies(family, choice, one_thread):
    """Each node alone with n = 2, and with the largest divisor <= 8 of its length (where that is
    not 2 again): verified against eager PyTorch, simulated peak within 5% of the measured one."""
    step, g, tree = _tiny_tree(family)
    assert len(tree) > 0
    inputs = step.make_inputs()
    for i, node in enumerate(tree.nodes):
        n = 2 if choice == "2" else _largest_divisor_upto(node.length, 8)
        if choice != "2" and n == 2:
            continue
        m = materialize(g, tree.with_n(i, n))
        program = compile_program(m.graph, m.order)
        v = verify(step, program, inputs)
        assert v.verified, f"node {i} (n={n}): {v.worst} differs by {v.max_rel_err:.2e}"
        measured = measure(program, step.program_inputs(inputs), repeats=1, warmup=0)
        simulated = simulate(m.graph, m.order, UnitCostModel()).peak_bytes
        err = abs(simulated - measured.peak_bytes) / measured.peak_bytes
        assert err <= 0.05, (
            f"node {i} (n={n}): simulated {simulated} vs measured {measured.peak_bytes}"
        )


def test_prepare_keeps_the_program_and_opens_the_loss():
    step, g, tree = _tiny_tree("bert-base")
    program = compile_program(g, g.program_order())
    assert verify(step, program, step.make_inputs()).verified
    ops = {g.node(v).op for v in g.ops()}
    assert "aten.ones_like.default" not in ops
    # a batch split crossing the loss: forward and backward of the whole encoder
    assert max(x.size for x in tree.nodes) > len(g) // 2


def test_nested_enabled_nodes_execute():
    step, g, tree = _tiny_tree("bert-base")
    outer = max(range(len(tree)), key=lambda j: tree.nodes[j].size)
    inner = next(
        i
        for i, x in enumerate(tree.nodes)
        if outer in tree.ancestors(i) and x.component != tree.nodes[outer].component
    )
    t = tree.with_n(outer, 2).with_n(inner, 2)
    m = materialize(g, t)
    check_shapes(m.graph)  # shapes and strides on meta tensors, before running anything
    assert m.applied == (outer, inner)
    assert len(m.ids[tree.nodes[inner].ftrans.split[0][0]]) == 4  # 2 parts of 2 parts
    program = compile_program(m.graph, m.order)
    assert verify(step, program, step.make_inputs()).verified


def _one_region_at_a_time(g: Graph, tree: FTree) -> Graph:
    """The enabled nodes applied as single F-Trans, parents first, each copy on the graph the
    previous split left: what `materialize` does in waves, one graph copy per wave."""
    ids = {v: [v] for v in g.nodes}
    for t in tree.preorder():
        node = tree.nodes[t]
        copies = len(ids[node.ftrans.split[0][0]]) if node.enabled else 0
        for split in [
            tuple(sorted((ids[v][j], a) for v, a in node.ftrans.split)) for j in range(copies)
        ]:
            res = split_graph(g, check(g, FTrans(split, node.n)))
            g = res.graph
            for v, _ in node.ftrans.split:
                ids[v] = [x for old in ids[v] for x in res.ids.get(old, (old,))]
    return g


def _program(g: Graph) -> list[tuple]:
    """The program in order, each input named by its producer (created nodes' ids depend on
    the order regions were split in, their names do not)."""

    def named(value):
        if isinstance(value, Ref):
            return (g.node(value.node).name, value.index)
        if isinstance(value, list | tuple):
            return [named(v) for v in value]
        return value

    return [
        (n.name, n.op, named(n.args), named(n.kwargs), n.outputs)
        for n in map(g.node, g.program_order())
    ]


def test_regions_split_together_give_the_program_one_at_a_time_gives():
    """A wave of sibling regions (the leaves of the F-Tree), and a child in both parts of its
    parent, each split in one copy of the graph, give the program splitting each region copy
    on its own does; the siblings reach one another (one layer's output is the next's input)."""
    step, g, tree = _tiny_tree("bert-base")
    leaves = [i for i in range(len(tree)) if not list(tree.children(i))]
    leaves = [i for i in leaves if tree.nodes[i].ftrans.n == 1 and _splits_alone(g, tree, i)]
    siblings = tree
    for i in leaves:
        siblings = siblings.with_n(i, 2)
    outer = max(range(len(tree)), key=lambda j: tree.nodes[j].size)
    inner = next(
        i
        for i, x in enumerate(tree.nodes)
        if outer in tree.ancestors(i) and x.component != tree.nodes[outer].component
    )
    nested = tree.with_n(outer, 2).with_n(inner, 2)
    assert len(leaves) >= 3
    for t in (siblings, nested):
        m = materialize(g, t)
        assert _program(m.graph) == _program(_one_region_at_a_time(g, t))
        check_shapes(m.graph)
    assert len(m.ids[tree.nodes[inner].ftrans.split[0][0]]) == 4  # both copies were split


def test_a_region_cut_across_by_one_split_before_it_is_refused():
    """Two F-Tree regions may share a node with neither within the other (a U-Net's skip
    joins): once one is split, the other's copies cannot be told apart, and enabling both is a
    FissionError, whether they are split together or the second continues the first's
    materialization."""
    step, g, tree = _tiny_tree("unet")
    region = [{v for v, _ in x.ftrans.split} for x in tree.nodes]
    pairs = [
        (a, b)
        for a in range(len(tree))
        for b in range(len(tree))
        if region[a] & region[b]  # neither within the other (that splits as a nested node)
        and not region[a] <= region[b]
        and not region[b] <= region[a]
        and _splits_alone(g, tree, a)
        and _splits_alone(g, tree, b)
    ]
    assert pairs
    a, b = pairs[0]
    first = materialize(g, tree.with_n(a, 2))
    for reuse in (None, first):
        with pytest.raises(FissionError, match="overlaps a region split before it"):
            materialize(g, tree.with_n(a, 2).with_n(b, 2), reuse=reuse)


def _splits_alone(g: Graph, tree: FTree, i: int) -> bool:
    try:
        materialize(g, tree.with_n(i, 2))
    except FissionError:
        return False
    return True


def test_split_along_an_already_split_dimension_is_refused():
    step, g, tree = _tiny_tree("bert-base")
    outer = max(range(len(tree)), key=lambda j: tree.nodes[j].size)
    inner = next(
        i
        for i, x in enumerate(tree.nodes)
        if outer in tree.ancestors(i) and x.component == tree.nodes[outer].component
    )
    with pytest.raises(FissionError, match="cannot be applied"):
        materialize(g, tree.with_n(outer, 2).with_n(inner, 2))  # the batch is 2: 1 left


def test_ftree_construction_within_10s_on_gpt_neo():
    """The F-Tree of the paper-size GPT-Neo-1.3B step (~5,000 nodes), graph preparation
    included; capture itself is not counted."""
    import time

    _, step = workload_step("gpt-neo-1.3b")
    start = time.perf_counter()
    tree = build_ftree(prepare(step.graph))
    assert time.perf_counter() - start <= 10.0
    assert max(x.size for x in tree.nodes) > len(step.graph) // 2  # the batch split of it all


def test_a_diffusion_unet_splits_whole_along_the_batch_and_verifies(one_thread):
    """Group norm, baddbmm with an `empty` operand, and the mean MSE loss (opened by `prepare`)
    no longer stop the batch dimension: the F-Tree's largest node splits most of the step
    (forward, loss and backward) in two, and the program runs as eager PyTorch does."""
    step, g, tree = _tiny_tree("corpus:sd_unet")
    i = max(range(len(tree)), key=lambda k: tree.nodes[k].size)
    ops = {g.node(v).op for v in tree.nodes[i].ftrans.nodes}
    assert tree.nodes[i].size > len(g) // 2
    assert {"aten.native_group_norm.default", "aten.baddbmm.default"} <= ops
    assert "aten.mse_loss_backward.default" in ops
    m = materialize(g, tree.with_n(i, 2))
    inputs = step.make_inputs()
    v = verify(step, compile_program(m.graph, m.order), inputs)
    assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"


def test_a_virtual_entry_ignores_the_labels_as_the_data_input_does():
    """Without the data input in a sub-graph, the virtual entry joins its computed sources only:
    the loss reading the labels is then dominated by the logits' producer (a re-analysed
    decoder's loss block, once its data input lies in another component), not by the entry."""
    from magis.analyze.dominators import VIRTUAL

    b = GraphBuilder(torch.float64)
    h = b.input("h", (8, 4))
    labels = b.input("labels", (8, 4))
    w = b.weight("w", (4, 4))
    logits = b.mm(b.relu(h, name="act"), w, name="logits")
    loss = b.mul(b.sub(logits, labels, name="residual"), logits, name="loss")
    b.output(loss)
    g = b.build()
    n = _named(g)
    nodes = [n[k] for k in ("labels", "act", "logits", "residual", "loss")]  # h left out
    tree = dominator_tree(g, nodes)
    assert tree.nodes[0] == VIRTUAL
    parent = {int(tree.nodes[i]): int(tree.nodes[p]) for i, p in enumerate(tree.parent) if p >= 0}
    assert parent[n["residual"]] == n["logits"]
    assert n["labels"] not in parent  # an input reached from no computed source: left out
    only_inputs = dominator_tree(g, [n["labels"], n["w"]])  # every source an input: joined
    assert set(only_inputs.nodes.tolist()) == {VIRTUAL, n["labels"], n["w"]}


# --- message passing: the edge dimension (issue 46) ---------------------------------------------


class _Propagate(torch.nn.Module):
    """One GCN layer's propagation, written the `how` way (`magis.capture.models.gcn.SCATTERS`)."""

    def __init__(self, how: str, width: int = 4) -> None:
        super().__init__()
        self.lin, self.how = torch.nn.Linear(width, width), how

    def forward(self, x, edges, weight):
        from magis.capture.models.gcn import propagate

        return propagate(self.lin(x), edges, weight, self.how).tanh().square().sum()


def _graph_batch(nodes: int = 6, edges: int = 12, width: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(nodes, width, generator=gen, dtype=torch.float64),
        torch.randint(0, nodes, (2, edges), generator=gen),
        torch.rand(edges, generator=gen, dtype=torch.float64),
    )


def test_index_rules_give_the_edge_dimension_an_axis():
    """index_select's output rows run along the index (x read whole); index_add's, scatter_add's
    and an accumulating index_put's edges are a reduce axis of index and source, summed into x
    one part after the other (`accumulates`), never summed with x once per part."""
    from magis.ir import TensorMeta
    from magis.ir.dims import op_dims

    def m(*shape, dtype="float64"):
        return TensorMeta(tuple(shape), dtype, 8)

    nodes, feats, idx, msg = m(6, 4), m(6, 4), m(12, dtype="int64"), m(12, 4)
    sel = op_dims("aten.index_select.default", (nodes, 0, idx), {}, (msg,))
    assert sel.inputs == ((None, 1), (0,)) and sel.outputs == ((0, 1),) and not sel.sums
    add = op_dims("aten.index_add.default", (nodes, 0, idx, msg), {}, (feats,))
    assert add.lengths == (6, 4, 12) and add.outputs == ((None, 1),)
    assert add.inputs == ((None, 1), (2,), (2, 1))
    assert add.sums == {(0, 2)} and add.accumulates == {(0, 0)} and add.is_reduce(2)
    index2d = m(12, 4, dtype="int64")
    sca = op_dims("aten.scatter_add.default", (nodes, 0, index2d, msg), {}, (feats,))
    assert sca.inputs == ((None, 1), (2, 1), (2, 1)) and sca.accumulates == {(0, 0)}
    put = op_dims("aten.index_put.default", (nodes, [idx], msg, True), {}, (feats,))
    assert put.inputs == ((None, 1), (2,), (2, 1)) and put.sums == {(0, 2)}
    plain = op_dims("aten.index_put.default", (nodes, [idx], msg, False), {}, (feats,))
    assert not plain.sums and not plain.accumulates and plain.inputs[1] == (None,)
    got = op_dims("aten.index.Tensor", (nodes, [idx]), {}, (msg,))
    assert got.inputs == ((None, 1), (0,)) and got.outputs == ((0, 1),)


@pytest.mark.parametrize("how", ["index_add", "self_loop", "scatter_add", "index_put", "index"])
def test_message_passing_calls_split_along_the_edges_as_their_rules_say(how, one_thread):
    """Each call of a propagation step (forward and backward), split in two along every axis
    its rule claims, the edges included, and merged as the rule says, equals the whole call."""
    from magis.capture.trace import training_step

    torch.manual_seed(0)
    step = training_step(_Propagate(how).double(), _graph_batch())
    cases = _call_cases(step)
    scatter = {"index_add": "index_add", "self_loop": "index_add", "scatter_add": "scatter_add"}
    name = scatter.get(how, "index_put")
    edge_calls = [c for c in cases if c[1].__name__.split(".")[0] == name]
    assert edge_calls and all(c[5].accumulates for c in edge_calls)
    assert _checked_splits(edge_calls) >= 2 * len(edge_calls)  # features and edges
    assert _checked_splits(cases) > 10


def _edge_regions(g: Graph, tree: FTree) -> list[int]:
    """The F-Tree nodes that split a scatter into the nodes along the edges."""
    from magis.analyze import node_dims

    dims = node_dims(g)
    return [
        i
        for i, x in enumerate(tree.nodes)
        if any(
            g.node(v).op == "aten.index_add.default" and dims[v].is_reduce(a)
            for v, a in x.ftrans.split
        )  # fmt: skip
    ]


def test_a_gcn_step_splits_along_the_edges_and_runs_as_eager_does(one_thread):
    """A three-layer GCN: each layer's and each backward's gather, message and scatter form a
    region of their own (the edge list and weights are read at several places: Alg. 1 alone
    offers none, `_entered_pieces` does); split in 2 and 4 they compute exactly what eager
    PyTorch computes, and the peak of the split step is lower."""
    from magis.capture.models.gcn import GCN, GCNConfig, gcn_batch
    from magis.capture.trace import training_step

    config = GCNConfig(nodes=10, edges=48, features=6, hidden=8, classes=3, layers=3)
    torch.manual_seed(0)
    x, edges, weight, labels = gcn_batch(config, torch.Generator().manual_seed(0))
    step = training_step(GCN(config).double(), (x.double(), edges, weight.double(), labels))
    g = prepare(step.graph)
    tree = build_ftree(g)
    regions = _edge_regions(g, tree)
    assert regions, [sorted(g.node(v).name for v in x.ftrans.nodes) for x in tree.nodes]
    inputs = step.make_inputs()
    for n in (2, 4):
        enabled = tree
        for i in regions:
            enabled = enabled.with_n(i, n)
        m = materialize(g, enabled)
        v = verify(step, compile_program(m.graph, m.order), inputs, tolerance=0.0)
        assert v.verified, f"n={n}: {v.worst} differs by {v.max_rel_err:.2e}"
        cost = UnitCostModel()
        split_peak = simulate(m.graph, m.order, cost).peak_bytes
        assert split_peak < simulate(g, g.program_order(), cost).peak_bytes


def test_an_accumulated_scatter_chains_its_parts_through_x(one_thread):
    """index_add into the features themselves (a self-loop): each part adds into the previous
    part's result, the first into x, so x is added once and no partial sums are added up."""
    from magis.analyze.ftrans import split_of_component
    from magis.capture.trace import training_step

    torch.manual_seed(0)
    step = training_step(_Propagate("self_loop").double(), _graph_batch())
    g = prepare(step.graph)
    (add,) = [
        v
        for v in g.ops()
        if g.node(v).op == "aten.index_add.default"
        and g.node(g.node(v).args[0].node).op == "aten.addmm.default"
    ]
    mul = g.node(add).args[3].node
    gather = g.node(mul).args[0].node
    edges = dgraph(g).component_of(add, 2)  # index_add's axis 2: the edges
    info = check(g, FTrans(split_of_component(g, {gather, mul, add}, edges).split, 3))
    assert info, info
    assert {m.kind for m in info.outputs.values()} == {OutputKind.ACCUMULATE}
    m = split_graph(g, info).graph
    order = m.program_order()
    adds = [v for v in order if m.node(v).op == "aten.index_add.default"]
    into = [m.node(v).args[0].node for v in adds]
    assert len(adds) == 4 and into[1:3] == adds[0:2]  # part 2 adds into part 1's result ...
    assert m.node(into[0]).op == "aten.addmm.default"  # ... and part 1 into x itself
    v = verify(step, compile_program(m, order), step.make_inputs(), tolerance=0.0)
    assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"


# --- recurrent layers: oneDNN's fused LSTM, and cells unrolled step by step ----------------------


class _RecurrentLM(torch.nn.Module):
    """An embedding, an LSTM or GRU (batch first) and a linear head: a language model in small."""

    def __init__(self, cell: str = "lstm", layers: int = 2, width: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, width)
        rnn = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[cell]
        self.rnn = rnn(width, width, num_layers=layers, batch_first=True)
        self.head = torch.nn.Linear(width, 20)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.rnn(self.embed(tokens))[0])
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _recurrent_step(cell: str = "lstm", dtype: torch.dtype = torch.float32, layers: int = 2):
    from magis.capture.trace import training_step

    torch.manual_seed(0)
    model = _RecurrentLM(cell, layers).to(dtype)
    batch = (torch.randint(0, 20, (4, 6)), torch.randint(0, 20, (4, 6)))
    return training_step(model, batch)


RNN_LAYER = "aten.mkldnn_rnn_layer.default"
RNN_LAYER_BACKWARD = "aten.mkldnn_rnn_layer_backward.default"
F32 = 1e-5  # float32 parts summed in another order: 2e-7 of the loss measured


def _rnn_nodes(g: Graph, op: str) -> list[int]:
    return [v for v in g.program_order() if g.node(v).op == op]


def test_lstm_layers_run_fused_in_float32_and_step_by_step_in_float64():
    """On a CPU nn.LSTM runs oneDNN's fused layer only in float32 (bfloat16): the float64 step
    unrolls its cells, which the decomposed-cell rules (unbind, stack ...) cover."""
    g = _recurrent_step().graph
    f32 = {g.node(v).op for v in g.ops()}
    f64 = _recurrent_step(dtype=torch.float64).graph
    assert {RNN_LAYER, RNN_LAYER_BACKWARD} <= f32
    assert not any("rnn" in f64.node(v).op for v in f64.ops())
    assert {"aten.unbind.int", "aten.stack.default"} <= {f64.node(v).op for v in f64.ops()}


def test_lstm_layer_rules_split_the_batch_and_sum_the_weight_gradients():
    """MAGIS §4.1 for the fused layer: N runs through input (T, N, I), states and outputs; the
    weights are read whole; the backward's weight and bias gradients sum over N; the
    workspace is each part's own (forward output 3, backward argument 22)."""
    g = prepare(_recurrent_step().graph)
    dims = node_dims(g)
    fwd, bwd = _rnn_nodes(g, RNN_LAYER)[0], _rnn_nodes(g, RNN_LAYER_BACKWARD)[-1]
    (n,) = dims[fwd].splittable
    assert dims[fwd].outputs[:3] == ((None, n, None), (n, None), (n, None))
    assert dims[fwd].inputs[1:5] == ((None, None),) * 2 + ((None,),) * 2
    assert dims[fwd].part_outputs == {(3, n)} and dims[fwd].carries(3, n)
    (nb,) = dims[bwd].splittable
    assert dims[bwd].sums == {(k, nb) for k in (1, 2, 3, 4)}
    assert dims[bwd].part_inputs == {(len(dims[bwd].inputs) - 1, nb)}


def _cut(args: tuple, dims, axis: int, half: slice) -> list:
    """A call's arguments for one half of `axis`: each tensor argument that runs along it
    sliced (contiguous, as the kernel needs), the others whole."""
    tensors = iter(range(len(args)))
    out = []
    for x in args:
        if isinstance(x, torch.Tensor):
            d = dims.input_dim(next(tensors), axis)
            x = x if d is None else x[(slice(None),) * d + (half,)].contiguous()
        out.append(x)
    return out


def test_lstm_layer_parts_with_their_own_workspaces_equal_the_whole_call(one_thread):
    """The rules on real calls: each half of the batch through the forward, then through the
    backward with its own forward part's workspace; concatenated and summed as the rules say,
    the parts equal the whole layer's outputs and gradients."""
    cases = {c[1].__name__: c for c in _call_cases(_recurrent_step(layers=1))}
    _, fwd, args, kwargs, fwd_out, fdims = cases["mkldnn_rnn_layer.default"]
    _, bwd, bargs, _, bwd_out, bdims = cases["mkldnn_rnn_layer_backward.default"]
    (n,), (nb,) = fdims.splittable, bdims.splittable
    parts = []
    for half in (slice(0, 2), slice(2, 4)):
        out = fwd(*_cut(args, fdims, n, half), **kwargs)
        b = _cut(bargs, bdims, nb, half)
        b[22] = out[3]  # the workspace: this part's own, not a slice of the whole one
        parts.append((out, bwd(*b)))
    for k in range(3):
        got = torch.cat([p[0][k] for p in parts], fdims.output_dim(k, n))
        torch.testing.assert_close(got, fwd_out[k])
    for k, want in enumerate(bwd_out):
        d = bdims.output_dim(k, nb)
        pieces = [p[1][k] for p in parts]
        got = torch.cat(pieces, d) if d is not None else pieces[0] + pieces[1]
        torch.testing.assert_close(got, want, msg=f"gradient {k}")


def test_an_lstm_step_splits_whole_along_the_batch_and_verifies(one_thread):
    """Forward, loss and backward of both fused layers in one region (each backward part reading
    its forward part's workspace), n = 2: float32's tolerance against eager, and the simulated
    peak, workspaces included, is the measured one."""
    step = _recurrent_step()
    g = prepare(step.graph)
    tree = build_ftree(g)
    i = max(range(len(tree)), key=lambda k: tree.nodes[k].size)
    ops = {g.node(v).op for v in tree.nodes[i].ftrans.nodes}
    assert {RNN_LAYER, RNN_LAYER_BACKWARD} <= ops
    m = materialize(g, tree.with_n(i, 2))
    assert len(_rnn_nodes(m.graph, RNN_LAYER_BACKWARD)) == 4
    # the search's meta check takes it: each backward part's output gradient is its part's
    # transpose, permuted but dense, as eager's is (a gapped slice would be refused)
    from magis.backend.meta_check import MetaChecker

    assert MetaChecker().derive(m.graph, m.touched).ok
    program, inputs = compile_program(m.graph, m.order), step.make_inputs()
    v = verify(step, program, inputs, tolerance=F32)
    assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"
    measured = measure(program, step.program_inputs(inputs), repeats=1, warmup=0).peak_bytes
    assert simulate(m.graph, m.order, UnitCostModel()).peak_bytes == measured


def _second_layer_region(g: Graph) -> FTrans:
    """The batch split of the second layer only: its forward to its backward, so the first
    layer's output (T, N, H) enters sliced along N, a strided slice."""
    from magis.analyze.ftrans import split_of_component

    fwd, bwd = _rnn_nodes(g, RNN_LAYER)[1], _rnn_nodes(g, RNN_LAYER_BACKWARD)[0]
    after = set(rx.descendants(g.dag, g.rx_index(fwd))) | {g.rx_index(fwd)}
    before = set(rx.ancestors(g.dag, g.rx_index(bwd))) | {g.rx_index(bwd)}
    dims, dg = node_dims(g), dgraph(g)
    comp = dg.component_of(fwd, next(iter(dims[fwd].splittable)))
    nodes = [
        g.dag[i]
        for i in after & before
        if g.dag[i] in dims
        and any(dg.component_of(g.dag[i], a) == comp for a in dims[g.dag[i]].splittable)
    ]
    return split_of_component(g, nodes, comp)


def test_a_strided_batch_slice_reaches_the_fused_layer_as_a_contiguous_copy(one_thread):
    """oneDNN reads (T, N/2, H) as if it were dense: a slice of the batch, strided, would give
    wrong values silently; fission copies it first (`OpInfo.dense_inputs`) and the program
    runs as eager does."""
    step = _recurrent_step()
    g = prepare(step.graph)
    f = _second_layer_region(g)
    info = check(g, FTrans(f.split, 2))
    assert info, info
    split = split_graph(g, info, g.program_order())
    copies = [
        v for v in split.graph.ops() if split.graph.node(v).name.endswith(("_dense0", "_dense1"))
    ]
    assert copies and all(split.graph.node(v).op == "aten.clone.default" for v in copies)
    order = split.graph.program_order()
    v = verify(step, compile_program(split.graph, order), step.make_inputs(), tolerance=F32)
    assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"


def test_a_workspace_made_outside_the_region_is_refused():
    """A backward split without its forward would read the whole batch's workspace in every
    part: refused, as is a forward split whose workspace a whole backward reads."""
    g = prepare(_recurrent_step(layers=1).graph)
    dims = node_dims(g)
    (fwd,), (bwd,) = _rnn_nodes(g, RNN_LAYER), _rnn_nodes(g, RNN_LAYER_BACKWARD)
    alone = check(g, FTrans(((bwd, next(iter(dims[bwd].splittable))),), 2))
    assert not alone and "workspace" in alone.reason
    forward = check(g, FTrans(((fwd, next(iter(dims[fwd].splittable))),), 2))
    assert not forward and "output 3" in forward.reason


def test_unrolled_gru_cells_split_as_their_rules_say(one_thread):
    """nn.GRU on a CPU (and nn.LSTM in float64) runs cell by cell: unbind along time, the gates
    unsafe_split, the steps stacked; each call's halves along the batch equal the whole."""
    cases = _call_cases(_recurrent_step("gru", torch.float64, layers=1))
    new = [c for c in cases if c[1].__name__.split(".")[0] in ("unbind", "stack", "unsafe_split")]
    assert {c[1].__name__.split(".")[0] for c in new} == {"unbind", "stack", "unsafe_split"}
    assert _checked_splits(new) >= 6


def test_a_materialization_reports_every_node_it_removed_across_waves_and_continuations():
    """`Materialized.removed` is exactly the nodes of the graph it began from that are gone,
    `touched` only nodes of the result: a node re-wired by one wave and removed by the next
    (an enabled node, then one inside it split again per part) was once dropped from both,
    and the child's derived tables kept its storage (T5's search failed to simulate)."""
    from magis.rules.fission import materialize
    from magis.search import fission_moves

    _, step = workload_step("corpus:t5:tiny", dtype=torch.float64)
    base, base_order, tree = fission_moves.analyze(step.graph, step.graph.program_order())
    ranked = sorted(range(len(tree.nodes)), key=lambda i: -tree.nodes[i].score)
    outer = next(i for i in ranked if tree.descendants(i))
    inner = max(tree.descendants(outer), key=lambda d: tree.nodes[d].score)
    first = tree.with_n(outer, 2)
    mat = materialize(base, first, list(base_order))
    both = first.with_n(inner, 2)
    for began, done in (
        (base, materialize(base, both, list(base_order))),
        (mat.graph, materialize(base, both, list(base_order), mat)),
    ):
        assert done.removed == frozenset(set(began.nodes) - set(done.graph.nodes))
        assert done.touched <= set(done.graph.nodes)


def test_split_changes_count_a_node_rewired_then_removed_as_removed():
    """The bookkeeping across waves (`SplitChanges`): a node the materialization began with,
    re-wired by one split and removed by the next, is removed; one it created and removed is
    no change; the T5 search state where the first was lost failed to simulate."""
    from types import SimpleNamespace

    from magis.rules.fission import SplitChanges

    changes = SplitChanges(first_new=100)
    changes.record(SimpleNamespace(touched={7, 100, 101}, removed={3}))  # 7 re-wired
    changes.record(SimpleNamespace(touched={102}, removed={7, 101}))
    assert changes.removed == {3, 7}
    assert changes.touched == {100, 102}


def test_a_region_output_that_views_an_outside_value_is_viewed_again_not_concatenated(one_thread):
    """GraphSAGE's `scatter_add(0, dst.unsqueeze(-1).expand_as(m), m)`: once its backward is split
    (the twins), a re-analysis offers the forward's region with the index's views in it, and
    the expanded index is read again by the backward outside it. The parts of a view are slices
    of it, so the whole is that view of the edge list again (no copy, the original strides):
    the program runs as eager does, with the simulated peak the measured one."""
    import torch.nn.functional as F

    from magis.capture import training_step
    from magis.search import fission_moves

    class Sage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.own1, self.near1 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
            self.own2, self.near2 = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

        @staticmethod
        def mean(h, src, dst, degree):
            m = h[src]
            index = dst.unsqueeze(-1).expand_as(m)
            return torch.zeros_like(h).scatter_add(0, index, m) / degree.unsqueeze(-1)

        def forward(self, x, edges, degree, labels):
            src, dst = edges[0], edges[1]
            h = F.relu(self.own1(x) + self.near1(self.mean(x, src, dst, degree)))
            h = self.own2(h) + self.near2(self.mean(h, src, dst, degree))
            return F.cross_entropy(h, labels)

    gen = torch.Generator().manual_seed(0)
    edges = torch.randint(0, 50, (2, 2000), generator=gen)
    degree = torch.ones(50, dtype=torch.float64).index_add_(0, edges[1], torch.ones(2000).double())
    x = torch.randn(50, 16, dtype=torch.float64, generator=gen)
    step = training_step(Sage().double(), (x, edges, degree, torch.randint(0, 4, (50,))))
    base, order, tree = fission_moves.analyze(step.graph, step.graph.program_order())
    twins = [
        m for m in fission_moves.moves(tree, None, True, twins=True) if m.kind == "enable-twins"
    ]
    first = fission_moves.apply(
        fission_moves.Lineage(base, order, tree, epoch=0), twins[-1].build()
    )
    base, order, tree = fission_moves.analyze(first.graph, list(first.order), reanalysis=True)
    names = [{base.node(v).name for v, _ in t.ftrans.split} for t in tree.nodes]
    i = next(k for k, n in enumerate(names) if {"expand", "scatter_add"} <= n)
    m = materialize(base, tree.with_n(i, 2))
    made = {m.graph.node(v).name for v in m.graph.nodes}
    expands = sorted(n for n in made if n.startswith("expand"))
    assert any(n.endswith("_whole") for n in expands), expands
    assert not any(n.endswith("_cat") for n in expands), expands
    program, inputs = compile_program(m.graph, m.order), step.make_inputs()
    v = verify(step, program, inputs)
    assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"
    measured = measure(program, step.program_inputs(inputs), repeats=1, warmup=0).peak_bytes
    assert simulate(m.graph, m.order, UnitCostModel()).peak_bytes == measured
