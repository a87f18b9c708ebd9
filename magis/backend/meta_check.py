"""The meta check: run a graph's ops on fake tensors and hold every output to its recorded meta.

A transformed graph is only correct if every op, fed tensors with the shapes, dtypes and *strides*
its inputs have, makes the outputs the graph says it makes. The strides matter: a `view` that
worked on a channels-last gradient fails on a contiguous one (issue 14: a conv backward split
into a transposed convolution returns NCHW where eager returned channels-last, and a later view
cannot run). The check finds that before anything runs, at any size: tensors are fake
(`FakeTensorMode`, as capture used), nothing is allocated.

Each node is checked from its inputs' *recorded* metas, not from what the check computed for its
producers. If every node turns recorded inputs into its recorded outputs, then by induction a
real run starting from inputs that match the placeholders produces the recorded metas throughout;
and a mismatch is reported at the node that makes it. So a rewrite needs only its touched nodes
and their users checked (`nodes_to_check`), which is what makes the check cheap enough for every
state of a search.

Strides are compared where torch itself looks at them: dims of size 1 (any stride) and empty
tensors (any strides) are ignored, as torch's own fake-tensor cross-checks do
(`torch._prims_common.check_significant_strides`). Storage offsets are not recorded: a view's
offset never decides whether an op can run.

A value guard, and an op whose output's shape came from the data at capture (a boolean-mask
index), are not checked here: no fake kernel can make them, and the guard checks them at run
time (`magis.ir.guards`).

magis's own Store and Load have no ATen kernel: they are checked as `aten.clone` (preserve
format), which is what the runtime's host pool does on a CPU (`HostPool.store`/`load`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from magis.capture.kernels import KERNEL_OPS, capture_kernels
from magis.errors import VerificationError
from magis.ir import Graph, Ref, TensorMeta
from magis.ir.guards import checked_at_run_time
from magis.ir.schema import check_op
from magis.ir.tensor import dense_layout

_CPU = torch.device("cpu")


class MetaCheckError(VerificationError):
    """A graph whose ops, run on fake tensors, do not make the metas the graph records."""


@dataclass(frozen=True)
class MetaMismatch:
    """One node whose op does not make what the graph says (or fails outright)."""

    node: int
    name: str
    op: str
    output: int | None  # which output differs; None when the op failed
    expected: TensorMeta | None
    got: TensorMeta | None
    error: str = ""  # the op's exception on fake tensors, one line

    def __str__(self) -> str:
        where = f"{self.name} ({self.op})"
        if self.output is None:
            return f"{where} fails on its recorded inputs: {self.error}"
        exp, got = self.expected, self.got
        if exp is None or got is None:
            return f"{where} output {self.output}: expected {exp}, got {got}"
        for field_name in ("shape", "dtype", "strides"):
            if getattr(exp, field_name) != getattr(got, field_name):
                return (
                    f"{where} output {self.output}: {field_name} {getattr(got, field_name)}, "
                    f"the graph records {getattr(exp, field_name)}"
                )
        return f"{where} output {self.output}: {got} differs from {exp}"


@dataclass(frozen=True)
class MetaReport:
    """What a meta check found: how many nodes it ran and every mismatch, in check order."""

    checked: int
    mismatches: tuple[MetaMismatch, ...] = field(default=())
    restrided: frozenset[int] = frozenset()  # nodes `MetaChecker.derive` gave other strides

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def raise_on_mismatch(self) -> None:
        """MetaCheckError naming the first mismatch (and how many there are)."""
        if self.mismatches:
            more = len(self.mismatches) - 1
            tail = f" (and {more} more)" if more else ""
            raise MetaCheckError(f"meta check: {self.mismatches[0]}{tail}")


def significant_strides(meta: TensorMeta) -> tuple[int | None, ...]:
    """The strides torch acts on: None for dims of size 1; nothing at all for an empty tensor."""
    if meta.numel == 0:
        return ()
    return tuple(s if d > 1 else None for d, s in zip(meta.shape, meta.strides, strict=True))


def same_meta(expected: TensorMeta, got: TensorMeta) -> bool:
    if expected.strides == got.strides and expected.shape == got.shape:
        return expected.dtype == got.dtype  # the common case, without the size-1 dims test
    return (
        expected.shape == got.shape
        and expected.dtype == got.dtype
        and significant_strides(expected) == significant_strides(got)
    )


def nodes_to_check(graph: Graph, touched: Iterable[int]) -> set[int]:
    """A rewrite's touched nodes (added or re-wired) still in `graph`, and every node reading
    them: the only nodes whose inputs or outputs a rewrite can have changed."""
    nodes = {n for n in touched if n in graph}
    return nodes | {u for n in nodes for u in graph.users(n)}


class MetaChecker:
    """Checks nodes on fake tensors. Holds one FakeTensorMode (making one costs ~30 ms): a search
    keeps one checker for all its states."""

    def __init__(self) -> None:
        self._mode = FakeTensorMode(allow_non_fake_inputs=False)
        self._memo: dict[tuple, tuple[TensorMeta | None, ...] | str] = {}

    def check_graph(self, graph: Graph) -> MetaReport:
        """Every op of `graph`."""
        return self.check_nodes(graph, graph.ops())

    def check_nodes(self, graph: Graph, nodes: Iterable[int]) -> MetaReport:
        """The ops among `nodes` (placeholders have nothing to run), each from its inputs'
        recorded metas, in topological order."""
        wanted = {n for n in nodes if n in graph and not graph.node(n).is_placeholder}
        order = [n for n in graph.topological_order() if n in wanted]
        fakes: dict[Ref, torch.Tensor] = {}
        mismatches: list[MetaMismatch] = []
        for nid in order:
            mismatches.extend(self._check_node(graph, nid, fakes))
        return MetaReport(len(order), tuple(mismatches))

    def _fake(self, meta: TensorMeta) -> torch.Tensor:
        """A fake CPU tensor of `meta`, made from a meta tensor outside the mode (a fake-mode
        `empty_strided` costs several times as much)."""
        base = torch.empty_strided(meta.shape, meta.strides, dtype=meta.torch_dtype, device="meta")
        return self._mode.fake_tensor_converter.from_meta_and_device(self._mode, base, _CPU)

    def _materialize(self, graph: Graph, value, fakes: dict[Ref, torch.Tensor]):
        """An argument with every Ref a fake tensor of its recorded meta, and every device the
        check's (as codegen puts constants on the device the program runs on)."""
        if isinstance(value, Ref):
            return fakes[value]
        if isinstance(value, torch.device):
            return _CPU
        if isinstance(value, list):
            return [self._materialize(graph, v, fakes) for v in value]
        if isinstance(value, tuple):
            return tuple(self._materialize(graph, v, fakes) for v in value)
        return value

    def _outputs(self, graph: Graph, node, fakes: dict[Ref, torch.Tensor]):
        """The metas `node`'s op makes from its inputs' recorded metas (None where it makes no
        tensor), or the op's error in one line. Memoized by op and argument signature: the
        parts of a split node, and a node read again after a rewrite elsewhere, repeat it."""
        key = (node.op, _signature(graph, node.args), _signature(graph, node.kwargs))
        found = self._memo.get(key)
        if found is None:
            found = self._run(graph, node, fakes)
            self._memo[key] = found
        return found

    def _run(self, graph: Graph, node, fakes: dict[Ref, torch.Tensor]):
        overload = check_op(node.op, f"node {node.id}.op") or torch.ops.aten.clone.default
        for ref in node.inputs:
            if ref not in fakes:
                fakes[ref] = self._fake(graph.meta(ref))
        # an op whose fake kernel magis provides at capture has it here too
        kernels = capture_kernels() if node.op in KERNEL_OPS else contextlib.nullcontext()
        try:
            with kernels, self._mode:
                args = self._materialize(graph, node.args, fakes)
                kwargs = {k: self._materialize(graph, v, fakes) for k, v in node.kwargs}
                result = overload(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of the op is the finding
            return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        results = list(result) if isinstance(result, list | tuple) else [result]
        return tuple(TensorMeta.of(r) if isinstance(r, torch.Tensor) else None for r in results)

    def _check_node(
        self, graph: Graph, nid: int, fakes: dict[Ref, torch.Tensor]
    ) -> list[MetaMismatch]:
        node = graph.node(nid)
        if checked_at_run_time(graph, nid):  # shaped by values: the run-time guard checks it
            return []
        got = self._outputs(graph, node, fakes)
        if isinstance(got, str):
            return [MetaMismatch(nid, node.name, node.op, None, None, None, got)]
        found = []
        for i, expected in enumerate(node.outputs):
            got_meta = got[i] if i < len(got) else None
            if got_meta is None and expected.numel == 0:
                continue  # an output the op does not make (a masked-out gradient)
            if got_meta is None or not same_meta(expected, got_meta):
                found.append(MetaMismatch(nid, node.name, node.op, i, expected, got_meta))
        return found

    def derive(self, graph: Graph, touched: Iterable[int]) -> MetaReport:
        """Re-derive, on fake tensors, the strides of the nodes a rewrite touched and of their
        readers, and record them in `graph` (`Graph.restride`), following the readers on while
        their strides change: a rule states its outputs' shapes and dtypes, and their strides
        are what the ops really return. What cannot be derived is a mismatch, and the rewrite
        is not applicable: an op that fails on the new strides (a `view` that relied on the old
        ones), an output of another shape or dtype, or an op that reads its input's strides
        (`as_strided`) after they changed."""
        pending = nodes_to_check(graph, touched)
        restrided: set[int] = set()
        fakes: dict[Ref, torch.Tensor] = {}
        mismatches: list[MetaMismatch] = []
        checked = 0
        # In rounds, each in dependency order (no whole-graph topological sort per state): a
        # node whose strides changed sends its readers to the next round.
        while pending and not mismatches:
            later: set[int] = set()
            for nid in _dependency_order(graph, pending):
                node = graph.node(nid)
                if node.is_placeholder:
                    continue
                checked += 1
                error = _layout_hazard(graph, node, restrided)
                if error:
                    mismatches.append(
                        MetaMismatch(nid, node.name, node.op, None, None, None, error)
                    )
                    break
                outputs = self._derived_outputs(graph, nid, fakes, mismatches)
                if mismatches:
                    break
                if outputs is None:
                    continue
                graph.restride(nid, outputs)
                restrided.add(nid)
                for i in range(len(outputs)):
                    fakes.pop(Ref(nid, i), None)
                later.update(graph.users(nid))
            pending = later
        return MetaReport(checked, tuple(mismatches), frozenset(restrided))

    def _derived_outputs(
        self, graph: Graph, nid: int, fakes, mismatches: list[MetaMismatch]
    ) -> tuple[TensorMeta, ...] | None:
        """The node's outputs with the strides its op returns; None when they are the recorded
        ones or cannot be derived (then the mismatch is appended)."""
        found = self._check_node(graph, nid, fakes)
        if not found:
            return None
        outputs = list(graph.node(nid).outputs)
        for m in found:
            if m.got is None or (m.got.shape, m.got.dtype) != (m.expected.shape, m.expected.dtype):
                mismatches.append(m)
                return None
            outputs[m.output] = replace(m.expected, strides=m.got.strides)
        return tuple(outputs)


def _dependency_order(graph: Graph, nodes: set[int]) -> list[int]:
    """`nodes` ordered so that each comes after those of them it depends on (Kahn's algorithm
    on the sub-graph they induce)."""
    waiting = {n: sum(p in nodes for p in graph.predecessors(n)) for n in nodes}
    ready = sorted(n for n, k in waiting.items() if k == 0)
    order = []
    while ready:
        n = ready.pop()
        order.append(n)
        for s in graph.successors(n):
            if s in waiting:
                waiting[s] -= 1
                if waiting[s] == 0:
                    ready.append(s)
    return order


def _signature(graph: Graph, value):
    """A hashable stand-in for an argument: every Ref its meta, lists as tuples."""
    if isinstance(value, Ref):
        return graph.meta(value)
    if isinstance(value, list | tuple):
        return tuple(_signature(graph, v) for v in value)
    if isinstance(value, torch.device):
        return "device"
    return type(value).__name__, value  # 1, 1.0 and True are equal keys, not equal arguments


# Ops whose result depends on their input's strides, not only on its values.
_STRIDE_READERS = frozenset({"aten.as_strided.default", "aten.as_strided_scatter.default"})
# Kernels that compute wrong values from a non-contiguous input (PyTorch 2.13, CPU: group
# norm's backward on a non-contiguous output gradient is off by whole units; found by
# `magis bench fuzz` after a fission concatenated a gradient along a non-leading dim), besides
# those the registry marks (`OpInfo.dense_inputs`: oneDNN's RNN layers).
_CONTIGUOUS_ONLY = frozenset({"aten.native_group_norm_backward.default"})


def _layout_hazard(graph: Graph, node, restrided: set[int]) -> str:
    """Why `node` cannot take its inputs' layouts after a rewrite ('' when it can)."""
    if node.op in _STRIDE_READERS and any(r.node in restrided for r in node.inputs):
        return "reads the strides of an input whose strides the rewrite changed"
    if node.op in _CONTIGUOUS_ONLY:
        for ref in node.inputs:
            meta = graph.meta(ref)
            if significant_strides(meta) != significant_strides(replace(meta, strides=None)):
                return "its kernel computes wrong values from a non-contiguous input"
    if graph.registry.lookup(node.op).dense_inputs:
        # oneDNN's RNN layers read a batch slice of a time-major tensor as if it were dense,
        # silently wrong; a permuted dense input is read right (eager PyTorch hands the layer's
        # backward its output gradient transposed, and a part of a batch split the same
        # transpose of its part)
        for ref in node.inputs:
            meta = graph.meta(ref)
            if not dense_layout(meta.shape, meta.strides):
                return "its kernel computes wrong values from a strided (gapped) input"
    return ""


def check_graph(graph: Graph, checker: MetaChecker | None = None) -> MetaReport:
    """Run every op of `graph` on fake tensors; report each output whose shape, dtype or
    strides differ from the graph's, and each op that fails."""
    return (checker or MetaChecker()).check_graph(graph)


def check_nodes(
    graph: Graph, nodes: Iterable[int], checker: MetaChecker | None = None
) -> MetaReport:
    """`check_graph` for `nodes` only (e.g. `nodes_to_check(graph, rewrite.touched)`)."""
    return (checker or MetaChecker()).check_nodes(graph, nodes)
