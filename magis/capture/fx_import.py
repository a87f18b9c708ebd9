"""Turn a functionalized torch.fx graph of ATen ops into a magis `Graph`.

getitem nodes disappear (consumers refer to an output by index); the functionalization epilogue
`copy_(placeholder, value)` is folded into `value`'s producer as an in-place write when it can be
(the parameter's memory then counts once, as in eager PyTorch), and kept as a `copy_` node writing
into the placeholder otherwise; dead nodes without side effects are dropped.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from magis.capture.specialize import READ_KEY, ValueRead
from magis.errors import CaptureError
from magis.ir import Graph, PlaceholderKind, Ref, TensorMeta
from magis.ir.graph import refs_in
from magis.ir.ops import EXPECT_OP, out_overload

_EMPTY = TensorMeta((0,), "float32", 4)  # an output the op did not produce (None)
_GUARD_OUTPUT = TensorMeta((), "bool", 1)  # a guard's (`magis.backend.guards.expect`)


def _metas(val) -> tuple[TensorMeta, ...]:
    if isinstance(val, torch.Tensor):
        return (TensorMeta.of(val),)
    if isinstance(val, list | tuple):
        return tuple(TensorMeta.of(v) if isinstance(v, torch.Tensor) else _EMPTY for v in val)
    return ()


def _convert_arg(a, env: dict[fx.Node, Ref]):
    if isinstance(a, fx.Node):
        return env[a]
    if isinstance(a, list):
        return [_convert_arg(x, env) for x in a]
    if isinstance(a, tuple):
        return tuple(_convert_arg(x, env) for x in a)
    return a


def op_name(target) -> str:
    """'aten.mm.default' for torch.ops.aten.mm.default."""
    return str(target) if isinstance(target, torch._ops.OpOverload) else repr(target)


def import_fx(
    gm: fx.GraphModule,
    placeholder_kinds: Sequence[PlaceholderKind],
    placeholder_names: Sequence[str] | None = None,
    modules: Mapping[str, str] | None = None,
) -> Graph:
    """Build a Graph from `gm` (ATen ops only; placeholders in the given kinds, in order).

    Tensor constants of `gm` (get_attr) become CONSTANT placeholders after the inputs; their
    values are `constant_values(gm)`. `modules` gives nodes (by name) their model module path;
    a node it does not name (a backward op) takes its first input's (`inherited_module`).
    """
    fx_graph = gm.graph
    _drop_dead(fx_graph)
    epilogue = _mutation_epilogue(fx_graph)
    graph = Graph()
    env: dict[fx.Node, Ref] = {}
    inputs = [n for n in fx_graph.nodes if n.op == "placeholder"]
    constants = [n for n in fx_graph.nodes if n.op == "get_attr"]
    for i, n in enumerate(inputs):
        name = placeholder_names[i] if placeholder_names else n.name
        meta, module = TensorMeta.of(n.meta["val"]), (modules or {}).get(name, "")
        env[n] = Ref(graph.add_placeholder(name, meta, placeholder_kinds[i], module))
    for n in constants:  # after the inputs: a program takes them as trailing arguments
        meta = TensorMeta.of(getattr(gm, n.target))
        env[n] = Ref(graph.add_placeholder(n.target, meta, PlaceholderKind.CONSTANT))
    for n in fx_graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        elif n.op == "call_function" and n.target is operator.getitem:
            src = env[n.args[0]]
            env[n] = Ref(src.node, n.args[1])
        elif n.op == "call_function":
            if n in epilogue.skipped:
                continue
            writes = env[epilogue.folded[n]] if n in epilogue.folded else None
            args = _convert_arg(n.args, env)
            kwargs = {k: _convert_arg(v, env) for k, v in n.kwargs.items()}
            module = "" if modules is None else modules.get(n.name, "")
            module = module or (inherited_module(graph, args, modules) if modules else "")
            read = n.meta.get(READ_KEY)
            if n.target is torch.ops.aten._local_scalar_dense.default:
                _add_guard(graph, n.name, args[0], read, module)  # the value, read in Python
                continue
            nid = graph.add_op(
                n.name,
                op_name(n.target),
                args,
                kwargs,
                _metas(n.meta.get("val")),
                writes_into=writes,
                module=module,
            )
            env[n] = Ref(nid)
            if read is not None:  # a shape that came from the data
                _add_guard(graph, f"{n.name}_guard", Ref(nid), read, module)
        elif n.op == "output":
            outs = [env[a] for a in refs_or_nodes(n.args[0])]
            graph.set_outputs(outs)
    order_writes_after_readers(graph)
    chain_random_ops(graph)
    graph.verify()
    return graph


def _add_guard(graph: Graph, name: str, tensor: Ref, read: ValueRead | None, module: str) -> int:
    """A value guard (`EXPECT_OP`) on `tensor` for what the step read of it at capture."""
    if read is None:  # only the specialized trace reads values, and it records each
        raise CaptureError(f"{name}: a value read that the capture did not record")
    args = (tensor, list(read.shape), read.value, read.site)
    return graph.add_op(name, EXPECT_OP, args, {}, (_GUARD_OUTPUT,), module=module)


def inherited_module(graph: Graph, args, modules: Mapping[str, str]) -> str:
    """A backward op computes for the module whose saved activations or weights it reads:
    the module of its first input that has its own (a forward op or a parameter, named in
    `modules`), else of its first input that inherited one (a gradient)."""
    inputs = [graph.node(ref.node) for ref in refs_in(args)]
    own = (n.module for n in inputs if n.name in modules and n.module)
    return next(own, None) or next((n.module for n in inputs if n.module), "")


def chain_random_ops(graph: Graph) -> None:
    """Random ops draw from one generator: their order is part of what the step computes, so
    each depends on the previous one. Every scheduler and rewrite then keeps the draws in
    program order without knowing about RNGs."""
    previous = None
    for nid in graph.program_order():
        if graph.node(nid).is_placeholder or not graph.info(nid).is_random:
            continue
        if previous is not None:
            graph.add_control_dep(previous, nid)
        previous = nid


def refs_or_nodes(value) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, list | tuple):
        return [x for v in value for x in refs_or_nodes(v)]
    return []


@dataclass
class _Epilogue:
    folded: dict[fx.Node, fx.Node] = field(default_factory=dict)  # producer -> its placeholder
    skipped: set[fx.Node] = field(default_factory=set)  # copy_ nodes made redundant by folding


def _mutation_epilogue(g: fx.Graph) -> _Epilogue:
    """Find `copy_(placeholder, value)` pairs that can become in-place writes of `value`'s op.

    Folding needs the producer to allocate (not a view, not itself a placeholder), to have one
    output of the placeholder's shape and dtype, and an `.out` overload the executor can call.
    """
    ep = _Epilogue()
    for n in g.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.copy_.default:
            continue
        dst, src = n.args[0], n.args[1]
        if dst.op != "placeholder" or not isinstance(src, fx.Node) or src.op != "call_function":
            continue
        if src in ep.folded or not _can_write_out(src, dst):
            continue
        ep.folded[src] = dst
        ep.skipped.add(n)
    return ep


def _can_write_out(src: fx.Node, dst: fx.Node) -> bool:
    target = src.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    sv, dv = src.meta.get("val"), dst.meta.get("val")
    if not isinstance(sv, torch.Tensor) or not isinstance(dv, torch.Tensor):
        return False
    if sv.shape != dv.shape or sv.dtype != dv.dtype or sv.stride() != dv.stride():
        return False
    if target._schema.is_mutable or any(a.alias_info for a in target._schema.returns):
        return False
    return out_overload(op_name(target)) is not None


_SIDE_EFFECT_FREE_DEAD = {
    "empty",
    "empty_like",
    "detach",
    "alias",
    "t",
    "view",
    "clone",
    "zeros",
    "ones_like",
    "zeros_like",
    "empty_strided",
    "expand",
    "_unsafe_view",
    "transpose",
    "permute",
    "lift_fresh_copy",
}


def _drop_dead(g: fx.Graph) -> None:
    """Remove unused nodes that have no side effects (functionalization leaves some behind)."""
    changed = True
    while changed:
        changed = False
        for n in reversed(list(g.nodes)):
            if n.op != "call_function" or n.users:
                continue
            base = getattr(n.target, "_schema", None)
            name = base.name.split("::")[-1] if base is not None else ""
            if n.target is operator.getitem or name in _SIDE_EFFECT_FREE_DEAD:
                g.erase_node(n)
                changed = True


def order_writes_after_readers(graph: Graph) -> None:
    """Every node that reads the old value of a storage an in-place write overwrites runs first.

    Values are versioned along alias chains: the placeholder and its views are version 0; the
    writer's output and its views are the new version, read only by the writer's descendants.
    """
    storages = graph.storages()
    writers: dict[Ref, int] = {}
    for nid in graph.program_order():
        written = graph.overwritten_placeholder(nid)
        if written is not None:
            writers[storages.storage_of(Ref(written))] = nid
    if not writers:
        return
    new_values = {Ref(w, 0) for w in writers.values()}
    for nid in graph.topological_order():  # views of a new value are new values
        node = graph.node(nid)
        if graph.info(nid).is_view and any(r in new_values for r in refs_in(node.args[:1])):
            new_values.update(Ref(nid, i) for i in range(len(node.outputs)))
    for storage, writer in writers.items():
        for reader in storages.readers[storage]:
            if reader == writer:
                continue
            reads_old = any(
                storages.storage_of(r) == storage and r not in new_values
                for r in graph.node(reader).inputs
            )
            if reads_old:
                graph.add_control_dep(reader, writer)


def constant_values(gm: fx.GraphModule) -> list:
    """The tensor constants of `gm`, in the order `import_fx` made their placeholders."""
    return [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]


def module_paths(gm: torch.fx.GraphModule, prefix: str) -> dict[str, str]:
    """Node name -> the innermost module it ran in, as a path below `prefix` (the model's
    attribute on the traced root: 'encoder.layer.3.attention.self'); nodes that ran in no
    submodule of the model (backward, optimizer) are left out."""
    paths = {}
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if not stack:
            continue
        fqn = list(stack.values())[-1][0]
        if fqn.startswith(prefix + "."):
            paths[n.name] = fqn.removeprefix(prefix + ".")
    return paths


def placeholder_modules(names: Sequence[str], kinds: Sequence[PlaceholderKind]) -> dict[str, str]:
    """Parameters and buffers by name -> their module ('encoder.layer.0.output.dense.weight'
    -> 'encoder.layer.0.output.dense'); optimizer state names add one more part."""
    strip = {PlaceholderKind.WEIGHT: 1, PlaceholderKind.BUFFER: 1, PlaceholderKind.OPT_STATE: 2}
    paths = {}
    for name, kind in zip(names, kinds, strict=True):
        parts = name.split(".")
        if kind in strip and len(parts) > strip[kind]:
            paths[name] = ".".join(parts[: -strip[kind]])
    return paths
