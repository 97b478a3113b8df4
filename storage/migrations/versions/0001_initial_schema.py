"""Initial schema: jobs, layer studies, trials, best configs, workers.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Column types are spelled out here rather than imported from `storage.models`, so this revision keeps meaning
the same schema when the models change later.  Status columns are VARCHAR(16) (the models' non-native enums).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

STATUS = sa.String(length=16)
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "autotune_jobs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("shape", sa.JSON(), nullable=False),
        sa.Column("shape_key", sa.String(length=128), nullable=False),
        sa.Column("tp", sa.Integer(), nullable=False),
        sa.Column("gpu", sa.String(length=128), nullable=True),
        sa.Column("backend", STATUS, nullable=False),
        sa.Column("layers", sa.JSON(), nullable=False),
        sa.Column("n_trials", sa.Integer(), nullable=False),
        sa.Column("status", STATUS, nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_autotune_jobs_created_at", "autotune_jobs", ["created_at"])
    op.create_index("ix_autotune_jobs_shape_key", "autotune_jobs", ["shape_key"])
    op.create_index("ix_autotune_jobs_status", "autotune_jobs", ["status"])

    op.create_table(
        "autotune_workers",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("host", sa.String(length=256), nullable=False),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.Column("gpu_model", sa.String(length=128), nullable=True),
        sa.Column("n_gpus", sa.Integer(), nullable=False),
        sa.Column("backend", STATUS, nullable=False),
        sa.Column("status", STATUS, nullable=False),
        sa.Column("registered_at", TIMESTAMP, nullable=False),
        sa.Column("last_heartbeat", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_autotune_workers_last_heartbeat", "autotune_workers", ["last_heartbeat"])

    op.create_table(
        "autotune_best_configs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("gpu", sa.String(length=128), nullable=False),
        sa.Column("shape_key", sa.String(length=128), nullable=False),
        sa.Column("slot", sa.String(length=32), nullable=False),
        sa.Column("hidden", sa.Integer(), nullable=False),
        sa.Column("tp", sa.Integer(), nullable=False),
        sa.Column("mbs", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("shape", sa.JSON(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("measurement", sa.JSON(), nullable=False),
        sa.Column("spread", sa.JSON(), nullable=True),
        sa.Column("job_id", sa.String(length=36), nullable=True),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["autotune_jobs.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("gpu", "shape_key", "slot"),
    )
    op.create_index("ix_autotune_best_configs_lookup", "autotune_best_configs", ["hidden", "tp", "mbs", "seq"])

    op.create_table(
        "autotune_layer_studies",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("slot", sa.String(length=32), nullable=False),
        sa.Column("optuna_study_name", sa.String(length=512), nullable=False),
        sa.Column("status", STATUS, nullable=False),
        sa.Column("best_trial_id", sa.Integer(), nullable=True),
        sa.Column("n_complete", sa.Integer(), nullable=False),
        sa.Column("n_failed", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["autotune_jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "slot"),
    )
    op.create_index("ix_autotune_layer_studies_job_id", "autotune_layer_studies", ["job_id"])

    op.create_table(
        "autotune_trials",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("optuna_trial_number", sa.Integer(), nullable=False),
        sa.Column("purpose", STATUS, nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("state", STATUS, nullable=False),
        sa.Column("measurement", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("worker_id", sa.String(length=36), nullable=True),
        sa.Column("lease_expires_at", TIMESTAMP, nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=True),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.ForeignKeyConstraint(["study_id"], ["autotune_layer_studies.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["worker_id"], ["autotune_workers.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_autotune_trials_state_id", "autotune_trials", ["state", "id"])
    op.create_index("ix_autotune_trials_state_lease", "autotune_trials", ["state", "lease_expires_at"])
    op.create_index("ix_autotune_trials_study_id", "autotune_trials", ["study_id"])

    # Studies and trials point at each other: the study's best-trial key can only exist once trials does.
    # Batch mode makes this a table rebuild on SQLite (no ALTER ADD CONSTRAINT there), a plain ALTER elsewhere.
    with op.batch_alter_table("autotune_layer_studies") as batch_op:
        batch_op.create_foreign_key(
            "fk_layer_studies_best_trial", "autotune_trials", ["best_trial_id"], ["id"], ondelete="SET NULL"
        )


def downgrade() -> None:
    with op.batch_alter_table("autotune_layer_studies") as batch_op:
        batch_op.drop_constraint("fk_layer_studies_best_trial", type_="foreignkey")
    op.drop_table("autotune_trials")
    op.drop_table("autotune_layer_studies")
    op.drop_table("autotune_best_configs")
    op.drop_table("autotune_workers")
    op.drop_table("autotune_jobs")
