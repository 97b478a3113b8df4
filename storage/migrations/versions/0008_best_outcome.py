"""A best config row keeps the tuner's verdict in ``outcome`` and the winning trial in ``trial_id``.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03

Before, the service wrote ``spread`` as ``{"outcome": <SlotOutcome>, "trial_id": <id>}`` and `autotune tune`
wrote it as ``{"cv": ..., "repeats": ...}``: one column, two shapes, named after neither.  Both now write the
verdict whole (`storage.tuning.record_winner`).  Rows of the first shape keep their verdict and trial; rows of
the second had no verdict to keep (their cv and repeats are in ``measurement`` too) and get NULL.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None

TABLE = "autotune_best_configs"


def upgrade() -> None:
    with op.batch_alter_table(TABLE) as batch:
        batch.add_column(sa.Column("outcome", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("trial_id", sa.Integer(), nullable=True))
    bind = op.get_bind()
    rows = bind.execute(sa.text(f"SELECT id, spread FROM {TABLE} WHERE spread IS NOT NULL")).all()
    for row_id, spread in rows:
        old = _json(spread)
        if "outcome" in old:
            update = sa.text(f"UPDATE {TABLE} SET outcome = :outcome, trial_id = :trial_id WHERE id = :id")
            bind.execute(
                update.bindparams(sa.bindparam("outcome", type_=sa.JSON)),
                {"outcome": old["outcome"], "trial_id": old.get("trial_id"), "id": row_id},
            )
    with op.batch_alter_table(TABLE) as batch:
        batch.drop_column("spread")


def downgrade() -> None:
    with op.batch_alter_table(TABLE) as batch:
        batch.add_column(sa.Column("spread", sa.JSON(), nullable=True))
    bind = op.get_bind()
    rows = bind.execute(sa.text(f"SELECT id, outcome, trial_id FROM {TABLE} WHERE outcome IS NOT NULL")).all()
    for row_id, outcome, trial_id in rows:
        update = sa.text(f"UPDATE {TABLE} SET spread = :spread WHERE id = :id")
        bind.execute(
            update.bindparams(sa.bindparam("spread", type_=sa.JSON)),
            {"spread": {"outcome": _json(outcome), "trial_id": trial_id}, "id": row_id},
        )
    with op.batch_alter_table(TABLE) as batch:
        batch.drop_column("trial_id")
        batch.drop_column("outcome")


def _json(value: Any) -> dict[str, Any]:
    """A JSON column as read through plain SQL: text on SQLite, already decoded by psycopg on PostgreSQL."""
    return json.loads(value) if isinstance(value, str) else dict(value)
