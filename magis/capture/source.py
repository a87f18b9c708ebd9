"""Where a capture failed, in the code the user can change: the source line of a traceback.

A capture runs the user's forward (and the model library's) under make_fx and fake tensors;
when it fails, the traceback runs through torch's dispatch, magis's tracing and Python's own
modules, and the one frame that matters is the innermost frame of everything else: the line of
the user's or the library's code where a tensor's value was read or an op was called that could
not be traced. `failure_site` finds it in an exception and its causes.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import logging
import re
import sysconfig
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import torch

from magis.errors import (
    CaptureError,
    RandomDrawError,
    TraceFailedError,
    ValueReadError,
    exception_line,
)

# Frames in these folders are never the place to change: torch's own code, magis's, and
# Python's standard library (contextlib, functools around the user's code); installed
# libraries are the place (a venv's standard-library folder holds its site-packages).
_PATHS = sysconfig.get_paths()
_MAGIS = Path(__file__).parents[1].resolve()
_NOT_USER = (Path(torch.__file__).parent.resolve(), _MAGIS)
_STDLIB = tuple({Path(_PATHS[k]).resolve() for k in ("stdlib", "platstdlib")})
_LIBRARIES = tuple({Path(_PATHS[k]).resolve() for k in ("purelib", "platlib")})
_INSTALLED = ("site-packages", "dist-packages")

# An attribute whose value switches a training-only random choice on or off (LayerDrop,
# stochastic depth): named in the error when the line that read a value mentions one.
_RANDOM_DEPTH_FIELD = re.compile(r"\b(\w+\.\w*(?:layerdrop|drop_path|drop_prob)\w*)\b")
_RANDOM_DRAW = re.compile(r"\brand\w*\(|\brandom\(|\buniform_?\(|\bbernoulli")
# A branch on a config attribute (`if self.config.problem_type is None:`): the library's own
# switch between paths, named in a value-read error as the setting that may avoid it.
_CONFIG_BRANCH = re.compile(r"^(?:el)?if\b")
_CONFIG_FIELD = re.compile(r"\b((?:self\.)?config\.\w+)")


@dataclass(frozen=True)
class SourceLine:
    """One line of the user's or a library's code: its file, number and text, and the lines of
    its function up to it (`before`, to tell what the line tests)."""

    path: Path
    lineno: int
    code: str
    before: tuple[str, ...] = ()
    # the frame's locals (a failure's own frame), to read the field a random draw tests
    scope: dict = field(default_factory=dict, compare=False, repr=False)

    def __str__(self) -> str:
        where = f"{display_path(self.path)}:{self.lineno}"
        return f"{where} `{self.code}`" if self.code else where

    def random_depth_field(self) -> str | None:
        """The field a LayerDrop / stochastic-depth draw tests, when this line (or its function
        above it) draws a random number and names one: `config.layerdrop`, `self.drop_path`."""
        lines = (*self.before, self.code)
        if not any(_RANDOM_DRAW.search(line) for line in lines):
            return None
        for line in reversed(lines):
            found = _RANDOM_DEPTH_FIELD.search(line)
            if found:
                return found.group(1)
        return None

    def field_value(self, name: str) -> object:
        """The value of `name` ('self.layerdrop', 'config.layerdrop') in the failing frame, or
        None where it cannot be read (no frame, a missing attribute)."""
        first, *rest = name.split(".")
        value = self.scope.get(first)
        for attr in rest:
            value = getattr(value, attr, None)
        return value

    def branch_fields(self, most: int = 2) -> list[str]:
        """The config attributes that the branches above this line in its function test,
        nearest first: the settings that choose the path it is on."""
        found: list[str] = []
        for line in reversed(self.before):
            if _CONFIG_BRANCH.match(line):
                found += [f for f in _CONFIG_FIELD.findall(line) if f not in found]
        return found[:most]


def display_path(path: Path) -> str:
    """`path` as a user finds it: below site-packages (an installed library's
    `transformers/models/.../modeling_x.py`, also in a virtual environment inside the working
    folder), below the working folder, else in full."""
    parts = path.parts
    for marker in _INSTALLED:
        if marker in parts:
            return str(Path(*parts[parts.index(marker) + 1 :]))
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what caused it, outermost first (each cause ran deeper in the stack)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _is_user_file(path: Path) -> bool:
    if not path.is_file():  # generated code (fx's `<eval_with_key>`), the interpreter
        return False
    resolved = path.resolve()
    if any(resolved.is_relative_to(p) for p in _NOT_USER):
        return False
    library = any(resolved.is_relative_to(p) for p in _LIBRARIES)
    return library or not any(resolved.is_relative_to(p) for p in _STDLIB)


def _function_lines(frame: FrameType, lineno: int) -> tuple[str, ...]:
    """The lines of `frame`'s function before `lineno`, stripped (none when it has no source)."""
    try:
        lines, first = inspect.getsourcelines(frame.f_code)
    except (OSError, TypeError):
        return ()
    return tuple(line.strip() for line in lines[: max(lineno - first, 0)])


