"""Twins: after a split in n, each part repeats the others, and so does its peak. A
re-analysis takes the hot-spots near the peak (not only at it), finds one region per part,
and the search enables them together (`fission_moves._twin_moves`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from magis.analyze.ftree import memory_hotspots
from magis.backend import compile_program, verify
from magis.capture.trace import training_step
from magis.cost import UnitCostModel
from magis.search import fission_moves
from magis.sim import near_peak_storages, simulate


class _TinyLM(torch.nn.Module):
    """A decoder's shape in small: its loss block (log-softmax, NLL and their backward over
    a vocabulary far wider than the model) is the peak, as in Qwen2 and Bloom."""

    def __init__(self, vocab: int = 1024, width: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.mix = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.embed(tokens))))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _step():
    torch.manual_seed(0)
    # 1,024 rows of logits, so that the loss blocks outweigh the weights (and their gradients,
    # which tell the parts' peaks apart) as at full size.
    tokens = torch.randint(0, 1024, (4, 256))
    return training_step(_TinyLM().double(), (tokens, torch.randint(0, 1024, (4, 256))))


def _batch_split(step):
    """The step split along its batch in 2 (the initial F-Tree's largest region), scheduled."""
    graph = step.graph
    base, base_order, tree = fission_moves.analyze(graph, graph.program_order())
    i = max(range(len(tree)), key=lambda k: tree.nodes[k].size)
    lineage = fission_moves.Lineage(base, base_order, tree, epoch=0)
    return fission_moves.apply(lineage, fission_moves.enable_directly(tree, i, 2))


def test_near_peak_storages_widen_the_hot_spots_to_steps_just_below_the_peak():
    split = _batch_split(_step())
    sim = simulate(split.graph, split.order, UnitCostModel())
    at_peak = near_peak_storages(split.graph, split.order, 0.0)
    assert at_peak == {h.storage for h in sim.hotspots}
    assert memory_hotspots(split.graph, split.order) == at_peak
    near = near_peak_storages(split.graph, split.order, 0.05)
    assert at_peak < near
    floor = 0.95 * sim.peak_bytes  # every storage added is live at a step at least this high
    timeline = sim.timeline
    for s in near - at_peak:
        steps = [k for k, v in enumerate(split.order) if v == s.node]
        assert steps and timeline[steps[0] :].max() >= floor


def test_a_reanalysis_finds_the_parts_loss_blocks_as_twins_and_enables_them_together():
    step = _step()
    split = _batch_split(step)
    found = fission_moves.analyze(split.graph, list(split.order), reanalysis=True)
    assert found is not None
    base, base_order, tree = found
    groups = fission_moves.twin_groups(tree)
    loss_groups = [
        g
        for g in groups
        if all(
            any(base.node(v).op == "aten._log_softmax.default" for v in tree.nodes[i].ftrans.nodes)
            for i in g
        )
    ]
    assert loss_groups, "the two parts' loss blocks are not twins"
    group = loss_groups[0]
    assert len(group) == 2
    a, b = (set(tree.nodes[i].ftrans.nodes) for i in group)
    assert not a & b

    lineage = fission_moves.Lineage(base, base_order, tree, epoch=1)
    offered = list(fission_moves.moves(tree, None, True, twins=True))
    assert any(m.kind == "enable-twins" for m in offered)
    assert not any(
        m.kind == "enable-twins" for m in fission_moves.moves(tree, None, True)
    )  # not without `twins` (the search always asks for them)

    cost = UnitCostModel()
    together = fission_moves.apply(lineage, fission_moves._enable_all(tree, group, 2))
    alone = fission_moves.apply(lineage, fission_moves.enable_directly(tree, group[0], 2))
    peak = {
        name: simulate(f.graph, f.order, cost).peak_bytes
        for name, f in (("together", together), ("alone", alone), ("split", split))
    }
    assert peak["together"] < peak["alone"] <= peak["split"]
    v = verify(step, compile_program(together.graph, together.order), step.make_inputs())
    assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"


def test_the_equal_peaks_of_repeated_layers_are_split_together():
    """A GCN's message passings (3 forward, 3 backward, each a gather, a product and a
    scatter-add over the edges) reach one peak each; the initial analysis takes the hot-spots
    within `INITIAL_NEAR_PEAK` of the peak, and the twin groups that promise one saving
    (forward: 3 ops, backward: 4) are offered as one move (`_peers`). That move lowers the
    peak the most (a one-step enable splits one message passing and leaves the others at the
    peak; the level-wide enable, its regions grown over their border, reaches 0.58), and the
    split program runs as eager PyTorch."""
    from magis.capture.models.gcn import GCN, GCNConfig, gcn_batch

    torch.manual_seed(0)
    config = GCNConfig(nodes=50, edges=2000, features=16, hidden=16, classes=4, layers=3)
    x, edges, weight, labels = gcn_batch(config, torch.Generator().manual_seed(0))
    step = training_step(GCN(config).double(), (x.double(), edges, weight.double(), labels))
    graph = step.graph
    base, base_order, tree = fission_moves.analyze(graph, graph.program_order())
    lineage = fission_moves.Lineage(base, base_order, tree, epoch=0)
    cost = UnitCostModel()
    start = simulate(base, base_order, cost).peak_bytes
    peaks: dict[str, list[int]] = {}
    for move in fission_moves.moves(tree, None, True, twins=True):
        split = fission_moves.apply(lineage, move.build())
        peaks.setdefault(move.kind, []).append(simulate(split.graph, split.order, cost).peak_bytes)
        if move.kind == "enable-peers" and len(peaks[move.kind]) == 1:
            v = verify(step, compile_program(split.graph, split.order), step.make_inputs())
            assert v.verified, f"{v.worst} differs by {v.max_rel_err:.2e}"
    others = [p for kind, ps in peaks.items() if kind != "enable-peers" for p in ps]
    assert others and min(peaks["enable-peers"]) < min(others), peaks
    assert max(peaks["enable-direct"]) > 0.99 * start, peaks
    assert max(peaks["enable-peers"]) < 0.6 * start, peaks
