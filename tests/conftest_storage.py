"""Database fixtures for the storage conformance suite: a fresh SQLite file and a fresh PostgreSQL database.

PostgreSQL is the server at 127.0.0.1:5432 (trust auth), here and in CI.  Each test gets its own uniquely named
database, created from the ``test`` database and dropped afterwards, so tests never see each other's rows and
parallel runs never collide.  An unreachable server fails the test with the reason: the suite exists to run
against a real PostgreSQL, so skipping would hide exactly what it is for.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

import storage

PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
PG_ADMIN_DATABASE = "test"


@pytest.fixture(scope="session")
def pg_admin() -> Iterator[Engine]:
    """An autocommit connection pool to the ``test`` database (CREATE/DROP DATABASE cannot run in a transaction)."""
    engine = create_engine(f"{PG_SERVER}/{PG_ADMIN_DATABASE}", isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except OperationalError as e:
        pytest.fail(
            f"PostgreSQL at {PG_SERVER}/{PG_ADMIN_DATABASE} is unreachable; the storage suite needs it for real "
            f"(start it, e.g. `pg_ctlcluster 15 main start`): {e.orig}",
            pytrace=False,
        )
    yield engine
    engine.dispose()


def _new_database(pg_admin: Engine, prefix: str) -> Iterator[str]:
    """URL of a new, empty PostgreSQL database, dropped (connections and all) once the caller resumes this."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with pg_admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield f"{PG_SERVER}/{name}"
    with pg_admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def postgres_url(pg_admin: Engine) -> Iterator[str]:
    """URL of a new, empty PostgreSQL database, dropped after the test."""
    yield from _new_database(pg_admin, "autotune_storage")


@pytest.fixture(scope="module")
def module_postgres_url(pg_admin: Engine) -> Iterator[str]:
    """URL of a new, empty PostgreSQL database that the tests of one module share (a controller they share runs
    on it), dropped after them."""
    yield from _new_database(pg_admin, "autotune_module")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """URL of a new SQLite file under the test's temporary folder."""
    return f"sqlite:///{tmp_path / 'autotune.db'}"


@pytest.fixture(scope="module")
def module_sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """URL of a new SQLite file that the tests of one module share."""
    return f"sqlite:///{tmp_path_factory.mktemp('module_sqlite') / 'autotune.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Each test that asks for it runs twice: on SQLite and on PostgreSQL."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """A migrated database."""
    engine = storage.create_engine_for(url=db_url)
    storage.upgrade(engine=engine)
    yield engine
    engine.dispose()


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    with storage.session_factory(engine=engine)() as session:
        yield session
