"""Tensor metadata: what the memory model and the meta check need to know of a value."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from operator import attrgetter

import torch

# Every dtype this torch has, by its canonical name ('float32', not 'float'): the names a plan
# file may use. A name is looked up here, never as an attribute of torch.
_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
DTYPE_NAMES: frozenset[str] = frozenset(_DTYPES)


class UnknownDtypeError(ValueError):
    """A dtype name outside `DTYPE_NAMES` (a plan file is never trusted to name attributes)."""


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the portable spelling used in plans and reports."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype named `name`, one of `DTYPE_NAMES` (never an arbitrary torch attribute)."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise UnknownDtypeError(f"unknown dtype {name!r}")
    return dtype


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of `shape`, as torch computes them (a size-0 or 1 dim counts as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def dense_layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a tensor of `shape` and `strides` covers its storage span exactly once: row-major
    strides or a permutation of them (a transposed or channels-last tensor; not a slice with
    gaps, an expansion or an overlap). Dimensions of size one do not matter."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(strides, shape, strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def dense_permutation(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[int] | None:
    """The order of dims (outermost first) in which `strides` are the row-major strides of the
    permuted shape, or None where no order gives them (gaps, overlaps). Unlike `dense_layout`,
    size-one dimensions must have the strides such a permuted tensor gives them."""
    perm = sorted(range(len(shape)), key=lambda d: (-strides[d], d))
    dense = contiguous_strides(tuple(shape[d] for d in perm))
    return perm if all(strides[d] == s for d, s in zip(perm, dense, strict=True)) else None


def storage_span(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements from a tensor's first to its last element, both counted: the storage
    `empty_strided` allocates for it (its element count for a dense layout; 0 when empty)."""
    numel = math.prod(shape)
    if numel == 0 or dense_layout(shape, strides):
        return numel
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(shape, strides, strict=True))


def broadcast_numel(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Elements of the broadcast of shapes `a` and `b` (torch's rule: trailing dims aligned, a
    size-1 dim takes the other's size, so 1 against 0 gives 0)."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    return math.prod(y if x == 1 else x for x, y in zip(a, b, strict=True))


def pickled_by_fields(cls):
    """Class decorator: a slotted dataclass pickles as a call with its init fields (the field
    names read once here). `dataclasses`' own slots pickling calls `fields()` per object, and
    a search state sent to a worker holds some 50,000 nodes, each with refs and metas."""
    values = attrgetter(*(f.name for f in fields(cls) if f.init))  # a tuple: two or more

    def __reduce__(self):
        return cls, values(self)

    cls.__reduce__ = __reduce__
    return cls


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape, dtype, size in bytes and strides of one output of one node.

    `nbytes` is the bytes of its elements: what an op reads or writes of it, what a copy of
    it holds. `span_bytes` is the storage an op that allocates it with these strides takes
    (`StorageMap.nbytes`, but for the few losses that keep a larger buffer): the same for a
    dense layout, more for a gapped one, as `empty_strided` allocates (a functional `copy` into
    a view takes the view's whole storage instead: `OpInfo.clones_storage`). A view's are never
    counted as a storage (its base's storage is).

    `strides` are the ones the captured program produced (a channels-last convolution gradient
    is not row-major). Left out, they are row-major: the contract for a node a rule creates is
    that its outputs are contiguous unless the rule says otherwise. The meta check
    (`magis.backend.meta_check`) holds every graph to its recorded strides.
    """

    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    strides: tuple[int, ...] = field(default=None)  # type: ignore[assignment]  # set below
    _span: int = field(init=False, repr=False, compare=False, default=0)  # elements reached

    def __post_init__(self) -> None:
        if self.strides is None:
            object.__setattr__(self, "strides", contiguous_strides(self.shape))
        object.__setattr__(self, "_span", storage_span(self.shape, self.strides))

    @property
    def is_row_major(self) -> bool:
        """Whether the strides are the row-major ones of the shape."""
        return self.strides == contiguous_strides(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def span_bytes(self) -> int:
        return self._span * self.itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(
            tuple(int(s) for s in t.shape),
            dtype_name(t.dtype),
            t.element_size(),
            tuple(int(s) for s in t.stride()),
        )

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "itemsize": self.itemsize,
            "strides": list(self.strides),
        }
