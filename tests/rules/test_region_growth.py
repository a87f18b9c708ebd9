"""Regions grown over their border (`analyze.regions.grown_over_boundary`) and splits nested
inside an enabled split (`rules.ftree_moves.nested_enableable`): a language model's loss
block takes in the head's `mm` and its weight gradient, so that no tensor as wide as the
vocabulary crosses its border, and it is offered inside the parts of a whole-step split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import magis.analyze.regions as regions_module
from magis.analyze.ftrans import OutputKind, check
from magis.analyze.ftree import build_ftree
from magis.backend import compile_program, verify
from magis.capture.trace import training_step
from magis.cost import UnitCostModel
from magis.rules import enable_directly, enclosing_enableable, nested_enableable
from magis.rules.fission import materialize
from magis.search import fission_moves
from magis.sim import simulate

VOCAB, WIDTH, BATCH, TOKENS = 512, 8, 4, 16


class _HeadLM(torch.nn.Module):
    """An LM in small, its head without bias (a plain `mm`, as in Llama and Qwen2)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.mix = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.embed(tokens))))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _step():
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, TOKENS))
    return training_step(_HeadLM().double(), (tokens, torch.randint(0, VOCAB, (BATCH, TOKENS))))


def _loss_region(graph, tree) -> int:
    """The smallest tree-node holding the log-softmax."""
    (ls,) = [v for v in graph.ops() if graph.node(v).op == "aten._log_softmax.default"]
    holding = [i for i, x in enumerate(tree.nodes) if ls in x.ftrans.nodes]
    return min(holding, key=lambda i: tree.nodes[i].size)


def _border_shapes(graph, info) -> list[tuple[int, ...]]:
    return [tuple(graph.meta(r).shape) for r in (*info.inputs, *info.outputs)]


def _analyzed(step):
    graph = step.graph
    return fission_moves.analyze(graph, graph.program_order())


@pytest.mark.parametrize("grow", [False, True])
def test_the_loss_block_takes_in_the_head_and_its_weight_gradient(grow, monkeypatch):
    """Grown, the region's border holds no [tokens x vocabulary] tensor (the logits made
    outside it, their gradient concatenated for the weight gradient), its weight gradient is
    summed over the parts, and split in 2 and 4 it runs as eager PyTorch (float64, exact to
    rounding) at a lower simulated peak than the region Alg. 1 alone offers."""
    if not grow:
        monkeypatch.setattr(regions_module, "GROWTH_ROUNDS", 0)
    step = _step()
    base, order, tree = _analyzed(step)
    i = _loss_region(base, tree)
    info = check(base, tree.nodes[i].ftrans)
    wide = (BATCH * TOKENS, VOCAB)
    shapes = _border_shapes(base, info)
    if not grow:  # Alg. 1's S: the logits come in whole, their gradient goes out whole
        assert sum(s in (wide, wide[::-1]) for s in shapes) == 2, shapes
        return
    assert not any(s in (wide, wide[::-1]) for s in shapes), shapes
    summed = [r for r, m in info.outputs.items() if m.kind is OutputKind.SUM]
    assert (VOCAB, WIDTH) in [tuple(base.meta(r).shape) for r in summed]
    cost = UnitCostModel()
    peaks = {}
    for n in (2, 4):
        m = materialize(base, tree.with_n(i, n), list(order))
        v = verify(step, compile_program(m.graph, m.order), step.make_inputs())
        assert v.verified, f"n = {n}: {v.worst} differs by {v.max_rel_err:.2e}"
        peaks[n] = simulate(m.graph, m.order, cost).peak_bytes
    monkeypatch.setattr(regions_module, "GROWTH_ROUNDS", 0)
    base0, order0, tree0 = _analyzed(step)
    j = _loss_region(base0, tree0)
    m0 = materialize(base0, tree0.with_n(j, 4), list(order0))
    assert peaks[4] < simulate(m0.graph, m0.order, cost).peak_bytes


