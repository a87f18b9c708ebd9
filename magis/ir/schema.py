"""What a node may contain: the checks a graph from outside (a plan file) must pass.

A plan file is a program, and it may come from anyone. Codegen pastes node fields into Python
source (`magis.backend.codegen`), so every field that reaches the source is checked here first:
an op name must be a real `torch.ops.aten` overload (or one of magis's own Store/Load), every
keyword argument must be an argument of that overload's schema and a plain identifier, every
constant one of a few plain types. The plan loader (`magis.ir.serialize`) and codegen both call
`check_node`; neither trusts the other to have done it.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

from magis.errors import PlanError
from magis.ir.node import Node, Ref
from magis.ir.ops import COLLECTIVE_OPS, EXPECT_OP, LOAD_OP, STORE_OP, WAIT_OP

# Node names: parameter paths ('bert.encoder.layer.0.attention.self.query.weight') and fx names
# with the rules' suffixes. Codegen turns them into ASCII identifiers; the pattern keeps quotes,
# brackets, spaces and operators out of reports and error messages.
NAME_PATTERN = re.compile(r"[\w.\-]{1,1000}")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")
OP_PATTERN = re.compile(r"aten\.[A-Za-z_][A-Za-z0-9_]{0,99}\.[A-Za-z_][A-Za-z0-9_]{0,99}")
MAGIS_OPS = frozenset({STORE_OP, LOAD_OP, EXPECT_OP})
# Outside torch.ops.aten, only c10d's functional collectives and their wait (data parallelism,
# `magis.capture.collectives`), by exact name.
COMM_OPS = frozenset({*COLLECTIVE_OPS, WAIT_OP})
# String arguments of ATen ops are short words ('tanh', 'floor', 'sum'): codegen writes them by
# repr anyway, and a file with quotes or brackets in one is refused outright.
STRING_CONSTANT = re.compile(r"[\w ,.\->]{0,100}")
# A value guard's source line ('transformers/models/bart/modeling_bart.py:1041'): a path and a
# number, no quotes or brackets.
SITE_CONSTANT = re.compile(r"[\w ,.\-/:+@]{0,300}")
GUARD_VALUE_TYPES = (bool, int, float, type(None))
# Graph constants are these types, lists and tuples of them, and Refs (nothing else can be
# written into a plan file or pasted into generated code).
CONSTANT_TYPES = (
    bool,
    int,
    float,
    str,
    type(None),
    torch.dtype,
    torch.layout,
    torch.memory_format,
    torch.device,
)


class GraphSchemaError(PlanError):
    """A graph field that magis would never write: a hand-edited or hostile plan file."""


def shown(value: Any, limit: int = 60) -> str:
    """`repr(value)` cut to `limit` characters: error messages stay one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise GraphSchemaError(
            f"{where}: {shown(name)} is not a node name (letters, digits, '_', '.', '-')"
        )
    return name


@functools.lru_cache(maxsize=4096)  # bounded: a hostile file may name many ops
def _aten_overload(op: str) -> torch._ops.OpOverload | None:
    """torch.ops.aten.<packet>.<overload> for a name already matching OP_PATTERN, or None."""
    _, packet_name, overload_name = op.split(".")
    try:
        packet = getattr(torch.ops.aten, packet_name)
        overload = getattr(packet, overload_name)
    except (AttributeError, RuntimeError):
        return None
    return overload if isinstance(overload, torch._ops.OpOverload) else None


def _comm_overload(op: str, where: str) -> torch._ops.OpOverload:
    """torch.ops._c10d_functional.<packet>.default, or a one-line error on a PyTorch without it
    (a build without torch.distributed)."""
    _, packet_name, overload_name = op.split(".")
    try:
        return getattr(getattr(torch.ops._c10d_functional, packet_name), overload_name)
    except (AttributeError, RuntimeError) as exc:
        raise GraphSchemaError(
            f"{where}: this PyTorch has no collective {op} (built without torch.distributed?)"
        ) from exc


@functools.cache
def argument_names(overload: torch._ops.OpOverload) -> frozenset[str]:
    return frozenset(a.name for a in overload._schema.arguments)


def check_op(op: Any, where: str) -> torch._ops.OpOverload | None:
    """The ATen overload named `op`, or None for magis's Store and Load; anything else is
    refused (a name is looked up only once it matches OP_PATTERN, never evaluated)."""
    if isinstance(op, str) and op in MAGIS_OPS:
        return None
    if isinstance(op, str) and op in COMM_OPS:
        return _comm_overload(op, where)
    overload = _aten_overload(op) if isinstance(op, str) and OP_PATTERN.fullmatch(op) else None
    if overload is None:
        raise GraphSchemaError(f"{where}: {shown(op)} is not an ATen operator overload")
    return overload


def check_kwarg_name(key: Any, overload: torch._ops.OpOverload | None, op: str, where: str) -> str:
    if not isinstance(key, str) or not IDENTIFIER.fullmatch(key):
        raise GraphSchemaError(f"{where}: {shown(key)} is not an argument name")
    if overload is None or key not in argument_names(overload):
        raise GraphSchemaError(f"{where}: {shown(key)} is not an argument of {op}")
    return key


def check_constant(value: Any, where: str) -> None:
    """Refs, `CONSTANT_TYPES` and lists and tuples of them, by exact type (a subclass could
    carry its own `repr`)."""
    if isinstance(value, Ref):
        return
    if type(value) in (list, tuple):
        for i, v in enumerate(value):
            check_constant(v, f"{where}[{i}]")
        return
    if type(value) not in CONSTANT_TYPES:
        raise GraphSchemaError(f"{where}: a constant of type {type(value).__name__} is not allowed")
    if type(value) is str and not STRING_CONSTANT.fullmatch(value):
        raise GraphSchemaError(f"{where}: {shown(value)} is not a plain word")


def check_node(node: Node, where: str) -> torch._ops.OpOverload | None:
    """Check every field of `node` that codegen writes into source; return its overload."""
    check_name(node.name, f"{where}.name")
    if node.is_placeholder:
        if node.op != "placeholder" or node.args or node.kwargs:
            raise GraphSchemaError(f"{where}: a placeholder has no op, args or kwargs")
        return None
    overload = check_op(node.op, f"{where}.op")
    if node.op == EXPECT_OP:
        check_guard(node, where)
        return None
    if overload is None and (
        node.kwargs or len(node.args) != 1 or not isinstance(node.args[0], Ref)
    ):
        raise GraphSchemaError(f"{where}: {node.op} takes exactly one tensor argument")
    for i, a in enumerate(node.args):
        check_constant(a, f"{where}.args[{i}]")
    for key, value in node.kwargs:
        check_kwarg_name(key, overload, node.op, f"{where}.kwargs")
        check_constant(value, f"{where}.kwargs[{key}]")
    return overload


def check_guard(node: Node, where: str) -> None:
    """A value guard's fields: (tensor, shape, value or None, source line), nothing else."""
    args = node.args
    ok = (
        not node.kwargs
        and len(args) == 4
        and isinstance(args[0], Ref)
        and type(args[1]) in (list, tuple)
        and all(type(d) is int for d in args[1])
        and type(args[2]) in GUARD_VALUE_TYPES
        and type(args[3]) is str
        and SITE_CONSTANT.fullmatch(args[3]) is not None
    )
    if not ok:
        raise GraphSchemaError(
            f"{where}: {EXPECT_OP} takes (tensor, shape, value or None, source line), got "
            f"{shown(args)}"
        )
