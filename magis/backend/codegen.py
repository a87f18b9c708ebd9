"""Readable Python source for a graph and a schedule, calling torch.ops.aten (MAGIS §7.1).

The generated function takes the placeholders in graph order and returns the graph's outputs.
It mirrors the memory model: every value is dropped (`x = None`) right after its last reader in
the schedule, so a storage dies when its last alias does — exactly when the simulator frees it.
In-place updates call the op's `out=` overload with the placeholder as `out`.

A graph may come from a plan file, so nothing of it is pasted into the source unchecked: every
node passes `magis.ir.schema.check_node` (its op a real ATen overload, its keyword names
arguments of that overload's schema), the callee is spelled from the resolved overload, names
become ASCII identifiers, and constants are written by their own type's `repr`.
"""

from __future__ import annotations

import keyword
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from magis.backend.guards import expect
from magis.backend.runtime import HostPool
from magis.errors import UnsupportedOpError
from magis.ir import Graph, Ref
from magis.ir.ops import EXPECT_OP, LOAD_OP, STORE_OP, out_overload
from magis.ir.schema import IDENTIFIER, check_node, check_op, shown
from magis.sim import tables


@dataclass(frozen=True)
class Program:
    """Generated source and the function compiled from it."""

    source: str
    fn: Callable[..., tuple]
    input_names: tuple[str, ...]
    host_pool: HostPool  # where Store puts tensors (swapping)
    # Inputs (by position) that live in host memory for the whole step, read only through
    # Loads and written back by a Store (offloaded optimizer state, `magis.rules.offload`;
    # the simulator's `Tables.host_resident`): a caller keeps them on the host.
    host_inputs: frozenset[int] = frozenset()
    # Operators whose outputs are host copies (none here: `store` is a plain call).
    host_ops: frozenset = frozenset()

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        self.host_pool.begin_call()
        out = self.fn(*inputs)
        self.host_pool.join()  # Store/Load copies end inside the call (a CUDA graph needs it)
        return out


def _identifier(name: str, taken: set[str]) -> str:
    # ASCII only: Python folds Unicode identifiers (NFKC), so two distinct names could meet.
    ident = re.sub(r"[^A-Za-z0-9_]", "_", name)
    if not ident or ident[0].isdigit() or keyword.iskeyword(ident):
        ident = f"v_{ident}"
    base, k = ident, 1
    while ident in taken:
        ident = f"{base}_{k}"
        k += 1
    taken.add(ident)
    return ident


class Names:
    """A Python identifier for every value (Ref) of the graph."""

    def __init__(self, graph: Graph, order: list[int]) -> None:
        # Names the generated code uses besides the values' (`float` spells inf and nan).
        taken = {
            "torch",
            "aten",
            "c10d",
            "device",
            "program",
            "store",
            "store_into",
            "load",
            "ready",
            "arena",
            "float",
        }
        self._names: dict[Ref, str] = {}
        for nid in order:
            node = graph.node(nid)
            base = _identifier(node.name, taken)
            if len(node.outputs) == 1:
                self._names[Ref(nid)] = base
            else:
                for i in range(len(node.outputs)):
                    self._names[Ref(nid, i)] = _identifier(f"{base}_{i}", taken)

    def __getitem__(self, ref: Ref) -> str:
        return self._names[ref]


