"""Leader leases: which controller process runs the scheduler.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

One small table of our own (prefixed like the rest, so Optuna's tables are never touched); see
`storage.leader` for how a row is taken and renewed.  Types are spelled out, as in 0001.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "autotune_leader_leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=256), nullable=False),
        sa.Column("term", sa.Integer(), nullable=False),
        sa.Column("acquired_at", TIMESTAMP, nullable=False),
        sa.Column("expires_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("autotune_leader_leases")
