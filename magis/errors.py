"""Errors a user can act on.

Every error magis raises on bad input is a `MagisError` subclass whose message is one line saying
what is wrong and what to do. The CLI prints that line and exits non-zero; `--debug` shows the
traceback.
"""


class MagisError(Exception):
    """Base class of every error meant for the user."""


class UnknownWorkloadError(MagisError, KeyError):
    """A workload name that the zoo does not have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CaptureError(MagisError):
    """The step could not be traced to a static graph (data-dependent control flow, .item(), ...)."""


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
