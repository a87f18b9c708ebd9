"""A persistent table of measured op times in SQLite: MAGIS's "operator performance cache" (§6.2).

The cache must never stop the optimizer: a corrupted file is moved aside (``.corrupt``) and a
fresh one started; a locked database or an unwritable path degrades to a cache held in memory for
this run. Each case gives one `MagisWarning` line that names the file.

Each measured row carries the machine's pace when it was measured (`magis.cost.pace`), so that
a time taken on a busy machine is taken again on a quiet one (`ProfiledCostModel` drops such
rows from its run with `forget`; their new times replace them in the file).
"""

from __future__ import annotations

import os
import sqlite3
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from magis.errors import MagisWarning

CACHE_FILE = "op_cache.sqlite"
CACHE_ENV = "MAGIS_CACHE"
MEMORY = ":memory:"
SQLITE_SUFFIXES = (".sqlite", ".sqlite3", ".db")
# How long to wait for another process's write lock before giving up on the file for this run.
LOCK_TIMEOUT_S = 2.0
# Inside `batch()`, commit every this many rows: an interrupted profile keeps most of its work.
BATCH_ROWS = 64

SCHEMA_VERSION = 2  # 2: the pace column (a version-1 file is cleared once)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS op_times (
    device TEXT NOT NULL,
    torch TEXT NOT NULL,
    profiler TEXT NOT NULL,  -- how ops were timed: a new method invalidates old rows
    key TEXT NOT NULL,
    seconds REAL NOT NULL,
    source TEXT NOT NULL,  -- 'measured', or 'estimated' when the op could not run
    pace REAL NOT NULL,  -- seconds of the reference workload then (0: unknown)
    PRIMARY KEY (device, torch, profiler, key)
)
"""
_CORRUPT = ("SQLITE_NOTADB", "SQLITE_CORRUPT")
_PACKAGE_DIR = str(Path(__file__).parent)


def default_cache_path() -> Path:
    """``$MAGIS_CACHE`` (a directory, or the file itself when it ends in .sqlite/.sqlite3/.db),
    else ``op_cache.sqlite`` in the user's cache directory."""
    env = os.environ.get(CACHE_ENV)
    if env:
        path = Path(env).expanduser()
        return path if path.suffix in SQLITE_SUFFIXES else path / CACHE_FILE
    return Path(platformdirs.user_cache_dir("magis")) / CACHE_FILE


def _ensure_schema(conn: sqlite3.Connection) -> None:
    """Create the table; a file written with another schema version is cleared, not misread."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version != SCHEMA_VERSION:
        conn.execute("DROP TABLE IF EXISTS op_times")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.execute(_SCHEMA)
    conn.commit()


def _is_corruption(exc: sqlite3.Error) -> bool:
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name.startswith(_CORRUPT):
        return True
    text = str(exc).lower()
    return "not a database" in text or "malformed" in text


@dataclass(frozen=True)
class Row:
    """One cached op time."""

    seconds: float
    source: str  # 'measured', or 'estimated' when the op could not run
    pace: float = 0.0  # seconds of the reference workload when it was measured (0: unknown)


class OpTimeStore:
    """Rows (device, torch version, profiler version, op key text) -> seconds, each with the
    pace of the machine when it was measured.

    Rows of this scope are loaded when the file is opened and written as they are measured.

    `path` None or ":memory:" keeps everything in memory, silently. Reads never touch the disk
    after opening; `conn` is None whenever nothing is persisted.
    """

    def __init__(self, path: str | Path | None, scope: tuple[str, str, str]) -> None:
        self.scope = scope  # (device, torch version, profiler version)
        self.path = None if path is None or str(path) == MEMORY else Path(path)
        self.conn: sqlite3.Connection | None = None
        self.rows: dict[str, Row] = {}
        self._pending = 0
        self._batch_depth = 0
        if self.path is not None:
            self._open(self.path)

    # --- opening ------------------------------------------------------------------------------

    def _open(self, path: Path) -> None:
        try:
            self._connect_and_load(path)
        except sqlite3.Error as exc:
            if not _is_corruption(exc):
                self._degrade(f"cannot use op cache {path} ({_reason(exc)})")
                return
            aside = self._move_aside(path, exc)
            if aside is not None:
                try:
                    self._connect_and_load(path)
                except sqlite3.Error as again:
                    self._degrade(f"cannot use op cache {path} ({_reason(again)})")
        except OSError as exc:  # parent is a file, no permission to create the directory, ...
            self._degrade(f"cannot create op cache {path} ({exc.strerror or exc})")

    def _connect_and_load(self, path: Path) -> None:
        self._close()
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=LOCK_TIMEOUT_S)
        try:
            _ensure_schema(conn)
            rows = conn.execute(
                "SELECT key, seconds, source, pace FROM op_times"
                " WHERE device = ? AND torch = ? AND profiler = ?",
                self.scope,
            ).fetchall()
        except sqlite3.Error:
            conn.close()
            raise
        self.conn = conn
        for key, seconds, source, pace in rows:
            self.rows[key] = Row(float(seconds), source, float(pace))

    def _move_aside(self, path: Path, exc: sqlite3.Error) -> Path | None:
        self._close()
        aside = path.with_name(path.name + ".corrupt")
        try:
            os.replace(path, aside)
        except OSError as move_exc:
            self._degrade(
                f"op cache {path} is corrupt ({_reason(exc)}) and cannot be moved "
                f"aside ({move_exc.strerror or move_exc})"
            )
            return None
        _warn(
            f"op cache {path} was corrupt ({_reason(exc)}); moved it to {aside.name} and "
            "started a fresh one"
        )
        return aside

    def _degrade(self, why: str) -> None:
        self._close()
        _warn(f"{why}; keeping op times in memory for this run")

    def _close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    # --- use ----------------------------------------------------------------------------------

    def get(self, key: str) -> float | None:
        row = self.rows.get(key)
        return None if row is None else row.seconds

    def put(self, key: str, seconds: float, source: str, pace: float = 0.0) -> None:
        self.rows[key] = Row(seconds, source, pace)
        if self.conn is None:
            return
        try:
            self.conn.execute(
                "INSERT OR REPLACE INTO op_times VALUES (?, ?, ?, ?, ?, ?, ?)",
                (*self.scope, key, seconds, source, pace),
            )
            self._pending += 1
            if self._batch_depth == 0 or self._pending >= BATCH_ROWS:
                self._commit()
        except sqlite3.Error as exc:
            self._degrade(f"cannot write op cache {self.path} ({_reason(exc)})")

    def forget(self, keys: Iterable[str]) -> None:
        """Drop `keys` from this run's rows (asked for again, they are measured again and
        replace the file's rows)."""
        for key in keys:
            self.rows.pop(key, None)

    def _commit(self) -> None:
        if self.conn is not None and self._pending:
            self.conn.commit()
        self._pending = 0

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Group writes into few transactions (a commit per row would dominate profiling)."""
        self._batch_depth += 1
        try:
            yield
        finally:
            self._batch_depth -= 1
            if self._batch_depth == 0:
                try:
                    self._commit()
                except sqlite3.Error as exc:
                    self._degrade(f"cannot write op cache {self.path} ({_reason(exc)})")

    @property
    def persistent(self) -> bool:
        return self.conn is not None

    def close(self) -> None:
        with suppress(sqlite3.Error):
            self._commit()
        self._close()


def _reason(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _warn(message: str) -> None:
    """Warn once, attributed to the first caller outside magis/cost (the user's line)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, MagisWarning, stacklevel=level)
