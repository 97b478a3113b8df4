"""Jobs say who will run their presets.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03

``consumer`` is megatron, bridge, te-layer or te-modules (`search_spaces.consumers`): the job view and the
dashboard show that consumer's joint winner.  NULL for a job that names none, which every job before this
revision is: those show the per-slot winners alone.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_jobs") as batch:
        batch.add_column(sa.Column("consumer", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_jobs") as batch:
        batch.drop_column("consumer")