def test_a_loss_block_inside_a_whole_step_split_is_offered_and_runs():
    """With the whole step split in 2 along the batch, the loss block is no longer directly
    enableable (an enabled ancestor); it is offered nested (`nested_enableable`), the densest
    move is one of those, and the nested split runs as eager PyTorch at a lower peak."""
    step = _step()
    base, order, tree = _analyzed(step)
    outer = max(range(len(tree)), key=lambda k: tree.nodes[k].size)
    inner = _loss_region(base, tree)
    assert outer in tree.ancestors(inner)
    split = tree.with_n(outer, 2)
    nested = set(nested_enableable(split))
    assert inner in nested and outer not in nested
    assert inner not in set(nested_enableable(tree))  # nothing enabled above it yet
    offered = [m for m in fission_moves.moves(split, None, True) if m.kind == "enable-dense"]
    assert offered and {m.target for m in offered} <= nested
    cost = UnitCostModel()
    lineage = fission_moves.Lineage(base, order, tree, epoch=0)
    alone = fission_moves.apply(lineage, split)
    both = fission_moves.apply(lineage, enable_directly(split, inner, 2))
    v = verify(step, compile_program(both.graph, both.order), step.make_inputs())
    assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"
    assert (
        simulate(both.graph, both.order, cost).peak_bytes
        < simulate(alone.graph, alone.order, cost).peak_bytes
    )


def test_the_whole_step_split_encloses_a_split_loss_block_in_one_move():
    """The other way round: with the loss block split in 4 first, the whole step is offered
    as a one-step enable (`enclosing_enableable`); split in 4 it leaves the loss block a
    length of 2 in each part, so the loss block keeps 2 parts, and the nesting runs as eager
    PyTorch."""
    step = _step()
    base, order, tree = _analyzed(step)
    outer = max(range(len(tree)), key=lambda k: tree.nodes[k].size)
    inner = _loss_region(base, tree)
    assert tree.nodes[outer].length == tree.nodes[inner].length == BATCH
    first = tree.with_n(inner, 4)
    assert outer in set(enclosing_enableable(first))
    assert outer not in set(enclosing_enableable(tree))  # nothing enabled inside it yet
    moves = fission_moves.moves(first, None, True)
    offered = [m for m in moves if m.target == outer and m.kind == "enable-direct"]
    assert len(offered) == 2  # n = 4, then 2
    both = offered[0].build()
    assert (both.nodes[outer].n, both.nodes[inner].n) == (4, 1)  # 4 / 4 leaves 1: disabled
    both = offered[1].build()
    assert (both.nodes[outer].n, both.nodes[inner].n) == (2, 2)
    lineage = fission_moves.Lineage(base, order, tree, epoch=0)
    split = fission_moves.apply(lineage, both)
    v = verify(step, compile_program(split.graph, split.order), step.make_inputs())
    assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"


class _Attention(torch.nn.Module):
    """One self-attention with [batch x heads, tokens, tokens] probabilities (as diffusers'
    attention computes them), large next to everything else."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(BATCH * 2, 4 * TOKENS, -1).chunk(3, dim=-1)
        p = torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1)
        y = torch.bmm(p, v).reshape(BATCH, 4 * TOKENS, -1)
        return self.out(y).tanh().sum()


def test_a_reanalysis_grows_a_region_around_an_attentions_backward():
    """With the backward's probability gradient and softmax gradient hot (and the forward's
    probabilities, which they read), no dominator covers them; the re-analysis (`hot_entries`) grows a region from them (`regions.grown_by_gain`)
    over the `bmm` that makes the gradient and the two that read the softmax's, splits it
    along [batch x heads] or the rows, and the split runs as eager PyTorch at a lower peak."""
    torch.manual_seed(0)
    step = training_step(
        _Attention().double(), (torch.randn(BATCH, 4 * TOKENS, WIDTH, dtype=torch.float64),)
    )
    graph, order = step.graph, step.graph.program_order()
    sbd = [v for v in graph.ops() if graph.node(v).op == "aten._softmax_backward_data.default"]
    (dp,) = [r.node for r in graph.node(sbd[0]).inputs[:1]]
    probs = graph.node(sbd[0]).inputs[1]  # the forward's probabilities, live at that peak
    smap = graph.storages()
    hot = frozenset(
        smap.storage_of(r) for r in (graph.node(dp).out(), graph.node(sbd[0]).out(), probs)
    )
    plain = build_ftree(graph, hotspots=hot, order=order)
    assert not any({dp, sbd[0]} <= x.ftrans.nodes for x in plain.nodes)
    tree = build_ftree(graph, hotspots=hot, order=order, hot_entries=True)
    (i,) = [i for i, x in enumerate(tree.nodes) if {dp, sbd[0]} <= x.ftrans.nodes]
    ops = sorted(graph.node(v).op for v in tree.nodes[i].ftrans.nodes)
    assert ops.count("aten.bmm.default") == 3, ops
    cost = UnitCostModel()
    whole = simulate(graph, order, cost).peak_bytes
    m = materialize(graph, tree.with_n(i, 2), list(order))
    v = verify(step, compile_program(m.graph, m.order), step.make_inputs())
    assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"
    assert simulate(m.graph, m.order, cost).peak_bytes < whole
