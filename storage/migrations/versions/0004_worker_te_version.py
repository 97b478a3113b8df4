"""Workers report whether TransformerEngine is installed.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02

``te_version`` is TE's version on the worker's host, NULL without TE (every worker before this revision):
the scheduler places te jobs only on te workers that report one.  The ``te`` backend itself is a new value
of the backend columns, which hold short strings checked in Python, so it needs no change here.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_workers") as batch:
        batch.add_column(sa.Column("te_version", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_workers") as batch:
        batch.drop_column("te_version")
