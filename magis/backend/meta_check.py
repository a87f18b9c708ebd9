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

magis's own Store and Load have no ATen kernel: they are checked as `aten.clone` (preserve
format), which is what the runtime's host pool does on a CPU (`HostPool.store`/`load`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from magis.errors import VerificationError
from magis.ir import Graph, Ref, TensorMeta
from magis.ir.schema import check_op

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

    def check_graph(self, graph: Graph) -> MetaReport:
        """Every op of `graph`."""
        return self.check_nodes(graph, graph.ops())

    def check_nodes(self, graph: Graph, nodes: Iterable[int]) -> MetaReport:
        """The ops among `nodes` (placeholders have nothing to run), each from its inputs'
        recorded metas, in topological order."""
        wanted = {n for n in nodes if n in graph and not graph.node(n).is_placeholder}
        order = [n for n in graph.topological_order() if n in wanted]
        fakes = {r: self._fake(graph.meta(r)) for n in order for r in graph.node(n).inputs}
        mismatches: list[MetaMismatch] = []
        with self._mode:
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

    def _check_node(
        self, graph: Graph, nid: int, fakes: dict[Ref, torch.Tensor]
    ) -> list[MetaMismatch]:
        node = graph.node(nid)
        overload = check_op(node.op, f"node {nid}.op") or torch.ops.aten.clone.default
        try:
            args = self._materialize(graph, node.args, fakes)
            kwargs = {k: self._materialize(graph, v, fakes) for k, v in node.kwargs}
            result = overload(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of the op is the finding
            error = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            return [MetaMismatch(nid, node.name, node.op, None, None, None, error)]
        results = list(result) if isinstance(result, list | tuple) else [result]
        found = []
        for i, expected in enumerate(node.outputs):
            got = results[i] if i < len(results) else None
            if got is None and expected.numel == 0:
                continue  # an output the op does not make (a masked-out gradient)
            got_meta = TensorMeta.of(got) if isinstance(got, torch.Tensor) else None
            if got_meta is None or not same_meta(expected, got_meta):
                found.append(MetaMismatch(nid, node.name, node.op, i, expected, got_meta))
        return found


def check_graph(graph: Graph, checker: MetaChecker | None = None) -> MetaReport:
    """Run every op of `graph` on fake tensors; report each output whose shape, dtype or
    strides differ from the graph's, and each op that fails."""
    return (checker or MetaChecker()).check_graph(graph)


def check_nodes(
    graph: Graph, nodes: Iterable[int], checker: MetaChecker | None = None
) -> MetaReport:
    """`check_graph` for `nodes` only (e.g. `nodes_to_check(graph, rewrite.touched)`)."""
    return (checker or MetaChecker()).check_nodes(graph, nodes)
