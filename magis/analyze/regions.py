"""Candidate regions of the F-Tree (MAGIS §4.3, `magis.analyze.ftree`): a node set checked as an
F-Trans along one D-Graph component (`checked_split`), scored as Eq. 3 and 4 score a dominator's
subtree (`piece_score`), and grown beyond what Algorithm 1 offers, two ways (our extensions):

- over its border while that makes the whole tensors at the border smaller
  (`grown_over_boundary`: a loss block takes in the LM head's `mm` and its weight gradient);
- from a hot node, over its neighbours while the region's gain grows (`grown_by_gain`): an
  attention's backward (the probabilities' gradient `bmm`, `_softmax_backward_data`, the two
  `bmm`s that read it) has no dominator of its own in the D-Graph's sub-graph, as its inputs
  come from the forward and from the layer after, so Algorithm 1 never offers it.
"""

from __future__ import annotations

from magis.analyze.dgraph import dgraph, node_dims
from magis.analyze.ftrans import (
    FTransInfo,
    OutputKind,
    Rejected,
    check,
    split_of_component,
    without_input_reductions,
)
from magis.ir import Graph

GROWTH_ROUNDS = 4  # the boundary tensors a region may absorb, one per round
GROWTH_TRIES = 3  # the largest boundary tensors tried in each round


def grown_over_boundary(graph: Graph, info: FTransInfo, c: int, n: int) -> FTransInfo:
    """Our extension to Alg. 1: S grown over the largest tensors of its boundary while that
    makes the boundary smaller.

    S = T.des(v_dom) \\ {v_dom} leaves v_dom's output, sliced, as S's input, and a consumer
    outside S that reads an output along a reduce axis of its own call (a weight gradient's
    `mm` summing over the tokens) takes that output concatenated. Both are whole tensors at the
    region's border, and in a language model's loss block they are the largest of the step:
    the logits, made by the head's `mm` (v_dom), and their gradient, read by the head's weight
    gradient, each [tokens x vocabulary] — splitting the 17 ops between them keeps both whole.
    Taking in v_dom (its input, the hidden states, is a sliced [tokens x width]) and the
    weight-gradient `mm` (its output, summed over the parts, is [vocabulary x width]) leaves
    no whole vocabulary-wide tensor: the chunked cross-entropy of fused kernels, found as a
    region. A producer of an input, or the readers of an output, join S when the F-Trans stays
    valid (`check`) and the bytes at S's border (`boundary_bytes`) drop."""
    smap = graph.storages()
    for _ in range(GROWTH_ROUNDS):
        now = boundary_bytes(graph, info, smap)
        for extra in _growths(graph, info, c, smap)[:GROWTH_TRIES]:
            got = checked_split(graph, sorted(info.ftrans.nodes | extra), c, n)
            if not isinstance(got, Rejected) and boundary_bytes(graph, got, smap) < now:
                info = got
                break
        else:
            return info
    return info


def boundary_bytes(graph: Graph, info: FTransInfo, smap) -> int:
    """The storages at S's border that exist whole: the inputs it reads that are not resident
    (sliced or shared) and the outputs it merges (concatenated or summed), each counted once."""
    border = {smap.storage_of(r) for r in (*info.inputs, *info.outputs)}
    return sum(smap.nbytes[s] for s in border if s not in smap.resident)


def _growths(graph: Graph, info: FTransInfo, c: int, smap) -> list[frozenset[int]]:
    """The node sets S may take in, largest border tensor first: the producer of a
    non-resident input; all readers outside S of a concatenated output. Only sets whose
    nodes run along the component and that promise a smaller border (`_border_change`) are
    offered: most producers read inputs as large as what they make (an elementwise chain),
    and `check` is the analysis's most expensive step."""
    inside = info.ftrans.nodes
    options = _neighbours(graph, info, smap, concat_only=True)
    return [
        nodes
        for size, nodes in sorted(options, key=lambda o: -o[0])
        if along(graph, nodes, c) and _border_change(graph, inside | nodes, nodes, smap) < size
    ]


def along(graph: Graph, nodes: frozenset[int], c: int) -> bool:
    """Every node has exactly one axis in component c (`split_of_component`'s condition)."""
    dg, dims = dgraph(graph), node_dims(graph)
    for v in nodes:
        d = dims.get(v)
        if d is None or sum(dg.component_of(v, a) == c for a in d.splittable) != 1:
            return False
    return True