def calling_site(frame: FrameType | None) -> SourceLine | None:
    """The code that made the call running in `frame`: the first frame outwards that is
    neither torch's nor the standard library's, when it is the user's or a library's (None when
    it is magis's own, or there is none)."""
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.resolve().is_relative_to(_MAGIS):
            return None
        if _is_user_file(path):
            return _source_line(path.resolve(), frame.f_lineno, frame)
        frame = frame.f_back
    return None


def parameter_site(fn: Callable, name: str) -> SourceLine | None:
    """The line of `fn`'s source that declares its parameter `name` (the first line of its
    signature that names it), or None where `fn` has no source."""
    fn = inspect.unwrap(fn)
    try:
        lines, first = inspect.getsourcelines(fn)
        path = Path(inspect.getsourcefile(fn) or "")
    except (OSError, TypeError):
        return None
    declared = re.compile(rf"(?:^|[\s(,*]){re.escape(name)}\s*(?:[:=,)]|$)")
    for offset, line in enumerate(lines):
        if declared.search(line.strip()):
            return SourceLine(path.resolve(), first + offset, line.strip())
        if line.rstrip().endswith(":") and offset and ")" in line:  # the signature ended
            break
    return None


def failure_site(exc: BaseException) -> SourceLine | None:
    """The innermost frame outside torch, magis and the standard library in the tracebacks
    of `exc` and its causes: where the user's or the library's code failed."""
    found = None
    for link in _chain(exc):
        for frame, lineno in traceback.walk_tb(link.__traceback__):
            path = Path(frame.f_code.co_filename)
            if _is_user_file(path):
                found = (path.resolve(), lineno, frame)
    if found is None:
        return None
    path, lineno, frame = found
    return _source_line(path, lineno, frame, dict(frame.f_locals))


def _source_line(
    path: Path, lineno: int, frame: FrameType, scope: dict | None = None
) -> SourceLine:
    """Line `lineno` of `path`, run in `frame`: its code and its function's lines above it."""
    code = linecache.getline(str(path), lineno).strip()
    return SourceLine(path, lineno, code, _function_lines(frame, lineno), scope or {})


# A frame of a traceback as Python formats it: file, line number, function, then the code.
_FORMATTED_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n[ \t]*([^\n]*)')
_FORWARD_TRACEBACK = "Traceback of forward call"


def in_backward(exc: BaseException) -> bool:
    """Whether `exc` was raised while autograd's engine ran the backward: then no frame of the
    user's code is on the stack, only of the forward that recorded the failing op."""
    return any(
        frame.f_code.co_name == "_engine_run_backward"
        for link in _chain(exc)
        for frame, _ in traceback.walk_tb(link.__traceback__)
    )


def forward_site(rerun: Callable[[], object]) -> SourceLine | None:
    """Where the forward recorded the op whose backward failed: `rerun()` (the failed trace
    again) under autograd's anomaly mode, which keeps each op's forward stack and warns it
    when the op's backward raises; the innermost frame of the user's or a library's code in
    that stack. Run only after a failure: the mode formats a stack for every op recorded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # it fails again; the warning is the point
        with torch.autograd.detect_anomaly(check_nan=False), contextlib.suppress(Exception):
            rerun()
    for warning in reversed(caught):
        text = str(warning.message)
        if _FORWARD_TRACEBACK in text:
            return innermost_user_frame(text[text.index(_FORWARD_TRACEBACK) :])
    return None


def innermost_user_frame(formatted: str) -> SourceLine | None:
    """The last frame of the user's or a library's code in a formatted stack (`File "...",
    line N, in f` then its code)."""
    found = None
    for path, lineno, code in _FORMATTED_FRAME.findall(formatted):
        if _is_user_file(Path(path)):
            found = SourceLine(Path(path).resolve(), int(lineno), code.strip())
    return found


_DATA_DEPENDENT = frozenset(
    {
        "DataDependentOutputException",
        "GuardOnDataDependentSymNode",
        "DynamicOutputShapeException",
        "UnsupportedOperatorException",
    }
)


def is_data_dependent(exc: BaseException) -> bool:
    """Whether `exc` (or a cause) says a tensor's value was needed that fake tensors lack."""
    links = list(_chain(exc))
    return any(type(e).__name__ in _DATA_DEPENDENT for e in links) or any(
        "data-dependent" in str(e).lower() for e in links
    )


