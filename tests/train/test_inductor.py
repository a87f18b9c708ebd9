"""magis.compile(..., compiler="inductor"): a plan with its recomputations and Store/Load,
compiled by Inductor in segments (`magis.backend.fx_export`), trains as eager PyTorch does
(float64, relative error <= 1e-9 over five AdamW steps), and an op Inductor cannot compile is a
one-line error naming it (issue 43)."""

from __future__ import annotations

import pytest
import torch
from train_helpers import (
    ADAMW,
    STATE_SEARCH,
    TOL,
    mlp,
    mlp_loss,
    one_thread,
    train_adamw,
)

import magis.backend.fx_export as fx_export
import magis.backend.inductor_fusion as inductor_fusion
from magis.backend.fx_export import InductorUnsupportedError, segments
from magis.backend.inductor_fusion import FUSION_LEVELS, FusionCheck
from magis.backend.memory import allocated_peak_bytes, storage_bytes
from magis.capture.workloads import get_workload
from magis.ir.ops import LOAD_OP, STORE_OP
from magis.train import CompileError, compile, compile_program_order


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def fixed_points(step) -> int:
    """Recomputed nodes and Store/Load of the plan a step runs."""
    graph, order = step.plan.graph, step.plan.order
    keys = fx_export.value_numbers(graph, order)
    seen, recomputed = set(), 0
    for nid in order:
        if graph.node(nid).is_placeholder or graph.info(nid).is_view:
            continue
        recomputed += keys[nid] in seen
        seen.add(keys[nid])
    copies = sum(graph.node(n).op in (STORE_OP, LOAD_OP) for n in order)
    return recomputed + copies


def train_inductor(model, batch, loss_fn, **limit: float):
    def make(m, opt):
        return compile(m, opt, batch, loss_fn=loss_fn, compiler="inductor", **limit, **STATE_SEARCH)

    return train_adamw(model, batch, loss_fn, make)


def test_an_mlp_trains_as_eager_through_inductor(float64):
    model, batch = mlp()
    # latency 1.10: a plan of recomputations and Store/Load (13 on this MLP); under a memory
    # limit the 20 states end at the whole step split in 8, which recomputes nothing
    loss_err, (err, where), step = train_inductor(model, batch, mlp_loss, lat_limit=1.1)
    assert fixed_points(step) >= 1, "the plan holds no recomputation or Store/Load"
    assert step.program.segments and all(s.compiled is not None for s in step.program.segments)
    assert loss_err <= TOL and err <= TOL, (loss_err, err, where)


def test_a_zoo_workload_trains_as_eager_through_inductor(float64):
    wl = get_workload("unet:tiny")
    torch.manual_seed(0)
    model = wl.build(torch.float64)
    batch = wl.make_inputs(wl.batch)

    def loss_fn(m, *xs):
        return wl.loss_fn(m(xs[0]), *xs)

    loss_err, (err, where), step = train_inductor(model, batch, loss_fn, mem_limit=0.4)
    assert fixed_points(step) >= 1, "the plan holds no recomputation or Store/Load"
    assert loss_err <= TOL and err <= TOL, (loss_err, err, where)


