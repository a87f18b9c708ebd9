"""A step that seeds PyTorch's random generator itself is refused while it is captured.

A captured graph's random ops (dropout's `bernoulli`, `randn`) draw, when the program runs, from
the generator as it stands when the step starts. A step that calls `torch.manual_seed` or
`torch.seed` inside its forward or backward (Reformer's reversible layers seed the generator from
the operating system's entropy on every forward, and again in the backward, to replay dropout;
its LSH attention seeds it with `hash_seed`) makes the draws after that call come from another
stream, which the graph does not hold: the captured program would draw other numbers than eager
PyTorch does, and verification would fail with a mismatch that names a gradient, not the cause.
`refuse_reseeding` makes the call itself the failure: the capture stops with a one-line
`ReseedError` naming the line that seeded (found from the calling frames: magis's own seeding,
around the trace, passes through).

Decision (issue 46, "every failure a one-line error with a source line"): refused, not
captured. Seeds drawn from the operating system differ every step, so a graph specialized to the
one drawn at capture would replay one dropout mask forever; a constant seed could be held by the
graph as a side-effecting op, but no architecture of the sweep needs that without the first kind.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import wraps
from unittest import mock

import torch

from magis.capture.source import calling_site
from magis.errors import ReseedError

# Where the generator is seeded from: `torch.manual_seed` and `torch.seed` are
# `torch.random`'s functions, looked up on either module when the model calls them.
_SEEDING = (
    (torch, "manual_seed"),
    (torch, "seed"),
    (torch.random, "manual_seed"),
    (torch.random, "seed"),
)


@contextmanager
def refuse_reseeding() -> Iterator[None]:
    """Within the block, a call of `torch.manual_seed` / `torch.seed` from the user's or a
    library's code raises `ReseedError` naming that line (module docstring)."""
    with ExitStack() as stack:
        for module, name in _SEEDING:
            stack.enter_context(mock.patch.object(module, name, _refusing(getattr(module, name))))
        yield


def _refusing(seed_fn: Callable) -> Callable:
    @wraps(seed_fn)
    def seeding(*args, **kwargs):
        site = calling_site(sys._getframe(1))
        if site is None:  # magis's own seeding around the trace
            return seed_fn(*args, **kwargs)
        raise ReseedError(
            f"cannot capture the step: it seeds PyTorch's random generator itself at {site} "
            f"(torch.{seed_fn.__name__}): the captured graph's random ops draw from the "
            "generator as seeded before the step, so they would not draw what eager PyTorch "
            "draws; seed it before the step, outside the model"
        )

    return seeding
