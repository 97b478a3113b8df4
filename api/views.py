"""Response bodies assembled from storage rows: a job with its progress and per-slot best, a page of trials.

Kept apart from the routes so the server-sent events and the job endpoint build one and the same view.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

import storage
from api.fit import waiting_reason
from api.schemas import BestSoFar, JobPublic, JobSummary, Progress, SlotPublic, TrialPublic
from api.trial_rows import fastest
from overlap_runtime.shape import ModelShape
from storage import BestConfig, Job, JobStatus, LayerStudy, Trial

UNFINISHED_CAP = 0.99
"""A slot that ran all its trials still owes its finalists: progress shows 99% until it is decided."""


def job_view(*, session: Session, job: Job) -> JobPublic:
    """The job, its progress and each slot's best config so far (the final winner once decided)."""
    studies = storage.list_layer_studies(session=session, job_id=job.id)
    winners = _winners(session=session, job=job)
    slots = [
        SlotPublic(
            slot=study.slot,
            status=study.status.value,
            n_complete=study.n_complete,
            n_failed=study.n_failed,
            best=winners.get(study.slot) or _best_so_far(session=session, study=study),
        )
        for study in studies
    ]
    return JobPublic(
        **JobSummary.model_validate(job).model_dump(),
        progress=_progress(job=job, studies=studies),
        slots=slots,
        waiting_reason=waiting_reason(job, storage.list_workers(session=session)),
    )


def _progress(*, job: Job, studies: list[LayerStudy]) -> Progress:
    done = sum(s.n_complete + s.n_failed for s in studies)
    total = job.n_trials * len(job.layers)
    if job.status == JobStatus.SUCCEEDED:
        fraction = 1.0
    else:
        per_slot = [
            1.0
            if s.status not in (JobStatus.QUEUED, JobStatus.RUNNING)
            else UNFINISHED_CAP * min(1.0, (s.n_complete + s.n_failed) / job.n_trials)
            for s in studies
        ]
        fraction = sum(per_slot) / len(job.layers) if job.layers else 0.0
    return Progress(done=done, total=total, fraction=round(fraction, 4))


def _winners(*, session: Session, job: Job) -> dict[str, BestSoFar]:
    """The slots this job has decided, from the best configs it wrote (a later job may since have replaced them)."""
    if job.status == JobStatus.QUEUED:
        return {}
    shape = ModelShape(**job.shape)
    rows = storage.get_best(session=session, shape=shape, dtype=shape.dtype)
    return {row.slot: _winner(row) for row in rows if row.job_id == job.id}


def _winner(row: BestConfig) -> BestSoFar:
    trial_id = (row.spread or {}).get("trial_id")
    return BestSoFar(trial_id=trial_id, config=row.config, measurement=row.measurement, final=True)


def _best_so_far(*, session: Session, study: LayerStudy) -> BestSoFar | None:
    if study.best_trial_id is None:
        return None
    trial = storage.get_trial(session=session, trial_id=study.best_trial_id)
    best = fastest(trial)
    if best is None:
        return None
    config, measurement = best
    return BestSoFar(trial_id=trial.id, config=config, measurement=measurement, final=False)


def trial_view(trial: Trial, *, slots: dict[int, str]) -> TrialPublic:
    return TrialPublic(
        id=trial.id,
        slot=slots.get(trial.study_id, "?"),
        optuna_trial_number=trial.optuna_trial_number,
        purpose=trial.purpose.value,
        state=trial.state.value,
        config=trial.config,
        measurement=trial.measurement,
        error=trial.error,
        worker_id=trial.worker_id,
        attempts=trial.attempts,
        created_at=trial.created_at,
        started_at=trial.started_at,
        finished_at=trial.finished_at,
    )
