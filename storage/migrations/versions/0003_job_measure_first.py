"""Jobs carry the configs their user asked to measure first.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02

``measure_first`` maps a slot to the configs (`OverlapConfig.to_dict()`) that seed its study; NULL for the
jobs that ask for none, which every job before this revision is.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_jobs") as batch:
        batch.add_column(sa.Column("measure_first", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_jobs") as batch:
        batch.drop_column("measure_first")
