"""Engines and sessions: SQLite for one machine, PostgreSQL for scale-out.

SQLite gets WAL (readers never block the single writer), a busy timeout (a writer waits for the lock instead
of failing with "database is locked" at once; Optuna's issue #820 is the classic report), foreign keys (off by
default in SQLite) and ``synchronous=NORMAL`` (durable at each checkpoint, safe with WAL), set on every new
connection because SQLite keeps most of them per connection.  PostgreSQL gets ``pool_pre_ping`` so a pooled
connection the server dropped during a long trial is replaced instead of failing the next request
(Optuna issue #5600).  psycopg 3 is the only PostgreSQL driver we ship, so bare ``postgresql://`` URLs are
pointed at it.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker

from overlap_runtime.errors import InputError
from storage.errors import StorageError

APP_DIR_NAME = "overlap-autotune"
SQLITE_FILE_NAME = "autotune.db"
URL_FORMS = "sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
SQLITE_BUSY_TIMEOUT_MS = 30_000
"""Long enough for a writer to outwait a burst of claims from many local workers."""
SQLITE_JOURNAL_SIZE_LIMIT = 4 << 20
"""Bytes of ``-wal`` file a checkpoint leaves behind: SQLite otherwise keeps the WAL at its largest size
forever, space a full disk never gets back (`storage.health.reclaim` truncates it to zero)."""
SQLITE_FILE_MODE = 0o600
"""The database holds every result and the worker secrets' hashes: only its user reads it (SQLite gives its
``-wal`` and ``-shm`` files the database file's mode)."""


def default_sqlite_path() -> Path:
    """``$XDG_DATA_HOME/overlap-autotune/autotune.db`` (``~/.local/share/...`` when unset), as platformdirs does."""
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data_home) / APP_DIR_NAME / SQLITE_FILE_NAME


def create_engine_for(*, url: str | None = None) -> Engine:
    """An engine for ``url`` (``sqlite:///PATH`` or ``postgresql+psycopg://...``); None means the default SQLite file.

    The default SQLite file's folder is created if missing, so a first run just works; a URL given names a
    file in a folder that exists (`InputError` naming db_url otherwise: a missing folder is more often a
    typo than a wish, and creating it would hide the typo).
    """
    parsed = _parse_url(url or f"sqlite:///{default_sqlite_path()}")
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:" and not parsed.database.startswith("file:"):
            folder = Path(parsed.database).parent
            if url is not None and not folder.is_dir():
                rule = f"must name a file in an existing folder, but {folder} does not exist"
                raise InputError("db_url", f"{rule} (only the default database's folder is created)", url)
            try:
                _create_private(Path(parsed.database))
            except OSError as e:  # a read-only file system, a folder we may not write: say it is the database
                raise StorageError(f"cannot create the SQLite file {parsed.database}: {e.strerror or e}") from e
        engine = create_engine(parsed)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(parsed, pool_pre_ping=True)


def _parse_url(url: str) -> URL:
    """``url`` parsed, bare ``postgresql://`` pointed at psycopg; `InputError` naming db_url for a URL that is
    not one or names a database SQLAlchemy has no dialect for (``notadb://``): bad input, not a broken database."""
    try:
        parsed = make_url(url)
        if parsed.drivername in ("postgresql", "postgres"):
            parsed = parsed.set(drivername="postgresql+psycopg")
        parsed.get_dialect().import_dbapi()  # an unknown scheme or a missing driver fails here, not on first use
    except ArgumentError:  # NoSuchModuleError (no such dialect) is one
        raise InputError("db_url", f"must be {URL_FORMS}", url) from None
    except ImportError as e:  # a dialect whose driver is not installed (postgresql+psycopg2)
        raise InputError("db_url", f"needs the driver {e.name}, which is not installed; use {URL_FORMS}", url) from None
    return parsed


def _create_private(path: Path) -> None:
    """Create the SQLite file (and its folder) readable by its user only, before SQLite would create it
    with the umask's mode (world-readable, usually); an existing file keeps the mode its owner gave it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, SQLITE_FILE_MODE))
    except FileExistsError:
        return
    os.chmod(path, SQLITE_FILE_MODE)  # the umask may have taken bits O_CREAT was given: say it exactly


def _sqlite_pragmas(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA journal_size_limit={SQLITE_JOURNAL_SIZE_LIMIT}")
    finally:
        cursor.close()


def session_factory(*, engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit, so storage functions can return them to routes."""
    return sessionmaker(bind=engine, expire_on_commit=False)
