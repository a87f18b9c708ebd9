"""Codegen writes only checked names and literals, and the names it makes never collide."""

import torch

from magis.backend import compile_program, generate
from magis.ir.builder import GraphBuilder


def test_a_value_named_float_does_not_shadow_the_inf_literal():
    b = GraphBuilder(torch.float64)
    x = b.input("x", (3,))
    y = b.call("aten.clamp.default", x, float("-inf"), float("inf"), name="float")
    b.output(y)
    g = b.build()
    source = generate(g, g.program_order())
    assert "float_1 = aten.clamp.default(x, float('-inf'), float('inf'))" in source
    x = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    assert torch.equal(compile_program(g, g.program_order())(x)[0], x)


def test_names_that_python_would_fold_together_stay_apart():
    """Python folds Unicode identifiers (NFKC: 'ﬁ' is 'fi'); codegen's names are ASCII."""
    b = GraphBuilder(torch.float64)
    a, c = b.input("ﬁ", (2,)), b.input("fi", (2,))
    b.output(b.sub(a, c, name="d"))
    g = b.build()
    assert generate(g, g.program_order()).startswith("def program(_, fi):")
    one, two = torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    assert torch.equal(compile_program(g, g.program_order())(one, two)[0], one)


def test_dropout_masks_are_drawn_by_the_fused_kernel_on_cuda():
    """On a GPU eager dropout runs native_dropout, whose random stream bernoulli_ does not
    share: the program draws its mask with that kernel there (issue 41), as before elsewhere."""
    import torch.nn.functional as F

    from magis.capture import training_step

    model = torch.nn.Linear(4, 4)
    step = training_step(
        model, (torch.randn(3, 4),), loss_fn=lambda out, x: F.dropout(out, 0.1).sum()
    )
    g = step.graph
    cpu = generate(g, g.program_order())
    cuda = generate(g, g.program_order(), device_type="cuda")
    assert "aten.bernoulli" in cpu and "native_dropout" not in cpu
    assert "aten.native_dropout.default(" in cuda and ", 0.1, True)[1]" in cuda
    assert "aten.bernoulli" not in cuda
