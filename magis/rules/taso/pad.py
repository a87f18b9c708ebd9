"""A zero pad is its input (TASO-style identity elimination; MAGIS §5).

`constant_pad_nd(x, [0, 0, ...])` copies `x` into a new tensor of the same shape and layout.
Model code writes it where a padding is computed per layer and comes out zero: Hugging Face's
MobileNetV2 pads the input of every convolution "the TensorFlow way", so 68 of its 103 pads
are zero pads, each a copy of an expanded activation (up to 6x the block's width), and the
copy, not the original, is what the convolution's backward keeps. Folded, the readers of the
copy read the original: the same values in the same layout, one copy less to run and to hold.

Not folded: a pad whose output is a graph output or whose layout differs from its input's
(a strided or channels-last input: its readers were traced on the copy's strides), and a pad
of a tensor that lives in an input's storage (an input updated in place later in the step
would change what the readers see).
"""

from __future__ import annotations

from magis.ir import Graph, Ref
from magis.rules.base import Rewritten, RuleContext, RuleKind, group_rule

PAD = "aten.constant_pad_nd.default"


def is_zero_pad(graph: Graph, nid: int) -> bool:
    """Whether `nid` is a `constant_pad_nd` that pads nothing and can be read as its input."""
    node = graph.node(nid)
    if node.op != PAD or not node.args or not isinstance(node.args[0], Ref):
        return False
    pads = node.args[1] if len(node.args) > 1 else node.kwargs_dict.get("pad", ())
    if any(pads):
        return False
    src = node.args[0]
    if graph.meta(src) != node.outputs[0] or Ref(nid) in graph.outputs:
        return False
    root = graph.storages().storage_of(src)
    return not graph.node(root.node).is_placeholder


def zero_pads(ctx: RuleContext) -> list[list[int]]:
    """Every zero pad outside frozen regions, folded in one rewrite: each is a plain copy, so
    none is worth keeping and offering them one at a time would spend a state on each."""
    nids = [n for n in ctx.nodes_of(PAD) if n not in ctx.frozen and is_zero_pad(ctx.graph, n)]
    return [nids] if nids else []


def fold_zero_pads(graph: Graph, nids: list[int]) -> Rewritten:
    """Each of `nids`' readers reads the pad's input instead; the pads are removed."""
    g = graph.copy()
    changed: set[int] = set()
    for nid in nids:
        changed.update(g.replace_uses(Ref(nid), g.node(nid).args[0]))
        g.remove_node(nid)
    removed = frozenset(nids)
    return Rewritten(g, frozenset(), frozenset(changed - removed), removed)


FOLD_ZERO_PADS = group_rule(
    "fold_zero_pads",
    RuleKind.TASO,
    find=zero_pads,
    build=fold_zero_pads,
    describe=lambda graph, nids: f"fold {len(nids)} zero pads into their inputs",
)
RULES = (FOLD_ZERO_PADS,)
