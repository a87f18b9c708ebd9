"""Cost models: seconds per op on the compute stream and per copy on the copy stream.

`RooflineModel` is analytic, with hardware presets (`rtx3090`, the paper's card and the default;
`a100`; `h100`); `ProfiledCostModel` measures ops on the local device ("cpu", or "cuda": the
local GPU) and keeps them in SQLite (MAGIS §6.2's operator performance cache); `UnitCostModel`
is the hand-checkable test mode.
"""

from __future__ import annotations

from typing import Any

import torch

from magis.cost.base import CacheInfo, CostModel, OpCall, OpKey, UnitCostModel, op_key
from magis.cost.profiled import ProfiledCostModel, ProfileInfo
from magis.cost.roofline import HARDWARE_PRESETS, Hardware, Peaks, RooflineModel
from magis.errors import MagisError, UnknownHardwareError


class NoDeviceError(MagisError):
    """A cost model asked for a device this machine does not have."""


COST_MODEL_NAMES: tuple[str, ...] = (*HARDWARE_PRESETS, "cpu", "cuda", "unit")


def get_cost_model(name: str, **kw: Any) -> CostModel:
    """The cost model called `name`: a roofline preset, "cpu" or "cuda" (profiled on this
    machine's CPU or its current GPU, cached like "cpu") or "unit".

    Keyword arguments go to the model's constructor (e.g. ``cache_path=`` for "cpu").
    """
    key = name.strip().lower()
    if key in HARDWARE_PRESETS:
        return RooflineModel(HARDWARE_PRESETS[key], **kw)
    if key == "cpu":
        return ProfiledCostModel(device="cpu", **kw)
    if key == "cuda":
        if not torch.cuda.is_available():
            raise NoDeviceError(
                "hardware 'cuda' profiles the local GPU and this machine has none (torch sees no "
                "CUDA device): use 'cpu', or a preset such as rtx3090"
            )
        return ProfiledCostModel(device=torch.device("cuda", torch.cuda.current_device()), **kw)
    if key == "unit":
        return UnitCostModel(**kw)
    raise UnknownHardwareError(
        f"unknown hardware '{name}'; choose one of {', '.join(COST_MODEL_NAMES)}"
    )


__all__ = [
    "COST_MODEL_NAMES",
    "HARDWARE_PRESETS",
    "CacheInfo",
    "CostModel",
    "Hardware",
    "NoDeviceError",
    "OpCall",
    "OpKey",
    "Peaks",
    "ProfileInfo",
    "ProfiledCostModel",
    "RooflineModel",
    "UnitCostModel",
    "get_cost_model",
    "op_key",
]
