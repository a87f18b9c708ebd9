"""In-place ops rewritten out of place on the traced graph: the common case of functionalization.

A training step's first trace (`make_fx` over the model, autograd and the update) holds in-place
ops: the optimizer's updates of weights and state (`sub_`, `mul_`, `lerp_`, `addcdiv_`, ...) and
now and then a model's own (`relu_` on a fresh activation). `torch.func.functionalize` removes
them by tracing the whole graph a second time, which took 40-45% of a capture (py-spy on
Mamba's 10,812-node step: the second trace 0.33 of the samples, the first 0.43).

When every in-place op is the plain kind (`foo_` with `foo` as its out-of-place twin, writing
only its first argument, a tensor that owns its storage), the rewrite is local and this module
does it in one pass: `y = x.foo_(a)` becomes `y = foo(x, a)`, every later read of `x` (or of an
earlier in-place result on it) reads `y`, and a mutated input gets `copy_(input, last value)`
before the output, as `functionalize(remove="mutations")` leaves it. Anything else (an in-place
op on a view, a view of the mutated tensor read after the write, an op with several mutable
arguments, an `out=` op) returns None and the caller traces through `functionalize`; so the
result is that trace's graph, which `tests/capture/test_inplace.py` checks node for node.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx._lazy_graph_module import _make_graph_module
from torch.fx.passes.shape_prop import _extract_tensor_metadata

_Overload = torch._ops.OpOverload

# Ops that return a tensor sharing their input's storage without saying so in their schema.
_UNANNOTATED_VIEWS = frozenset({"aten::_unsafe_view", "aten::_reshape_alias"})
# In-place ops whose out-of-place twin has another overload name (as functionalization pairs them).
_RENAMED_TWINS = {"aten::bernoulli_.float": "p"}


def functionalized(gm: fx.GraphModule) -> fx.GraphModule | None:
    """`gm` with its in-place ops made out of place, or None where the rewrite is not local."""
    nodes = list(gm.graph.nodes)
    mutations = [n for n in nodes if _is_mutation(n)]
    if not mutations:
        return gm
    roots = _mutated_roots(mutations)
    if roots is None or _view_read_after_write(nodes, roots):
        return None
    twins = {n: _out_of_place(n.target) for n in mutations}
    if any(t is None for t in twins.values()):
        return None
    return _rewritten(gm, nodes, roots, twins)


def _is_mutation(n: fx.Node) -> bool:
    return (
        n.op == "call_function" and isinstance(n.target, _Overload) and n.target._schema.is_mutable
    )


def _out_of_place(target: _Overload) -> _Overload | None:
    """`aten.foo.overload` for `aten.foo_.overload` writing only its first argument, else None."""
    schema = target._schema
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if len(written) != 1 or written[0] is not schema.arguments[0] or len(schema.returns) != 1:
        return None
    name = schema.name.split("::")[-1]
    if not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    overload = _RENAMED_TWINS.get(f"{schema.name}.{target._overloadname}", target._overloadname)
    twin = getattr(packet, overload, None) if packet is not None else None
    if not isinstance(twin, _Overload) or twin._schema.is_mutable:
        return None
    mine = [(a.name, str(a.type)) for a in schema.arguments]
    theirs = [(a.name, str(a.type)) for a in twin._schema.arguments]
    return twin if mine == theirs else None


def _mutated_roots(mutations: list[fx.Node]) -> dict[fx.Node, fx.Node] | None:
    """Each in-place op's root: the tensor whose storage it writes (an input or a fresh tensor,
    reached through earlier in-place results on it); None if one writes into a view."""
    root: dict[fx.Node, fx.Node] = {}
    for n in mutations:
        base = n.args[0] if n.args else None
        if not isinstance(base, fx.Node):
            return None
        base = root.get(base, base)
        if not _owns_storage(base):
            return None
        root[n] = base
    return root


def _owns_storage(n: fx.Node) -> bool:
    if n.op == "placeholder":
        return True
    if n.op == "call_function" and n.target is operator.getitem:  # one output of a multi-output op
        producer, index = n.args
        if not isinstance(producer, fx.Node) or not isinstance(producer.target, _Overload):
            return False
        returns = producer.target._schema.returns
        return _owns_storage(producer) and index < len(returns) and not returns[index].alias_info
    if n.op != "call_function" or not isinstance(n.target, _Overload):
        return False
    return not _is_view(n.target) and not n.target._schema.is_mutable


def _is_view(target: object) -> bool:
    if not isinstance(target, _Overload):
        return False
    schema = target._schema
    return schema.name in _UNANNOTATED_VIEWS or any(r.alias_info for r in schema.returns)


def _view_read_after_write(nodes: list[fx.Node], roots: dict[fx.Node, fx.Node]) -> bool:
    """Whether a view of a written tensor (through views of views) is read after its first write:
    functionalization regenerates such a view from the new value; this pass does not."""
    order = {n: i for i, n in enumerate(nodes)}
    first_write: dict[fx.Node, int] = {}
    for n, r in roots.items():
        first_write.setdefault(r, order[n])
    aliased: dict[fx.Node, fx.Node] = {}  # view -> the written tensor it shows
    for n in nodes:
        if n in roots or not _is_view(n.target):
            continue
        for a in n.all_input_nodes:
            r = roots.get(a, aliased.get(a, a))
            if r in first_write:
                aliased[n] = r
                break
    return any(order[u] > first_write[r] for view, r in aliased.items() for u in view.users)


def _rewritten(
    gm: fx.GraphModule,
    nodes: list[fx.Node],
    roots: dict[fx.Node, fx.Node],
    twins: dict[fx.Node, _Overload],
) -> fx.GraphModule | None:
    """A copy of `gm` with each in-place op replaced by its twin and later reads redirected.

    A twin's output takes its own layout, which may differ from the written tensor's in the
    strides of size-1 dimensions (a TensorIterator's choice); the nodes that read it, and theirs,
    get their fake values again where their inputs' layouts changed, as the second trace gives
    them. None where such a node is not an ATen op (the caller traces again)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    current: dict[fx.Node, fx.Node] = {}  # root -> the new graph's node holding its value now
    relaid: set[fx.Node] = set()  # new nodes whose value's layout differs from the old one's

    def value(n: fx.Node) -> fx.Node:
        r = roots.get(n, n)
        return current[r] if r in current else env[n]

    for n in nodes:
        if n.op == "output":
            _sync_inputs(graph, env, current)
            graph.output(fx.map_arg(n.args[0], value))
            continue
        if n in roots:
            twin = twins[n]
            args = _defaults_the_twin_needs(n.target, twin, fx.map_arg(n.args, value), n.kwargs)
            kwargs = fx.map_arg(n.kwargs, value)
            new = graph.create_node("call_function", twin, args, kwargs, name=_packet_name(twin))
            new.meta = {**n.meta, **_fake_meta(_run_fake(twin, args, kwargs))}
            if not _same_layout(new.meta["val"], n.meta.get("val")):
                relaid.add(new)
            current[roots[n]] = env[n] = new
            continue
        new = env[n] = graph.node_copy(n, value)
        if relaid.isdisjoint(new.all_input_nodes):
            continue
        if not _is_aten_or_getitem(new):
            return None
        val = _run_fake(new.target, new.args, new.kwargs)
        if not _same_layout(val, n.meta.get("val")):
            new.meta.update(_fake_meta(val))
            relaid.add(new)
    return _make_graph_module(gm, graph)  # lazy where the caller asks (`trace.py`)


def _defaults_the_twin_needs(
    target: _Overload, twin: _Overload, args: tuple, kwargs: dict
) -> tuple:
    """`args` with the positional values the call left to `target`'s defaults and `twin` has
    none for (`bernoulli_(x)` means p = 0.5; `bernoulli.p` asks for it). Others stay omitted,
    as the second trace records them."""
    mine = target._schema.arguments
    theirs = twin._schema.arguments
    args = tuple(args)
    for i in range(len(args), len(mine)):
        a, b = mine[i], theirs[i]
        if a.kwarg_only or a.name in kwargs:
            break
        if b.has_default_value() or not a.has_default_value():
            break
        args = (*args, a.default_value)
    return args


def _is_aten_or_getitem(n: fx.Node) -> bool:
    return n.op == "call_function" and (
        isinstance(n.target, _Overload) or n.target is operator.getitem
    )


def _run_fake(target: object, args: tuple, kwargs: dict) -> object:
    """The op on its inputs' fake values (outside the trace: a FakeTensor dispatches itself)."""
    fake_args = fx.map_arg(args, lambda a: a.meta["val"])
    fake_kwargs = fx.map_arg(kwargs, lambda a: a.meta["val"])
    return target(*fake_args, **fake_kwargs)


def _fake_meta(val: object) -> dict:
    if isinstance(val, torch.Tensor):
        return {"val": val, "tensor_meta": _extract_tensor_metadata(val)}
    return {"val": val}


def _same_layout(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _layout(a) == _layout(b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b, strict=True))
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.storage_offset()


def _packet_name(target: _Overload) -> str:
    """The name make_fx gives an op's node (`mul`, numbered by the graph: `mul_26`)."""
    return target.overloadpacket.__name__


def _sync_inputs(graph: fx.Graph, env: dict[fx.Node, fx.Node], current: dict) -> None:
    """`copy_(input, value)` for each written input, in the inputs' order."""
    copy = torch.ops.aten.copy_.default
    for r in (r for r in env if r.op == "placeholder" and r in current):
        node = graph.create_node("call_function", copy, (env[r], current[r]), name="copy_")
        node.meta = {"val": env[r].meta["val"], "tensor_meta": env[r].meta.get("tensor_meta")}
