"""A small builder for hand-made graphs: the paper's worked examples, tests, random graphs.

    b = GraphBuilder()
    x = b.input("x", (4, 8))
    w = b.weight("w", (8, 8))
    y = b.relu(b.mm(x, w), name="y")
    b.output(y)
    g = b.build()

Every call is an ATen overload; its output metadata comes from running it on meta tensors (no
data, no memory), so shapes, dtypes and multi-output ops are exactly what PyTorch would make, and a
wrong call fails here, naming the op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from magis.ir.graph import Graph, PlaceholderKind, Ref
from magis.ir.ops import resolve_overload
from magis.ir.tensor import TensorMeta


class GraphBuilder:
    """Builds a `Graph` node by node; nodes are added in call order (the program order)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.graph = Graph()
        self.dtype = dtype
        self._meta: dict[Ref, torch.Tensor] = {}
        self._outputs: list[Ref] = []
        self._count: dict[str, int] = {}

    # --- inputs ---------------------------------------------------------------------------

    def placeholder(
        self,
        name: str,
        shape: Sequence[int],
        kind: PlaceholderKind,
        dtype: torch.dtype | None = None,
    ) -> Ref:
        t = torch.empty(tuple(shape), dtype=dtype or self.dtype, device="meta")
        meta = TensorMeta.of(t)
        ref = Ref(self.graph.add_placeholder(name, meta, kind))
        self._meta[ref] = t
        return ref

    def input(self, name: str, shape: Sequence[int], dtype: torch.dtype | None = None) -> Ref:
        return self.placeholder(name, shape, PlaceholderKind.DATA, dtype)

    def weight(self, name: str, shape: Sequence[int], dtype: torch.dtype | None = None) -> Ref:
        return self.placeholder(name, shape, PlaceholderKind.WEIGHT, dtype)

    # --- ops ------------------------------------------------------------------------------

    def call(self, op: str, *args, name: str | None = None, **kwargs) -> Ref | tuple[Ref, ...]:
        """Add a call of ATen overload `op` ('aten.mm.default'); multi-output ops return a tuple."""
        meta_args = self._metas(args)
        meta_kwargs = {k: self._metas(v) for k, v in kwargs.items()}
        out = resolve_overload(op)(*meta_args, **meta_kwargs)
        outs = list(out) if isinstance(out, list | tuple) else [out]
        metas = tuple(TensorMeta.of(t) for t in outs)
        nid = self.graph.add_op(name or self._name(op), op, tuple(args), kwargs, metas)
        refs = tuple(Ref(nid, i) for i in range(len(outs)))
        for r, t in zip(refs, outs, strict=True):
            self._meta[r] = t
        return refs[0] if len(refs) == 1 else refs

    def _metas(self, value):
        if isinstance(value, Ref):
            return self._meta[value]
        if isinstance(value, list):
            return [self._metas(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self._metas(v) for v in value)
        return value

    def _name(self, op: str) -> str:
        base = op.split(".")[1] if "." in op else op
        k = self._count.get(base, 0)
        self._count[base] = k + 1
        return base if k == 0 else f"{base}_{k}"

    # conveniences for the common ops
    def mm(self, a: Ref, b: Ref, name: str | None = None) -> Ref:
        return self.call("aten.mm.default", a, b, name=name)

    def add(self, a: Ref, b: Ref, name: str | None = None) -> Ref:
        return self.call("aten.add.Tensor", a, b, name=name)

    def sub(self, a: Ref, b: Ref, name: str | None = None) -> Ref:
        return self.call("aten.sub.Tensor", a, b, name=name)

    def mul(self, a: Ref, b: Ref, name: str | None = None) -> Ref:
        return self.call("aten.mul.Tensor", a, b, name=name)

    def relu(self, a: Ref, name: str | None = None) -> Ref:
        return self.call("aten.relu.default", a, name=name)

    def t(self, a: Ref, name: str | None = None) -> Ref:
        return self.call("aten.t.default", a, name=name)

    def sum(
        self, a: Ref, dims: Sequence[int], keepdim: bool = False, name: str | None = None
    ) -> Ref:
        return self.call("aten.sum.dim_IntList", a, list(dims), keepdim, name=name)

    def view(self, a: Ref, shape: Sequence[int], name: str | None = None) -> Ref:
        return self.call("aten.view.default", a, list(shape), name=name)

    # --- finish ---------------------------------------------------------------------------

    def output(self, *refs: Ref) -> None:
        self._outputs.extend(refs)

    def build(self) -> Graph:
        self.graph.set_outputs(self._outputs)
        self.graph.verify()
        return self.graph
