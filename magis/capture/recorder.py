"""Record a step's ATen ops into an FX graph with one dispatch mode: make_fx's graph, cheaper.

make_fx wraps every traced tensor in a proxy, builds each node through an FX tracer (argument
trees flattened and rebuilt, a proxy per output, a detached snapshot of every value) and runs a
torch-function mode besides. On a long unrolled step that costs more than the fake kernels
themselves: py-spy on Mamba's 99,900-node step put 0.44 of the capture in make_fx's own
bookkeeping and 0.26 in the fake kernels it calls.

`record` gets the same graph from one `TorchDispatchMode` over the fake mode: each op that
reaches it becomes a node whose arguments are the nodes that made its tensor arguments (the
latest op to return a tensor object made it, so a read after an in-place op reads the in-place
node, as in make_fx), its `val` the fake output, and `nn_module_stack` the modules it ran in
(global forward hooks, each module named by its first path below the root, as make_fx's
module-stack tracer names it). It follows make_fx (torch 2.13, non-symbolic, not
pre-dispatch) where that shapes the graph: CompositeImplicitAutograd ops that reach the mode are
decomposed as autograd would have, `lift_fresh` is recorded as `lift_fresh_copy`, a tensor no op
made is a `_tensor_constant` attribute, multi-output ops get a `getitem` per element, value reads
of constants are not recorded, and the autocast cache is off. Node names are make_fx's.

Whatever it does not cover (a tensor subclass such as DTensor or an async collective, a
higher-order op, or any failure other than a fake kernel's data-dependent one) raises
`NotRecorded`, and `first_trace` traces with make_fx instead; so does any torch but the one
the recorder was checked against (`FOLLOWS_TORCH`: the GPU machine's 2.11 traces with make_fx).

Measured (this machine, `examples/mamba_scan.py:factory`, 99,900 nodes, capture from the model
file to the graph): 86 s with make_fx, 45 s with the recorder; the graph documents of all 36
zoo and corpus `:tiny` steps in both step kinds are identical either way (a one-off sweep,
2026-11-30; `tests/capture/test_recorder.py` checks four, and the cases below by hand).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx._lazy_graph_module import _make_graph_module
from torch.fx.experimental.proxy_tensor import disable_autocast_cache, make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from magis.errors import MagisError

try:  # torch internals that make_fx's own choices live in (torch 2.13; the GPU machine's 2.11)
    from torch._subclasses.fake_impls import fast_detach
    from torch.utils._python_dispatch import autograd_would_have_decomposed
except ImportError:  # another torch: make_fx traces (`record` declines)
    fast_detach = autograd_would_have_decomposed = None

_aten = torch.ops.aten
_prim_device = torch.ops.prim.device.default  # a query, not an op (make_fx records none)
_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)
# What a fake kernel raises where the step reads a value: make_fx raises the same, so the
# caller's error handling (or its trace on real tensors) takes it as it is.
_VALUE_READS = (DataDependentOutputException, DynamicOutputShapeException)


def first_trace(
    fn: Callable, args: Sequence, root: torch.nn.Module | None, specialized: dict
) -> fx.GraphModule:
    """A step's first trace: `record` on fake tensors (`specialized` holds make_fx's
    `_error_on_data_dependent_ops`, True for them), else make_fx: on real tensors (the trace
    specialized to the values read) and where the recorder declines. With `root`, the module
    `fn` calls, nodes carry the stack of `root`'s submodules they ran in."""
    if specialized.get("_error_on_data_dependent_ops"):
        try:
            return record(fn, args, root)
        except NotRecorded:
            pass
    if root is None:
        return make_fx(fn, **specialized)(*args)
    return make_fx(_rooted(fn, root), record_module_stack=True, **specialized)(*args)


def _rooted(fn: Callable, root: torch.nn.Module) -> Callable:
    """`fn` marked as calling `root` (where make_fx looks for the module tree)."""

    def traced(*args):
        return fn(*args)

    traced._orig_mod = root
    return traced


# The torch whose make_fx the recorder was checked against node for node (the graph documents
# of every zoo and corpus step: `scripts/recorder-parity`, to re-run before moving this);
# under another, make_fx traces: its choices may have moved.
FOLLOWS_TORCH = "2.13."


