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

import dataclasses
import uuid
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Path, Response, status

import storage
from api.deps import (
    Admin,
    BestCacheDep,
    LeaseNonce,
    MetricsDep,
    Registration,
    SessionDep,
    SettingsDep,
    WakeDep,
    WorkerId,
)
from api.schemas import (
    ClaimPublic,
    EnrolmentCreate,
    EnrolmentCreated,
    ErrorPublic,
    LeasePublic,
    ProposalBody,
    TrialPublicState,
    TrialReport,
    WorkerCreate,
    WorkerCreated,
    WorkerPublic,
    WorkerRevoked,
)
from api.trial_rows import measurement_json, proposal_of
from overlap_runtime.errors import InputError
from overlap_runtime.measurement import MAX_REPORT_SAMPLES, check_physical, repeats_carried
from storage import Backend, secrets

router = APIRouter(prefix="/v1/workers", tags=["workers"])

TrialId = Annotated[int, Path(ge=1, le=(1 << 31) - 1)]
SUSPECT_SHARE = 0.5
"""A result of a GPU backend whose GEMM alone (``gemm_ms``, the library GEMM of the slot: the same problem
whatever the config) ran faster than this share of the fastest that other workers measured for the same GPU
model, shape and slot is suspect: two GPUs of one model differ by a few percent, not by 2x.  The GEMM, not
the overlap: a fast config is no lie, and physics ties the overlap to the GEMM (`check_physical`), so a
forged fast overlap needs a forged fast GEMM.  Never on the cpu backend: its workers' hosts differ, and a
loaded host times the same GEMM 2x slower than an idle one."""
SUSPECT_SEEN = 2
"""Results of other workers needed before a result can be called suspect: with fewer, too little was seen."""
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorPublic},
    404: {"model": ErrorPublic},
    409: {"model": ErrorPublic},
}


def _suspect(measurements: list[dict[str, Any]], seen: list[float]) -> str | None:
    """Why these measurements lie far outside ``seen`` (other workers' ``gemm_ms`` for the same study); None
    when they do not, or when too little was seen to tell."""
    if len(seen) < SUSPECT_SEEN:
        return None
    fastest = min(seen)
    for index, data in enumerate(measurements):
        gemm = data.get("gemm_ms")
        if gemm is not None and gemm < SUSPECT_SHARE * fastest:
            return (
                f"measurements.{index}.gemm_ms is {gemm:.6g} ms, under {SUSPECT_SHARE:g} x the fastest GEMM of "
                f"{len(seen)} results other workers measured for this GPU model, shape and slot ({fastest:.6g} ms)"
            )
    return None


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


@router.post(
    "/enrolments", status_code=status.HTTP_201_CREATED, dependencies=[Admin], responses={401: {"model": ErrorPublic}}
)
def enrol(body: EnrolmentCreate, session: SessionDep) -> EnrolmentCreated:
    """A one-time enrolment token: one worker registers with it (as with the worker token), once, within
    ``ttl_s``.  Shown this once; the controller keeps its hash."""
    token, expires_at = storage.issue_enrolment(session=session, ttl=timedelta(seconds=body.ttl_s))
    return EnrolmentCreated(token=token, expires_at=expires_at)


# The uuid converter: "/enrolments" is no worker id, so its path advertises POST alone (a 405's Allow).
@router.delete(
    "/{worker_id:uuid}", dependencies=[Admin], responses={401: {"model": ErrorPublic}, 404: {"model": ErrorPublic}}
)
def revoke_worker(worker_id: uuid.UUID, session: SessionDep, best_cache: BestCacheDep, wake: WakeDep) -> WorkerRevoked:
    """Revoke a worker: its secret ends (its next call is a 401), its leased trials wait again for other
    workers, and its complete trials are withdrawn from the studies and the winners (`storage.revocation`)."""
    revoked = storage.revoke_worker(session=session, worker_id=str(worker_id))
    best_cache.clear()  # this process answers /v1/best from the winners left at once; others within the cache's ttl
    wake()
    return WorkerRevoked(**dataclasses.asdict(revoked))


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
def claim(worker_id: WorkerId, session: SessionDep, settings: SettingsDep, wake: WakeDep) -> Response | ClaimPublic:
    """The oldest waiting trial this worker can run (backend, GPU model, tp), leased to it; 204 when none."""
    got = storage.claim_trial(session=session, worker_id=worker_id, lease=timedelta(seconds=settings.lease_s))
    if got is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    wake()  # the queue of waiting trials is one shorter: the scheduler tops it up for the other workers
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
def release(
    worker_id: WorkerId, trial_id: TrialId, nonce: LeaseNonce, session: SessionDep, wake: WakeDep
) -> TrialPublicState:
    """Hand the leased trial back to the queue now (a worker told to stop), rather than at its lease's end;
    409 once the worker no longer holds it."""
    trial = storage.release_trial(session=session, trial_id=trial_id, worker_id=worker_id, nonce=nonce)
    wake()
    return TrialPublicState(id=trial.id, state=trial.state.value)


@router.post("/{worker_id}/trials/{trial_id}/result", responses={**ERRORS, 422: {"model": ErrorPublic}})
def report(
    worker_id: WorkerId,
    trial_id: TrialId,
    nonce: LeaseNonce,
    body: TrialReport,
    session: SessionDep,
    metrics: MetricsDep,
    wake: WakeDep,
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
        wake()
        return TrialPublicState(id=trial.id, state=trial.state.value)
    measurements = body.measurements or []
    trial = storage.get_trial(session=session, trial_id=trial_id)
    expected = len(proposal_of(trial).configs)
    if len(measurements) != expected:
        raise InputError(
            "measurements", f"must hold one measurement per proposed config ({expected})", len(measurements)
        )
    dumped = [m.model_dump(exclude_unset=True) for m in measurements]
    carried = sum(map(repeats_carried, dumped))
    if carried > MAX_REPORT_SAMPLES:
        raise InputError(
            "measurements", f"must carry at most {MAX_REPORT_SAMPLES} repeats, baselines' included", carried
        )
    study = storage.get_layer_study(session=session, study_id=trial.study_id)
    job = storage.get_job(session=session, job_id=study.job_id)
    dtype = str(job.shape.get("dtype", "bf16"))
    for index, data in enumerate(dumped):
        try:
            check_physical(data, backend=job.backend.value, dtype=dtype)
        except InputError as e:
            raise InputError(f"measurements.{index}.{e.field}", e.rule, e.value) from None
    suspect = None
    if job.backend != Backend.CPU:  # every host's CPU is "cpu": no model whose speed other workers have shown
        suspect = _suspect(dumped, storage.seen_gemm_ms(session=session, trial_id=trial_id, worker_id=worker_id))
    trial = storage.complete_trial(
        session=session,
        trial_id=trial_id,
        worker_id=worker_id,
        nonce=nonce,
        measurement=measurement_json([m.model_dump() for m in measurements]),
        suspect=suspect,
    )
    metrics.observe_trial(trial)
    wake()  # the study is told the result and asks for its next config in this pass, not the next interval's
    return TrialPublicState(id=trial.id, state=trial.state.value)