def _border_change(graph: Graph, grown: frozenset[int], nodes: frozenset[int], smap) -> int:
    """The bytes `nodes` bring to the border of S = `grown` (an upper bound of what taking
    them in adds): their non-resident inputs from outside it and their outputs read outside
    it."""
    border = {smap.storage_of(r) for v in nodes for r in graph.node(v).inputs}
    border = {s for s in border if s.node not in grown and s not in smap.resident}
    outs = {
        r for v in nodes for u in graph.users(v) if u not in grown for r in graph.node(u).inputs
    }
    outs.update(graph.outputs)
    border |= {smap.storage_of(r) for r in outs if r.node in nodes}
    return sum(smap.nbytes[s] for s in border)


def piece_score(graph: Graph, members: list[int], hot, n: int) -> tuple[float, float]:
    """(heat, score) of S = `members` (Eq. 3 and Eq. 4, counted as `get_scores` counts them)."""
    smap = graph.storages()
    inside = set(members)
    heat = float(sum(smap.nbytes[s] for s in hot if s.node in inside))
    read = {smap.storage_of(r) for v in members for r in graph.node(v).inputs}
    inputs = sum(
        float(smap.nbytes[s])
        for s in read
        if s.node not in inside and s not in smap.resident and s not in hot
    )
    return heat, (1 - 1 / n) * heat - inputs


def checked_split(graph: Graph, members: list[int], c: int, n: int):
    """The F-Trans splitting `members` along component c, checked, or why it is rejected."""
    f = split_of_component(graph, members, c)
    if not isinstance(f, Rejected):
        f = without_input_reductions(graph, f)
    info = check(graph, f) if not isinstance(f, Rejected) else f
    if not isinstance(info, Rejected) and info.length % n:
        info = Rejected(f"the score's n = {n} does not divide the length {info.length}")
    return info


def region_gain(graph: Graph, info: FTransInfo, hot, n: int, smap) -> float:
    """Eq. 4 of the region (`piece_score`) less every whole tensor it merges at its border
    (outputs concatenated or summed, hot or not): a hot tensor made inside S but merged whole
    for a reader outside is not made smaller by the split."""
    _, score = piece_score(graph, sorted(info.ftrans.nodes), hot, n)
    merged = {smap.storage_of(r) for r in info.outputs}
    return score - sum(smap.nbytes[s] for s in merged if s not in smap.resident)


def grown_by_gain(graph: Graph, info: FTransInfo, c: int, n: int, hot) -> tuple[FTransInfo, float]:
    """A region grown from `info` over the producer of an input or all outside readers of an
    output, the option of the largest `region_gain` each round while the gain grows: from an
    attention backward's hot `bmm`, its `_softmax_backward_data`, then the two `bmm`s that
    read that (whose outputs are small); (region, its gain)."""
    smap = graph.storages()
    now = region_gain(graph, info, hot, n, smap)
    for _ in range(GROWTH_ROUNDS):
        best = None
        for _, extra in _neighbours(graph, info, smap)[: 2 * GROWTH_TRIES]:
            if not along(graph, extra, c):
                continue
            got = checked_split(graph, sorted(info.ftrans.nodes | extra), c, n)
            if isinstance(got, Rejected):
                continue
            gain = region_gain(graph, got, hot, n, smap)
            if gain > now and (best is None or gain > best[0]):
                best = (gain, got)
        if best is None:
            break
        now, info = best
    return info, now


def _neighbours(
    graph: Graph, info: FTransInfo, smap, concat_only: bool = False
) -> list[tuple[int, frozenset[int]]]:
    """(border tensor's bytes, nodes S may take in for it): the producer of each non-resident
    input; all readers outside S of each output (`concat_only`: of each concatenated one)."""
    inside = info.ftrans.nodes
    options: list[tuple[int, frozenset[int]]] = []
    for ref in info.inputs:
        s = smap.storage_of(ref)
        if s not in smap.resident and not graph.node(ref.node).is_placeholder:
            options.append((smap.nbytes[s], frozenset({ref.node})))
    for ref, merge in info.outputs.items():
        if concat_only and merge.kind is not OutputKind.CONCAT:
            continue
        readers = frozenset(
            u for u in graph.users(ref.node) if u not in inside and ref in graph.node(u).inputs
        )
        if readers:
            options.append((smap.nbytes[smap.storage_of(ref)], readers))
    return options