class NotRecorded(Exception):
    """The step uses something `record` does not cover: trace it with make_fx."""


def record(fn: Callable, args: Sequence, root: torch.nn.Module | None = None) -> fx.GraphModule:
    """The graph of `fn(*args)` (fake tensors in, a tuple out) as make_fx would trace it, with
    `nn_module_stack` on the nodes that ran inside `root`'s submodules."""
    if not torch.__version__.startswith(FOLLOWS_TORCH) or fast_detach is None:
        raise NotRecorded(f"the recorder follows make_fx of torch {FOLLOWS_TORCH}")
    recorder = _Recorder(root)
    try:
        with disable_autocast_cache(), recorder.module_hooks(), recorder:
            for i, a in enumerate(args):
                recorder.placeholder(i, a)
            out = fn(*args)
    except (NotRecorded, MagisError, *_VALUE_READS):
        raise
    except Exception as exc:  # noqa: BLE001 - anything else: make_fx decides
        raise NotRecorded(f"{type(exc).__name__}: {exc}") from exc
    return recorder.module(out)


class _Recorder(TorchDispatchMode):
    """The dispatch mode that appends each op to `graph` (see the module docstring)."""

    def __init__(self, root: torch.nn.Module | None) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self.attrs = torch.nn.Module()  # the tensor constants, as the GraphModule's attributes
        # Weak keys, as make_fx's tracker: a strong reference to an op's output changes what
        # autograd does with it (a `detach` of `ones_like`'s result that make_fx never sees).
        self.node_of: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.constant_of: dict[int, str] = {}
        self.constants: list[torch.Tensor] = []
        self.paths = _first_paths(root)
        self.stack: list[tuple[str, tuple[str, str]]] = []
        self.meta_mode: FakeTensorMode | None = None
        self.implicit: dict[object, bool] = {}

    # -- the graph's ends --------------------------------------------------------------

    def placeholder(self, i: int, value: object) -> None:
        node = self.graph.placeholder(f"arg{i}_1")
        if isinstance(value, torch.Tensor):
            node.meta["val"] = _snapshot(value)
            self.node_of[value] = node
        else:
            node.meta["val"] = value

    def module(self, out: object) -> fx.GraphModule:
        self.graph.output(self._arg(out))
        # lazy where the caller asks for it: the Python code of a 100,000-node graph is seconds
        return _make_graph_module(self.attrs, self.graph)

    # -- the module stack ------------------------------------------------------------------

    def module_hooks(self):
        return _ModuleHooks(self)

    def enter_module(self, module: torch.nn.Module) -> None:
        path = self.paths.get(id(module))
        if path is None:  # not a submodule of the root (built in a forward): its caller's
            self.stack.append(self.stack[-1] if self.stack else ("", ("", "")))
            return
        key = f"L__self__{path}".replace(".", "_")
        self.stack.append((key, (path, type(module).__qualname__)))

    def leave_module(self) -> None:
        if self.stack:
            self.stack.pop()

    # -- recording -------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _prim_device:
            return func(*args, **kwargs)
        if any(t not in _PLAIN for t in types):
            raise NotRecorded(f"{func} on a tensor subclass ({', '.join(map(str, types))})")
        # the argument tree is walked only where it is read, not for each of 100,000 ops
        flat = _flat_tensors
        if self._implicit(func) and autograd_would_have_decomposed(func, flat((args, kwargs))):
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        if func is _aten.is_nonzero.default:
            with self:
                return bool((args[0] != 0).item())
        if torch.Tag.data_dependent_output in func.tags and _all_constant(flat((args, kwargs))):
            return func(*args, **kwargs)  # the fake mode reads the constants; make_fx records none
        if func is _aten.lift_fresh.default:
            func = _aten.lift_fresh_copy.default
        node = self.graph.create_node(
            "call_function",
            func,
            self._arg(tuple(args)),
            self._arg(kwargs),
            name=self.graph._target_to_str(func.overloadpacket.__name__),
        )
        if self.stack:
            node.meta["nn_module_stack"] = dict(self.stack)
        out = func(*args, **kwargs)
        self._record_output(out, node)
        return out

    def _implicit(self, func) -> bool:
        """Whether `func` has a CompositeImplicitAutograd kernel (`OpOverload.decompose`'s
        test), asked once per op."""
        known = self.implicit.get(func)
        if known is None:
            known = func not in _SHAPE_QUERIES and (
                _IMPLICIT in func.py_kernels
                or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _IMPLICIT)
            )
            self.implicit[func] = known
        return known

    def _record_output(self, out: object, node: fx.Node) -> None:
        if isinstance(out, torch.Tensor):
            node.meta["val"] = _snapshot(out)
            self.node_of[out] = node
        elif isinstance(out, tuple | list):
            node.meta["val"] = tuple(
                _snapshot(o) if isinstance(o, torch.Tensor) else o for o in out
            )
            for i, item in enumerate(out):
                part = self.graph.create_node(
                    "call_function", operator.getitem, (node, i), {}, name="getitem"
                )
                if self.stack:
                    part.meta["nn_module_stack"] = dict(self.stack)
                self._record_output(item, part)
        else:
            node.meta["val"] = out

    def _arg(self, value: object) -> object:
        if isinstance(value, torch.Tensor):
            node = self.node_of.get(value)
            return node if node is not None else self._constant(value)
        if isinstance(value, tuple | list):
            mapped = [self._arg(v) for v in value]
            return mapped if isinstance(value, list) else tuple(mapped)
        if isinstance(value, dict):
            return {k: self._arg(v) for k, v in value.items()}
        return value

    def _constant(self, t: torch.Tensor) -> fx.Node:
        """A tensor no recorded op made: an attribute of the module, read by a `get_attr` node
        at each use (make_fx's `_tensor_constant<i>`; `_param_constant<i>` for a Parameter)."""
        name = self.constant_of.get(id(t))
        if name is None:
            base = "_param_constant" if isinstance(t, torch.nn.Parameter) else "_tensor_constant"
            name = f"{base}{sum(1 for k in self.constant_of.values() if k.startswith(base))}"
            self.constant_of[id(t)] = name
            self.constants.append(t)  # its id stays its own
            setattr(self.attrs, name, t)
        node = self.graph.get_attr(name)
        node.meta["val"] = t if isinstance(t, FakeTensor) else self._fake_like(t)
        return node

    def _fake_like(self, t: torch.Tensor) -> torch.Tensor:
        if self.meta_mode is None:
            self.meta_mode = FakeTensorMode(allow_fallback_kernels=True)
        with self.meta_mode:
            return torch.empty_strided(t.shape, t.stride(), device=t.device, dtype=t.dtype)


