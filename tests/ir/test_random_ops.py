"""Every ATen op that draws from the RNG is a random op: never recomputed, never reordered
against another draw, never split by fission (a recomputed draw is another draw)."""

import torch

from magis.capture import capture
from magis.ir.ops import build_default_registry

# Takes a Generator argument, draws nothing: it reads the generator's seed.
NOT_A_DRAW = {"initial_seed"}


def test_every_functional_aten_op_taking_a_generator_is_random():
    registry = build_default_registry()
    missing = set()
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::") or schema.is_mutable:
            continue
        if not any("Generator" in str(a.type) for a in schema.arguments):
            continue
        name = schema.name.split("::")[1]
        if name in NOT_A_DRAW:
            continue
        op = f"aten.{name}.{schema.overload_name or 'default'}"
        if not registry.lookup(op).is_random:
            missing.add(op)
    assert not missing


def test_in_place_draws_are_random_once_captured():
    draws = {
        "exponential": lambda x: torch.empty_like(x).exponential_() * x,
        "normal": lambda x: torch.empty_like(x).normal_() * x,
        "uniform": lambda x: torch.empty_like(x).uniform_() * x,
        "geometric": lambda x: torch.empty_like(x).geometric_(0.5) * x,
    }
    for name, fn in draws.items():
        g = capture(fn, torch.randn(4, 3)).graph
        random = [g.node(n).op for n in g.ops() if g.info(n).is_random]
        assert len(random) == 1, (name, [g.node(n).op for n in g.ops()])
