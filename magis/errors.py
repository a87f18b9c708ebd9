"""Errors a user can act on.

Every error magis raises on bad input is a `MagisError` subclass whose message is one line saying
what is wrong and what to do. The CLI prints that line and exits non-zero; `--debug` shows the
traceback. Ctrl-C is never an error: `deferred_interrupt` keeps it from cutting a write (or an
exchange with a worker process) in half, and `interrupt_kept` from being lost.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


class MagisError(Exception):
    """Base class of every error meant for the user."""


class UnknownWorkloadError(MagisError, KeyError):
    """A workload name that the zoo does not have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CaptureError(MagisError):
    """The step could not be traced to a static graph (data-dependent control flow, .item(), ...)."""


class ValueReadError(CaptureError):
    """The step reads a tensor's value in Python (.item(), a branch on a tensor): one line naming
    the source line where it does."""


class RandomDrawError(ValueReadError):
    """The step reads the value of a random draw in Python (LayerDrop, a random token drop):
    one static graph holds one draw; one line naming where, and the setting to change."""


class ReseedError(CaptureError):
    """The step seeds PyTorch's random generator itself (`torch.manual_seed`, `torch.seed`
    inside the forward or backward): one line naming where."""


class TraceFailedError(CaptureError):
    """Tracing the step failed (an op without a fake kernel, a shape error): one line naming the
    source line where it did."""


class ValueGuardError(MagisError):
    """A run read another value than the one its step was captured for (a value guard,
    `magis.capture.specialize`): the plan holds only for the value read at capture."""


class UnsupportedOpError(MagisError):
    """An op the executor cannot run."""


class VerificationError(MagisError):
    """A transformed program does not compute what eager PyTorch computes."""


class PlanError(MagisError):
    """A plan file that cannot be read or does not match its graph."""


class LimitError(MagisError):
    """A memory or latency limit, or a memory figure, that cannot be read."""


class UnknownHardwareError(MagisError, KeyError):
    """A hardware preset name the cost model does not know."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class MagisWarning(UserWarning):
    """Something degraded but the work goes on (a rebuilt cache, an opaque op)."""


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Ctrl-C waits until the block is done, then interrupts: a file being written (a plan, a
    report) or a message to a worker is never cut in half. Only in the main thread (signals go
    there)."""
    pending: list[object] = []

    def remember(signum, frame) -> None:
        pending.append(signum)

    try:
        previous = signal.signal(signal.SIGINT, remember)
    except ValueError:  # not the main thread: nothing can be deferred
        yield
        return
    if previous is signal.SIG_IGN:  # a process told to ignore Ctrl-C keeps ignoring it
        signal.signal(signal.SIGINT, previous)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
    if pending:
        raise KeyboardInterrupt


def exception_line(exc: BaseException) -> str:
    """`TypeName: first line of the message`: an exception as one line of a report."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


@contextmanager
def interrupt_kept() -> Iterator[None]:
    """Ctrl-C interrupts at once, as usual, and is not lost: a KeyboardInterrupt raised inside a
    finalizer (`__del__`, a weakref callback: a capture runs many, as fake tensors die) is
    printed and ignored by Python, and the work would go on as if no key had been pressed. A
    Ctrl-C seen in the block and not raised out of it is raised when the block ends. Only in the
    main thread (signals go there)."""
    seen: list[object] = []

    def interrupt(signum, frame) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, interrupt)
    except ValueError:  # not the main thread: signals are not handled here
        yield
        return
    if previous is signal.SIG_IGN:  # a process told to ignore Ctrl-C keeps ignoring it
        signal.signal(signal.SIGINT, previous)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
    if seen:  # the block ended normally: its KeyboardInterrupt was swallowed somewhere
        raise KeyboardInterrupt
