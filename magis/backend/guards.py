"""Value guards at run time: a step captured for the values it read checks them where it reads.

A step whose Python reads a tensor's value (`.item()`, `bool(tensor)`, a boolean-mask index) is
captured for the value it read then (`magis.capture.specialize`); its graph holds a guard
(`magis.ir.ops.EXPECT_OP`) at each read. Generated code calls `expect`; a graph handed to
Inductor holds the same check as the operator `magis::expect`, marked as having a side effect so
that no pass drops it although nothing reads its output. Either way a run whose value differs
stops with a one-line `ValueGuardError` naming the line that read it: it never computes another
step than the one verified.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.fx.node import has_side_effect

from magis.errors import ValueGuardError

# Floating values compare within this relative tolerance: a plan may sum in another order
# than eager (a split reduction), as verification allows (`magis.backend.executor`).
FLOAT_TOLERANCE = 1e-5


def expect(x: torch.Tensor, shape: Sequence[int], value: bool | int | float | None, site: str):
    """`ValueGuardError` unless `x` has `shape` and (where given) holds `value`; returns a
    one-byte tensor (the graph's output of the guard, read by nothing). `site` is the line
    that read it ('' for a read in the backward)."""
    site = site or "in the backward"
    if tuple(x.shape) != tuple(shape):
        raise ValueGuardError(
            f"{site}: the step read a tensor of shape {list(x.shape)} where it was captured "
            f"with {list(shape)} (a boolean mask or a count from the data); its plan holds for "
            "the captured values only: capture it again with this batch, or make the read "
            "tensor arithmetic"
        )
    if value is not None:
        got = x.item()
        if not _same(got, value):
            raise ValueGuardError(
                f"{site}: the step read the value {got!r} where it was captured with {value!r}; "
                "its plan holds for the captured value only: capture it again with this batch, "
                "or make the read tensor arithmetic"
            )
    return torch.ones((), dtype=torch.bool, device=x.device)


def _same(got: bool | int | float, want: bool | int | float) -> bool:
    if isinstance(want, float) or isinstance(got, float):
        return math.isclose(got, want, rel_tol=FLOAT_TOLERANCE) or (
            math.isnan(got) and math.isnan(want)
        )
    return got == want


@torch.library.custom_op("magis::expect", mutates_args=())
def expect_op(x: torch.Tensor, shape: list[int], value: float | None, site: str) -> torch.Tensor:
    """`expect` as an operator a compiled graph can hold (a value as a float: a schema has no
    union of bool, int and float; booleans and counts below 2**53 compare exactly)."""
    return expect(x, shape, value, site)


@expect_op.register_fake
def _expect_fake(x: torch.Tensor, shape: list[int], value: float | None, site: str):
    return torch.empty((), dtype=torch.bool, device=x.device)


# The overload a compiled graph calls: nothing reads its output, so it is marked as having a
# side effect (fx's dead-code elimination would drop it otherwise).
EXPECT_OVERLOAD = has_side_effect(torch.ops.magis.expect.default)
