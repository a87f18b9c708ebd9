"""Running a plan inside one preallocated arena (ROAM §IV-B's layout, executed).

The generated function first allocates `arena = torch.empty(arena_bytes, dtype=torch.uint8)`;
every op that allocates a storage writes into its slot — `arena[off:off + nbytes]` viewed with
the output's dtype and shape — through the op's `out=` overload. So the arena is the only
storage the program allocates, and its size is the layout's: the real peak, measured.

Decisions:
- Out overloads are found by schema, as `magis.ir.ops.out_overload` does, but more widely: any
  overload of the op's packet with as many out arguments as the op has results, whose other
  arguments match by name and type (the backward ops' `grad_input`, `nll_loss_forward.output`,
  `sum.IntList_out`); failing that, one that matches once the tensor-options arguments (dtype,
  layout, device, pin_memory) are dropped, since the slot already carries dtype and device
  (factories: `empty_like`, `ones_like`, `arange`, `_to_copy`).
- A slot has the strides the functional op's result would have (`output_strides`): eager
  semantics depend on them (`_to_copy` of a transposed tensor keeps its layout, and a later
  `permute` + `view` is valid only for that layout).
- An op with no out overload runs as usual and its result is copied into its slot: a transient
  that lives for one copy. So are ops with an empty result (the gradient `convolution_backward`
  is told not to compute), which out kernels refuse. `ArenaProgram` names those ops and the
  largest transient, so the measured peak is arena + residents + at most that.
- Some out overloads are compute-then-copy wrappers inside PyTorch (registered only as
  CompositeExplicitAutograd: `convolution.out`, `native_layer_norm.out`, ...). Their temporary
  is invisible to the dispatch tracker, which sees the op, not its insides; `ArenaProgram` lists
  them and bounds the hidden bytes, for honest reporting (a GPU allocator would see them).
- Store, Load, in-place updates and views are generated as `codegen` does, except that a Load
  copies from host memory straight into its slot. Graph outputs are returned as views into the
  arena, which they keep alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from magis.backend.codegen import (
    Names,
    Program,
    call_source,
    compile_program,
    literal,
    program_from_source,
)
from magis.ir import Graph, Ref
from magis.ir.ops import LOAD_OP, resolve_overload
from magis.ir.tensor import dense_layout
from magis.layout import Layout

_TENSOR_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory"})


@dataclass(frozen=True)
class ArenaOut:
    """How one op writes into the arena: the overload, out argument names, dropped kwargs."""

    target: str  # e.g. "aten.native_layer_norm.out"
    out_names: tuple[str, ...]
    dropped: frozenset[str]  # tensor-options kwargs the out overload does not take
    qualified: str  # "aten::native_layer_norm.out", for dispatcher queries


def arena_out(op: str) -> ArenaOut | None:
    """The out= overload an allocating op writes its slot(s) through, or None (see module)."""
    if not op.startswith("aten."):
        return None
    base = resolve_overload(op)
    wanted = _signature(base._schema.arguments)
    packet = base.overloadpacket
    n_out = len(base._schema.returns)
    preferred = [f"{op.split('.')[2]}_out", "out"]  # the usual names first, as out_overload
    ordered = [o for o in preferred if o in packet.overloads()]
    ordered += sorted(o for o in packet.overloads() if o not in preferred)
    relaxed = None
    for overload in ordered:
        schema = getattr(packet, overload)._schema
        outs = tuple(a.name for a in schema.arguments if a.is_out)
        if len(outs) != n_out:
            continue
        ins = _signature(a for a in schema.arguments if not a.is_out)
        found = ArenaOut(
            f"aten.{packet.__name__}.{overload}", outs, frozenset(), f"{schema.name}.{overload}"
        )
        if ins == wanted:
            return found
        dropped = frozenset(n for n, _ in wanted) - frozenset(n for n, _ in ins)
        kept = [arg for arg in wanted if arg[0] not in dropped]
        if relaxed is None and dropped <= _TENSOR_OPTIONS and kept == ins:
            relaxed = ArenaOut(found.target, outs, dropped, found.qualified)
    return relaxed


def _signature(arguments) -> list[tuple[str, str]]:
    """(name, type) of each argument: names alone would take add.Scalar_out for add.Tensor."""
    return [(a.name, str(a.type)) for a in arguments]


def writes_directly(spec: ArenaOut, device: torch.device) -> bool:
    """Whether the out overload has a kernel of its own for `device` (else PyTorch computes the
    functional result and copies it: a hidden temporary)."""
    key = "CUDA" if device.type == "cuda" else "CPU"
    return torch._C._dispatch_has_kernel_for_dispatch_key(spec.qualified, key)


@dataclass(frozen=True)
class ArenaProgram:
    """A program whose every allocation is a slot of one arena."""

    program: Program
    arena_bytes: int
    copied_ops: tuple[str, ...]  # computed as usual, then copied into their slot
    transient_bytes: int  # the largest result such an op allocates before its copy
    wrapped_ops: tuple[str, ...]  # out overloads that compute-then-copy inside PyTorch
    hidden_bytes: int  # the largest temporary such an op can hide from the tracker

    @property
    def source(self) -> str:
        return self.program.source

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        return self.program(*inputs)


@dataclass
class _Gen:
    """What generating one arena program needs, and what it has written so far."""

    graph: Graph
    names: Names
    slots: dict[Ref, int]
    strides: dict[Ref, tuple[int, ...]]
    device: torch.device
    lines: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    transient: int = 0
    wrapped: list[str] = field(default_factory=list)
    hidden: int = 0

    def emit(self, line: str) -> None:
        self.lines.append(f"    {line}")

    def targets(self, nid: int) -> str:
        return ", ".join(self.names[r] for r in _outputs(self.graph, nid))

    def slot(self, ref: Ref) -> str:
        meta = self.graph.meta(ref)
        off = self.slots[ref]
        shape = literal(tuple(meta.shape), self.names)
        view = f"arena[{off}:{off + meta.nbytes}].view({meta.torch_dtype})"
        stride = self.strides.get(ref)
        if stride is None or stride == _contiguous(meta.shape):
            return f"{view}.view({shape})"
        return f"{view}.as_strided({shape}, {literal(tuple(stride), self.names)})"


def generate_arena(
    graph: Graph, order: list[int], layout: Layout, device: torch.device | str = "cpu"
) -> _Gen:
    """The arena program's source lines and what they copy or hide (see the module)."""
    gen = _Gen(
        graph,
        Names(graph, order),
        layout.offset_of,
        output_strides(graph, order),
        torch.device(device),
    )
    params = ", ".join(gen.names[Ref(p)] for p in graph.placeholders())
    gen.lines.append(f"def program({params}):")
    gen.emit(f"arena = torch.empty({layout.arena_bytes}, dtype=torch.uint8, device=device)")
    smap = graph.storages()
    for nid in order:
        node = graph.node(nid)
        if node.is_placeholder:
            continue
        allocated = [
            r
            for r in _outputs(graph, nid)
            if r in gen.slots and r in smap.nbytes and r not in smap.host
        ]
        if not allocated or node.writes_into is not None:
            gen.emit(f"{gen.targets(nid)} = {call_source(graph, nid, gen.names)}")
        elif node.op == LOAD_OP:
            gen.emit(
                f"{gen.targets(nid)} = {gen.slot(allocated[0])}.copy_({gen.names[node.inputs[0]]})"
            )
        else:
            _emit_allocating(gen, nid)
    results = [gen.names[r] for r in graph.outputs]
    gen.emit(f"return ({', '.join(results)}{',' if len(results) == 1 else ''})")
    return gen


