"""Graphs as plain, versioned JSON (never pickle: a plan file may come from someone else).

Constant arguments are encoded as tagged JSON values: a `Ref` as {"ref": [node, index]}, a tuple
as {"tuple": [...]}, dtypes, devices, layouts and memory formats by name, non-finite floats as
{"float": "inf"}. Decoding accepts nothing else, so a file cannot smuggle in an object.

Reading is strict: every field is typed and checked, unknown fields are refused, every op is
looked up and every keyword checked against the op's schema (`magis.ir.schema`), every reference
must name a node read before it; a `GraphSchemaError` names the offending field
(``graph.nodes[12].kwargs: 'x); import os' is not an argument of aten.gelu.default``). The file
also carries a sha256 of its own content: a graph edited after magis wrote it (an op swapped, an
output shape changed) is refused before anything reads its figures or runs it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

import torch

from magis.errors import PlanError
from magis.ir.graph import Graph, GraphError, Node, NodeKind, PlaceholderKind, Ref, refs_in
from magis.ir.schema import (
    GraphSchemaError,
    check_kwarg_name,
    check_name,
    check_node,
    check_op,
    shown,
)
from magis.ir.tensor import DTYPE_NAMES, TensorMeta, dtype_from_name, dtype_name

GRAPH_FORMAT = "magis.graph"
GRAPH_VERSION = 2  # 2: tensor strides, content digest, strict schema

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
_DEVICE = re.compile(r"(cpu|cuda|meta)(:[0-9]{1,3})?")
_NON_FINITE = {"inf", "-inf", "nan"}
_MAX_DEPTH = 16  # nesting of constant values (lists of lists of ...); captured graphs use 2
_MAX_INT = 2**62  # sizes, strides and ids beyond this are nonsense (and overflow int64 maths)
_INT64 = 2**63  # every integer argument of an ATen op is an int64

_GRAPH_KEYS = frozenset({"format", "version", "digest", "nodes", "control", "outputs"})
_NODE_KEYS = frozenset(
    {"id", "name", "op", "kind", "placeholder_kind", "args", "kwargs", "outputs", "writes_into"}
)
# Written only when the node has one (a graph without module paths reads as before).
_OPTIONAL_NODE_KEYS = frozenset({"module"})
_META_KEYS = frozenset({"shape", "dtype", "itemsize", "strides"})


# --- writing -------------------------------------------------------------------------------


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


def node_to_json(node: Node) -> dict:
    data = {
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
    if node.module:
        data["module"] = node.module
    return data


def content_digest(data: dict) -> str:
    """sha256 of a graph document's content (every field but the digest), canonically dumped."""
    body = {k: v for k, v in data.items() if k != "digest"}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise GraphSchemaError(f"graph: not a JSON document ({exc})") from None
    return hashlib.sha256(text.encode()).hexdigest()


def graph_to_json(graph: Graph) -> dict:
    """The whole graph with control edges, outputs and a digest of it all. Nodes go in
    topological order (program order for a captured graph): a rewritten graph's old nodes may
    read newer ones, and a reader checks that every reference names a node read before."""
    control = sorted((b, a) for a in graph.nodes for b in graph.control_deps(a))
    data = {
        "format": GRAPH_FORMAT,
        "version": GRAPH_VERSION,
        "nodes": [node_to_json(graph.node(n)) for n in graph.topological_order()],
        "control": [list(edge) for edge in control],
        "outputs": [[r.node, r.index] for r in graph.outputs],
    }
    data["digest"] = content_digest(data)
    return data


# --- reading -------------------------------------------------------------------------------


def _fields(
    value: Any, keys: frozenset[str], where: str, optional: frozenset[str] = frozenset()
) -> dict:
    """`value` as an object with exactly the fields `keys`, and maybe some of `optional`."""
    if type(value) is not dict:
        raise GraphSchemaError(f"{where}: expected an object, got {type(value).__name__}")
    unknown = [k for k in value if k not in keys and k not in optional]
    if unknown:
        raise GraphSchemaError(f"{where}: unknown field {shown(unknown[0])}")
    missing = sorted(keys - value.keys())
    if missing:
        raise GraphSchemaError(f"{where}: missing field {missing[0]!r}")
    return value


