"""Trials as a work queue: the controller adds them, workers claim them under a lease and report back.

Optuna's own heartbeat only runs inside ``Study.optimize``, not with ask/tell, so the lease here is what
notices a dead worker: `expire_leases` fails every running trial whose lease ran out, and the controller tells
Optuna FAIL and asks the config again.

Every state change is one conditional UPDATE (``WHERE state = ... AND worker_id = ...``) rather than a read
followed by a write, which makes it atomic on both backends without locks held across a round trip.  The claim
picks its row with ``SELECT ... FOR UPDATE SKIP LOCKED`` inside that UPDATE: on PostgreSQL concurrent claimers
skip each other's rows instead of queueing on them; SQLite drops ``FOR UPDATE`` (it has no row locks) and
serialises writers on the database lock instead, so the same statement is an ``UPDATE ... WHERE id = (SELECT
... LIMIT 1) AND state = 'waiting' RETURNING`` claim there.  The ``state`` re-check in the outer WHERE is what
keeps a claim single on both: a row someone else claimed in between simply matches nothing.  None from a claim
means "nothing this worker can take right now" (rows locked by concurrent claimers are skipped): poll again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, exists, false, select, update
from sqlalchemy.orm import InstrumentedAttribute, Session, aliased

from overlap_runtime.errors import LeaseLost
from storage import secrets
from storage.errors import Conflict, NotFound, wraps_driver_errors
from storage.models import (
    ACTIVE_JOB_STATUSES,
    Backend,
    Job,
    LayerStudy,
    Purpose,
    Trial,
    TrialState,
    Worker,
    WorkerStatus,
    utcnow,
)
from storage.page import Page, paginate

LEASE_EXPIRED = "lease expired (worker lost)"


@dataclass(frozen=True, kw_only=True, slots=True)
class Claim:
    """A claimed trial with what the worker needs to run it: the slot (study) and the shape and backend (job)."""

    trial: Trial
    study: LayerStudy
    job: Job
    nonce: str
    """The lease's nonce (only its hash is stored): renewals and the result must repeat it."""


@wraps_driver_errors
def add_trial(
    *,
    session: Session,
    study_id: int,
    optuna_trial_number: int,
    config: Mapping[str, Any],
    purpose: Purpose = Purpose.SEARCH,
    now: datetime | None = None,
) -> Trial:
    """Queue a config the controller asked Optuna for (or a baseline / finalist re-run) as a waiting trial."""
    trial = Trial(
        study_id=study_id,
        optuna_trial_number=optuna_trial_number,
        purpose=Purpose(purpose),
        config=dict(config),
        state=TrialState.WAITING,
        attempts=0,
        created_at=now or utcnow(),
    )
    session.add(trial)
    session.commit()
    return trial


@wraps_driver_errors
def get_trial(*, session: Session, trial_id: int) -> Trial:
    trial = session.get(Trial, trial_id)
    if trial is None:
        raise NotFound(f"trial {trial_id} not found")
    return trial


@wraps_driver_errors
def list_trials(
    *,
    session: Session,
    job_id: str,
    limit: int = 50,
    offset: int = 0,
    study_id: int | None = None,
    state: TrialState | None = None,
) -> Page[Trial]:
    """A job's trials in the order they were queued, optionally of one study or in one state."""
    stmt = select(Trial).join(LayerStudy, LayerStudy.id == Trial.study_id).where(LayerStudy.job_id == job_id)
    if study_id is not None:
        stmt = stmt.where(Trial.study_id == study_id)
    if state is not None:
        stmt = stmt.where(Trial.state == state)
    return paginate(session=session, stmt=stmt.order_by(Trial.id), limit=limit, offset=offset)


