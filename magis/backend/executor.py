"""Run a generated program on real tensors: measure its peak and time, verify it against eager.

Verification follows TASO's random testing (thesis §3.4): the same seeded random inputs (and the
same RNG state, so dropout draws the same masks) go through eager PyTorch and through the
program; the loss, the outputs and every input the step updates in place (parameters, optimizer
state, running statistics) must agree.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from magis.backend.codegen import Program
from magis.backend.memory import LiveBytesTracker
from magis.capture import Step


@dataclass(frozen=True)
class Verification:
    verified: bool
    max_rel_err: float
    worst: str  # the value with the largest relative error
    tolerance: float


@dataclass(frozen=True)
class Measurement:
    peak_bytes: int  # resident inputs + peak of live storages, by the dispatch tracker
    resident_bytes: int
    wall_s: float  # median over repeats
    cuda_max_allocated: int | None = None
    host_peak_bytes: int = 0  # swapped-out tensors in the host pool, beside the device figure


def clone_all(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def placed_inputs(program: Program, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `inputs` where the program keeps them: those it holds on the host
    (`Program.host_inputs`: offloaded optimizer state) in host memory, pinned when a GPU runs
    the program (its Loads copy them in, its Stores write them back)."""
    placed = []
    for i, t in enumerate(inputs):
        t = t.detach()
        if i in program.host_inputs and t.device.type != "cpu":
            placed.append(t.to("cpu").pin_memory())
        else:
            placed.append(t.clone())
    return placed


def tracker_for(program: Program, inputs: Sequence[torch.Tensor]) -> LiveBytesTracker:
    """The live-bytes tracker of one run: every input resident on the device but those the
    program keeps on the host, which the simulator counts there (`Tables.host_resident`).
    `program` is a `Program` or an `InductorProgram` (`magis.backend.inductor`)."""
    device = [t for i, t in enumerate(inputs) if i not in program.host_inputs]
    host = [t for i, t in enumerate(inputs) if i in program.host_inputs]
    return LiveBytesTracker(device, host, program.host_ops)


# Below this magnitude a tensor is compared absolutely: values that are zero in exact arithmetic
# (BERT's key-bias gradient: softmax ignores a constant shift) come out as rounding noise of
# 1e-17 whose *relative* difference between two correct programs is of order one.
ABSOLUTE_FLOOR = 1e-6


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / (max |expected| + ABSOLUTE_FLOOR), as numpy's allclose does."""
    if actual.shape != expected.shape:
        return float("inf")
    if not expected.is_floating_point():
        return 0.0 if torch.equal(actual, expected) else float("inf")
    if expected.numel() == 0:
        return 0.0
    a, e = actual.double(), expected.double()
    nan = e.isnan()
    if not torch.equal(a.isnan(), nan):  # NaN where the other is a number: never equal
        return float("inf")
    if bool(nan.any()):  # NaN in the same places (eager computes them too): compare the rest
        a, e = a[~nan], e[~nan]
        if e.numel() == 0:
            return 0.0
    if torch.equal(a, e):
        return 0.0
    diff = (a - e).abs().max().item()
    ratio = diff / (e.abs().max().item() + ABSOLUTE_FLOOR)
    return float("inf") if math.isnan(ratio) else ratio  # inf - inf, inf / inf


def verify(
    step: Step,
    program: Program,
    inputs: Sequence[torch.Tensor],
    tolerance: float = 1e-9,
    seed: int = 0,
) -> Verification:
    """Run the step eagerly and `program` on copies of `inputs` and compare everything."""
    ref_in, run_in = clone_all(inputs), clone_all(inputs)
    torch.manual_seed(seed)
    ref_out = step.fn(*ref_in)
    torch.manual_seed(seed)
    run_out = program(*step.program_inputs(run_in))
    pairs = list(zip(step.output_names, run_out, ref_out, strict=True))
    pairs += list(zip(step.input_names, run_in, ref_in, strict=True))
    worst, worst_err = "", 0.0
    for name, actual, expected in pairs:
        err = relative_error(actual, expected)
        if err > worst_err or not worst:
            worst, worst_err = name, err
    return Verification(worst_err <= tolerance, worst_err, worst, tolerance)


def measure(
    program: Program,
    inputs: Sequence[torch.Tensor],
    repeats: int = 10,
    warmup: int = 2,
    seed: int = 0,
) -> Measurement:
    """Peak live bytes (one tracked run) and median wall time of `repeats` untracked runs.

    The first calls of a program pay one-off costs (operator lookup, allocator growth: 100x a
    steady step on bert-base:tiny), so `warmup` runs are not timed.
    """
    tracked_in = placed_inputs(program, inputs)
    tracker = tracker_for(program, tracked_in)
    torch.manual_seed(seed)
    with tracker:
        out = program(*tracked_in)
    del out
    host_peak = program.host_pool.peak_bytes
    for _ in range(warmup):
        program(*placed_inputs(program, inputs))
    wall = []
    for _ in range(repeats):
        run_in = placed_inputs(program, inputs)
        torch.manual_seed(seed)
        _sync(run_in)
        start = time.perf_counter()
        program(*run_in)
        _sync(run_in)
        wall.append(time.perf_counter() - start)
    return Measurement(
        tracker.peak_bytes,
        tracker.resident_bytes,
        statistics.median(wall),
        _cuda_peak(program, inputs),
        host_peak,
    )


def _sync(tensors: Sequence[torch.Tensor]) -> None:
    if tensors and tensors[0].is_cuda:
        torch.cuda.synchronize()


def _cuda_peak(program: Program, inputs: Sequence[torch.Tensor]) -> int | None:
    """The caching allocator's view of the same run, for users with a GPU."""
    if not inputs or not inputs[0].is_cuda:
        return None
    run_in = clone_all(inputs)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    program(*run_in)
    torch.cuda.synchronize()
    return (
        torch.cuda.max_memory_allocated() - base + sum(t.untyped_storage().nbytes() for t in run_in)
    )
