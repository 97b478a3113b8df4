"""Workers: registration with their GPU inventory, heartbeats, and who has gone silent.

A worker that misses heartbeats is only marked lost here; the trial it held is failed separately, by
`storage.trials.expire_leases`, once its lease runs out.  Keeping the two apart means a worker stuck in a long
trial but still heartbeating is never mistaken for a dead one, and a trial is never failed twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, select, update
from sqlalchemy.orm import Session

from storage import secrets
from storage.errors import NotFound, wraps_driver_errors
from storage.models import GONE_WORKER_STATUSES, Backend, Worker, WorkerStatus, utcnow


@wraps_driver_errors
def register_worker(
    *,
    session: Session,
    name: str,
    host: str,
    gpus: Sequence[Mapping[str, Any]],
    gpu_model: str | None,
    n_gpus: int,
    backend: Backend,
    te_version: str | None = None,
    secret_hash: str | None = None,
    now: datetime | None = None,
) -> Worker:
    """Register a worker process under a new id (a restarted worker registers again: its old row goes lost).

    ``secret_hash`` (`storage.secrets.issue`) is what the worker's calls are checked against; a worker
    registered without one cannot authenticate over the API.
    """
    now = now or utcnow()
    worker = Worker(
        id=str(uuid.uuid4()),
        name=name,
        host=host,
        gpus=[dict(gpu) for gpu in gpus],
        gpu_model=gpu_model,
        n_gpus=n_gpus,
        backend=Backend(backend),
        te_version=te_version,
        status=WorkerStatus.IDLE,
        registered_at=now,
        last_heartbeat=now,
        secret_hash=secret_hash,
    )
    session.add(worker)
    session.commit()
    return worker


@wraps_driver_errors
def get_worker(*, session: Session, worker_id: str) -> Worker:
    worker = session.get(Worker, worker_id)
    if worker is None:
        raise NotFound(f"worker {worker_id!r} not found")
    return worker


@wraps_driver_errors
def authenticate_worker(*, session: Session, worker_id: str, secret: str) -> bool:
    """Whether ``secret`` is the one worker ``worker_id`` got at registration; `NotFound` for an unknown id."""
    return secrets.matches(secret, get_worker(session=session, worker_id=worker_id).secret_hash)


@wraps_driver_errors
def heartbeat(*, session: Session, worker_id: str, now: datetime | None = None) -> Worker:
    """Record that the worker is alive; a worker marked lost or stopped that speaks again comes back as idle."""
    status = case((Worker.status.in_(GONE_WORKER_STATUSES), WorkerStatus.IDLE), else_=Worker.status)
    return _heard_from(session=session, worker_id=worker_id, status=status, now=now)


@wraps_driver_errors
def stop_worker(*, session: Session, worker_id: str, now: datetime | None = None) -> Worker:
    """Record that the worker stopped cleanly: shown as stopped, never as lost (its heartbeats end on purpose)."""
    return _heard_from(session=session, worker_id=worker_id, status=WorkerStatus.STOPPED, now=now)


def _heard_from(*, session: Session, worker_id: str, status: Any, now: datetime | None) -> Worker:
    """Set the worker's status (a value or a SQL expression) and its last word's time; `NotFound` if unknown."""
    stmt = (
        update(Worker)
        .where(Worker.id == worker_id)
        .values(last_heartbeat=now or utcnow(), status=status)
        .returning(Worker)
        .execution_options(populate_existing=True)
    )
    worker = session.scalars(stmt).one_or_none()
    if worker is None:
        raise NotFound(f"worker {worker_id!r} not found")
    session.commit()
    return worker


@wraps_driver_errors
def list_workers(*, session: Session, status: WorkerStatus | None = None) -> list[Worker]:
    """All workers (a fleet is tens of rows, so no pagination), most recently heard from first."""
    stmt = select(Worker).order_by(Worker.last_heartbeat.desc(), Worker.id)
    if status is not None:
        stmt = stmt.where(Worker.status == status)
    return list(session.scalars(stmt))


@wraps_driver_errors
def mark_lost_workers(*, session: Session, timeout: timedelta, now: datetime | None = None) -> list[Worker]:
    """Mark lost every worker not heard from for longer than ``timeout``; returns the newly lost ones."""
    now = now or utcnow()
    stmt = (
        update(Worker)
        .where(Worker.status.not_in(GONE_WORKER_STATUSES), Worker.last_heartbeat < now - timeout)
        .values(status=WorkerStatus.LOST)
        .returning(Worker)
        .execution_options(populate_existing=True)
    )
    workers = sorted(session.scalars(stmt), key=lambda w: w.id)
    session.commit()
    return workers
