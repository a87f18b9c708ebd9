"""magis: memory optimization of PyTorch training steps (MAGIS, ASPLOS'24, and beyond).

The top-level names are the everyday API: `magis.capture(fn, *args)` and
`magis.training_step(model, inputs, ...)` return a `Step` whose `.graph` the rest of magis
analyzes, schedules, transforms and runs; `magis.optimize(step_or_model, ..., mem_limit= or
lat_limit=)` returns a `Plan` (`magis.plan`). `magis.commands` holds every command of the CLI as
a function. (`magis.capture` is also the capture subpackage; calling it captures.)
"""

import magis.capture as capture  # noqa: F401 - callable: magis.capture(fn, *example_args)
from magis.capture.trace import Step, training_step
from magis.errors import MagisError
from magis.plan import Plan

__all__ = [
    "MagisError",
    "Plan",
    "Step",
    "TrainStep",
    "capture",
    "compile",
    "optimize",
    "torch_backend",
    "training_step",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`optimize`, `compile`, `torch_backend` and `TrainStep` import the search on first use (PEP 562), so that
    `import magis.plan` (loading a plan, `magis explain`) or a capture does not load it."""
    if name == "optimize":
        from magis.commands.optimize import optimize as value
    elif name == "compile":
        from magis.train import compile as value
    elif name == "torch_backend":
        from magis.train.torch_backend import torch_backend as value
    elif name == "TrainStep":
        from magis.train import TrainStep as value
    else:
        raise AttributeError(f"module 'magis' has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value
