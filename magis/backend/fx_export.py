"""A plan's program compiled by Inductor, its memory decisions kept (issue 43).

The plan (graph + order) is cut into SEGMENTS, each emitted as an ATen-level FX GraphModule and
compiled by `torch._inductor.compile_fx.compile_fx_inner`; between segments a small Python
runner (`magis.backend.inductor`) passes the tensors on and drops every value after its last
segment. Why segments, and why these configuration switches:

- **Store and Load stay.** They are opaque custom ops (`magis.backend.host_ops`) whose copies
  the program's `HostPool` makes, as in the generated Python: Inductor runs them as fallback
  kernels at their place, never drops one (its output is read) and, with re-ordering off,
  never moves one. (A first version cut a segment at each of them instead: an MLP's AdamW
  plan, whose offloaded state is loaded and stored per parameter, became 33 segments and 38 s
  of compiling; as ops, it is one segment.)
- **A recomputation stays a recomputation.** Two nodes computing the same value (equal op and
  constants over equal inputs, by value numbering) never share a segment: nothing inside one
  compiled graph can merge the copy back into its original (Inductor's kernel CSE, a pattern
  match) or hoist it next to the original, which would keep its output alive all along. Views
  are exempt: they allocate nothing, merging them costs no memory.
- **Order inside a segment.** `reorder_for_locality` and `reorder_for_peak_memory` are off:
  Inductor's scheduler then keeps the FX order, which is the plan's, and changes it only by
  fusing (a pointwise chain becomes one kernel and its intermediates are never allocated; see
  below for the fusions that would raise the peak). `pattern_matcher` is off so that the ops run are the plan's
  ops, and `fallback_random` is on so that a random op draws eager's numbers (eager's kernel).
- **One layout per value.** `layout_optimization` is off. On (Inductor's default; on a CPU
  with mkldnn, `GraphLowering.decide_layout_opt` always picks channels-last for convolutions),
  a ReLU output that a convolution reads in the forward and its backward reads again is
  written twice by the fused kernel, contiguous for the pointwise backward and channels-last
  for the convolution's, and both copies live from forward to backward: measured through
  Inductor, unet:tiny at mem_limit 0.5 held 1.057 of the plan's simulated peak.
- **No AOTAutograd.** `compile_fx_inner` takes the graph as it is: AOTAutograd's joint-graph
  CSE and partitioner, which would re-decide what is saved and recomputed, never run.
- **No buffer reuse.** `allow_buffer_reuse` is off. On, Inductor's generated code keeps a dead
  buffer's storage until a later buffer of its size takes it over (its `del` moves from the last
  reader to the reuse), so storages the plan freed stay held in between; on a CPU a Store's host
  copy can even become a device buffer. Measured on bert-base:tiny at mem_limit 0.5 (20 searched
  states): 1.052 of the simulated peak with reuse, 1.001 without. A caching allocator (CUDA)
  reuses freed blocks anyway.
- **Every value the plan hands from one node to another is a buffer, made at its node.**
  Inductor's lowering inlines a pointwise value into its reader's kernel (unless it has many
  readers or reads) and computes it there: its inputs then live until that reader, where the
  plan freed them at the value's node. On unet:small at mem_limit 0.5 a recomputed max-pool was
  computed at its backward, 86 nodes later, which kept the 16 MiB ReLU output it pools alive
  with it: 1.079 of the plan's simulated peak. Each traced node knows the plan node it belongs
  to (FX's node-meta propagation carries `meta["custom"]` through the decompositions), and a
  value read by another plan node is marked `inductor_realize_to_strides` (realized where it is
  computed, in the strides it was traced with). A decomposition's own intermediates are still
  inlined (a batch norm's backward stays a few kernels, not a buffer per step), and fusion can
  still merge the buffers' kernels again, under the check below.
- **One C++ function per kernel.** On a CPU, Inductor gathers the kernels between two extern
  calls into one function and allocates all their buffers before it
  (`inductor_fusion.one_function_per_kernel` says what that cost).
- **Fusion that keeps the peak.** Fusing runs several nodes at one place and can lengthen
  lives: each segment is compiled at the most fusing level that keeps Inductor's estimate of
  its peak (`magis.backend.inductor_fusion`).
- **In-place stays in place.** A node that writes into an input (a parameter's or optimizer
  state's update) is `aten.copy_(input, value)` in its segment: Inductor writes the input's
  own storage, as functionalized graphs' input mutations are compiled. A view that a segment
  reads is re-emitted inside it from its base, so Inductor sees the alias to a written input.
- **Compiled on the first call**, with that call's tensors as examples: a segment's inputs are
  the previous segments' outputs, whose strides are Inductor's choice and known only then.

An op Inductor cannot compile is a one-line `InductorUnsupportedError` naming the op and node.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from magis.backend import guards, host_ops
from magis.backend.inductor_fusion import (
    FUSION_LEVELS,
    FusionCheck,
    checked_fusion_config,
    fusion_rules,
    one_function_per_kernel,
)
from magis.backend.runtime import HostPool
from magis.errors import UnsupportedOpError
from magis.ir import Graph, Ref
from magis.ir.guards import checked_at_run_time
from magis.ir.node import map_refs
from magis.ir.ops import EXPECT_OP, LOAD_OP, STORE_OP
from magis.ir.schema import check_node, shown

# The key of `meta["custom"]` naming the plan node an FX node computes (a part of)
PLAN_NODE = "magis_node"
# The meta key of the strides eager's kernel gave a plan node's output (`_EagerLayouts`)
PLAN_STRIDES = "magis_strides"

# Inductor's configuration while a segment compiles (see the module docstring for each).
INDUCTOR_CONFIG = {
    "reorder_for_locality": False,
    "reorder_for_peak_memory": False,
    "pattern_matcher": False,
    "fallback_random": True,
    "layout_optimization": False,
    "allow_buffer_reuse": False,
}


class InductorUnsupportedError(UnsupportedOpError):
    """An op of the plan that Inductor cannot compile."""


@dataclass
class Segment:
    """Nodes compiled together: its inputs (values made before it) and outputs (used later)."""

    nids: list[int]
    inputs: list[Ref] = field(default_factory=list)
    outputs: list[Ref] = field(default_factory=list)
    compiled: Callable | None = None
    fusion_level: str | None = None  # the `inductor_fusion.FUSION_LEVELS` it was compiled at


def value_numbers(graph: Graph, order: list[int]) -> dict[int, int]:
    """A number per node, equal for two nodes that compute the same value from the same inputs
    (a recomputation and its original): hash-consing over (op, constants, inputs' numbers).
    Random ops, host copies, in-place writes and placeholders are numbered by their own id."""
    numbers: dict[int, int] = {}
    table: dict[tuple, int] = {}

    def of(value):
        return map_refs(value, lambda r: (numbers[r.node], r.index))

    for nid in order:
        node = graph.node(nid)
        info = graph.info(nid)
        if node.is_placeholder or info.is_random or info.copy_stream or node.writes_into:
            key: tuple = ("node", nid)
        else:
            key = (node.op, repr(of(node.args)), repr(of(node.kwargs)))
        numbers[nid] = table.setdefault(key, len(table))
    return numbers


def segments(graph: Graph, order: list[int]) -> list[Segment]:
    """The plan's order cut before every node whose value the current segment already
    computes (a recomputation): no segment holds a value twice."""
    keys = value_numbers(graph, order)
    steps: list[Segment] = []
    seen: set[int] = set()
    for nid in order:
        if graph.node(nid).is_placeholder:
            continue
        is_view = graph.info(nid).is_view
        if not steps or (not is_view and keys[nid] in seen):
            steps.append(Segment([]))
            seen = set()
        steps[-1].nids.append(nid)
        if not is_view:
            seen.add(keys[nid])
    _wire(graph, steps)
    return steps


def _wire(graph: Graph, steps: list[Segment]) -> None:
    """Fill each segment's inputs (values made before it; a view's base, the view taken again
    inside) and outputs (values a later segment or the graph's result reads)."""
    where = {nid: k for k, s in enumerate(steps) for nid in s.nids}
    needed_after: dict[int, set[Ref]] = {}
    for s in steps:
        mine = set(s.nids)
        reads = {r for nid in s.nids for r in _base_reads(graph, nid, mine)}
        s.inputs = sorted(r for r in reads if r.node not in mine)
        for ref in s.inputs:
            made = where.get(ref.node)
            if made is not None:
                needed_after.setdefault(made, set()).add(ref)
    for ref in graph.outputs:
        made = where.get(ref.node)
        if made is not None:
            needed_after.setdefault(made, set()).add(ref)
    for k, s in enumerate(steps):  # a write's value is its input's tensor: not an output
        s.outputs = sorted(r for r in needed_after.get(k, ()) if not _is_write(graph, r))


def _is_write(graph: Graph, ref: Ref) -> bool:
    return graph.node(ref.node).writes_into is not None


def _reads(graph: Graph, nid: int) -> list[Ref]:
    node = graph.node(nid)
    return [*node.inputs, *([node.writes_into] if node.writes_into is not None else [])]


def _view_base(graph: Graph, ref: Ref, mine: set[int]) -> Ref:
    """The non-view value a view made outside the segment is taken of (re-emitted inside)."""
    while ref.node not in mine and graph.info(ref.node).is_view and graph.node(ref.node).inputs:
        ref = graph.node(ref.node).inputs[0]
    return ref


def _base_reads(graph: Graph, nid: int, mine: set[int]) -> list[Ref]:
    out = []
    for ref in _reads(graph, nid):
        base = _view_base(graph, ref, mine)
        if base != ref:  # the view chain's own other inputs (none for plain views)
            out.extend(_chain_inputs(graph, ref, mine))
        out.append(base)
    return out


def _chain_inputs(graph: Graph, ref: Ref, mine: set[int]) -> list[Ref]:
    extra = []
    while ref.node not in mine and graph.info(ref.node).is_view and graph.node(ref.node).inputs:
        extra.extend(graph.node(ref.node).inputs[1:])
        ref = graph.node(ref.node).inputs[0]
    return extra


def segment_module(
    graph: Graph,
    seg: Segment,
    device: torch.device,
    pool: int,
    names: Sequence[str] | None = None,
) -> fx.GraphModule:
    """The segment as an FX GraphModule of ATen calls: its inputs as placeholders (`names`, or
    in0, in1, ...), in-place writes as `aten.copy_` into the written input, Store/Load as
    `magis::store` / `load` of host pool number `pool` (`magis.backend.host_ops`), its outputs
    as a tuple."""
    g = fx.Graph()
    names = names if names is not None else [f"in{i}" for i in range(len(seg.inputs))]
    env: dict[Ref, fx.Node] = {r: g.placeholder(n) for r, n in zip(seg.inputs, names, strict=True)}

    def value(ref: Ref) -> fx.Node:
        if ref not in env:  # a view made outside: taken again of its base here
            node = graph.node(ref.node)
            emit(ref.node)
            if ref not in env:
                raise InductorUnsupportedError(f"{node.op} ({shown(node.name)}): no value")
        return env[ref]

    def arg(v):
        if isinstance(v, torch.device):
            return device
        return map_refs(v, value)

    def emit(nid: int) -> None:
        node = graph.node(nid)
        if node.op in (STORE_OP, LOAD_OP):
            env[Ref(nid)] = host_copy(node)
            return
        if node.op == EXPECT_OP:
            env[Ref(nid)] = _tag(guard(node), nid)
            return
        if checked_at_run_time(graph, nid):
            raise InductorUnsupportedError(
                f"{node.op} ({shown(node.name)}): its output's shape comes from the data (the "
                "capture specialized it to the values read): Inductor compiles static shapes "
                "only; run this step with the python backend"
            )
        overload = check_node(node, f"node {node.id} ({shown(node.name)})")
        call = g.call_function(overload, arg(node.args), {k: arg(v) for k, v in node.kwargs})
        _tag(call, nid)
        if node.writes_into is None and len(node.outputs) == 1 and not graph.info(nid).is_view:
            call.meta[PLAN_STRIDES] = node.outputs[0].strides
        if node.writes_into is not None:
            call = g.call_function(torch.ops.aten.copy_.default, (value(node.writes_into), call))
            _tag(call, nid)
        if len(node.outputs) == 1 and not _returns_list(overload):
            env[Ref(nid)] = call
        else:
            for i in range(len(node.outputs)):
                env[Ref(nid, i)] = _tag(g.call_function(operator.getitem, (call, i)), nid)

    def guard(node) -> fx.Node:
        x, shape, expected, site = node.args
        number = None if expected is None else float(expected)
        return g.call_function(guards.EXPECT_OVERLOAD, (value(x), list(shape), number, site))

    def host_copy(node) -> fx.Node:
        x = value(node.inputs[0])
        if node.writes_into is not None:
            into = value(node.writes_into)
            g.call_function(torch.ops.magis.store_into.default, (x, into, pool))
            return into
        if node.op == STORE_OP:
            return _tag(g.call_function(torch.ops.magis.store.default, (x, pool)), node.id)
        return _tag(g.call_function(torch.ops.magis.load.default, (x, pool, device)), node.id)

    for nid in seg.nids:
        emit(nid)
    g.output(tuple(env[r] for r in seg.outputs))
    return fx.GraphModule(torch.nn.Module(), g)


def _tag(call: fx.Node, nid: int) -> fx.Node:
    call.meta["custom"] = {PLAN_NODE: nid}
    return call


def traced_for_inductor(gm: fx.GraphModule, table: dict, inputs: list) -> fx.GraphModule:
    """`gm` traced down to the ops Inductor lowers (`table`'s decompositions applied, without
    functionalization or CSE), each traced node keeping its plan node's tag, and every value
    passed between plan nodes marked to be realized where it is computed (module docstring)."""
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(*args):
        with fx_traceback.preserve_node_meta():  # the Interpreter's current node's meta
            return _EagerLayouts(gm).run(*args)

    traced = make_fx(run, decomposition_table=table, tracing_mode="fake")(*inputs)
    for node in traced.graph.nodes:
        if _passed_between_plan_nodes(node):
            node.meta["inductor_realize_to_strides"] = True
    return traced


class _EagerLayouts(fx.Interpreter):
    """Runs the segment giving each plan node's output the strides eager's kernel gave it,
    where a decomposition gives others: the plan's views were recorded on eager's layouts.
    (Inductor's `cat` decomposition drops an empty input and clones the other, keeping its
    transposed strides where eager's kernel writes a contiguous result: GPT-2's key cache, and
    its next `view` then failed.) The copy is `prims.copy_strided`, which Inductor fuses with
    the producer."""

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        want = n.meta.get(PLAN_STRIDES)
        if isinstance(out, torch.Tensor) and want is not None and _other_layout(out, want):
            out = torch.ops.prims.copy_strided.default(out, tuple(want))
        return out


def _other_layout(t: torch.Tensor, strides: Sequence[int]) -> bool:
    """Whether `t`'s strides differ from `strides` in a dimension of more than one element."""
    return len(strides) == t.dim() and any(
        size > 1 and a != b for size, a, b in zip(t.shape, t.stride(), strides, strict=True)
    )


def _passed_between_plan_nodes(node: fx.Node) -> bool:
    """A tensor made by a plan node (not a view or an in-place write, which make no buffer of
    their own) and read by another plan node."""
    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and any(r.alias_info is not None for r in schema.returns):
        return False
    own = _plan_node(node)
    return own is not None and any(_plan_node(u) not in (own, None) for u in node.users)


def _plan_node(node: fx.Node) -> int | None:
    return node.meta.get("custom", {}).get(PLAN_NODE)


def _returns_list(overload) -> bool:
    returns = overload._schema.returns
    return len(returns) != 1 or isinstance(returns[0].type, torch.ListType)


# Measuring: Inductor's generated code allocates its buffers by `empty_strided_cpu`, a direct
# call outside the dispatcher that a TorchDispatchMode never sees. Inductor's own memory-lifecycle
# tracking (`test_configs.track_memory_lifecycle`, "log": it logs, never raises) makes every
# buffer an `aten.empty_strided` call instead, which `LiveBytesTracker` counts. It is set after
# fusion and buffer reuse are decided (`Scheduler.insert_memory_check_nodes`), so the kernels,
# their buffers and their reuse are those of the unmeasured compile.
MEASURED_CONFIG = {"test_configs.track_memory_lifecycle": "log"}


def compile_segment(
    graph: Graph, seg: Segment, inputs: list[torch.Tensor], pool: HostPool, measured: bool = False
) -> Callable:
    """Inductor's compiled function of `seg` for these example inputs (called with a list,
    which it empties: an input dies inside the segment at its last use), at the most fusing
    level that keeps the segment's peak (recorded in `seg.fusion_level`). `measured`: its
    allocations are dispatched, for `magis.backend.memory.LiveBytesTracker`."""
    from torch._inductor import config  # Inductor loads on the first compile only
    from torch._inductor.compile_fx import compile_fx_inner

    device = inputs[0].device if inputs else torch.device("cpu")
    gm = segment_module(graph, seg, device, host_ops.pool_number(pool))
    # Random ops are kept whole: with `fallback_random` Inductor runs eager's kernel on them, so
    # a dropout mask is eager's (decomposed, bernoulli draws other numbers).
    random = {check_node(graph.node(n), "") for n in seg.nids if graph.info(n).is_random}
    table = {k: v for k, v in _decompositions().items() if k not in random}
    base = {**INDUCTOR_CONFIG, **(MEASURED_CONFIG if measured else {})}
    for level in FUSION_LEVELS:
        check = FusionCheck()
        try:
            with (
                config.patch({**base, **checked_fusion_config(check, level)}),
                fusion_rules(level),
                one_function_per_kernel(),
            ):
                # Inductor lowers the ops of its decomposition table's output (AOTAutograd's
                # job in torch.compile): traced here, without functionalization or CSE.
                traced = traced_for_inductor(gm, table, inputs)
                compiled = compile_fx_inner(traced, inputs)
                seg.fusion_level = level
                return compiled
        except Exception as exc:  # Inductor's lowering errors have no common public base
            if check.raised:
                continue  # this level's fusion raised the peak: the next fuses less
            raise InductorUnsupportedError(_unsupported(graph, seg, exc)) from exc
    raise AssertionError("the last fusion level never raises")  # pragma: no cover


def _decompositions() -> dict:
    """Inductor's decomposition table, completed with torch's own decomposition of every op
    Inductor has no lowering for. torch.compile never hands Inductor such an op (AOTAutograd
    traces a model's composite ops, `upsample_bilinear2d.vec`, down to what Inductor lowers); a
    captured graph holds them as aten ran them (`upsample_bilinear2d.default`), and Inductor
    refuses to fall back to eager on an op that has a decomposition (an error when `CI` is set)."""
    from torch._decomp import decomposition_table
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import lowerings

    table = dict(select_decomp_table())
    for op, fn in decomposition_table.items():
        if op not in lowerings and op not in table:
            table[op] = fn
    return table


def _unsupported(graph: Graph, seg: Segment, exc: Exception) -> str:
    text = str(exc)
    for nid in seg.nids:
        node = graph.node(nid)
        if node.op in text:
            return f"Inductor cannot compile {node.op} (node {shown(node.name)}): {_first(text)}"
    return f"Inductor cannot compile a segment of {len(seg.nids)} nodes: {_first(text)}"


def _first(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0][:200] if lines else "no message"
