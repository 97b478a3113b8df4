"""Each best config row also keeps its slot's TE-exact winner.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02

``te_exact_config`` is the fastest config that TE runs exactly as measured (`OverlapConfig.to_dict()`) and
``te_exact_measurement`` its measurement; both NULL where none was measured, which every row before this
revision is (its export then says that the slot has no TE-exact measurement).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_best_configs") as batch:
        batch.add_column(sa.Column("te_exact_config", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("te_exact_measurement", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_best_configs") as batch:
        batch.drop_column("te_exact_measurement")
        batch.drop_column("te_exact_config")
