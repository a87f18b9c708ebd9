"""Tensor metadata: what the memory model needs to know of a value, and nothing it does not."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the portable spelling used in plans and reports."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        return getattr(torch, name)
    return _DTYPES[name]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape, dtype and size in bytes of one output of one node.

    `nbytes` is the size of the storage the producing op allocates; for a view it is the view's
    own extent, which is never counted on its own (its base's storage is).
    """

    shape: tuple[int, ...]
    dtype: str
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(int(s) for s in t.shape), dtype_name(t.dtype), t.element_size())

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "itemsize": self.itemsize}

    @staticmethod
    def from_json(d: dict) -> TensorMeta:
        return TensorMeta(tuple(d["shape"]), d["dtype"], d["itemsize"])
