"""Nodes of the computation graph and the references between them (MAGIS §2.1, Table 1)."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from magis.ir.tensor import TensorMeta, pickled_by_fields


@pickled_by_fields
@dataclass(frozen=True, slots=True, order=True)
class Ref:
    """Output `index` of node `node`."""

    node: int
    index: int = 0


class NodeKind(enum.Enum):
    PLACEHOLDER = "placeholder"
    OP = "op"


class PlaceholderKind(enum.Enum):
    """What an input of the step holds; decides how the peak breakdown counts it."""

    WEIGHT = "weight"
    BUFFER = "buffer"
    OPT_STATE = "optimizer_state"
    DATA = "data"
    CONSTANT = "constant"  # a tensor the traced code created from Python data (a get_attr)


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class Node:
    id: int
    name: str
    op: str  # "placeholder" or an overload name such as "aten.mm.default"
    kind: NodeKind
    args: tuple = ()  # constants and Refs (lists of Refs for cat and friends)
    kwargs: tuple[tuple[str, Any], ...] = ()
    outputs: tuple[TensorMeta, ...] = ()
    placeholder_kind: PlaceholderKind | None = None
    # The output is written into this placeholder's storage (optimizer and running-stat
    # updates): it allocates nothing, and every other reader of the old value runs before it.
    writes_into: Ref | None = None
    inputs: tuple[Ref, ...] = field(default=())  # distinct Refs in args/kwargs, in order
    # The model's module this node computes for ('encoder.layer.3.attention'), where capture
    # knew it; '' elsewhere. Only reports read it (`magis explain`).
    module: str = ""

    @property
    def is_placeholder(self) -> bool:
        return self.kind is NodeKind.PLACEHOLDER

    @property
    def kwargs_dict(self) -> dict[str, Any]:
        return dict(self.kwargs)

    def out(self, index: int = 0) -> Ref:
        return Ref(self.id, index)


def refs_in(value: Any) -> Iterator[Ref]:
    """Every Ref inside an argument value (lists and tuples searched)."""
    if isinstance(value, Ref):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from refs_in(v)


def map_refs(value: Any, fn) -> Any:
    """`value` with every Ref replaced by fn(ref), lists and tuples rebuilt."""
    if isinstance(value, Ref):
        return fn(value)
    if isinstance(value, list):
        return [map_refs(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(map_refs(v, fn) for v in value)
    return value
