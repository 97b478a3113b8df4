"""Jobs: what a user asked to tune, and where it stands.

Status changes are conditional UPDATEs (``... WHERE status IN (queued, running)``), never read-then-write, so
a user's cancel and the controller's "succeeded" cannot both win: whichever commits first makes the other's
WHERE match nothing, and the loser gets `Conflict`.  Once terminal, a job stays terminal.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from overlap_runtime.config import OverlapConfig
from overlap_runtime.shape import ModelShape
from storage.errors import Conflict, NotFound, wraps_driver_errors
from storage.models import ACTIVE_JOB_STATUSES, Backend, Job, JobStatus, LayerStudy, utcnow
from storage.page import Page, paginate


@wraps_driver_errors
def create_job(
    *,
    session: Session,
    shape: ModelShape,
    layers: Sequence[str],
    n_trials: int,
    backend: Backend,
    gpu: str | None = None,
    measure_first: Mapping[str, Sequence[OverlapConfig]] | None = None,
    consumer: str | None = None,
    now: datetime | None = None,
) -> Job:
    """Queue a job; its layer studies are added by the controller when it picks the job up.

    ``measure_first``: per slot, configs that seed the slot's study when it is created (`first_configs`).
    ``consumer``: who runs its presets (the job view shows that consumer's joint winner).
    """
    now = now or utcnow()
    job = Job(
        id=str(uuid.uuid4()),
        shape=shape.as_given(),
        shape_key=shape.key,
        tp=shape.tp,
        gpu=gpu,
        backend=Backend(backend),
        layers=list(layers),
        n_trials=n_trials,
        measure_first=None
        if measure_first is None
        else {slot: [c.to_dict() for c in configs] for slot, configs in measure_first.items()},
        consumer=consumer,
        status=JobStatus.QUEUED,
        created_at=now,
        updated_at=now,
    )
    session.add(job)
    session.commit()
    return job


def first_configs(job: Job, slot: str) -> tuple[OverlapConfig, ...]:
    """The configs the job's user asked to measure first on ``slot``."""
    return tuple(OverlapConfig.from_dict(c) for c in (job.measure_first or {}).get(slot, ()))


@wraps_driver_errors
def get_job(*, session: Session, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id!r} not found")
    return job


NEWEST_FIRST = (Job.created_at.desc(), Job.id.desc())


@wraps_driver_errors
def jobs_in(*, session: Session, status: JobStatus) -> list[Job]:
    """Every job in ``status``, newest first, in one query: what the scheduler drives on each pass (`list_jobs`
    pages and counts, which cost an idle pass more CPU than all of its other queries)."""
    return list(session.scalars(select(Job).where(Job.status == status).order_by(*NEWEST_FIRST)))


@wraps_driver_errors
def list_jobs(
    *, session: Session, limit: int = 50, offset: int = 0, status: JobStatus | None = None, id_prefix: str | None = None
) -> Page[Job]:
    """Newest first, so the first page is what a dashboard wants to show; ``id_prefix`` keeps the jobs whose
    id starts with it (the 8 characters the dashboard shows, say)."""
    stmt = select(Job).order_by(*NEWEST_FIRST)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if id_prefix is not None:
        stmt = stmt.where(Job.id.startswith(id_prefix.lower(), autoescape=True))
    return paginate(session=session, stmt=stmt, limit=limit, offset=offset)


@wraps_driver_errors
def set_job_status(
    *,
    session: Session,
    job_id: str,
    status: JobStatus,
    error: str | None = None,
    gpu: str | None = None,
    now: datetime | None = None,
) -> Job:
    """Move an active job to ``status`` (``finished_at`` is stamped on a terminal one); `Conflict` if it already
    ended.  ``gpu``, when given, replaces the job's GPU (the full model name its short one resolved to)."""
    now = now or utcnow()
    status = JobStatus(status)
    values: dict[str, object] = {"status": status, "updated_at": now}
    if error is not None:
        values["error"] = error
    if gpu is not None:
        values["gpu"] = gpu
    if status not in ACTIVE_JOB_STATUSES:
        values["finished_at"] = now
    return _update_active_job(session=session, job_id=job_id, values=values)


@wraps_driver_errors
def cancel_job(*, session: Session, job_id: str, now: datetime | None = None) -> Job:
    """Cancel an active job and its active layer studies.

    Its waiting trials stay in the table but are never claimed (claims skip inactive jobs); trials already
    running finish and their results are kept, so nothing measured is thrown away.
    """
    now = now or utcnow()
    values = {"status": JobStatus.CANCELLED, "updated_at": now, "finished_at": now}
    job = _update_active_job(session=session, job_id=job_id, values=values, commit=False)
    session.execute(
        update(LayerStudy)
        .where(LayerStudy.job_id == job_id, LayerStudy.status.in_(ACTIVE_JOB_STATUSES))
        .values(status=JobStatus.CANCELLED)
    )
    session.commit()
    return job


def _update_active_job(*, session: Session, job_id: str, values: dict[str, object], commit: bool = True) -> Job:
    stmt = (
        update(Job)
        .where(Job.id == job_id, Job.status.in_(ACTIVE_JOB_STATUSES))
        .values(values)
        .returning(Job)
        .execution_options(populate_existing=True)
    )
    job = session.scalars(stmt).one_or_none()
    if job is None:
        current = get_job(session=session, job_id=job_id)
        raise Conflict(f"job {job_id!r} is already {current.status.value}; a finished job cannot change status")
    if commit:
        session.commit()
    return job
