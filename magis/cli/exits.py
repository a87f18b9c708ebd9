"""How a `magis` command ends: its exit codes, the checks of a command line made before any work
(output paths, input files, positive numbers), and the deferral of Ctrl-C while a file is written.

Exit codes (the README's CLI section lists them too):

- 0: done (for `optimize`, the limit is met);
- 1: an error (an unknown workload or hardware, a plan that cannot be read or does not fit, a
  program that does not verify, a benchmark that found mismatches);
- 2: a command line that cannot work, found before any work starts: an unknown or malformed
  option, a limit that cannot be read or cannot be met, a time budget <= 0, an output path that
  cannot be written or an input file that does not exist;
- 3: `optimize` searched and its best plan does not meet the limit (the plan is still saved);
- 130: interrupted (Ctrl-C); what was saved is said on the last line.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

from magis.errors import LimitError, MagisError, deferred_interrupt

__all__ = [
    "ExitCode",
    "Interrupted",
    "UsageError",
    "check_input_file",
    "check_output_folder",
    "check_output_path",
    "check_positive",
    "deferred_interrupt",
    "exit_code_of",
]


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    LIMIT_NOT_MET = 3
    INTERRUPTED = 130


class UsageError(MagisError):
    """An option's value that cannot work, found before any work (exit code 2)."""


class Interrupted(Exception):
    """Ctrl-C ended a command; the message says what it leaves behind (exit code 130).

    Not a KeyboardInterrupt: typer turns those into a bare exit status 130 and the message
    would be lost on the way to `magis.cli.main`."""


USAGE_ERRORS: tuple[type[MagisError], ...] = (UsageError, LimitError)


def exit_code_of(error: MagisError) -> ExitCode:
    return ExitCode.USAGE if isinstance(error, USAGE_ERRORS) else ExitCode.ERROR


def check_output_path(path: Path | None, flag: str) -> Path | None:
    """`path` if a file can be written there (its folder exists or can be made); else a
    one-line UsageError. Checked when the command line is read, so that a search or a capture
    is never lost to a path that cannot be written."""
    if path is None:
        return None
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent  # the folders below `folder` will be made
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write in {folder}")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: the file is not writable")
    return path


def check_output_folder(path: Path, flag: str) -> Path:
    """`path` if it is, or can be made as, a folder to write in; else a one-line UsageError."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: is a file, not a folder")
    folder = path
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write in {folder}")
    return path


def check_input_file(path: Path | None, flag: str) -> Path | None:
    """`path` if it is a readable file; else a one-line UsageError."""
    if path is None:
        return None
    if not path.exists():
        raise UsageError(f"{flag} {path}: no such file")
    if not path.is_file():
        raise UsageError(f"{flag} {path}: not a file")
    if not os.access(path, os.R_OK):
        raise UsageError(f"{flag} {path}: the file is not readable")
    return path


def check_positive(value: float | None, flag: str) -> float | None:
    if value is not None and not value > 0:  # `not >` also refuses nan
        raise UsageError(f"{flag} must be more than 0, got {value}")
    return value
