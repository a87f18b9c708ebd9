"""The device a command executes on (`magis run --device`), and whether a step fits there.

A paper-size step can need more memory than the machine has (bert-base at Table 2's batch
needs about 30 GiB to run and verify). `check_fits` estimates that from the simulation of the
step captured on fake tensors (nothing allocated) and refuses before the model is built.
"""

from __future__ import annotations

import torch

from magis.capture import Step, get_workload, workload_step
from magis.capture.host_memory import host_available_memory
from magis.capture.user_model import is_model_file
from magis.commands.shared import Progress, silent
from magis.cost import NoDeviceError, get_cost_model
from magis.errors import MagisError
from magis.ir import PlaceholderKind
from magis.sim import simulate

DEVICES = ("cpu", "cuda")


class WontFitError(MagisError):
    """A step that needs more memory than the device has available."""


def check_device(name: str | torch.device) -> torch.device:
    """`name` ("cpu", "cuda" or "cuda:N") as a device this machine has; else a one-line error."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in DEVICES:
        raise MagisError(f"unknown device {str(name)!r}; choose cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NoDeviceError(
            "--device cuda: this machine has no CUDA device (torch sees none); use --device cpu"
        )
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and device.index is not None and device.index >= count:
        raise NoDeviceError(f"no CUDA device {device.index}: torch sees {count}")
    return device


def available_memory(device: torch.device) -> int:
    """Bytes a new allocation can have on `device`: the CUDA driver's free memory, or the
    kernel's MemAvailable (RAM that can be had without swapping)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_memory()


def run_memory_estimate(step: Step) -> tuple[int, int, int]:
    """(bytes needed, simulated peak, resident bytes) to run and verify `step` (`magis run`).

    While the program runs beside the eager reference (`magis.backend.verify`), memory holds:
    the model's own parameters, the seeded inputs, the reference's copy of them (kept to compare)
    and the program's copy with its live tensors - the simulated peak. So: peak + 2 x resident
    (two more copies of every input) + the weights. An estimate: the allocator's slack is not in it.
    """
    g = step.graph
    sim = simulate(g, g.program_order(), get_cost_model("unit"))
    weights = sum(g.node(p).outputs[0].nbytes for p in g.placeholders(PlaceholderKind.WEIGHT))
    return sim.peak_bytes + 2 * sim.resident_bytes + weights, sim.peak_bytes, sim.resident_bytes


def check_fits(
    workload: str,
    device: torch.device,
    progress: Progress = silent,
    dtype: torch.dtype | None = None,
) -> None:
    """Refuse a paper-size `workload` whose run would not fit in `device`'s available memory,
    from a capture on fake tensors. `:tiny` and `:small` workloads are MiB-sized by design and
    are not checked (the check costs a second capture)."""
    if not is_model_file(workload) and get_workload(workload).size != "paper":
        return  # a model file is built at full size: checked as a paper-size workload
    progress("estimating its memory (fake tensors)")
    _, fake = workload_step(workload, dtype=dtype, real=False)
    needed, peak, resident = run_memory_estimate(fake)
    available = available_memory(device)
    if needed > available:
        raise WontFitError(
            f"{workload} needs about {_gib(needed)} to run and verify on {device.type} (simulated "
            f"peak {_gib(peak)}, plus copies of its {_gib(resident)} of inputs) and "
            f"{_gib(available)} is available: run {workload}:small or {workload}:tiny, or "
            f"simulate it with magis analyze {workload}"
        )


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"
