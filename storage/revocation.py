"""Revoking a worker (issue 29): its secret ends, its leased trials go back to the queue, and its results leave
the studies and the winners.

A worker that reported forged numbers, or whose host was compromised, is found after the fact; what it
measured is then worth nothing.  Its complete trials become failed with `REVOKED` as their reason (kept,
with their measurements, for whoever audits them), so no view, count or re-derivation takes them again; a
study whose best trial was one of them has none, and a winner measured by one of them is removed, so
``GET /v1/best`` answers from the winners left.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, update
from sqlalchemy.orm import Session

from storage.errors import wraps_driver_errors
from storage.models import BestConfig, LayerStudy, Trial, TrialState, WorkerStatus, utcnow
from storage.workers import get_worker

REVOKED = "revoked: the worker that measured it was revoked, its results withdrawn"


@dataclass(frozen=True, kw_only=True, slots=True)
class Revocation:
    """What revoking one worker changed."""

    worker_id: str
    requeued: int
    """Trials it held a lease on, waiting again for any other worker."""
    withdrawn: int
    """Its complete trials, now failed with `REVOKED`."""
    winners_removed: int
    """Best configs it had measured, removed."""


@wraps_driver_errors
def revoke_worker(*, session: Session, worker_id: str) -> Revocation:
    """Revoke ``worker_id`` in one transaction; `NotFound` for an unknown worker.  Revoking twice is harmless
    (the second finds nothing left to change)."""
    worker = get_worker(session=session, worker_id=worker_id)
    worker.secret_hash = None  # `secrets.matches` takes no secret against nothing: its next call is a 401
    worker.status = WorkerStatus.LOST
    requeued = session.scalars(
        update(Trial)
        .where(Trial.worker_id == worker_id, Trial.state == TrialState.RUNNING)
        .values(state=TrialState.WAITING, worker_id=None, lease_expires_at=None, lease_nonce_hash=None, started_at=None)
        .returning(Trial.id)
    ).all()
    withdrawn = list(
        session.execute(
            update(Trial)
            .where(Trial.worker_id == worker_id, Trial.state == TrialState.COMPLETE)
            .values(state=TrialState.FAILED, error=REVOKED, finished_at=utcnow())
            .returning(Trial.id, Trial.study_id)
        )
    )
    ids = [row.id for row in withdrawn]
    for row in withdrawn:
        session.execute(
            update(LayerStudy)
            .where(LayerStudy.id == row.study_id)
            .values(n_complete=LayerStudy.n_complete - 1, n_failed=LayerStudy.n_failed + 1)
        )
    session.execute(update(LayerStudy).where(LayerStudy.best_trial_id.in_(ids)).values(best_trial_id=None))
    removed = session.scalars(delete(BestConfig).where(BestConfig.trial_id.in_(ids)).returning(BestConfig.id)).all()
    session.commit()
    return Revocation(worker_id=worker_id, requeued=len(requeued), withdrawn=len(ids), winners_removed=len(removed))
