"""`magis bench train`: what running a plan costs beside eager PyTorch (issue #15).

For each workload (the zoo's `:small` ones: a training step of about a second on a CPU), the
same model and the same `torch.optim` optimizer take steps two ways, interleaved so that a
machine's drift falls on both alike:

* eager: `zero_grad`, forward and loss, `backward`, `optimizer.step()`;
* magis: a `TrainStep` whose plan is the captured program order
  (`magis.train.compile_program_order`): the generated program, no search, so the ratio is the
  price of running a plan (dispatch from generated code, the update in the graph), not the
  effect of a memory-saving rewrite.

The figure is the ratio of the median step times (target: at most 1.05). With
`compiler="inductor"` the magis step is the same plan compiled by Inductor
(`magis.backend.fx_export`); its segments compile on the first call, counted in `capture_s`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from magis.capture.steps import default_dtype
from magis.capture.workloads import Workload, get_workload
from magis.train import compile_program_order

OPTIMIZERS: dict[str, Callable] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
}


@dataclass
class TrainBenchRow:
    workload: str
    optimizer: str
    threads: int
    steps: int  # timed steps of each kind
    eager_s: float  # median step time
    magis_s: float
    ratio: float  # magis_s / eager_s
    capture_s: float  # capture and code generation (Inductor's first call included), once
    compiler: str = "python"

    def to_json(self) -> dict:
        return asdict(self)


def bench_train(
    workload_names: Sequence[str],
    repeats: int = 5,
    optimizer: str = "adamw",
    warmup: int = 2,
    progress: Callable[[str], None] = lambda _: None,
    compiler: str = "python",
) -> list[TrainBenchRow]:
    """Median step time of a program-order `TrainStep` (its program run by `compiler`) against
    eager PyTorch, per workload."""
    return [
        _bench_one(name, repeats, optimizer, warmup, progress, compiler) for name in workload_names
    ]


def _bench_one(name, repeats, optimizer, warmup, progress, compiler) -> TrainBenchRow:
    make_opt = OPTIMIZERS[optimizer]
    progress(f"{name}: building and capturing")
    wl = get_workload(name)
    with default_dtype(wl.dtype):
        torch.manual_seed(0)
        model_a, model_b = wl.build(), wl.build()
        batch = wl.make_inputs(wl.batch)
    model_b.load_state_dict(model_a.state_dict())

    loss_fn = workload_loss(wl)
    opt_a, opt_b = make_opt(model_a.parameters()), make_opt(model_b.parameters())
    start = time.perf_counter()
    step = compile_program_order(model_b, opt_b, batch, loss_fn=loss_fn, compiler=compiler)
    if compiler == "inductor":
        progress(f"{name}: Inductor compiling")
        step(*batch)  # a step the eager model takes too, below
        eager_first = True
    else:
        eager_first = False
    capture_s = time.perf_counter() - start

    def eager():
        opt_a.zero_grad()
        loss_fn(model_a, *batch).backward()
        opt_a.step()

    if eager_first:
        eager()
    progress(f"{name}: timing {repeats} steps of each")
    eager_s, magis_s = _interleaved(eager, lambda: step(*batch), repeats, warmup)
    return TrainBenchRow(
        name,
        optimizer,
        torch.get_num_threads(),
        repeats,
        eager_s,
        magis_s,
        magis_s / eager_s,
        capture_s,
        compiler,
    )


def workload_loss(wl: Workload) -> Callable[..., torch.Tensor]:
    """`loss_fn(model, *batch)` of a workload, as a user passes it to `magis.compile`."""

    def loss_fn(model, *data):
        if wl.loss_fn is None:  # the model's forward is the loss (a corpus workload)
            return model(*data)
        return wl.loss_fn(model(data[0]), *data)

    return loss_fn


def _interleaved(a: Callable[[], None], b: Callable[[], None], repeats: int, warmup: int):
    for _ in range(warmup):
        a()
        b()
    times_a, times_b = [], []
    for _ in range(repeats):
        for fn, times in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def format_rows(rows: Sequence[TrainBenchRow]) -> str:
    lines = [f"{'workload':<22} {'optimizer':<9} {'eager s':>9} {'magis s':>9} {'ratio':>7}"]
    for r in rows:
        lines.append(
            f"{r.workload:<22} {r.optimizer:<9} {r.eager_s:>9.4f} {r.magis_s:>9.4f} {r.ratio:>7.3f}"
        )
    return "\n".join(lines)
