"""Schema migrations with Alembic, configured in code (no alembic.ini to ship or find).

Our history lives in its own version table, `VERSION_TABLE`, because Optuna's `RDBStorage` keeps its own
Alembic history in the default ``alembic_version`` table of the same database; sharing that table would make
each tool see the other's revision as unknown.  `include_name` keeps Optuna's tables out of autogenerate, so a
new revision never proposes to drop them.  To write a new revision from model changes::

    with engine.connect() as conn:
        alembic.command.revision(alembic_config(connection=conn), message="...", autogenerate=True)
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, inspect, text

from storage.errors import wraps_driver_errors
from storage.models import TABLE_PREFIX

VERSION_TABLE = f"{TABLE_PREFIX}alembic_version"
MIGRATIONS_DIR = Path(__file__).parent / "migrations"
MIGRATION_LOCK_KEY = 0x6175746F74756E65  # "autotune": the advisory lock that serialises concurrent upgrades


def include_name(name: str | None, type_: str, _parent_names: object) -> bool:
    """Autogenerate sees only our tables (prefixed), never Optuna's."""
    return type_ != "table" or (name or "").startswith(TABLE_PREFIX)


def alembic_config(*, connection: Connection) -> Config:
    """An Alembic config that runs `MIGRATIONS_DIR` on ``connection`` (env.py reads it from ``attributes``)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


@wraps_driver_errors
def upgrade(*, engine: Engine, revision: str = "head") -> None:
    """Migrate the database to ``revision``; safe to call on every start (a no-op when already there).

    Several controllers may start at once against one database: the first takes a database-wide lock
    (a PostgreSQL advisory lock; SQLite's write lock via ``BEGIN IMMEDIATE``) and migrates, the others wait for
    it, then find the database at head.  Both backends run DDL inside the transaction, so a failed migration
    leaves nothing half-applied.
    """
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        elif connection.dialect.name == "sqlite":
            connection.exec_driver_sql("BEGIN IMMEDIATE")  # pysqlite would not BEGIN before DDL by itself
        command.upgrade(alembic_config(connection=connection), revision)


@wraps_driver_errors
def current_revision(*, engine: Engine) -> str | None:
    """The revision the database is at, None for a database we never migrated.

    Read straight from our version table: `/healthz` asks on every probe, and Alembic's MigrationContext
    would log two INFO lines each time.  Our history is linear, so the table holds one row at most.
    """
    with engine.connect() as connection:
        if not inspect(connection).has_table(VERSION_TABLE):
            return None
        return connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar_one_or_none()
