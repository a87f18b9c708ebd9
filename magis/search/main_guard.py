"""Whether the caller's script would run again in every worker process (issue 45).

Python's forkserver and spawn start methods prepare each new process by running the parent's
`__main__` script again, as `__mp_main__` (`multiprocessing.spawn.get_preparation_data`,
`_fixup_main_from_path`), so that what it defines can be unpickled there. A script whose search
with workers is not under `if __name__ == "__main__":` would repeat its whole top level in
each worker — capture, searches, prints — while the real search runs. The standard library
offers no per-process way to leave `__main__` out of that preparation (only rewriting
`sys.modules["__main__"]` for the whole process while the workers start, on a thread), so the
search finds such a script before any worker starts and says what to do in one line.

The script is read as Python reads it: the statement of `__main__`'s module-level code that
is running now (the frame's line) must be an `if __name__ == "__main__":` block. A `__main__`
the workers would not run again (an interactive session, `python -c`, a package's
`__main__.py`) is never refused.
"""

from __future__ import annotations

import ast
import multiprocessing
import sys
from pathlib import Path
from types import FrameType, ModuleType

from magis.errors import MagisError

GUARD_ADVICE = 'put the script\'s top-level code under `if __name__ == "__main__":`'


class UnguardedMainError(MagisError):
    """A search with workers was started from a script's top level outside an
    `if __name__ == "__main__":` block: each worker would run the script again."""


def refuse_unguarded_main() -> None:
    """Raise `UnguardedMainError` (one line: where, and what to do) when the workers about to
    start would run the caller's script again, or when this process is itself a worker still
    starting (a script this check cannot read: its search and the parent's would wait on each
    other)."""
    line = unguarded_main_line(sys._getframe(1))
    if line is not None:
        raise UnguardedMainError(
            f"a search with workers > 1 was started at line {line} of the script, outside a "
            f"main guard, so each worker would run the script again: {GUARD_ADVICE}"
        )
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise UnguardedMainError(
            f"a search with workers > 1 was started while a worker process was starting: "
            f"{GUARD_ADVICE}"
        )


def rerun_main_path(main: ModuleType) -> Path | None:
    """The file a spawned or forkserver worker would run again for `main` (None: none),
    as `multiprocessing.spawn.get_preparation_data` and `_fixup_main_from_name` decide."""
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return None  # a package's __main__.py: never run again
    path = getattr(main, "__file__", None)
    return Path(path) if path else None


def unguarded_main_line(frame: FrameType | None = None) -> int | None:
    """The line of the running statement of `__main__`'s module-level code when that
    statement is not under a `__main__` guard and the workers would run it again; None when
    it is guarded, or the script cannot be read (then nothing is claimed)."""
    main = sys.modules.get("__main__")
    path = rerun_main_path(main) if main is not None else None
    line = _main_module_line(main, frame or sys._getframe(1)) if path else None
    if path is None or line is None:
        return None
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    for stmt in tree.body:
        if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
            return None if _is_main_guard(stmt) else line
    return None


def _main_module_line(main: ModuleType, frame: FrameType | None) -> int | None:
    """The line `__main__`'s module-level code is running, from the stack above `frame`."""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            return frame.f_lineno
        frame = frame.f_back
    return None


def _is_main_guard(stmt: ast.stmt) -> bool:
    """`if __name__ == "__main__":` (either side of the `==`)."""
    if not isinstance(stmt, ast.If) or not isinstance(stmt.test, ast.Compare):
        return False
    test = stmt.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    named = any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
    literal = any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)
    return named and literal