def _list(value: Any, where: str) -> list:
    if type(value) is not list:
        raise GraphSchemaError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _int(value: Any, where: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value <= _MAX_INT:
        raise GraphSchemaError(f"{where}: expected an integer >= {low}, got {shown(value)}")
    return value


def _ints(value: Any, where: str) -> tuple[int, ...]:
    return tuple(_int(v, f"{where}[{i}]") for i, v in enumerate(_list(value, where)))


def _pair(value: Any, where: str) -> tuple[int, int]:
    pair = _list(value, where)
    if len(pair) != 2:
        raise GraphSchemaError(
            f"{where}: expected a pair [node, node or output], got {shown(value)}"
        )
    return _int(pair[0], f"{where}[0]"), _int(pair[1], f"{where}[1]")


def _name_in(table: dict[str, Any], value: Any, what: str, where: str) -> Any:
    if type(value) is not str or value not in table:
        raise GraphSchemaError(f"{where}: unknown {what} {shown(value)}")
    return table[value]


def _device(value: Any, where: str) -> torch.device:
    if type(value) is not str or not _DEVICE.fullmatch(value):
        raise GraphSchemaError(f"{where}: unknown device {shown(value)}")
    return torch.device(value)


def _non_finite(value: Any, where: str) -> float:
    if type(value) is not str or value not in _NON_FINITE:
        raise GraphSchemaError(f"{where}: {shown(value)} is not inf, -inf or nan")
    return float(value)


def _dtype(value: Any, where: str) -> torch.dtype:
    if type(value) is not str or value not in DTYPE_NAMES:
        raise GraphSchemaError(f"{where}: unknown dtype {shown(value)}")
    return dtype_from_name(value)


_DECODERS = {
    "ref": lambda body, where: Ref(*_pair(body, where)),
    "float": _non_finite,
    "dtype": _dtype,
    "device": _device,
    "layout": lambda body, where: _name_in(_LAYOUTS, body, "layout", where),
    "memory_format": lambda body, where: _name_in(_MEMORY_FORMATS, body, "memory format", where),
}


def decode_value(value: Any, where: str = "value", depth: int = 0) -> Any:
    """A constant argument from its JSON form; GraphSchemaError for anything magis never writes."""
    if depth > _MAX_DEPTH:
        raise GraphSchemaError(f"{where}: values nested deeper than {_MAX_DEPTH}")
    kind = type(value)
    if kind is int and not -_INT64 <= value < _INT64:
        raise GraphSchemaError(f"{where}: {shown(value)} is out of the int64 range")
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return _decode_items(value, where, depth)
    if kind is dict and len(value) == 1:
        ((tag, body),) = value.items()
        if tag == "tuple":
            return tuple(_decode_items(body, f"{where}.tuple", depth))
        if tag in _DECODERS:
            return _DECODERS[tag](body, f"{where}.{tag}")
    raise GraphSchemaError(f"{where}: unreadable value {shown(value)}: was it written by magis?")


def _decode_items(body: Any, where: str, depth: int) -> list:
    return [decode_value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(_list(body, where))]


def meta_from_json(value: Any, where: str) -> TensorMeta:
    d = _fields(value, _META_KEYS, where)
    shape = _ints(d["shape"], f"{where}.shape")
    dtype = _dtype(d["dtype"], f"{where}.dtype")
    itemsize = _int(d["itemsize"], f"{where}.itemsize")
    if itemsize != dtype.itemsize:
        raise GraphSchemaError(f"{where}.itemsize: {itemsize} is not the size of {d['dtype']}")
    strides = _ints(d["strides"], f"{where}.strides")
    if len(strides) != len(shape):
        raise GraphSchemaError(f"{where}.strides: {len(strides)} strides for {len(shape)} dims")
    return TensorMeta(shape, d["dtype"], itemsize, strides)


def node_from_json(value: Any, where: str, known: dict[int, Node]) -> Node:
    """A node, checked field by field; its references must name nodes in `known`."""
    d = _fields(value, _NODE_KEYS, where, _OPTIONAL_NODE_KEYS)
    nid = _int(d["id"], f"{where}.id")
    if nid in known:
        raise GraphSchemaError(f"{where}.id: node id {nid} appears twice")
    kind = _name_in({k.value: k for k in NodeKind}, d["kind"], "node kind", f"{where}.kind")
    if kind is NodeKind.PLACEHOLDER:
        pkinds = {k.value: k for k in PlaceholderKind}
        pkind = _name_in(pkinds, d["placeholder_kind"], "kind", f"{where}.placeholder_kind")
        if d["op"] != "placeholder":
            raise GraphSchemaError(f"{where}.op: a placeholder's op is 'placeholder'")
    elif d["placeholder_kind"] is not None:
        raise GraphSchemaError(f"{where}.placeholder_kind: only a placeholder has one")
    else:
        pkind = None
    overload = None if kind is NodeKind.PLACEHOLDER else check_op(d["op"], f"{where}.op")
    args = tuple(_decode_items(d["args"], f"{where}.args", 0))
    if type(d["kwargs"]) is not dict:
        raise GraphSchemaError(f"{where}.kwargs: expected an object")
    kwargs = tuple(
        sorted(
            (
                check_kwarg_name(k, overload, d["op"], f"{where}.kwargs"),
                decode_value(v, f"{where}.kwargs.{k}"),
            )
            for k, v in d["kwargs"].items()
        )
    )
    outputs = tuple(
        meta_from_json(m, f"{where}.outputs[{i}]")
        for i, m in enumerate(_list(d["outputs"], f"{where}.outputs"))
    )
    writes = d["writes_into"]
    writes_into = None if writes is None else _ref_value(writes, f"{where}.writes_into")
    node = Node(
        id=nid,
        name=check_name(d["name"], f"{where}.name"),
        op=d["op"],
        kind=kind,
        args=args,
        kwargs=kwargs,
        outputs=outputs,
        placeholder_kind=pkind,
        writes_into=writes_into,
        inputs=tuple(dict.fromkeys([*refs_in(args), *refs_in([v for _, v in kwargs])])),
        module=check_name(d["module"], f"{where}.module") if "module" in d else "",
    )
    check_node(node, where)
    _check_structure(node, where, known)
    return node


def _ref_value(value: Any, where: str) -> Ref:
    if type(value) is not dict or list(value) != ["ref"]:
        raise GraphSchemaError(f"{where}: expected a reference {{'ref': [node, output]}}")
    return Ref(*_pair(value["ref"], f"{where}.ref"))


def _check_structure(node: Node, where: str, known: dict[int, Node]) -> None:
    if node.is_placeholder and (len(node.outputs) != 1 or node.writes_into is not None):
        raise GraphSchemaError(f"{where}: a placeholder has one output and writes nothing")
    if not node.is_placeholder and not node.outputs:
        raise GraphSchemaError(f"{where}.outputs: an op has at least one output")
    for ref in node.inputs:
        _check_known(ref, where, known)
    if node.writes_into is not None:
        _check_known(node.writes_into, f"{where}.writes_into", known)
        if not known[node.writes_into.node].is_placeholder:
            raise GraphSchemaError(f"{where}.writes_into: only a placeholder is written in place")


def _check_known(ref: Ref, where: str, known: dict[int, Node]) -> None:
    node = known.get(ref.node)
    if node is None or ref.index >= len(node.outputs):
        raise GraphSchemaError(
            f"{where}: reference to {ref.node}:{ref.index}, not an earlier value"
        )


def _check_header(data: Any) -> None:
    if type(data) is not dict:
        raise GraphSchemaError(f"graph: expected an object, got {type(data).__name__}")
    if data.get("format") != GRAPH_FORMAT:
        raise PlanError("not a magis graph (its 'format' field is missing or different)")
    version = data.get("version")
    if version != GRAPH_VERSION:
        if type(version) is int and version < GRAPH_VERSION:
            raise PlanError(
                f"graph format version {version} is older than {GRAPH_VERSION}: "
                "re-run magis optimize to make a new plan"
            )
        raise PlanError(
            f"graph format version {shown(version)} is not {GRAPH_VERSION}: upgrade magis"
        )
    _fields(data, _GRAPH_KEYS, "graph")
    if data["digest"] != content_digest(data):
        raise GraphSchemaError(
            "graph.digest: the plan's graph was edited after magis wrote it; re-run magis optimize"
        )


def graph_from_json(data: Any) -> Graph:
    """Rebuild a graph saved by `graph_to_json`; a PlanError names what is wrong with the file."""
    _check_header(data)
    graph = Graph()
    known: dict[int, Node] = {}
    for i, d in enumerate(_list(data["nodes"], "graph.nodes")):
        node = node_from_json(d, f"graph.nodes[{i}]", known)
        known[node.id] = node
        graph.restore_node(node)
    for i, edge in enumerate(_list(data["control"], "graph.control")):
        before, after = _pair(edge, f"graph.control[{i}]")
        if before not in known or after not in known:
            raise GraphSchemaError(f"graph.control[{i}]: names a node that is not in the graph")
        graph.add_control_dep(before, after)
    outputs = [
        Ref(*_pair(r, f"graph.outputs[{i}]"))
        for i, r in enumerate(_list(data["outputs"], "graph.outputs"))
    ]
    for i, ref in enumerate(outputs):
        _check_known(ref, f"graph.outputs[{i}]", known)
    graph.set_outputs(outputs)
    try:
        graph.verify()
    except GraphError as exc:
        raise GraphSchemaError(f"graph.control: {exc}") from None
    return graph
