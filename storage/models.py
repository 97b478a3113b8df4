"""The service's tables as SQLAlchemy 2 typed ORM classes.

Every table name starts with ``autotune_`` because Optuna's `RDBStorage` lives in the same database and owns
unprefixed names (``studies``, ``trials``, ``version_info``, ``alembic_version``, ...): an unprefixed
``trials`` of ours would collide with Optuna's.  Statuses are stored as short strings (not native PostgreSQL
enums) so adding a state later is a plain migration on SQLite and PostgreSQL alike.

Timestamps are timezone-aware UTC in Python on both backends: PostgreSQL stores ``timestamptz``; SQLite has no
time zone type, so `UTCDateTime` stores naive UTC text there and re-attaches UTC when reading.  ISO text of one
fixed format sorts like time, so lease comparisons work in SQL on SQLite too.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime, Dialect, Enum, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from autotune.tuner.proposal import Purpose
from overlap_runtime.knobs import Backend

TABLE_PREFIX = "autotune_"


def utcnow() -> datetime:
    """The one clock of the storage layer (callers may pass their own ``now`` instead, e.g. in tests)."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A datetime column that only accepts aware datetimes and always returns aware UTC ones."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"timestamps must be timezone-aware, but got naive {value.isoformat()}")
        value = value.astimezone(UTC)
        return value if dialect.name == "postgresql" else value.replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class JobStatus(enum.StrEnum):
    """Life of a job and of each of its layer studies; the last three are terminal."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE_JOB_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING)


class TrialState(enum.StrEnum):
    """A trial waits in the queue, runs under a worker's lease, then completes or fails."""

    WAITING = "waiting"
    RUNNING = "running"
    COMPLETE = "complete"
    FAILED = "failed"


class WorkerStatus(enum.StrEnum):
    """Busy while it holds a claimed trial; lost when its heartbeats stopped, stopped when it said it stops
    (Ctrl-C, SIGTERM, ``--exit-when-idle``); either comes back on its next heartbeat."""

    IDLE = "idle"
    BUSY = "busy"
    LOST = "lost"
    STOPPED = "stopped"


GONE_WORKER_STATUSES = (WorkerStatus.LOST, WorkerStatus.STOPPED)
"""Workers that run nothing until they speak again."""


def _enum(cls: type[enum.StrEnum]) -> Enum:
    """A VARCHAR(16) holding the enum's value, checked in Python, not a native database enum."""
    return Enum(cls, native_enum=False, length=16, values_callable=lambda e: [m.value for m in e])


class Base(DeclarativeBase):
    type_annotation_map = {  # noqa: RUF012 (SQLAlchemy reads this class attribute)
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[str]: JSON(),
        JobStatus: _enum(JobStatus),
        TrialState: _enum(TrialState),
        Purpose: _enum(Purpose),
        Backend: _enum(Backend),
        WorkerStatus: _enum(WorkerStatus),
    }


class Job(Base):
    """One tuning request: a shape, the slots to tune and how many trials each slot gets."""

    __tablename__ = f"{TABLE_PREFIX}jobs"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    shape: Mapped[dict[str, Any]]
    """The user's shape, as given (`ModelShape.as_given`)."""
    shape_key: Mapped[str] = mapped_column(String(128), index=True)
    """`ModelShape.key` of ``shape``."""
    tp: Mapped[int]
    """Copied out of ``shape`` so claims can filter on it in SQL without dialect-specific JSON access."""
    gpu: Mapped[str | None] = mapped_column(String(128))
    """GPU model name the job must run on (as NVML reports it), or None for any."""
    backend: Mapped[Backend]
    layers: Mapped[list[str]]
    n_trials: Mapped[int]
    """Trials per layer slot."""
    measure_first: Mapped[dict[str, Any] | None]
    """Slot -> the configs (`OverlapConfig.to_dict()`) the user asked to measure first; None when none."""
    consumer: Mapped[str | None] = mapped_column(String(16))
    """Who runs the job's presets (`search_spaces.consumers.Consumer`); None: the per-slot winners alone."""
    status: Mapped[JobStatus] = mapped_column(index=True)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(index=True)
    updated_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]


