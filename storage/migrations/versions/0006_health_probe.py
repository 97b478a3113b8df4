"""A one-row table that ``/healthz`` writes, so the health check sees a database that can no longer write.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

A read-only database or a full disk still answers reads: a probe that only reads said "ok" while every
write failed (issue 21).  ``/healthz`` updates the row's ``at`` and commits, which fails exactly as a real
write would.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    table = op.create_table(
        "autotune_health_probes",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=True),
    )
    op.bulk_insert(table, [{"name": "health", "at": None}])


def downgrade() -> None:
    op.drop_table("autotune_health_probes")
