"""The IR: graph, tensor metadata, storages and aliases, the op registry (MAGIS §2.1, Table 1)."""

from magis.ir.graph import (
    DerivedKey,
    Graph,
    GraphError,
    Node,
    NodeKind,
    PlaceholderKind,
    Ref,
    StorageMap,
    derive_storages,
)
from magis.ir.ops import DEFAULT_REGISTRY, OpInfo, OpRegistry
from magis.ir.order import positions
from magis.ir.tensor import TensorMeta

__all__ = [
    "DEFAULT_REGISTRY",
    "DerivedKey",
    "Graph",
    "GraphError",
    "Node",
    "NodeKind",
    "OpInfo",
    "OpRegistry",
    "PlaceholderKind",
    "Ref",
    "StorageMap",
    "TensorMeta",
    "derive_storages",
    "positions",
]