_ATEN_OP = re.compile(r"aten\.\w+(?:\.\w+)?")


def failed_op(exc: BaseException, logged: Sequence[str] = ()) -> str | None:
    """The ATen op a capture failed at: named in `exc` or a cause, else the innermost op being
    dispatched in the traceback, else the last one whose fake kernel failed
    (`fake_kernel_failures_kept`: torch does not log every such failure, depending on what ran
    before in the process, so the log is the last resort)."""
    for link in _chain(exc):
        found = _ATEN_OP.search(str(link))
        if found:
            return found.group(0)
    for link in _chain(exc):
        op = _dispatched_op(link)
        if op is not None:
            return op
    return logged[-1] if logged else None


def _dispatched_op(exc: BaseException) -> str | None:
    """The innermost ATen operator a frame of `exc`'s traceback was dispatching (an
    `OpOverload` held as `func` or `self` by the dispatch and fake-tensor frames)."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        for name in ("func", "self"):
            value = tb.tb_frame.f_locals.get(name)
            if isinstance(value, torch._ops.OpOverload) and value.namespace == "aten":
                found = str(value)
        tb = tb.tb_next
    return found


@contextlib.contextmanager
def fake_kernel_failures_kept() -> Iterator[list[str]]:
    """Torch logs a traceback when an op's fake kernel fails; the error that follows is what
    the user sees (one line), so the log record is kept, not printed: the ops it names are
    collected in the list yielded."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    ops: list[str] = []

    def keep(record: logging.LogRecord) -> bool:
        found = _ATEN_OP.search(record.getMessage())
        if found and record.levelno >= logging.ERROR:
            ops.append(found.group(0))
            return False
        return True

    logger.addFilter(keep)
    try:
        yield ops
    finally:
        logger.removeFilter(keep)


def capture_failure(
    exc: BaseException, logged: Sequence[str] = (), rerun: Callable[[], object] | None = None
) -> CaptureError:
    """`exc`, raised while tracing, as the one-line error the user sees: a value read in Python
    (`ValueReadError`) or another trace failure (`TraceFailedError`), each naming the source
    line where it happened (`failure_site`). A value read on a line that tests a LayerDrop or
    stochastic-depth field also names the field to set: that is training-only random control
    flow, which one static graph cannot hold (README "Coverage"). A failure in the backward
    names the forward line whose backward it was (`forward_site`, with `rerun`: the trace
    again)."""
    site, op = failure_site(exc), failed_op(exc, logged)
    if site is None and rerun is not None and in_backward(exc):
        site = forward_site(rerun)
        if site is not None:
            return _backward_failure(exc, site, op)
    at = (f" at {site}" if site is not None else "") + (f", in {op}" if op else "")
    if is_data_dependent(exc):
        field = site.random_depth_field() if site is not None else None
        if field is not None and site.field_value(field) != 0:  # at 0 no draw changes a branch
            return RandomDrawError(
                f"cannot capture a static graph: the step branches on a random draw{at} "
                f"(training-only random control flow, data-dependent: LayerDrop or stochastic "
                f"depth); set the probability it reads (`{field}`) to 0 in the model's config"
            )
        fields = site.branch_fields() if site is not None else []
        switch = (
            f"; the path it is on is chosen by {', '.join(f'`{f}`' for f in fields)}: a "
            "setting of it may take a static-shape path"
            if fields
            else ""
        )
        return ValueReadError(
            f"cannot capture a static graph: the step reads a tensor's value in Python{at} "
            "(.item(), bool(tensor) or data-dependent control flow); make it tensor "
            f"arithmetic or move it out of the step{switch}"
        )
    return TraceFailedError(f"tracing failed{at}: {exception_line(exc)}")


def _backward_failure(exc: BaseException, site: SourceLine, op: str | None) -> CaptureError:
    """A failure in the backward of the op `site` recorded (`capture_failure`)."""
    within = f" (in {op})" if op else ""
    if is_data_dependent(exc):
        return ValueReadError(
            f"cannot capture a static graph: the backward of {site} needs a tensor's value"
            f"{within}, as indexing by a boolean mask does; write it as tensor arithmetic "
            "(torch.where, or the mask multiplied in) or move it out of the step"
        )
    return TraceFailedError(
        f"tracing failed in the backward of {site}{within}: {exception_line(exc)}"
    )
