"""The cache's optuna storage, opened so that a fault in it never stops a run.

    >>> from autofit.search.storage import default_storage, open_storage
    >>> storage = open_storage(default_storage())  # None (warned): go on without the cache

The cache is a convenience: whatever is wrong with it, a tuning run or a check
goes on, after ONE warning line on the ``autofit`` logger (``cache_warning``) that
names the file and what was done about it:

* a garbage or truncated ``studies.db`` (SQLite: "file is not a database", "database
  disk image is malformed"): moved aside to ``studies.db.corrupt-<UTC time>`` and a
  fresh one is started (without the cache when it cannot be moved);
* a cache folder that cannot be created or written (read-only, a file in the way):
  the run goes on without the cache;
* two first-ever runs creating the tables at once ("table studies already exists",
  a duplicate alembic version row): the loser opens the tables the winner made;
* "database is locked": SQLite waits ``BUSY_TIMEOUT_S`` for the other writer.

A fault met later, while reading or writing (``is_cache_fault``), is handled by the
caller the same way: one warning, then on without the cache.

Known limitations:
    NB: running as root, a read-only cache folder is writable (root ignores file
    modes): such a cache is used as if it were writable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

__all__ = ["default_storage", "open_storage", "connect", "sqlite_path", "is_cache_fault",
           "FaultGuard",
           "cache_warning", "error_line", "BUSY_TIMEOUT_S"]

logger = logging.getLogger("autofit")

BUSY_TIMEOUT_S = 30.0  # how long SQLite waits for another process's write to end
_OPEN_TRIES = 6  # racing first runs: the loser's retry finds the tables made
# SQLite's words for a file that is not (or no longer) a database
_CORRUPT = ("file is not a database", "malformed", "not a database", "file is encrypted")
# what two processes meet when they create the tables at once, or write at once
_RACE = ("already exists", "unique constraint failed", "database is locked")


def default_storage() -> str:
    """``sqlite:///<cache dir>/studies.db``; the dir is $AUTOFIT_CACHE_DIR or ~/.cache/autofit.

    The folder is made by ``open_storage`` (where a failure is a warning, not an error).
    """
    from autofit.probe.versions import cache_dir

    return f"sqlite:///{cache_dir() / 'studies.db'}"


def sqlite_path(url: str) -> Path | None:
    """The database file of a ``sqlite:///`` URL; None for another storage or ``:memory:``."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        return None
    rest = url[len(prefix):].split("?", 1)[0]
    return Path(rest) if rest and rest != ":memory:" else None


def cache_warning(message: str) -> None:
    """The one warning line of a cache fault (logger ``autofit``; the run goes on)."""
    logger.warning("%s", message)


def is_cache_fault(e: BaseException) -> bool:
    """Whether ``e`` comes from the cache's storage (the database, its file or folder)."""
    import optuna

    try:
        from sqlalchemy.exc import SQLAlchemyError
    except ImportError:  # pragma: no cover - optuna's RDB storage needs it
        SQLAlchemyError = ()  # type: ignore[assignment,misc]  # noqa: N806
    return isinstance(e, (SQLAlchemyError, sqlite3.Error, OSError,
                          optuna.exceptions.StorageInternalError))


class FaultGuard:
    """Runs a cache's operations: the first cache fault is one warning, then the cache is off.

    ``guard(default, fn, *args)`` is ``fn(*args)``, or ``default`` once the cache broke;
    errors that are not cache faults pass through.
    """

    def __init__(self, what: str) -> None:
        self.what = what  # "autofit cache <path>": how the warning names the cache
        self.broken = False

    def __call__(self, default: Any, fn: Any, *args: Any) -> Any:
        if self.broken:
            return default
        try:
            return fn(*args)
        except Exception as e:
            if not is_cache_fault(e):
                raise
            self.broken = True
            cache_warning(f"{self.what} failed ({error_line(e)}); going on without the cache")
            return default


def error_line(e: BaseException) -> str:
    """One line of an error: the driver's message, without SQLAlchemy's SQL and links."""
    orig = getattr(e, "orig", None)
    text = str(orig if orig is not None else e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _sqlite_problem(path: Path) -> str | None:
    """Why an existing SQLite file cannot be used as a database (None: usable or absent).

    ``PRAGMA quick_check`` reads every page (a few ms for a cache of some MiB), so a
    truncated file is found here, not in the middle of a run.
    """
    if not path.exists():
        return None
    if path.is_dir():
        return "a folder is in the way of the database file"
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S)
        try:
            rows = con.execute("PRAGMA quick_check").fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        msg = str(e)
        return msg if any(w in msg.lower() for w in _CORRUPT) else None
    if rows and rows[0][0] != "ok":
        return f"database disk image is malformed ({rows[0][0]})"
    return None


def _move_aside(path: Path) -> Path | None:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}-{os.getpid()}")
    try:
        path.rename(target)
    except OSError:
        return None
    for suffix in ("-journal", "-wal", "-shm"):  # SQLite's side files belong to the old one
        side = path.with_name(path.name + suffix)
        if side.exists():
            with contextlib.suppress(OSError):
                side.rename(target.with_name(target.name + suffix))
    return target


def _prepare_file(path: Path) -> bool:
    """The folder made, a corrupt file moved aside; False: run without the cache (warned)."""
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        cache_warning(f"autofit cache folder {folder} cannot be created ({e.strerror or e}); "
                      "running without the cache (set AUTOFIT_CACHE_DIR to a writable folder)")
        return False
    if not os.access(folder, os.W_OK | os.X_OK):
        cache_warning(f"autofit cache folder {folder} is read-only; running without the cache "
                      "(set AUTOFIT_CACHE_DIR to a writable folder)")
        return False
    problem = _sqlite_problem(path)
    if problem is None:
        return True
    if path.is_dir():
        cache_warning(f"autofit cache {path}: {problem}; running without the cache (remove it "
                      "or set AUTOFIT_CACHE_DIR to another folder)")
        return False
    moved = _move_aside(path)
    if moved is None:
        cache_warning(f"autofit cache {path} is unreadable ({problem}) and cannot be moved "
                      "aside; running without the cache (delete it to start a fresh one)")
        return False
    cache_warning(f"autofit cache {path} was unreadable ({problem}); moved it to {moved.name} "
                  "and started a fresh one")
    return True


def connect(url: str) -> Any:
    """optuna's ``RDBStorage`` for ``url``, retrying what racing runs meet (tables made
    at once, a locked database); the last error is raised when the retries run out."""
    from optuna.storages import RDBStorage

    kwargs = {"connect_args": {"timeout": BUSY_TIMEOUT_S}} if url.startswith("sqlite") else {}
    for attempt in range(_OPEN_TRIES):
        try:
            return RDBStorage(url, engine_kwargs=kwargs)
        except Exception as e:
            if attempt == _OPEN_TRIES - 1 or not any(w in error_line(e).lower() for w in _RACE):
                raise
            time.sleep(0.1 * (attempt + 1))  # the other run is making the tables: let it end
    raise AssertionError("unreachable")  # pragma: no cover


def open_storage(url: str | None) -> Any:
    """An optuna storage for ``url`` (None: in memory), or None after one warning line.

    See the module docstring for the faults survived and how.
    """
    import optuna

    if url is None:
        return optuna.storages.InMemoryStorage()
    path = sqlite_path(url)
    if path is not None and not _prepare_file(path):
        return None
    try:
        return connect(url)
    except Exception as e:  # noqa: BLE001 - any fault of the cache is a warning
        cache_warning(f"autofit cache {path if path is not None else url} cannot be opened "
                      f"({error_line(e)}); running without the cache")
        return None