def literal(value, names: Names) -> str:
    """Source for a constant: each type's own repr (a subclass's override is never called)."""
    if isinstance(value, Ref):
        return names[value]
    if value is None or isinstance(value, bool):
        return "None" if value is None else ("True" if value else "False")
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, str):
        return str.__repr__(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float.__repr__(value)
        return "float('nan')" if math.isnan(value) else f"float('{'-' if value < 0 else ''}inf')"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return "device"  # the device the program runs on, whatever the capture saw
    if isinstance(value, torch.layout | torch.memory_format):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(literal(v, names) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(literal(v, names) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    raise UnsupportedOpError(
        f"cannot generate code for the constant {value!r} ({type(value).__name__})"
    )


def call_source(graph: Graph, nid: int, names: Names, device_type: str = "cpu") -> str:
    node = graph.node(nid)
    overload = check_node(node, f"node {node.id} ({shown(node.name)})")
    if node.op == EXPECT_OP:  # a value guard (`magis.backend.guards`)
        return f"expect({', '.join(literal(a, names) for a in node.args)})"
    if overload is None:  # Store / Load: the runtime's host pool does the copy
        if node.writes_into is not None:  # offloaded state written back (rules/offload.py)
            return f"store_into({names[node.inputs[0]]}, {names[node.writes_into]})"
        verb = "store" if node.op == STORE_OP else "load"
        return f"{verb}({names[node.inputs[0]]})"
    args = [literal(a, names) for a in node.args]
    kwargs = [f"{k}={literal(v, names)}" for k, v in node.kwargs]
    if node.writes_into is not None:
        overload = out_overload(node.op)
        if overload is None:
            raise UnsupportedOpError(
                f"{node.op} has no out= overload to write {node.name} in place"
            )
        kwargs.append(f"out={names[node.writes_into]}")
    if node.op == "aten.bernoulli.p" and device_type == "cuda" and _keep_probability(node):
        return _drawn_as_cuda_dropout(args[0], node.args[1], graph.meta(Ref(nid)).torch_dtype)
    if node.op == "aten.bernoulli.p" and not graph.meta(node.inputs[0]).is_row_major:
        return _drawn_in_memory_order(args, kwargs)
    return f"{_callee(overload)}({', '.join(args + kwargs)})"


def _drawn_in_memory_order(args: list[str], kwargs: list[str]) -> str:
    """Dropout's mask as eager draws it. Eager runs `empty_like(x).bernoulli_(p)`, which
    draws in the memory order of `x` (channels-last, transposed); functionalization records
    `bernoulli.p(x, p)`, which draws row-major into a fresh tensor: another mask from the same
    seed. The in-place draw on a tensor laid out like `x`, made row-major as recorded, is the
    mask eager drew on any build of PyTorch (for one extra buffer of the mask's size)."""
    laid_out_like_x = f"aten.empty_like.default({args[0]})"
    in_place = f"aten.bernoulli_.float({', '.join([laid_out_like_x, *args[1:], *kwargs])})"
    return f"aten.clone.default({in_place}, memory_format=torch.contiguous_format)"


def _keep_probability(node) -> bool:
    """A bernoulli.p with a constant probability and no generator of its own: dropout's mask."""
    keep = node.args[1] if len(node.args) == 2 else None
    return isinstance(keep, float) and 0.0 < keep < 1.0 and not node.kwargs


def _drawn_as_cuda_dropout(x: str, keep: float, dtype: torch.dtype) -> str:
    """Dropout's mask as eager draws it on a GPU. There `F.dropout` runs the fused
    `native_dropout` kernel, whose Philox stream differs from `bernoulli_`'s; the capture records
    dropout as `bernoulli.p(x, 1 - p)` (the CPU decomposition). Drawing the mask with the fused
    kernel itself (its second output; the first is discarded) gives eager's mask from the same
    seed, so plans verify against eager on a GPU as on a CPU, CUDA graphs included."""
    drop = float(f"{1.0 - keep:.15g}")  # 1 - 0.9 is 0.09999999999999998: the user wrote 0.1
    mask = f"aten.native_dropout.default({x}, {float.__repr__(drop)}, True)[1]"
    return f"aten._to_copy.default({mask}, dtype={dtype})"


def _callee(overload: torch._ops.OpOverload) -> str:
    """'aten.mm.default', spelled from the resolved overload (not from the graph's string); a
    functional collective is 'c10d.all_reduce.default' (torch.ops._c10d_functional)."""
    packet, name = overload.overloadpacket.__name__, overload._overloadname
    if not (IDENTIFIER.fullmatch(packet) and IDENTIFIER.fullmatch(name)):
        raise UnsupportedOpError(f"cannot call the operator {shown(str(overload))} by name")
    namespace = "c10d" if overload.namespace == "_c10d_functional" else "aten"
    return f"{namespace}.{packet}.{name}"


def _last_uses(graph: Graph, order: list[int]) -> dict[int, list[Ref]]:
    """For each step, the values whose last reader it is (or that nobody reads: their producer)."""
    last: dict[Ref, int] = {}
    for nid in order:
        node = graph.node(nid)
        if node.is_placeholder:
            continue
        for i in range(len(node.outputs)):
            last[Ref(nid, i)] = nid
        for ref in node.inputs:
            if not graph.node(ref.node).is_placeholder:
                last[ref] = nid
    for ref in graph.outputs:
        last.pop(ref, None)
    dropped: dict[int, list[Ref]] = {}
    for ref, nid in last.items():
        dropped.setdefault(nid, []).append(ref)
    return dropped


def generate(
    graph: Graph, order: list[int], fn_name: str = "program", device_type: str = "cpu"
) -> str:
    """Python source of `fn_name(*placeholders)` running `graph` in `order` on a device of
    `device_type` (only dropout's mask is drawn differently on "cuda")."""
    names = Names(graph, order)
    placeholders = graph.placeholders()
    lines = [f"def {fn_name}({', '.join(names[Ref(p)] for p in placeholders)}):"]
    dropped = _last_uses(graph, order)
    pending_loads: set[Ref] = set()
    for nid in order:
        node = graph.node(nid)
        if node.is_placeholder:
            continue
        for ref in node.inputs:
            if ref in pending_loads:  # the first user waits for the copy to land (GPU)
                lines.append(f"    ready({names[ref]})")
                pending_loads.discard(ref)
        if node.op == LOAD_OP:
            pending_loads.add(Ref(nid))
        outs = [names[Ref(nid, i)] for i in range(len(node.outputs))]
        target = outs[0] if len(outs) == 1 and not _returns_list(node) else ", ".join(outs)
        target += "," if len(outs) == 1 and _returns_list(node) else ""
        line = f"    {target} = {call_source(graph, nid, names, device_type)}"
        if dropped.get(nid):
            line += ";  " + " = ".join(sorted(names[r] for r in dropped[nid])) + " = None"
        lines.append(line)
    results = [names[r] for r in graph.outputs]
    lines.append(f"    return ({', '.join(results)}{',' if len(results) == 1 else ''})")
    return "\n".join(lines) + "\n"


def _returns_list(node) -> bool:
    """The op returns a list (split_with_sizes, unbind): one output is unpacked as `x, = ...`,
    not bound to the list (a gradient bucket of one tensor splits into one part)."""
    overload = check_op(node.op, node.name)
    returns = overload._schema.returns if overload is not None else ()
    return len(returns) == 1 and isinstance(returns[0].type, torch.ListType)


def compile_program(graph: Graph, order: list[int], device: torch.device | str = "cpu") -> Program:
    """Generate and compile the program for `graph` in `order`, its constants on `device`."""
    device = torch.device(device)
    source = generate(graph, order, device_type=device.type)
    return program_from_source(graph, order, source, device)


def program_from_source(
    graph: Graph, order: list[int], source: str, device: torch.device | str = "cpu"
) -> Program:
    """Compile `source`, generated for `graph` in `order`, into a Program running on `device`."""
    device = torch.device(device)
    pool = HostPool()
    scope = {
        "torch": torch,
        "aten": torch.ops.aten,
        "c10d": torch.ops._c10d_functional,
        "device": device,
        "store": pool.store,
        "store_into": pool.store_into,
        "load": lambda host: pool.load(host, device),
        "ready": pool.ready,
        "expect": expect,
    }
    exec(compile(source, "<magis-program>", "exec"), scope)  # noqa: S102 - our own generated code
    names = Names(graph, order)
    placeholders = graph.placeholders()
    inputs = tuple(names[Ref(p)] for p in placeholders)
    on_host = tables(graph).host_resident
    host_inputs = frozenset(i for i, p in enumerate(placeholders) if Ref(p) in on_host)
    return Program(source, scope["program"], inputs, pool, host_inputs)