def compile_arena_program(
    graph: Graph, order: list[int], layout: Layout, device: torch.device | str = "cpu"
) -> ArenaProgram:
    """Generate and compile the arena program of `graph` in `order` with `layout`."""
    gen = generate_arena(graph, order, layout, device)
    source = "\n".join(gen.lines) + "\n"
    program = program_from_source(graph, order, source, device)
    return ArenaProgram(
        program,
        layout.arena_bytes,
        tuple(gen.copied),
        gen.transient,
        tuple(gen.wrapped),
        gen.hidden,
    )


def _outputs(graph: Graph, nid: int) -> list[Ref]:
    return [Ref(nid, i) for i in range(len(graph.node(nid).outputs))]


def _emit_allocating(gen: _Gen, nid: int) -> None:
    graph, node = gen.graph, gen.graph.node(nid)
    refs = _outputs(graph, nid)
    spec = arena_out(node.op)
    if spec is None or any(graph.meta(r).nbytes == 0 for r in refs):
        _emit_copied(gen, nid)
        return
    args = [literal(a, gen.names) for a in node.args]
    kwargs = [f"{k}={literal(v, gen.names)}" for k, v in node.kwargs if k not in spec.dropped]
    kwargs += [f"{n}={gen.slot(r)}" for n, r in zip(spec.out_names, refs, strict=True)]
    gen.emit(f"{gen.targets(nid)} = {spec.target}({', '.join(args + kwargs)})")
    if not writes_directly(spec, gen.device):
        gen.wrapped.append(node.name)
        gen.hidden = max(gen.hidden, sum(graph.meta(r).nbytes for r in refs))


