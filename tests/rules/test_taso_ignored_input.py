"""`shrink_ignored_inputs`: the buffer a beta-0 `baddbmm` ignores made [1 x 1 x 1], checked the
TASO way (the rewritten step equals eager PyTorch) and by what it frees (diffusers' attention
scores, computed into a fresh `empty` as large as they are)."""

import torch
from torch import nn

from magis.capture import training_step, workload_step
from magis.cost import get_cost_model
from magis.ir import Graph, PlaceholderKind, Ref, TensorMeta
from magis.rules import RuleContext
from magis.rules.taso import SHRINK_IGNORED_INPUTS
from magis.rules.taso.ignored_input import ignored_inputs
from magis.sim import simulate
from tests.rules.test_taso import _apply_and_verify

EMPTY, BADDBMM = "aten.empty.memory_format", "aten.baddbmm.default"


class Scores(nn.Module):
    """Attention probabilities as diffusers computes them (`get_attention_scores`)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qk = nn.Linear(width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        room = torch.empty(x.shape[0], x.shape[1], x.shape[1], dtype=x.dtype)
        scores = torch.baddbmm(room, q, k.transpose(1, 2), beta=0, alpha=q.shape[-1] ** -0.5)
        return (scores.softmax(-1) @ x).tanh().sum()


def test_an_ignored_input_is_shrunk_and_the_step_matches_eager():
    torch.manual_seed(0)
    x = torch.randn(3, 16, 4, dtype=torch.float64)
    step = training_step(Scores(4).double(), (x,), loss_fn=lambda out, x: out)
    cost, graph = get_cost_model("rtx3090"), step.graph
    (scores,) = [n for n in graph.ops() if graph.node(n).op == BADDBMM]
    program = graph.program_order()
    before = simulate(graph, program, cost).timeline[program.index(scores)]
    ((res, order),) = _apply_and_verify(step, SHRINK_IGNORED_INPUTS)
    g = res.graph
    (made,) = [n for n in g.ops() if g.node(n).op == EMPTY]
    assert g.node(made).outputs[0].shape == (1, 1, 1) and len(res.removed) == 1
    freed = before - simulate(g, order, cost).timeline[order.index(scores)]
    assert freed == 3 * 16 * 16 * 8 - 8  # the [3 x 16 x 16] float64 buffer, less its [1 x 1 x 1]


def test_an_input_that_counts_or_is_read_elsewhere_is_kept():
    """beta 1 adds the input; an `empty` also read by another op is that op's input too."""
    g = Graph()
    meta = TensorMeta((2, 3, 3), "float32", 4)
    a = g.add_placeholder("a", meta, PlaceholderKind.DATA)
    for name, beta, shared in (("adds", 1, False), ("shared", 0, True), ("shrunk", 0, False)):
        room = g.add_op(f"room_{name}", EMPTY, ([2, 3, 3],), {"dtype": torch.float32}, (meta,))
        g.add_op(name, BADDBMM, (Ref(room), Ref(a), Ref(a)), {"beta": beta}, (meta,))
        if shared:
            g.add_op(f"neg_{name}", "aten.neg.default", (Ref(room),), outputs=(meta,))
    ctx = RuleContext(g, tuple(g.program_order()), None)
    ((maker,),) = ignored_inputs(ctx)
    assert g.node(maker).name == "room_shrunk"


def test_sd_unets_attention_scores_no_longer_need_a_buffer_as_large():
    """SD U-Net (diffusers, tiny): every attention's scores buffer is shrunk in one rewrite,
    and the step still equals eager PyTorch."""
    _, step = workload_step("corpus:sd_unet:tiny", dtype=torch.float64)
    graph = step.graph
    buffers = [n for n in graph.ops() if graph.node(n).op == EMPTY]
    ((res, _),) = _apply_and_verify(step, SHRINK_IGNORED_INPUTS)
    assert len(res.removed) == len(buffers) > 1