class EmptyCacheAttention(torch.nn.Module):
    """A key appended to an empty cache (`cat` with an empty tensor, as GPT-2 and T5 do) and
    then viewed: eager's `cat` writes a contiguous result, Inductor's decomposition clones the
    transposed key, whose strides the `view` cannot take."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.proj(x).view(4, 6, 2, 8).transpose(1, 2)  # [batch, heads, seq, head]
        k = torch.cat([k.new_empty(0), k], dim=0)
        return k.reshape(8, 6, 8).sum(dim=1).tanh()


def test_a_plan_view_of_a_decomposed_cat_keeps_eager_layout(float64):
    """`fx_export._EagerLayouts`: a decomposition's output is given eager's strides."""
    model = EmptyCacheAttention()
    batch = (torch.randn(4, 6, 8),)

    def loss_fn(m, x):
        return m(x).square().mean()

    loss_err, (err, where), _ = train_inductor(model, batch, loss_fn, mem_limit=1.0)
    assert loss_err <= TOL and err <= TOL, (loss_err, err, where)


def test_fusion_may_raise_the_estimated_peak_by_its_tolerance_only():
    allowed = 1000 * (1 + inductor_fusion.FUSION_TOLERANCE)
    assert not FusionCheck(before=1000, after=int(allowed)).raised
    assert FusionCheck(before=1000, after=int(allowed) + 1).raised


def test_a_segment_whose_fusion_raises_the_peak_compiles_again_unfused(float64, monkeypatch):
    # every estimate counts as raised: each fusing level is abandoned, the last never is
    monkeypatch.setattr(inductor_fusion, "FUSION_TOLERANCE", -1.0)
    model, batch = mlp()

    def make(m, opt):
        return compile_program_order(m, opt, batch, loss_fn=mlp_loss, compiler="inductor")

    loss_err, (err, where), step = train_adamw(model, batch, mlp_loss, make)
    levels = {s.fusion_level for s in step.program.segments}
    assert levels == {FUSION_LEVELS[-1]}, levels
    assert loss_err <= TOL and err <= TOL, (loss_err, err, where)


def test_no_segment_holds_a_recomputation_with_its_original(float64):
    model, batch = mlp()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    step = compile(
        model, opt, batch, loss_fn=mlp_loss, lat_limit=1.1, compiler="inductor", **STATE_SEARCH
    )
    graph, order = step.plan.graph, step.plan.order
    keys = fx_export.value_numbers(graph, order)
    steps = segments(graph, order)
    assert fixed_points(step) >= 1
    for s in steps:
        computed = [keys[n] for n in s.nids if not graph.info(n).is_view]
        assert len(computed) == len(set(computed))
    seen = [n for s in steps for n in s.nids]
    assert seen == [n for n in order if not graph.node(n).is_placeholder]


def test_an_unknown_compiler_is_one_line(float64):
    model, batch = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(CompileError, match="unknown compiler='xla'") as info:
        compile(model, opt, batch, loss_fn=mlp_loss, mem_limit=0.5, compiler="xla", **STATE_SEARCH)
    assert "\n" not in str(info.value)


def test_an_op_inductor_cannot_compile_is_one_line_naming_it(float64, monkeypatch):
    model, batch = mlp()
    opt = torch.optim.AdamW(model.parameters())
    # The program order: a searched plan may hold a Store, which Inductor without implicit
    # fallbacks refuses before it reaches mm (the plan depends on the machine's speed).
    step = compile_program_order(model, opt, batch, loss_fn=mlp_loss, compiler="inductor")
    # Inductor without implicit fallbacks refuses an op it has no lowering for (here, mm's).
    monkeypatch.setitem(fx_export.INDUCTOR_CONFIG, "implicit_fallbacks", False)
    from torch._inductor import lowering

    monkeypatch.delitem(lowering.lowerings, torch.ops.aten.mm.default)
    with pytest.raises(InductorUnsupportedError) as info:
        step(*batch)
    message = str(info.value)
    assert "\n" not in message and "aten.mm.default" in message, message


def zoo(name: str):
    wl = get_workload(name)
    torch.manual_seed(0)
    model = wl.build(torch.float64)
    batch = wl.make_inputs(wl.batch)

    def loss_fn(m, *xs):
        return wl.loss_fn(m(xs[0]), *xs)

    return model, batch, loss_fn


@pytest.mark.parametrize("name", ["unet:tiny", "bert-base:tiny"])
def test_the_measured_peak_through_inductor_is_at_most_the_simulated_peak(float64, name):
    """`measure=True` through Inductor: its buffers dispatched (`fx_export.MEASURED_CONFIG`)
    and counted by the tracker the Python backend uses. On these plans Inductor holds no
    more than the plan (at most 2% over its simulated peak: 20-state plans at 0.5,
    bert-base:tiny 1.001, unet:tiny 0.998, whose fusion is held back to keep the peak,
    `inductor_fusion`; every value passed between plan nodes realized at its node, which
    brought unet:small from 1.079 to 0.998, `fx_export`) and may
    hold less: a chain of pointwise ops fused into one kernel never allocates its
    intermediates, and where the simulated peak is such a chain (AdamW's update of the
    largest weight: its mul, sqrt, div and add temporaries) the measured peak is the plan's
    next highest point (unet:tiny, a 5-state plan: 0.962). The measured build runs the same
    kernels as an ordinary one: the CPU allocator's own peak is within 3% for both (with
    Inductor's C++ kernels grouped into one function, the ordinary build's was 7.7% above
    on bert-base:tiny, `inductor_fusion.one_function_per_kernel`)."""
    model, batch, loss_fn = zoo(name)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    step = compile(
        model, opt, batch, loss_fn=loss_fn, mem_limit=0.5, compiler="inductor", measure=True,
        **STATE_SEARCH,
    )  # fmt: skip
    step(*batch)  # compiles the segments, outside the measurement
    step(*batch)
    measured, simulated = step.last_peak_bytes, step.simulated_peak_bytes
    assert all(s.fusion_level in FUSION_LEVELS for s in step.program.segments)
    assert FUSED_FLOOR * simulated <= measured <= 1.02 * simulated, (measured, simulated)

    # The measured build runs the kernels an ordinary one runs: the same plan compiled without
    # measuring, fed as a train step feeds it (parameters detached, the optimizer's scalars as
    # views of one tensor: a segment's inputs' layouts decide some of Inductor's kernels), holds
    # what the CPU allocator sees the measured build hold
    model2, batch2, loss_fn2 = zoo(name)
    opt2 = torch.optim.AdamW(model2.parameters(), **ADAMW)
    plain = compile(model2, opt2, batch2, loss_fn=loss_fn2, plan=step.plan, compiler="inductor")
    plain(*batch2)  # compiles
    ordinary = allocated_peak_bytes(lambda: plain(*batch2))
    tracked = allocated_peak_bytes(lambda: step(*batch))
    assert ordinary <= tracked <= 1.03 * ordinary, (ordinary, tracked)


# The least measured / simulated peak the fused kernels reach on these plans (0.974 seen): a
# tracker that missed Inductor's buffers would count the resident bytes alone (0.69 on unet).
FUSED_FLOOR = 0.95


def allocator_peak(program, inputs) -> int:
    program(*[t.clone() for t in inputs])  # compiles
    run_in = [t.clone() for t in inputs]
    return storage_bytes(run_in) + allocated_peak_bytes(lambda: program(*run_in))
