"""An input a matmul ignores need not exist whole (TASO-style; MAGIS §5).

`baddbmm(input, a, b, beta=0, alpha=s)` is `s * (a @ b)`: with beta 0 the input's values are
ignored (PyTorch's documented contract: not even its NaNs reach the result), and only its shape
matters, which broadcasting lets be all ones. Diffusers' attention computes its scores so, into
a freshly made `empty` as large as the scores: on SD U-Net's 4096-token self-attentions a
[64 x 4096 x 4096] float32 buffer (4 GiB) that nothing reads, live beside the scores and the
probabilities. The rule makes that buffer a [1 x 1 x 1] one: the same kernel, the same alpha,
the same result to the last bit, 4 GiB less at that step.

Applied where the ignored input is made for the matmul alone (an `empty` or `zeros` no other
node reads and no graph output is), so nothing else can see the change.
"""

from __future__ import annotations

from magis.ir import Graph, Ref, TensorMeta
from magis.rules.base import Rewritten, RuleContext, RuleKind, group_rule
from magis.rules.taso.common import Replacement, replaced_in_place

# The matmuls that add a scaled input (their first argument); beta is their fourth.
SCALED_ADDS = (
    "aten.baddbmm.default",
    "aten.addmm.default",
    "aten.addbmm.default",
    "aten.addmv.default",
)
BETA_AT = 3
FRESH = ("aten.empty.memory_format", "aten.zeros.default")  # ops that make a tensor from a size


def _beta(graph: Graph, nid: int) -> object:
    node = graph.node(nid)
    return node.args[BETA_AT] if len(node.args) > BETA_AT else node.kwargs_dict.get("beta", 1)


def ignored_fresh_input(graph: Graph, nid: int) -> int | None:
    """The node making `nid`'s input when `nid` ignores it (beta 0) and nothing else reads it,
    else None."""
    node = graph.node(nid)
    src = node.args[0] if node.args else None
    if not isinstance(src, Ref) or _beta(graph, nid) != 0:
        return None
    maker = graph.node(src.node)
    if maker.op not in FRESH or graph.users(src.node) != [nid] or src in graph.outputs:
        return None
    if not maker.args or maker.outputs[0].numel <= 1:
        return None
    return src.node


def ignored_inputs(ctx: RuleContext) -> list[list[int]]:
    """The makers of every ignored input outside frozen regions, shrunk in one rewrite: each
    only saves memory, at no cost, so none is worth keeping."""
    makers = []
    for op in SCALED_ADDS:
        for nid in ctx.nodes_of(op):
            maker = ignored_fresh_input(ctx.graph, nid)
            if maker is not None and nid not in ctx.frozen and maker not in ctx.frozen:
                makers.append(maker)
    return [sorted(makers)] if makers else []


def shrink_ignored_inputs(graph: Graph, makers: list[int]) -> Rewritten:
    """Each maker replaced by one that makes its tensor with every dimension 1."""
    return replaced_in_place(graph, makers, _shrunk)


def _shrunk(g: Graph, nid: int) -> Replacement:
    node = g.node(nid)
    meta = node.outputs[0]
    ones = (1,) * len(meta.shape)
    new = g.add_op(
        f"{node.name}_shrunk",
        node.op,
        (list(ones), *node.args[1:]),
        dict(node.kwargs),
        outputs=(TensorMeta(ones, meta.dtype, meta.itemsize),),
    )
    return Replacement((nid,), (new,), ((Ref(nid, 0), Ref(new, 0)),))


SHRINK_IGNORED_INPUTS = group_rule(
    "shrink_ignored_inputs",
    RuleKind.TASO,
    find=ignored_inputs,
    build=shrink_ignored_inputs,
    describe=lambda graph, makers: f"shrink {len(makers)} inputs that matmuls ignore (beta 0)",
)
RULES = (SHRINK_IGNORED_INPUTS,)
