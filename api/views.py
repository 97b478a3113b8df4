"""Response bodies assembled from storage rows: a job with its progress and per-slot best, a page of trials.

Kept apart from the routes so the server-sent events and the job endpoint build one and the same view.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

import storage
from api.fit import waiting_reason
from api.schemas import (
    BestSoFar,
    JobPublic,
    JobSummary,
    OverlapConfigBody,
    Progress,
    ProposalBody,
    SlotPublic,
    TrialPublic,
)
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
    """Trials done over trials planned, and the fraction the bar shows; never more than 100%, and 100% only
    with every trial planned done.

    A slot plans ``n_trials`` while it runs and, once decided, exactly the trials it ran: early stopping ends a
    slot sooner (a job of 60 trials per slot may finish after 42), finalist re-measurements come on top, and a
    slot decided in an earlier job's study runs none here.  Counting ``n_trials`` for a decided slot was how
    a finished job showed "100%" beside "42/60 trials".
    """
    done = total = 0
    fractions = []
    for study in studies:
        ran = study.n_complete + study.n_failed
        if study.status in (JobStatus.QUEUED, JobStatus.RUNNING):
            planned = max(job.n_trials, ran)
            fractions.append(UNFINISHED_CAP * min(1.0, ran / job.n_trials))
        else:
            planned = ran
            fractions.append(1.0)
        done += ran
        total += planned
    unstarted = len(job.layers) - len(studies)  # a queued job has no studies yet
    total += unstarted * job.n_trials
    fraction = sum(fractions) / len(job.layers) if job.layers else 0.0
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
    return BestSoFar(
        trial_id=trial_id, config=OverlapConfigBody.model_validate(row.config), measurement=row.measurement, final=True
    )


def _best_so_far(*, session: Session, study: LayerStudy) -> BestSoFar | None:
    if study.best_trial_id is None:
        return None
    trial = storage.get_trial(session=session, trial_id=study.best_trial_id)
    best = fastest(trial)
    if best is None:
        return None
    config, measurement = best
    return BestSoFar(
        trial_id=trial.id, config=OverlapConfigBody.model_validate(config), measurement=measurement, final=False
    )


def trial_view(trial: Trial, *, slots: dict[int, str]) -> TrialPublic:
    return TrialPublic(
        id=trial.id,
        slot=slots.get(trial.study_id, "?"),
        optuna_trial_number=trial.optuna_trial_number,
        purpose=trial.purpose.value,
        state=trial.state.value,
        config=ProposalBody.model_validate(trial.config),
        measurement=trial.measurement,
        error=trial.error,
        worker_id=trial.worker_id,
        attempts=trial.attempts,
        created_at=trial.created_at,
        started_at=trial.started_at,
        finished_at=trial.finished_at,
    )