class _ModuleHooks:
    """Global forward hooks that keep the recorder's module stack while the step runs."""

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder
        self.handles: list = []

    def __enter__(self) -> _ModuleHooks:
        hooks = torch.nn.modules.module
        self.handles = [
            hooks.register_module_forward_pre_hook(self._pre),
            hooks.register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def _pre(self, module, args) -> None:
        self.recorder.enter_module(module)

    def _post(self, module, args, out) -> None:
        self.recorder.leave_module()


_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd
_SHAPE_QUERIES = frozenset({_aten.size.default, _aten.stride.default, _aten.storage_offset.default})


def _first_paths(root: torch.nn.Module | None) -> dict[int, str]:
    """Each submodule of `root` by the first path that reaches it (a shared module keeps the
    first, as make_fx's module-stack tracer does)."""
    paths: dict[int, str] = {}
    if root is None:
        return paths
    for name, m in root.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), name)
    return paths


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A detached alias of `t` with its metadata as it is now (an in-place `transpose_` later
    changes `t`'s, not this), without a trip through dispatch (make_fx's `snapshot_fake`)."""
    return fast_detach(t.fake_mode, t) if isinstance(t, FakeTensor) else t.detach()


def _flat_tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _flat_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat_tensors(v)]
    return []


def _all_constant(tensors: list[torch.Tensor]) -> bool:
    return bool(tensors) and all(getattr(t, "constant", None) is not None for t in tensors)
