"""Graphs as plain, versioned JSON (never pickle: a plan file may come from someone else).

Constant arguments are encoded as tagged JSON values: a `Ref` as {"ref": [node, index]}, a tuple
as {"tuple": [...]}, dtypes, devices, layouts and memory formats by name, non-finite floats as
{"float": "inf"}. Decoding accepts nothing else, so a file cannot smuggle in an object.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from magis.errors import PlanError
from magis.ir.graph import Graph, Node, NodeKind, PlaceholderKind, Ref, refs_in
from magis.ir.tensor import TensorMeta, dtype_from_name, dtype_name

GRAPH_FORMAT = "magis.graph"
GRAPH_VERSION = 1

_LAYOUTS = {str(v).removeprefix("torch."): v for v in (torch.strided, torch.sparse_coo)}
_MEMORY_FORMATS = {
    str(v).removeprefix("torch."): v
    for v in (
        torch.contiguous_format,
        torch.channels_last,
        torch.preserve_format,
        torch.channels_last_3d,
    )
}


def encode_value(value: Any) -> Any:
    if isinstance(value, Ref):
        return {"ref": [value.node, value.index]}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    raise PlanError(f"cannot save the constant {value!r} ({type(value).__name__}) in a graph file")


def decode_value(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        ((tag, body),) = value.items()
        decoder = _DECODERS.get(tag)
        if decoder is not None:
            return decoder(body)
    raise PlanError(f"unreadable value {value!r} in graph file: was it written by magis?")


def _decode_memory_format(name: str) -> torch.memory_format:
    if name not in _MEMORY_FORMATS:
        raise PlanError(f"unknown memory format {name!r} in graph file")
    return _MEMORY_FORMATS[name]


def _decode_layout(name: str) -> torch.layout:
    if name not in _LAYOUTS:
        raise PlanError(f"unknown layout {name!r} in graph file")
    return _LAYOUTS[name]


_DECODERS = {
    "ref": lambda b: Ref(int(b[0]), int(b[1])),
    "tuple": lambda b: tuple(decode_value(v) for v in b),
    "float": lambda b: float(b),
    "dtype": dtype_from_name,
    "device": torch.device,
    "layout": _decode_layout,
    "memory_format": _decode_memory_format,
}


def node_to_json(node: Node) -> dict:
    return {
        "id": node.id,
        "name": node.name,
        "op": node.op,
        "kind": node.kind.value,
        "placeholder_kind": node.placeholder_kind.value if node.placeholder_kind else None,
        "args": [encode_value(a) for a in node.args],
        "kwargs": {k: encode_value(v) for k, v in node.kwargs},
        "outputs": [m.to_json() for m in node.outputs],
        "writes_into": encode_value(node.writes_into),
    }


def node_from_json(d: dict) -> Node:
    args = tuple(decode_value(a) for a in d["args"])
    kwargs = tuple(sorted((k, decode_value(v)) for k, v in d["kwargs"].items()))
    inputs = tuple(dict.fromkeys([*refs_in(args), *refs_in([v for _, v in kwargs])]))
    kind = d.get("placeholder_kind")
    return Node(
        id=int(d["id"]),
        name=str(d["name"]),
        op=str(d["op"]),
        kind=NodeKind(d["kind"]),
        args=args,
        kwargs=kwargs,
        outputs=tuple(TensorMeta.from_json(m) for m in d["outputs"]),
        placeholder_kind=PlaceholderKind(kind) if kind else None,
        writes_into=decode_value(d["writes_into"]),
        inputs=inputs,
    )


def graph_to_json(graph: Graph) -> dict:
    """The whole graph with control edges and outputs. Nodes go in topological order (which is
    program order for a captured graph): a rewritten graph's old nodes may read newer ones."""
    control = sorted((b, a) for a in graph.nodes for b in graph.control_deps(a))
    return {
        "format": GRAPH_FORMAT,
        "version": GRAPH_VERSION,
        "nodes": [node_to_json(graph.node(n)) for n in graph.topological_order()],
        "control": [list(edge) for edge in control],
        "outputs": [[r.node, r.index] for r in graph.outputs],
    }


def graph_from_json(data: dict) -> Graph:
    """Rebuild a graph saved by `graph_to_json`; a PlanError says what is wrong with the file."""
    if data.get("format") != GRAPH_FORMAT:
        raise PlanError("not a magis graph (its 'format' field is missing or different)")
    if data.get("version") != GRAPH_VERSION:
        raise PlanError(
            f"graph format version {data.get('version')} is not {GRAPH_VERSION}: upgrade magis"
        )
    graph = Graph()
    try:
        for d in data["nodes"]:
            graph.restore_node(node_from_json(d))
        for before, after in data["control"]:
            graph.add_control_dep(int(before), int(after))
        graph.set_outputs(Ref(int(n), int(i)) for n, i in data["outputs"])
        graph.verify()
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"broken graph file: {type(exc).__name__}: {exc}") from exc
    return graph