class LayerStudy(Base):
    """One Optuna study per (job, slot); the counters spare the API from counting trials on every poll."""

    __tablename__ = f"{TABLE_PREFIX}layer_studies"
    __table_args__ = (UniqueConstraint("job_id", "slot"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey(f"{TABLE_PREFIX}jobs.id", ondelete="CASCADE"), index=True)
    slot: Mapped[str] = mapped_column(String(32))
    optuna_study_name: Mapped[str] = mapped_column(String(512))
    status: Mapped[JobStatus]
    best_trial_id: Mapped[int | None] = mapped_column(
        # use_alter: studies and trials point at each other, so this key is added after both tables exist.
        ForeignKey(f"{TABLE_PREFIX}trials.id", ondelete="SET NULL", use_alter=True, name="fk_layer_studies_best_trial")
    )
    n_complete: Mapped[int] = mapped_column(default=0)
    n_failed: Mapped[int] = mapped_column(default=0)


class Trial(Base):
    """One measurement of one config, handed to a worker under a lease."""

    __tablename__ = f"{TABLE_PREFIX}trials"
    __table_args__ = (
        # The claim scans waiting trials in id order; the reaper scans running trials by lease.
        Index(f"ix_{TABLE_PREFIX}trials_state_id", "state", "id"),
        Index(f"ix_{TABLE_PREFIX}trials_state_lease", "state", "lease_expires_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    study_id: Mapped[int] = mapped_column(ForeignKey(f"{TABLE_PREFIX}layer_studies.id", ondelete="CASCADE"), index=True)
    optuna_trial_number: Mapped[int]
    """Not unique: a finalist re-measurement may repeat the number of the trial it re-measures."""
    purpose: Mapped[Purpose]
    config: Mapped[dict[str, Any]]
    state: Mapped[TrialState]
    measurement: Mapped[dict[str, Any] | None]
    error: Mapped[str | None] = mapped_column(Text)
    worker_id: Mapped[str | None] = mapped_column(ForeignKey(f"{TABLE_PREFIX}workers.id", ondelete="SET NULL"))
    lease_expires_at: Mapped[datetime | None]
    lease_nonce_hash: Mapped[str | None] = mapped_column(String(64))
    """SHA-256 of the nonce handed out with the current claim (`storage.secrets`): renewals and results must
    repeat the nonce, so a result counts only from the worker holding this very lease."""
    suspect: Mapped[str | None] = mapped_column(Text)
    """Why this complete trial's result lies far outside what other workers measured for its study
    (`storage.seen_gemm_ms`, `api.routes.workers`); never told to the tuner: another worker re-measures it
    (`api.scheduler`).  None: within."""
    attempts: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class BestConfig(Base):
    """The current winner per (gpu, shape key, slot); the shape columns make `get_best` a plain index scan."""

    __tablename__ = f"{TABLE_PREFIX}best_configs"
    __table_args__ = (
        UniqueConstraint("gpu", "shape_key", "slot"),
        Index(f"ix_{TABLE_PREFIX}best_configs_lookup", "hidden", "tp", "mbs", "seq"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    gpu: Mapped[str] = mapped_column(String(128))
    """GPU model the winner was measured on ("cpu" for the CPU backend); never null, it is part of the key."""
    shape_key: Mapped[str] = mapped_column(String(128))
    slot: Mapped[str] = mapped_column(String(32))
    hidden: Mapped[int]
    tp: Mapped[int]
    mbs: Mapped[int]
    seq: Mapped[int]
    dtype: Mapped[str] = mapped_column(String(16))
    shape: Mapped[dict[str, Any]]
    config: Mapped[dict[str, Any]]
    measurement: Mapped[dict[str, Any]]
    outcome: Mapped[dict[str, Any] | None]
    """The tuner's verdict on the slot (`SlotOutcome.to_dict()`: both winners, TE's default re-measured, the
    winner's spread, trial counts, notes); None for a row older than revision 0008 that had none."""
    trial_id: Mapped[int | None]
    """The trial row that measured the winner (the finalist batch, usually); None outside a service job."""
    te_exact_config: Mapped[dict[str, Any] | None]
    """The slot's second winner: the fastest config TE runs exactly as measured (`search_spaces.te_exact`);
    None when none was measured."""
    te_exact_measurement: Mapped[dict[str, Any] | None]
    job_id: Mapped[str | None] = mapped_column(ForeignKey(f"{TABLE_PREFIX}jobs.id", ondelete="SET NULL"))
    updated_at: Mapped[datetime]


class Worker(Base):
    """A registered worker process and what it can run."""

    __tablename__ = f"{TABLE_PREFIX}workers"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(256))
    host: Mapped[str] = mapped_column(String(256))
    gpus: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    """Inventory, one dict per GPU: name, memory, driver, nvlink, sm_count, ..."""
    gpu_model: Mapped[str | None] = mapped_column(String(128))
    """The model all its GPUs share (None for a CPU-only worker); claims match it against `Job.gpu`."""
    n_gpus: Mapped[int]
    backend: Mapped[Backend]
    te_version: Mapped[str | None] = mapped_column(String(64))
    """TransformerEngine's version where the worker's host has it installed, else None; te jobs run only on
    te workers that report one."""
    status: Mapped[WorkerStatus]
    registered_at: Mapped[datetime]
    last_heartbeat: Mapped[datetime] = mapped_column(index=True)
    secret_hash: Mapped[str | None] = mapped_column(String(64))
    """SHA-256 of the secret the worker got at registration (`storage.secrets`); worker calls carry it."""


class LeaderLease(Base):
    """Who holds a role that one controller process at a time may play (the scheduler), and until when.

    A row per role, taken and renewed by `storage.leader`: the holder renews ``expires_at`` while it is
    alive; once that passes, any other process may take the role over.  ``term`` counts the hand-overs, so a
    process can tell "I renewed my lease" from "I lost it and got it back" (its in-memory state is then stale).
    """

    __tablename__ = f"{TABLE_PREFIX}leader_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    """The role, e.g. ``"scheduler"``."""
    holder: Mapped[str] = mapped_column(String(256))
    """The process holding (or that last held) the role: ``host:pid:random``."""
    term: Mapped[int]
    """1 for the first holder, +1 every time the role is taken rather than renewed."""
    acquired_at: Mapped[datetime]
    """When the current term began."""
    expires_at: Mapped[datetime]
    """The role is free from this moment on unless the holder renews it first."""


class Enrolment(Base):
    """A one-time, short-lived token that registers one worker (`storage.enrolments`), kept as its hash."""

    __tablename__ = f"{TABLE_PREFIX}enrolments"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    used_at: Mapped[datetime | None]
    """When a worker registered with it; it registers nobody after that."""


class HealthProbe(Base):
    """The row ``/healthz`` writes to learn whether the database still takes writes (`storage.health`)."""

    __tablename__ = f"{TABLE_PREFIX}health_probes"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    at: Mapped[datetime | None]
