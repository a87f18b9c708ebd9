"""magis: memory optimization of PyTorch training steps (MAGIS, ASPLOS'24, and beyond).

The top-level names are the everyday API: `magis.capture(fn, *args)` and
`magis.training_step(model, inputs, ...)` return a `Step` whose `.graph` the rest of magis
analyzes, schedules, transforms and runs; `magis.optimize(step_or_model, ..., mem_limit= or
lat_limit=)` returns a `Plan` (`magis.plan`). `magis.commands` holds every command of the CLI as
a function. (`magis.capture` is also the capture subpackage; calling it captures.)
"""

import magis.capture as capture  # noqa: F401 - callable: magis.capture(fn, *example_args)
from magis.capture.trace import Step, training_step
from magis.commands.optimize import optimize
from magis.errors import MagisError
from magis.plan import Plan
from magis.train import TrainStep, compile

__all__ = [
    "MagisError",
    "Plan",
    "Step",
    "TrainStep",
    "capture",
    "compile",
    "optimize",
    "training_step",
]
__version__ = "0.1.0"
