"""Response bodies assembled from storage rows: a job with its progress and per-slot best, a page of trials.

Kept apart from the routes so the server-sent events and the job endpoint build one and the same view.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

import storage
from api.fit import waiting_reason
from api.lookup import rows_view
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
from search_spaces.consumers import Consumer
from search_spaces.te_exact import is_te_exact
from storage import BestConfig, Job, JobStatus, LayerStudy, Trial, TrialState
from storage.page import MAX_PAGE_SIZE

UNFINISHED_CAP = 0.99
"""A slot that ran all its trials still owes its finalists: progress shows 99% until it is decided."""


def job_view(*, session: Session, job: Job) -> JobPublic:
    """The job, its progress and each slot's best config so far (the final winner once decided)."""
    studies = storage.list_layer_studies(session=session, job_id=job.id)
    rows = _winner_rows(session=session, job=job)
    exact_so_far = _te_exact_so_far(session=session, job=job) if len(rows) < len(studies) else {}
    slots = [
        SlotPublic(
            slot=study.slot,
            status=study.status.value,
            n_complete=study.n_complete,
            n_failed=study.n_failed,
            best=_winner(rows[study.slot]) if study.slot in rows else _best_so_far(session=session, study=study),
            te_exact=_te_exact_winner(rows[study.slot]) if study.slot in rows else exact_so_far.get(study.id),
        )
        for study in studies
    ]
    decided = bool(studies) and all(study.slot in rows for study in studies)
    choice = rows_view(list(rows.values()), Consumer(job.consumer)) if job.consumer and decided else None
    return JobPublic(
        **JobSummary.model_validate(job).model_dump(),
        progress=_progress(job=job, studies=studies),
        slots=slots,
        consumer_choice=choice,
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


def _winner_rows(*, session: Session, job: Job) -> dict[str, BestConfig]:
    """The best config rows this job wrote, per slot it decided (a later job may since have replaced them)."""
    if job.status == JobStatus.QUEUED:
        return {}
    shape = ModelShape(**job.shape)
    rows = storage.get_best(session=session, shape=shape, dtype=shape.dtype)
    return {row.slot: row for row in rows if row.job_id == job.id}


def _winner(row: BestConfig) -> BestSoFar:
    trial_id = row.trial_id
    return BestSoFar(
        trial_id=trial_id, config=OverlapConfigBody.model_validate(row.config), measurement=row.measurement, final=True
    )


def _te_exact_winner(row: BestConfig) -> BestSoFar | None:
    if row.te_exact_config is None or row.te_exact_measurement is None:
        return None
    config = OverlapConfigBody.model_validate(row.te_exact_config)
    return BestSoFar(trial_id=None, config=config, measurement=row.te_exact_measurement, final=True)


def _te_exact_so_far(*, session: Session, job: Job) -> dict[int, BestSoFar]:
    """Per study of the job, the fastest valid TE-exact measurement of its completed trials so far."""
    tp = ModelShape(**job.shape).tp
    found: dict[int, tuple[float, BestSoFar]] = {}
    offset = 0
    while True:
        page = storage.list_trials(
            session=session, job_id=job.id, state=TrialState.COMPLETE, limit=MAX_PAGE_SIZE, offset=offset
        )
        for trial in page.items:
            best = fastest(trial, where=lambda config: is_te_exact(config, tp))
            if best is None:
                continue
            config, measurement = best
            ms, held = measurement.get("overlap_ms"), found.get(trial.study_id)
            if ms is not None and (held is None or ms < held[0]):
                body = OverlapConfigBody.model_validate(config)
                so_far = BestSoFar(trial_id=trial.id, config=body, measurement=measurement, final=False)
                found[trial.study_id] = (ms, so_far)
        offset += len(page.items)
        if not page.items or offset >= page.total:
            return {study_id: so_far for study_id, (_, so_far) in found.items()}


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
        suspect=trial.suspect,
        worker_id=trial.worker_id,
        attempts=trial.attempts,
        created_at=trial.created_at,
        started_at=trial.started_at,
        finished_at=trial.finished_at,
    )
