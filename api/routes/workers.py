"""Workers: register with a GPU inventory, heartbeat, claim a trial under a lease, renew it, report back.

Workers hold no database credentials: everything goes through these endpoints with the controller's bearer
token.  A claim is atomic in storage (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, a single ``UPDATE ...
RETURNING`` on SQLite), so two workers never get the same trial.  A result is accepted only while the
worker still holds the lease: once it has run out the controller may have asked the config again, and a
late result must not count twice.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Path, Response, status

import storage
from api.deps import Authorized, MetricsDep, SessionDep, SettingsDep
from api.schemas import (
    ClaimPublic,
    ErrorPublic,
    LeasePublic,
    ProposalBody,
    TrialPublicState,
    TrialReport,
    WorkerCreate,
    WorkerPublic,
)
from api.trial_rows import measurement_json, proposal_of
from overlap_runtime.errors import InputError
from storage import Backend

router = APIRouter(prefix="/v1/workers", tags=["workers"])

TrialId = Annotated[int, Path(ge=1, le=(1 << 31) - 1)]
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorPublic},
    404: {"model": ErrorPublic},
    409: {"model": ErrorPublic},
}


@router.get("")
def list_workers(session: SessionDep) -> list[WorkerPublic]:
    """Every registered worker with its inventory, most recently heard from first."""
    return [WorkerPublic.model_validate(w) for w in storage.list_workers(session=session)]


@router.post("", status_code=status.HTTP_201_CREATED, dependencies=[Authorized], responses=ERRORS)
def register_worker(body: WorkerCreate, session: SessionDep) -> WorkerPublic:
    """Register a worker process; a restarted worker registers again and gets a new id."""
    worker = storage.register_worker(
        session=session,
        name=body.name,
        host=body.host,
        gpus=[g.model_dump() for g in body.gpus],
        gpu_model=body.gpu_model,
        n_gpus=body.n_gpus,
        backend=Backend(body.backend),
        te_version=body.te_version,
    )
    return WorkerPublic.model_validate(worker)


@router.post("/{worker_id}/heartbeat", dependencies=[Authorized], responses=ERRORS)
def heartbeat(worker_id: uuid.UUID, session: SessionDep) -> WorkerPublic:
    return WorkerPublic.model_validate(storage.heartbeat(session=session, worker_id=str(worker_id)))


@router.post(
    "/{worker_id}/claim",
    dependencies=[Authorized],
    response_model=ClaimPublic,
    responses={**ERRORS, 204: {"description": "Nothing this worker can run now"}},
)
def claim(worker_id: uuid.UUID, session: SessionDep, settings: SettingsDep) -> Response | ClaimPublic:
    """The oldest waiting trial this worker can run (backend, GPU model, tp), leased to it; 204 when none."""
    got = storage.claim_trial(session=session, worker_id=str(worker_id), lease=timedelta(seconds=settings.lease_s))
    if got is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    assert got.trial.lease_expires_at is not None  # claim_trial leases what it returns
    return ClaimPublic(
        trial_id=got.trial.id,
        job_id=got.job.id,
        slot=got.study.slot,
        shape=got.job.shape,
        backend=got.job.backend.value,
        proposal=ProposalBody.model_validate(got.trial.config),
        lease_expires_at=got.trial.lease_expires_at,
        lease_s=settings.lease_s,
    )


@router.post("/{worker_id}/trials/{trial_id}/renew", dependencies=[Authorized], responses=ERRORS)
def renew(worker_id: uuid.UUID, trial_id: TrialId, session: SessionDep, settings: SettingsDep) -> LeasePublic:
    """Extend the lease while measuring; 409 once the worker no longer holds it (drop the trial then)."""
    expires = storage.renew_lease(
        session=session, trial_id=trial_id, worker_id=str(worker_id), lease=timedelta(seconds=settings.lease_s)
    )
    return LeasePublic(lease_expires_at=expires)


@router.post(
    "/{worker_id}/trials/{trial_id}/result",
    dependencies=[Authorized],
    responses={**ERRORS, 422: {"model": ErrorPublic}},
)
def report(
    worker_id: uuid.UUID, trial_id: TrialId, body: TrialReport, session: SessionDep, metrics: MetricsDep
) -> TrialPublicState:
    """Store the measurements (one per proposed config, in order) or the failure; 409 if the lease was lost."""
    given = [name for name in ("measurements", "failure") if name in body.model_fields_set]
    if len(given) != 1:
        raise InputError("measurements", "give exactly one of measurements and failure", given or None)
    if getattr(body, given[0]) is None:
        raise InputError(given[0], "must not be null")
    if body.failure is not None:
        trial = storage.fail_trial(session=session, trial_id=trial_id, reason=body.failure, worker_id=str(worker_id))
        metrics.observe_trial(trial)
        return TrialPublicState(id=trial.id, state=trial.state.value)
    measurements = body.measurements or []
    expected = len(proposal_of(storage.get_trial(session=session, trial_id=trial_id)).configs)
    if len(measurements) != expected:
        raise InputError(
            "measurements", f"must hold one measurement per proposed config ({expected})", len(measurements)
        )
    trial = storage.complete_trial(
        session=session,
        trial_id=trial_id,
        worker_id=str(worker_id),
        measurement=measurement_json([m.model_dump() for m in measurements]),
    )
    metrics.observe_trial(trial)
    return TrialPublicState(id=trial.id, state=trial.state.value)
