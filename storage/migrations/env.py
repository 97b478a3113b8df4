"""Alembic environment: runs on the connection `storage.migrate.alembic_config` hands over, online only."""

from __future__ import annotations

from alembic import context

from storage.migrate import VERSION_TABLE, include_name
from storage.models import Base

context.configure(
    connection=context.config.attributes["connection"],
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    include_name=include_name,
    # SQLite cannot ALTER most things; batch mode rebuilds the table instead. A no-op on PostgreSQL.
    render_as_batch=True,
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