def _emit_copied(gen: _Gen, nid: int) -> None:
    """Compute as usual, then copy each non-empty result into its slot (a transient)."""
    graph, node = gen.graph, gen.graph.node(nid)
    refs = _outputs(graph, nid)
    call = call_source(graph, nid, gen.names)
    copied = [r for r in refs if graph.meta(r).nbytes > 0]
    if len(refs) == 1:
        gen.emit(f"{gen.names[refs[0]]} = {gen.slot(refs[0])}.copy_({call})")
    else:
        gen.emit(f"{gen.targets(nid)} = {call}")
        for r in copied:
            gen.emit(f"{gen.names[r]} = {gen.slot(r)}.copy_({gen.names[r]})")
    if copied:
        gen.copied.append(node.name)
        gen.transient = max(gen.transient, sum(graph.meta(r).nbytes for r in copied))


# --- the caching allocator's view (CUDA) -------------------------------------------------------


@dataclass(frozen=True)
class CudaPeaks:
    """Non-resident bytes at peak under PyTorch's caching allocator, for one plan."""

    reserved: int  # what the allocator held from the driver, without the arena
    allocated: int  # what tensors used, same run: reserved - allocated is its fragmentation
    arena_reserved: int  # what it held running the arena program


def cuda_peaks(graph: Graph, order: list[int], layout: Layout, inputs) -> CudaPeaks:
    """Run the plan on the GPU with and without the arena and read the allocator's peaks."""
    device = torch.device("cuda")
    on_gpu = [t.to(device) for t in inputs]
    plain = compile_program(graph, order, device)
    arena = compile_arena_program(graph, order, layout, device)
    reserved, allocated = _allocator_peaks(plain, on_gpu)
    arena_reserved, _ = _allocator_peaks(arena.program, on_gpu)
    return CudaPeaks(reserved, allocated, arena_reserved)


def _allocator_peaks(program: Program, inputs) -> tuple[int, int]:
    """(reserved, allocated) peak bytes of one run beyond what was held before it."""
    run_in = [t.clone() for t in inputs]  # in-place updates must not leak into the next run
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base_reserved, base_allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = program(*run_in)
    torch.cuda.synchronize()
    peaks = (
        torch.cuda.max_memory_reserved() - base_reserved,
        torch.cuda.max_memory_allocated() - base_allocated,
    )
    del out
    return peaks


# --- strides of the functional results -------------------------------------------------------


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def output_strides(graph: Graph, order: list[int]) -> dict[Ref, tuple[int, ...]]:
    """The strides each allocating op's result has when the functional op runs.

    The graph records shapes, not strides, so we replay it on the meta device (no memory, no
    RNG). Only dense layouts (a permutation of a contiguous one) are kept; anything else, or an
    op without a meta kernel, gets a contiguous slot.
    """
    smap = graph.storages()
    values = {Ref(p): _meta_like(graph.meta(Ref(p))) for p in graph.placeholders()}
    for nid in order:
        node = graph.node(nid)
        if node.is_placeholder:
            continue
        for i, t in enumerate(_run_meta(node, values)):
            values[Ref(nid, i)] = t
        if node.writes_into is not None:
            values[Ref(nid)] = values[node.writes_into]  # the result is the placeholder itself
    return {
        r: tuple(values[r].stride())
        for r in smap.nbytes
        if r in values and dense_layout(tuple(values[r].shape), values[r].stride())
    }


def _meta_like(meta) -> torch.Tensor:
    return torch.empty(meta.shape, dtype=meta.torch_dtype, device="meta")


def _run_meta(node, values: dict[Ref, torch.Tensor]) -> list[torch.Tensor]:
    fallback = [_meta_like(m) for m in node.outputs]
    if not node.op.startswith("aten."):
        return fallback
    args = _to_meta(node.args, values)
    kwargs = {k: _to_meta(v, values) for k, v in node.kwargs}
    try:
        out = resolve_overload(node.op)(*args, **kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel: a contiguous slot will do
        return fallback
    outs = list(out) if isinstance(out, tuple | list) else [out]
    return [
        t if isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(m.shape) else f
        for t, m, f in zip(outs, node.outputs, fallback, strict=False)
    ]


def _to_meta(value, values: dict[Ref, torch.Tensor]):
    """An argument with Refs replaced by their meta tensors and devices by the meta device."""
    if isinstance(value, Ref):
        return values[value]
    if isinstance(value, torch.device):
        return torch.device("meta")
    if isinstance(value, list):
        return [_to_meta(v, values) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_meta(v, values) for v in value)
    return value
