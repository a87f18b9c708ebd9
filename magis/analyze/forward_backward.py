"""The forward and the backward of a captured training step, read off its graph.

Checkpointing (`baselines/chain.py`) and fusion-aware min-cut re-materialization (He & Yu,
MLSys 2023, §3: the forward values the backward reads are saved or recomputed;
`rules/mincut_remat.py`) both split a step this way, not by module names: the forward is what
the loss depends on; the backward is what the weight update depends on outside the forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import rustworkx as rx

from magis.ir import Graph, PlaceholderKind


def forward_backward(
    graph: Graph, order: Sequence[int] | None = None
) -> tuple[list[int], frozenset[int], tuple[int, ...]]:
    """(forward ops in `order`, backward nodes, forward-side aliases); `order` is the program
    order unless given (a schedule of the graph).

    The forward is the ancestors of the loss (the step's first output). The backward is what
    the weight update (in-place writes into weights and optimizer state) or the other outputs
    (gradients, in a step without optimizer) depend on, outside the forward: not the running
    statistics updates, which read forward values but run with the forward.
    """
    if not graph.outputs:
        return [], frozenset(), ()
    order = graph.program_order() if order is None else order
    loss = graph.outputs[0].node
    anc = {graph.dag[i] for i in rx.ancestors(graph.dag, graph.rx_index(loss))} | {loss}
    fwd = [n for n in order if n in anc and not graph.node(n).is_placeholder]
    trained = (PlaceholderKind.WEIGHT, PlaceholderKind.OPT_STATE)
    sinks = [r.node for r in graph.outputs[1:]] + [
        n.id
        for n in graph.nodes.values()
        if n.writes_into is not None and graph.node(n.writes_into.node).placeholder_kind in trained
    ]
    seen = set(sinks)
    stack = list(sinks)
    while stack:
        for p in graph.predecessors(stack.pop()):
            if p not in seen and p not in anc:
                seen.add(p)
                stack.append(p)
    backward = [n for n in order if n in seen and not graph.node(n).is_placeholder]
    # Autograd's detach()es of saved tensors are traced where the forward ran them: they are
    # forward-side aliases (their storage is the forward's), not backward readers.
    start = next((i for i, n in enumerate(backward) if not graph.info(n).is_view), len(backward))
    return fwd, frozenset(backward[start:]), tuple(backward[:start])
