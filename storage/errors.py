"""Storage's exceptions, and the wrapper that turns driver errors into them.

Routes and workers catch `StorageError`, its subclasses and `LeaseLost` (a worker's lost claim, defined in
`overlap_runtime.errors` since the REST client raises it too) only; they never see sqlite3, psycopg or
SQLAlchemy exceptions.  `api/errors.py` answers `NotFound` with 404,
`Conflict` with 409 and any other `StorageError` with 503 (docs/rest.md).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from overlap_runtime.errors import AutotuneError

P = ParamSpec("P")
R = TypeVar("R")


class StorageError(AutotuneError, RuntimeError):
    """The database refused or failed an operation; ``__cause__`` holds the driver's exception."""


class NotFound(StorageError, LookupError):
    """No row with that id: ``"job 'abc' not found"``."""


class Conflict(StorageError):
    """The row exists but is in a state that forbids the change (e.g. cancelling a finished job)."""


_PUBLIC_REASONS = (
    (("readonly", "read-only", "read only"), "the database is read-only"),
    (("database or disk is full", "no space left", "disk full", "could not extend file"), "the disk is full"),
    (("locked", "lock timeout", "deadlock"), "the database is busy"),
)


def public_reason(error: BaseException) -> str:
    """What went wrong with the database in words an unauthenticated caller may read: a driver's message
    names the server's host and port, its user and the statement, none of which the 503 of a public
    endpoint should show (the controller's log has the whole message)."""
    text = str(error).lower()
    for needles, reason in _PUBLIC_REASONS:
        if any(needle in text for needle in needles):
            return reason
    return "the database does not answer"


def wraps_driver_errors(func: Callable[P, R]) -> Callable[P, R]:
    """Roll back the ``session`` keyword argument on any error; re-raise SQLAlchemy errors as `StorageError`.

    Rolling back here means a failed call leaves nothing half-written and the caller's session usable
    (SQLAlchemy otherwise refuses every later statement until someone rolls back).
    """

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except Exception as e:
            session = kwargs.get("session")
            if isinstance(session, Session):
                with contextlib.suppress(SQLAlchemyError):  # a dead connection cannot roll back; e says why
                    session.rollback()
            if isinstance(e, SQLAlchemyError):
                cause = getattr(e, "orig", None) or e
                raise StorageError(f"{func.__name__} failed: {type(cause).__name__}: {cause}") from e
            raise

    return wrapper