@wraps_driver_errors
def claim_trial(*, session: Session, worker_id: str, lease: timedelta, now: datetime | None = None) -> Claim | None:
    """Atomically hand the oldest waiting trial this worker can run to it; None when there is none.

    The worker can run a trial when the job's backend is its backend (a te worker only with TE installed: its
    ``te_version``), the job's GPU model is unset or equals
    the worker's, the job's tp fits its GPU count (CPU workers run any tp on gloo ranks), and neither the job
    nor the slot's study has finished or been cancelled.  A claim also counts as the worker's heartbeat.
    """
    now = now or utcnow()
    worker = session.get(Worker, worker_id)
    if worker is None:
        raise NotFound(f"worker {worker_id!r} not found")
    nonce, nonce_hash = secrets.issue()
    candidate = aliased(Trial)
    pick = (
        select(candidate.id)
        .join(LayerStudy, LayerStudy.id == candidate.study_id)
        .join(Job, Job.id == LayerStudy.job_id)
        .where(candidate.state == TrialState.WAITING, *_runnable_by(worker, candidate))
        .order_by(candidate.id)
        .limit(1)
        .with_for_update(skip_locked=True, of=candidate)
        .scalar_subquery()
    )
    stmt = (
        update(Trial)
        .where(Trial.id == pick, Trial.state == TrialState.WAITING)
        .values(
            state=TrialState.RUNNING,
            worker_id=worker_id,
            lease_expires_at=now + lease,
            lease_nonce_hash=nonce_hash,
            attempts=Trial.attempts + 1,
            started_at=now,
        )
        .returning(Trial)
        .execution_options(populate_existing=True)
    )
    trial = session.scalars(stmt).one_or_none()
    if trial is None:
        session.commit()
        return None
    session.execute(update(Worker).where(Worker.id == worker_id).values(status=WorkerStatus.BUSY, last_heartbeat=now))
    study = session.get_one(LayerStudy, trial.study_id, populate_existing=True)
    job = session.get_one(Job, study.job_id, populate_existing=True)
    session.commit()
    return Claim(trial=trial, study=study, job=job, nonce=nonce)


def _runnable_by(worker: Worker, candidate: type[Trial]) -> list[ColumnElement[bool]]:
    """SQL conditions on the ``candidate`` trial and its joined job and study rows for trials ``worker`` can
    run.  A proposal whose result ``worker`` reported as suspect is re-measured by another worker, never by
    it (`api.scheduler`): a second row of the same study and Optuna trial number."""
    own_suspect = aliased(Trial)
    conditions = [
        ~exists().where(
            own_suspect.study_id == candidate.study_id,
            own_suspect.optuna_trial_number == candidate.optuna_trial_number,
            own_suspect.suspect.is_not(None),
            own_suspect.worker_id == worker.id,
        ),
        Job.status.in_(ACTIVE_JOB_STATUSES),
        LayerStudy.status.in_(ACTIVE_JOB_STATUSES),
        Job.backend == worker.backend,
        Job.gpu.is_(None) if worker.gpu_model is None else (Job.gpu.is_(None) | (Job.gpu == worker.gpu_model)),
    ]
    if worker.backend != Backend.CPU:
        conditions.append(Job.tp <= worker.n_gpus)
    if worker.backend == Backend.TE and worker.te_version is None:
        conditions.append(false())  # a te worker without TE runs nothing
    return conditions


@wraps_driver_errors
def renew_lease(
    *, session: Session, trial_id: int, worker_id: str, nonce: str, lease: timedelta, now: datetime | None = None
) -> datetime:
    """Extend the worker's lease on a running trial to ``now + lease``; `LeaseLost` if it no longer holds it
    (``nonce`` is the claim's: `Claim.nonce`)."""
    now = now or utcnow()
    stmt = (
        update(Trial)
        .where(Trial.id == trial_id, *_lease_held(worker_id, nonce, now))
        .values(lease_expires_at=now + lease)
        .returning(Trial.lease_expires_at)
    )
    expires = session.scalars(stmt).one_or_none()
    if expires is None:
        raise _lease_lost(session=session, trial_id=trial_id, worker_id=worker_id, nonce=nonce)
    session.commit()
    return expires


