"""Workers authenticate with a secret of their own, and each lease carries a nonce.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02

``autotune_workers.secret_hash`` is the SHA-256 of the secret a worker got at registration: worker calls
carry the secret, not the clients' token, so a client cannot speak as a worker whose id it read from
``GET /v1/workers``.  ``autotune_trials.lease_nonce_hash`` is the SHA-256 of the nonce handed out with a claim:
renewals and results must repeat it, so only the claim's holder can report on that lease.  Rows from before
this revision have neither: such a worker registers again, such a lease runs out.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_workers") as batch:
        batch.add_column(sa.Column("secret_hash", sa.String(64), nullable=True))
    with op.batch_alter_table("autotune_trials") as batch:
        batch.add_column(sa.Column("lease_nonce_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_trials") as batch:
        batch.drop_column("lease_nonce_hash")
    with op.batch_alter_table("autotune_workers") as batch:
        batch.drop_column("secret_hash")
