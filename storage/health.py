"""What ``/healthz`` asks the database beyond "do you answer": can it still write, and, after a full disk,
give the space back.

SQLite in WAL mode appends every write to the ``-wal`` file and copies it into the database at checkpoints;
the file is reused, not shrunk, so after a disk filled up and space was freed, the WAL kept its size and
the next writes filled the freed space again (issue 21).  `reclaim` checkpoints and truncates the WAL to
zero bytes, and the engine's ``journal_size_limit`` (`storage.engine`) caps what an ordinary checkpoint
leaves behind.
"""

from __future__ import annotations

from sqlalchemy import Engine, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from storage.errors import wraps_driver_errors
from storage.models import HealthProbe, utcnow

PROBE = "health"


@wraps_driver_errors
def probe_read(*, session: Session) -> None:
    """Read once: raises `StorageError` when the database does not answer."""
    session.execute(select(1)).one()


@wraps_driver_errors
def probe_write(*, session: Session) -> None:
    """Write and commit one row: raises `StorageError` when the database takes no writes (read-only, full)."""
    session.execute(update(HealthProbe).where(HealthProbe.name == PROBE).values(at=utcnow()))
    session.commit()


def reclaim(*, engine: Engine) -> bool:
    """On SQLite, checkpoint the WAL into the database and truncate it to zero bytes, giving its space back
    to a disk that filled up; whether the checkpoint completed (False while readers pin the WAL, or the
    database cannot be written).  Nothing to do on PostgreSQL."""
    if engine.dialect.name != "sqlite":
        return True
    try:
        with engine.connect() as connection:
            busy, _, _ = connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()
    except SQLAlchemyError:
        return False
    return busy == 0