@wraps_driver_errors
def complete_trial(
    *,
    session: Session,
    trial_id: int,
    worker_id: str,
    nonce: str,
    measurement: Mapping[str, Any],
    suspect: str | None = None,
    now: datetime | None = None,
) -> Trial:
    """Store the worker's measurement and mark the trial complete, if the worker still holds its lease (the
    one ``nonce`` was handed out with); ``suspect``: why the result lies outside what was seen (`Trial.suspect`).

    A lease that ran out is lost even before `expire_leases` has run: from its expiry on, the controller is
    entitled to fail the trial and ask the config again, so a late result must not also count.
    """
    now = now or utcnow()
    values = {"state": TrialState.COMPLETE, "measurement": dict(measurement), "finished_at": now, "suspect": suspect}
    trial = _finish(session=session, trial_id=trial_id, conditions=_lease_held(worker_id, nonce, now), values=values)
    if trial is None:
        raise _lease_lost(session=session, trial_id=trial_id, worker_id=worker_id, nonce=nonce)
    _count(session=session, study_ids=[trial.study_id], counter=LayerStudy.n_complete)
    _worker_idle(session=session, worker_id=worker_id, now=now)
    session.commit()
    return trial


@wraps_driver_errors
def seen_gemm_ms(*, session: Session, trial_id: int, worker_id: str) -> list[float]:
    """Every ``gemm_ms`` that workers other than ``worker_id`` reported, unsuspected, in the study of
    ``trial_id``: how fast this GPU model runs this shape's slot GEMM alone, whatever the config (an Optuna study is one GPU model,
    shape and slot, shared by the jobs that ask for it, each with a `LayerStudy` row of its own)."""
    trial = get_trial(session=session, trial_id=trial_id)
    name = select(LayerStudy.optuna_study_name).where(LayerStudy.id == trial.study_id).scalar_subquery()
    studies = select(LayerStudy.id).where(LayerStudy.optuna_study_name == name)
    rows = session.scalars(
        select(Trial.measurement).where(
            Trial.study_id.in_(studies),
            Trial.state == TrialState.COMPLETE,
            Trial.worker_id != worker_id,
            Trial.suspect.is_(None),
        )
    )
    return [m["gemm_ms"] for row in rows if row for m in row.get("measurements", ()) if m.get("gemm_ms") is not None]


@wraps_driver_errors
def fail_trial(
    *,
    session: Session,
    trial_id: int,
    reason: str,
    worker_id: str | None = None,
    nonce: str = "",
    now: datetime | None = None,
) -> Trial:
    """Mark a trial failed with ``reason``.

    With ``worker_id`` (a worker reporting its own failure) the worker must hold the lease ``nonce`` was
    handed out with, else `LeaseLost`.
    Without it (the controller giving up on a trial) any waiting or running trial can be failed; failing one
    that already finished is a `Conflict`.
    """
    now = now or utcnow()
    values = {"state": TrialState.FAILED, "error": reason, "finished_at": now}
    if worker_id is None:
        conditions: list[ColumnElement[bool]] = [Trial.state.in_((TrialState.WAITING, TrialState.RUNNING))]
    else:
        conditions = _lease_held(worker_id, nonce, now)
    trial = _finish(session=session, trial_id=trial_id, conditions=conditions, values=values)
    if trial is None:
        if worker_id is not None:
            raise _lease_lost(session=session, trial_id=trial_id, worker_id=worker_id, nonce=nonce)
        current = get_trial(session=session, trial_id=trial_id)
        raise Conflict(f"trial {trial_id} is already {current.state.value}")
    _count(session=session, study_ids=[trial.study_id], counter=LayerStudy.n_failed)
    if worker_id is not None:
        _worker_idle(session=session, worker_id=worker_id, now=now)
    session.commit()
    return trial


