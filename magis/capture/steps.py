"""Training steps of the workload zoo, captured: the entry point of `magis analyze` and `run`."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from magis.capture.collectives import ParallelError
from magis.capture.sharding import PlannedJob
from magis.capture.step_kinds import DEFAULT_STEP, StepKind, read_step_kind
from magis.capture.trace import Step, training_step
from magis.capture.user_model import UserModel, is_model_file, model_file_step
from magis.capture.workloads import Workload, get_workload


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def workload_step(
    name: str,
    batch: int | None = None,
    dtype: torch.dtype | None = None,
    step: StepKind | str = DEFAULT_STEP,
    real: bool | None = None,
    seed: int = 0,
    *,
    float64_when_tiny: bool = False,
    job: PlannedJob | None = None,
) -> tuple[Workload | UserModel, Step]:
    """Build workload `name` and capture its training step (forward, backward, update).

    Paper-size workloads are built under a FakeTensorMode (nothing allocated); `tiny` and `small`
    ones with real tensors, so the step can be executed and verified (`real` overrides this).
    `dtype` overrides the workload's floating-point dtype for floating workloads (tests verify in
    float64). `float64_when_tiny` is the step `magis optimize`, `run` and `layout --plan` work
    on: a `:tiny` workload without a `dtype` is built in float64, so that plans made for it
    verify to 1e-9 against eager PyTorch, and a plan saved by one command matches the step the
    next one captures. `step` is the kind of step (`magis.capture.step_kinds.StepKind`); an
    autocast one keeps the workload's float32 master weights even then (autocast leaves
    float64 tensors uncast: such a capture would hold no reduced-precision op).

    `name` may also be a model file, `path/to/model.py:factory` (`magis.capture.user_model`):
    built at full size under fake tensors unless `real`.

    With `job`, the step is one rank's of that data-parallel job (`PlannedJob`: DDP's
    all-reduce, or FSDP's sharded parameters and collectives).
    """
    kind = read_step_kind(step)
    if job is not None and is_model_file(name):
        raise ParallelError(
            f"{name}: --parallel plans a zoo or corpus workload; for your own model use "
            "magis.compile(..., parallel=) in its training script"
        )
    if is_model_file(name):
        return model_file_step(name, batch, dtype, kind, real=bool(real), seed=seed)
    wl = get_workload(name, batch)
    real = wl.size != "paper" if real is None else real
    tight = float64_when_tiny and not kind.keeps_master_dtype
    if dtype is None and tight and wl.size == "tiny":
        dtype = torch.float64
    dtype = dtype if dtype is not None else wl.dtype
    mode = contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True)
    with default_dtype(dtype), mode:
        torch.manual_seed(seed)
        model = wl.build_model()
        inputs = wl.make_inputs(wl.batch)
        sharding = job.shard(model) if job is not None else None
    return wl, training_step(
        model,
        inputs,
        loss_fn=wl.loss_fn,
        optimizer=kind.optimizer,
        autocast=kind.autocast,
        parallel=job.ranks if job is not None else None,
        sharding=sharding,
    )
