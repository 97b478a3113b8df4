"""Storage's exceptions, and the wrapper that turns driver errors into them.

Routes and workers catch `StorageError` and its subclasses only; they never see sqlite3, psycopg or
SQLAlchemy exceptions.  `NotFound` maps to HTTP 404, `Conflict` to 409, `LeaseLost` tells a worker to drop
its result (the trial is no longer its), any other `StorageError` is a 5xx.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

P = ParamSpec("P")
R = TypeVar("R")


class StorageError(RuntimeError):
    """The database refused or failed an operation; ``__cause__`` holds the driver's exception."""


class NotFound(StorageError, LookupError):
    """No row with that id: ``"job 'abc' not found"``."""


class Conflict(StorageError):
    """The row exists but is in a state that forbids the change (e.g. cancelling a finished job)."""


class LeaseLost(StorageError):
    """The worker no longer holds the trial: its lease expired or the trial went to someone else."""


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
