"""Workers: register with a GPU inventory, heartbeat, claim a trial under a lease, renew it, report back.

Workers hold no database credentials.  They register with the controller's worker token (the clients' token
where it has none: `api.deps.require_registration`) and get a secret of their own in the answer; every later
call of that worker carries the secret (`api.deps.require_worker`), so neither the shared token nor a worker
id read from ``GET /v1/workers`` lets anyone speak for a worker.  A claim is atomic in storage
(``FOR UPDATE SKIP LOCKED`` on PostgreSQL, a single ``UPDATE ... RETURNING`` on SQLite), so two workers never
get the same trial, and it hands out a nonce for that lease.  A renewal or result is accepted only from the
worker that holds the lease, with the lease's nonce, while the lease is live: once it has run out the
controller may have asked the config again, and a late result must not count twice.  A result is checked
against physics before it is stored (`check_physical`): a time no GPU could produce is a 422, never a best
config.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Path, Response, status

import storage
from api.deps import LeaseNonce, MetricsDep, Registration, SessionDep, SettingsDep, WorkerId
from api.schemas import (
    ClaimPublic,
    ErrorPublic,
    LeasePublic,
    ProposalBody,
    TrialPublicState,
    TrialReport,
    WorkerCreate,
    WorkerCreated,
    WorkerPublic,
)
from api.trial_rows import measurement_json, proposal_of
from overlap_runtime.errors import InputError
from overlap_runtime.measurement import check_physical
from storage import Backend, secrets

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


@router.post("", status_code=status.HTTP_201_CREATED, dependencies=[Registration], responses=ERRORS)
def register_worker(body: WorkerCreate, session: SessionDep) -> WorkerCreated:
    """Register a worker process; a restarted worker registers again and gets a new id.  The answer holds the
    worker's ``secret``, shown this once: the worker's own calls authenticate with it."""
    secret, secret_hash = secrets.issue()
    worker = storage.register_worker(
        session=session,
        name=body.name,
        host=body.host,
        gpus=[g.model_dump() for g in body.gpus],
        gpu_model=body.gpu_model,
        n_gpus=body.n_gpus,
        backend=Backend(body.backend),
        te_version=body.te_version,
        secret_hash=secret_hash,
    )
    return WorkerCreated(**WorkerPublic.model_validate(worker).model_dump(), secret=secret)


@router.post("/{worker_id}/heartbeat", responses=ERRORS)
def heartbeat(worker_id: WorkerId, session: SessionDep) -> WorkerPublic:
    return WorkerPublic.model_validate(storage.heartbeat(session=session, worker_id=worker_id))


@router.post("/{worker_id}/stop", responses=ERRORS)
def stop(worker_id: WorkerId, session: SessionDep) -> WorkerPublic:
    """The worker stops cleanly (Ctrl-C, SIGTERM, ``--exit-when-idle``): it is shown as stopped, not lost; a
    heartbeat brings it back."""
    return WorkerPublic.model_validate(storage.stop_worker(session=session, worker_id=worker_id))


@router.post(
    "/{worker_id}/claim",
    response_model=ClaimPublic,
    responses={**ERRORS, 204: {"description": "Nothing this worker can run now"}},
)
def claim(worker_id: WorkerId, session: SessionDep, settings: SettingsDep) -> Response | ClaimPublic:
    """The oldest waiting trial this worker can run (backend, GPU model, tp), leased to it; 204 when none."""
    got = storage.claim_trial(session=session, worker_id=worker_id, lease=timedelta(seconds=settings.lease_s))
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
        lease_nonce=got.nonce,
    )


@router.post("/{worker_id}/trials/{trial_id}/renew", responses=ERRORS)
def renew(
    worker_id: WorkerId, trial_id: TrialId, nonce: LeaseNonce, session: SessionDep, settings: SettingsDep
) -> LeasePublic:
    """Extend the lease while measuring; 409 once the worker no longer holds it (drop the trial then)."""
    expires = storage.renew_lease(
        session=session, trial_id=trial_id, worker_id=worker_id, nonce=nonce, lease=timedelta(seconds=settings.lease_s)
    )
    return LeasePublic(lease_expires_at=expires)


@router.post("/{worker_id}/trials/{trial_id}/release", responses=ERRORS)
def release(worker_id: WorkerId, trial_id: TrialId, nonce: LeaseNonce, session: SessionDep) -> TrialPublicState:
    """Hand the leased trial back to the queue now (a worker told to stop), rather than at its lease's end;
    409 once the worker no longer holds it."""
    trial = storage.release_trial(session=session, trial_id=trial_id, worker_id=worker_id, nonce=nonce)
    return TrialPublicState(id=trial.id, state=trial.state.value)


@router.post("/{worker_id}/trials/{trial_id}/result", responses={**ERRORS, 422: {"model": ErrorPublic}})
def report(
    worker_id: WorkerId,
    trial_id: TrialId,
    nonce: LeaseNonce,
    body: TrialReport,
    session: SessionDep,
    metrics: MetricsDep,
) -> TrialPublicState:
    """Store the measurements (one per proposed config, in order) or the failure; 409 if the lease was lost,
    422 for a measurement no GPU could have made (`check_physical`, naming the field)."""
    given = [name for name in ("measurements", "failure") if name in body.model_fields_set]
    if len(given) != 1:
        raise InputError("measurements", "give exactly one of measurements and failure", given or None)
    if getattr(body, given[0]) is None:
        raise InputError(given[0], "must not be null")
    if body.failure is not None:
        trial = storage.fail_trial(
            session=session, trial_id=trial_id, reason=body.failure, worker_id=worker_id, nonce=nonce
        )
        metrics.observe_trial(trial)
        return TrialPublicState(id=trial.id, state=trial.state.value)
    measurements = body.measurements or []
    trial = storage.get_trial(session=session, trial_id=trial_id)
    expected = len(proposal_of(trial).configs)
    if len(measurements) != expected:
        raise InputError(
            "measurements", f"must hold one measurement per proposed config ({expected})", len(measurements)
        )
    dumped = [m.model_dump(exclude_unset=True) for m in measurements]
    study = storage.get_layer_study(session=session, study_id=trial.study_id)
    backend = storage.get_job(session=session, job_id=study.job_id).backend.value
    for index, data in enumerate(dumped):
        try:
            check_physical(data, backend=backend)
        except InputError as e:
            raise InputError(f"measurements.{index}.{e.field}", e.rule, e.value) from None
    trial = storage.complete_trial(
        session=session,
        trial_id=trial_id,
        worker_id=worker_id,
        nonce=nonce,
        measurement=measurement_json([m.model_dump() for m in measurements]),
    )
    metrics.observe_trial(trial)
    return TrialPublicState(id=trial.id, state=trial.state.value)