@wraps_driver_errors
def release_trial(*, session: Session, trial_id: int, worker_id: str, nonce: str, now: datetime | None = None) -> Trial:
    """Hand a leased trial back to the queue at once (a worker told to stop: scancel, a pod's eviction), if
    ``worker_id`` still holds its lease with ``nonce``, else `LeaseLost`.

    The trial waits again as it was queued, for the next claim by any worker; nothing is told to the tuner,
    since nothing was measured.  Unlike a lease left to run out, no other worker waits the lease out first.
    """
    now = now or utcnow()
    values = {
        "state": TrialState.WAITING,
        "worker_id": None,
        "lease_expires_at": None,
        "lease_nonce_hash": None,
        "started_at": None,
    }
    trial = _finish(session=session, trial_id=trial_id, conditions=_lease_held(worker_id, nonce, now), values=values)
    if trial is None:
        raise _lease_lost(session=session, trial_id=trial_id, worker_id=worker_id, nonce=nonce)
    _worker_idle(session=session, worker_id=worker_id, now=now)
    session.commit()
    return trial


@wraps_driver_errors
def expire_leases(*, session: Session, now: datetime | None = None) -> list[Trial]:
    """Fail every running trial whose lease ended before ``now``, with reason `LEASE_EXPIRED`.

    Returns them so the controller can tell Optuna FAIL and ask their configs again; each one is returned by
    exactly one call, even with several controllers reaping at once.
    """
    now = now or utcnow()
    stmt = (
        update(Trial)
        .where(Trial.state == TrialState.RUNNING, Trial.lease_expires_at < now)
        .values(state=TrialState.FAILED, error=LEASE_EXPIRED, finished_at=now)
        .returning(Trial)
        .execution_options(populate_existing=True)
    )
    trials = sorted(session.scalars(stmt), key=lambda t: t.id)
    _count(session=session, study_ids=[t.study_id for t in trials], counter=LayerStudy.n_failed)
    session.commit()
    return trials


def _lease_held(worker_id: str, nonce: str, now: datetime) -> list[ColumnElement[bool]]:
    """The trial runs under this worker's live lease, the one ``nonce`` came with (a stored hash is compared
    in SQL: it is a hash of 256 random bits, so timing it tells nothing about the nonce)."""
    return [
        Trial.state == TrialState.RUNNING,
        Trial.worker_id == worker_id,
        Trial.lease_expires_at >= now,
        Trial.lease_nonce_hash == secrets.digest(nonce),
    ]


def _finish(
    *, session: Session, trial_id: int, conditions: list[ColumnElement[bool]], values: dict[str, Any]
) -> Trial | None:
    stmt = (
        update(Trial)
        .where(Trial.id == trial_id, *conditions)
        .values(values)
        .returning(Trial)
        .execution_options(populate_existing=True)
    )
    return session.scalars(stmt).one_or_none()


def _lease_lost(*, session: Session, trial_id: int, worker_id: str, nonce: str) -> LeaseLost:
    """Explain why ``worker_id`` does not hold the trial (raises `NotFound` for an unknown trial)."""
    trial = get_trial(session=session, trial_id=trial_id)
    if trial.state != TrialState.RUNNING:
        why = f"it is {trial.state.value}" + (f" ({trial.error})" if trial.error else "")
    elif trial.worker_id != worker_id:
        why = f"it is leased to worker {trial.worker_id!r}"
    elif not secrets.matches(nonce, trial.lease_nonce_hash):
        why = "the lease nonce is not the one its claim handed out"
    else:
        why = f"the lease expired at {trial.lease_expires_at.isoformat() if trial.lease_expires_at else '?'}"
    return LeaseLost(f"worker {worker_id!r} does not hold trial {trial_id}: {why}")


def _count(*, session: Session, study_ids: list[int], counter: InstrumentedAttribute[int]) -> None:
    """Add each study's number of newly finished trials to ``counter``, in SQL so concurrent adds are not lost."""
    for study_id, n in Counter(study_ids).items():
        session.execute(update(LayerStudy).where(LayerStudy.id == study_id).values({counter: counter + n}))


def _worker_idle(*, session: Session, worker_id: str, now: datetime) -> None:
    session.execute(update(Worker).where(Worker.id == worker_id).values(status=WorkerStatus.IDLE, last_heartbeat=now))
