"""Response bodies assembled from storage rows: a job with its progress and per-slot best, a page of trials.

Kept apart from the routes so the server-sent events and the job endpoint build one and the same view.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

import storage
from api.schemas import BestSoFar, JobPublic, JobSummary, Progress, SlotPublic, TrialPublic
from api.trial_rows import fastest
from overlap_runtime.shape import ModelShape
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
    return JobPublic(
        **JobSummary.model_validate(job).model_dump(), progress=_progress(job=job, studies=studies), slots=slots
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


def _winner_rows(*, session: Session, job: Job) -> dict[str, BestConfig]:
    """The best config rows this job wrote, per slot it decided (a later job may since have replaced them)."""
    if job.status == JobStatus.QUEUED:
        return {}
    shape = ModelShape(**job.shape)
    rows = storage.get_best(session=session, shape=shape, dtype=shape.dtype)
    return {row.slot: row for row in rows if row.job_id == job.id}


def _winner(row: BestConfig) -> BestSoFar:
    trial_id = (row.spread or {}).get("trial_id")
    return BestSoFar(trial_id=trial_id, config=row.config, measurement=row.measurement, final=True)


def _te_exact_winner(row: BestConfig) -> BestSoFar | None:
    if row.te_exact_config is None or row.te_exact_measurement is None:
        return None
    return BestSoFar(trial_id=None, config=row.te_exact_config, measurement=row.te_exact_measurement, final=True)


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
                so_far = BestSoFar(trial_id=trial.id, config=config, measurement=measurement, final=False)
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
