"""Optimizer-state offloading and its dual (issue 42, rules/offload.py): the state lives on
the host between steps, is loaded for its update and stored back; the simulator counts it in
host memory; the program equals eager; restoring gives the captured step back."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from magis.backend import compile_program
from magis.capture import StepKind, training_step
from magis.commands.shared import verify_and_measure
from magis.cost import get_cost_model
from magis.ir import PlaceholderKind
from magis.ir.ops import LOAD_OP, STORE_OP
from magis.ir.topological import stable_topological_order
from magis.rules import OFFLOAD_STATE, RESTORE_STATE, RuleContext
from magis.rules.offload import (
    offload_state,
    offload_states,
    offloadable,
    offloaded_stores,
    restore_state,
)
from magis.schedule.swaps import time_swaps
from magis.search.hashing import wl_hash
from magis.sim import simulate


class Net(nn.Module):
    def __init__(self, depth: int = 0) -> None:
        super().__init__()
        width = 32 if depth else 16
        self.a, self.b = nn.Linear(8, width), nn.Linear(width, 4)
        self.body = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.body(torch.relu(self.a(x))))


def _step(kind: str, depth: int = 0, batch: int = 4):
    torch.manual_seed(0)
    x, y = torch.randn(batch, 8), torch.randint(0, 4, (batch,))
    loss = lambda out, x, y: nn.functional.cross_entropy(out, y)  # noqa: E731
    if kind == "adam-float64":
        with torch.autocast("cpu", enabled=False):
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)
            try:
                return training_step(Net(), (x.double(), y), loss_fn=loss, optimizer="adamw")
            finally:
                torch.set_default_dtype(old)
    k = StepKind.ADAMW_BF16
    model = Net(depth)
    return training_step(model, (x, y), loss_fn=loss, optimizer=k.optimizer, autocast=k.autocast)


def _offload_all(graph, cost):
    """Every offloadable state offloaded, one rewrite at a time, each read off the rule."""
    while True:
        ctx = RuleContext(
            graph, tuple(graph.program_order()), simulate(graph, graph.program_order(), cost)
        )
        rewrite = next(iter(OFFLOAD_STATE.match(ctx)), None)
        if rewrite is None:
            return graph
        graph = rewrite.build().graph
        graph.verify()


def _timed(graph, cost):
    return time_swaps(graph, stable_topological_order(graph, graph.program_order()), cost)


@pytest.mark.parametrize("kind", ["adam-float64", "adamw-bf16"])
def test_offloaded_state_is_host_memory_and_the_program_equals_eager(kind):
    step, cost = _step(kind), get_cost_model("rtx3090")
    g = step.graph
    states = g.placeholders(PlaceholderKind.OPT_STATE)
    state_bytes = sum(g.node(p).outputs[0].nbytes for p in states)
    base = simulate(g, g.program_order(), cost)
    off = _offload_all(g, cost)
    assert not any(offloadable(off, p) for p in states)
    order = _timed(off, cost)
    sim = simulate(off, order, cost)
    # the state left the resident floor for host memory; each Load's copy is a device tensor
    assert sim.resident_bytes == base.resident_bytes - state_bytes
    assert sim.host_peak_bytes == state_bytes
    assert sim.copy_s > 0
    for p in states:  # loaded for the update, stored back after it
        (load,) = off.users(p)
        assert off.node(load).op == LOAD_OP
    program = compile_program(off, order)
    ran = verify_and_measure(replace(step, graph=off), program)
    assert ran.verification.verified, ran.verification
    # measured as the simulator counts it: the state is host memory, the Loads' copies device
    assert ran.measurement.peak_bytes == sim.peak_bytes


def test_restoring_every_state_gives_the_captured_step_back():
    step, cost = _step("adamw-bf16"), get_cost_model("rtx3090")
    off = _offload_all(step.graph, cost)
    order = _timed(off, cost)
    ctx = RuleContext(off, tuple(order), simulate(off, order, cost))
    rewrites = list(RESTORE_STATE.match(ctx))
    states = len(step.graph.placeholders(PlaceholderKind.OPT_STATE))
    # all of them at once, their first half, then one by one
    grouped = [r for r in rewrites if "optimizer state tensors" in r.description]
    assert len(grouped) == 2 and len(rewrites) == states + 2
    g = off
    for store in offloaded_stores(off, [n for n in off.nodes if off.node(n).op == STORE_OP]):
        g = restore_state(g, store).graph
        g.verify()
    assert not g.copy_nodes()
    assert int(wl_hash(g)) == int(wl_hash(step.graph))
    sim = simulate(g, stable_topological_order(g, g.program_order()), cost)
    assert (
        sim.resident_bytes == simulate(step.graph, step.graph.program_order(), cost).resident_bytes
    )


def test_every_state_offloaded_at_once_is_each_offloaded_in_turn_and_restores_at_once():
    step, cost = _step("adamw-bf16", depth=2), get_cost_model("rtx3090")
    g = step.graph
    states = sorted(p for p in g.placeholders(PlaceholderKind.OPT_STATE) if offloadable(g, p))
    ctx = RuleContext(
        g,
        tuple(g.program_order()),
        simulate(g, g.program_order(), cost),
    )
    whole, half, *singles = OFFLOAD_STATE.match(ctx)
    assert len(singles) == min(len(states), ctx.max_candidates)
    at_once = whole.build()
    at_once.graph.verify()
    assert int(wl_hash(at_once.graph)) == int(wl_hash(offload_states(g, states).graph))
    in_turn = g
    for p in states:
        in_turn = offload_state(in_turn, p).graph
    assert int(wl_hash(at_once.graph)) == int(wl_hash(in_turn))
    halved = half.build().graph
    assert sum(offloadable(halved, p) for p in states) == len(states) - len(states) // 2
    # the program equals eager, and one rewrite takes every state back
    order = _timed(at_once.graph, cost)
    ran = verify_and_measure(
        replace(step, graph=at_once.graph), compile_program(at_once.graph, order)
    )
    assert ran.verification.verified, ran.verification
    ctx = RuleContext(at_once.graph, tuple(order), simulate(at_once.graph, order, cost))
    back = next(iter(RESTORE_STATE.match(ctx))).build().graph
    back.verify()
    assert int(wl_hash(back)) == int(wl_hash(g))


def test_a_limit_below_the_resident_floor_is_searched_with_offloading():
    """The limit check counts the state offloading can move (commands/limits.py), and the
    search takes the move: its best plan keeps state on the host."""
    from magis import optimize
    from magis.sim import tables

    # many layers: one layer's update, with its state loaded, is a small part of the state
    step = _step("adamw-bf16", depth=12, batch=1)
    base = simulate(step.graph, step.graph.program_order(), get_cost_model("rtx3090"))
    floor = base.resident_bytes / base.peak_bytes
    plan = optimize(step, mem_limit=floor * 0.95, max_states=40)
    assert any(n.op == STORE_OP and n.writes_into is not None for n in plan.graph.nodes.values())
    assert tables(plan.graph).resident_bytes < base.resident_bytes
    assert plan.summary.peak_bytes < base.peak_bytes


def test_the_fuzzer_draws_offloading_and_finds_no_mismatch():
    from magis.bench.fuzz import run_fuzz

    rep = run_fuzz(24, seed=3, rules=(OFFLOAD_STATE, RESTORE_STATE))
    assert not rep.mismatches and not rep.meta_mismatches, rep.mismatches
    assert {"offload_state", "restore_state"} <= set(rep.rules_covered)
