"""Trials say why their result is suspect; one-time enrolment tokens for workers.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03

``suspect`` is the reason a complete trial's result lies far outside what other workers measured for the
same study (GPU model, shape, slot): its GEMM alone far faster than the fastest of theirs (issue 29).  Such a
result is kept, with its reason, and re-measured by another worker (`api.scheduler`).  NULL for every trial
before this revision, and for every result within what was seen.

``autotune_enrolments`` holds the SHA-256 of each enrolment token (`storage.enrolments`): one worker
registers with it, once, before it expires.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_trials") as batch:
        batch.add_column(sa.Column("suspect", sa.Text(), nullable=True))
    op.create_table(
        "autotune_enrolments",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("autotune_enrolments")
    with op.batch_alter_table("autotune_trials") as batch:
        batch.drop_column("suspect")
