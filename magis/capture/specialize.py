"""Capture of a step that reads tensor values in Python: specialized to the values read, guarded.

Fake tensors hold no values, so the fake capture (`magis.capture.trace`) cannot trace a step
whose Python reads one: `.item()`, `bool(tensor)` in an `if` or an `assert`, `.tolist()`, or a
boolean-mask index, whose result's shape is a count of the data. Where the step's tensors are
real, magis traces it again over copies of them, every op run (make_fx's real mode with
data-dependent ops allowed): as torch.export specializes a program to a value it reads, the graph
is the step for the values read then. `ValueReads` records each read, with its value, the shape
it had and the line that read it, and the import (`magis.capture.fx_import`) puts a guard
(`magis.ir.ops.EXPECT_OP`) at each: a run that reads another value stops with a one-line
`ValueGuardError` naming the line (`magis.backend.guards`); it never computes another step than
the one captured and verified.

Refused with a one-line error: a read of a value that depends on a random draw (a random token
drop's mask, LayerDrop's `torch.rand([]) < p`), which differs on every step, so that no plan
would hold twice; and a model whose tensors are fake or on the meta device (nothing to read).
The real trace runs the step once on the CPU: it needs the memory of one eager step.
"""

from __future__ import annotations

import contextlib
import operator
import re
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import TorchDispatchMode

from magis.capture.source import innermost_user_frame
from magis.errors import MagisWarning, RandomDrawError

# Said of a value read that cannot be specialized to: fake or meta tensors (nothing to read),
# or a data-parallel step (each rank would read its own value).
FAKE_ONLY = (
    " (with real weights and batch, on one process, magis captures such a step for the value "
    "read, guarded)"
)
# The fx node meta key under which `ValueReads` leaves a `ValueRead`.
READ_KEY = "magis_value_read"
# What a guard's source line may hold (`magis.ir.schema.SITE_CONSTANT`): anything else becomes _
_SITE_CHARS = re.compile(r"[^\w ,.\-/:+@]")
_INDEX_OPS = frozenset({torch.ops.aten.index.Tensor})


@dataclass(frozen=True)
class ValueRead:
    """A value the step read (None: only the shape of a data-dependent result mattered), the
    shape of the tensor it came from, and the line that read it ('' in the backward)."""

    value: bool | int | float | None
    shape: tuple[int, ...]
    site: str  # 'path:line', in the guard (`SITE_CONSTANT`'s characters)
    varies: bool = False  # another seed read another value (`refuse_random_reads`)
    code: str = ""  # the site with its line of code, for messages

    @property
    def where(self) -> str:
        return self.code or self.site or "the backward"


def reads_values(func: torch._ops.OpOverload, args: Sequence) -> bool:
    """Whether a call of `func` reads a tensor's value into Python or makes a tensor whose
    shape depends on values: `.item()` (`_local_scalar_dense`), nonzero, unique, masked_select,
    and an index by a boolean mask (an integer index has a static shape)."""
    if torch.Tag.data_dependent_output in func.tags:
        return True
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else ()
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        )
    return True


class ValueReads(TorchDispatchMode):
    """Records, on the node make_fx just made for it, every call that `reads_values` (see the
    module docstring). Pushed above make_fx's own mode, it sees each call first: the node is
    the last one of the tracer's graph once the call returns."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not reads_values(func, args):
            return out
        proxy = get_proxy_mode()
        if proxy is None:
            return out
        node = _last_call(proxy.tracer.graph)
        if node is not None and node.target is func:
            node.meta[READ_KEY] = _read(out, args)
        return out


def _last_call(graph: fx.Graph) -> fx.Node | None:
    """The last op node of `graph`, before the getitems that unpack a multi-output op."""
    for node in reversed(graph.nodes):
        if node.target is not operator.getitem:
            return node
    return None


def _read(out, args: Sequence) -> ValueRead:
    """The read `out` is (a Python number, or a tensor shaped by values). In a trace of a
    traced graph (the second trace, through `functionalize`), its line is the one the first
    trace found at this node, and a value other than the first trace's `varies`."""
    if isinstance(out, torch.Tensor | list | tuple):
        first = out if isinstance(out, torch.Tensor) else out[0]
        value, shape = None, tuple(first.shape)
    else:
        value, shape = out, tuple(args[0].shape)
    retraced = fx_traceback.has_preserved_node_meta()
    earlier = fx_traceback.get_current_meta().get(READ_KEY) if retraced else None
    if earlier is None:
        found = innermost_user_frame("".join(traceback.format_stack()))
        if found is None:  # the autograd engine runs the backward with no line of the user's
            return ValueRead(value, shape, "")
        site = _SITE_CHARS.sub("_", str(found).split(" `")[0])[:300]
        return ValueRead(value, shape, site, code=str(found))
    varies = earlier.value != value or earlier.shape != shape
    return ValueRead(value, shape, earlier.site, varies or earlier.varies, earlier.code)


def real_copies(tensors: Sequence) -> Callable[[], list] | None:
    """A function making fresh copies of `tensors` for one real trace (each trace mutates its
    copies, as the optimizer does), or None when one of them holds no values (fake, meta)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and (isinstance(t, FakeTensor) or t.is_meta):
            return None

    def copies() -> list:
        return [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in tensors]

    return copies


def real_step_inputs(
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    by_name: dict[str, torch.Tensor],
    state_of: Sequence[tuple[str, int]],
    rest: Sequence[torch.Tensor],
) -> Callable[[], list] | None:
    """Fresh real copies of a training step's flat inputs (`_Layout`'s order; optimizer state
    zeros) for a specialized trace, or None where a tensor holds no values."""
    copies = real_copies([*params, *buffers, *rest])
    if copies is None:
        return None
    held = len(params) + len(buffers)

    def inputs() -> list:
        flat = copies()
        state = [torch.zeros_like(by_name[n].detach()) for n, k in state_of for _ in range(k)]
        return [*flat[:held], *state, *flat[held:]]

    return inputs


def refuse_random_reads(gm: fx.GraphModule) -> None:
    """`RandomDrawError` for the first value read that differed between the two traces, which
    differ only in the random generator's seed (`seeded`): a value that depends on a draw
    (LayerDrop's coin, a random token drop's mask) differs on every step, so no plan for one
    value would hold twice. A read of a value that a draw reaches but does not change (a count
    of NaNs in a dropout's output) is kept."""
    for node in gm.graph.nodes:
        read = node.meta.get(READ_KEY)
        if read is not None and read.varies:
            raise RandomDrawError(
                f"cannot capture a static graph: the step reads a value that depends on a "
                f"random draw at {read.where} (another seed reads another "
                "value, so no plan for one value would hold twice); make it tensor arithmetic "
                "(torch.where, the mask multiplied in) or turn the randomness off in training"
            )


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """The random generator seeded with `seed`, and restored after: the traces draw as a step
    would without moving the user's generator."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def warn_specialized(gm: fx.GraphModule) -> None:
    """One `MagisWarning` line saying that the step was captured for the values it read, and
    where it read them (the first few lines; how many reads in all)."""
    reads = [n.meta[READ_KEY] for n in gm.graph.nodes if READ_KEY in n.meta]
    sites = list(dict.fromkeys(r.site or "the backward" for r in reads))  # no code: short
    shown = ", ".join(sites[:3]) + (f" and {len(sites) - 3} more lines" if len(sites) > 3 else "")
    warnings.warn(
        f"the step reads {len(reads)} tensor value(s) in Python ({shown}): captured for the "
        "values read with this batch, each one guarded (a run that reads another value stops "
        "with an error naming the line)",
        MagisWarning,
        stacklevel=2,
    )
