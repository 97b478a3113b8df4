"""Layer studies: one Optuna study per (job, slot), tracked beside the job so progress is one query.

`add_layer_study` is idempotent per (job, slot) so a controller that restarts mid-job can simply add the
studies again: it gets the existing rows back instead of duplicates.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.errors import Conflict, NotFound, wraps_driver_errors
from storage.models import Job, JobStatus, LayerStudy, Trial


@wraps_driver_errors
def add_layer_study(*, session: Session, job_id: str, slot: str, optuna_study_name: str) -> LayerStudy:
    """The study of ``slot`` in ``job_id``, created if missing; `Conflict` if it exists under another Optuna name."""
    study = session.scalars(select(LayerStudy).where(LayerStudy.job_id == job_id, LayerStudy.slot == slot)).first()
    if study is not None:
        if study.optuna_study_name != optuna_study_name:
            raise Conflict(
                f"slot {slot!r} of job {job_id!r} already tracks Optuna study {study.optuna_study_name!r}, "
                f"not {optuna_study_name!r}"
            )
        return study
    study = LayerStudy(
        job_id=job_id,
        slot=slot,
        optuna_study_name=optuna_study_name,
        status=JobStatus.QUEUED,
        n_complete=0,
        n_failed=0,
    )
    session.add(study)
    session.commit()
    return study


@wraps_driver_errors
def get_layer_study(*, session: Session, study_id: int) -> LayerStudy:
    study = session.get(LayerStudy, study_id)
    if study is None:
        raise NotFound(f"layer study {study_id} not found")
    return study


@wraps_driver_errors
def list_layer_studies(*, session: Session, job_id: str) -> list[LayerStudy]:
    """The job's studies in the order they were added (the job's layer order)."""
    return list(session.scalars(select(LayerStudy).where(LayerStudy.job_id == job_id).order_by(LayerStudy.id)))


@wraps_driver_errors
def study_names_in(*, session: Session, status: JobStatus) -> set[str]:
    """The Optuna study names of every job in ``status``, in one query."""
    stmt = select(LayerStudy.optuna_study_name).join(Job, LayerStudy.job_id == Job.id).where(Job.status == status)
    return set(session.scalars(stmt))


@wraps_driver_errors
def update_layer_study(
    *, session: Session, study_id: int, status: JobStatus | None = None, best_trial_id: int | None = None
) -> LayerStudy:
    """Set the study's status and/or its best trial (the tuner judges which trial is best; storage only records it).

    `Conflict` if ``best_trial_id`` belongs to another study: a slot's winner must come from that slot.
    """
    study = get_layer_study(session=session, study_id=study_id)
    if best_trial_id is not None:
        owner = session.scalar(select(Trial.study_id).where(Trial.id == best_trial_id))
        if owner != study_id:
            raise Conflict(f"best_trial_id: trial {best_trial_id} is not a trial of layer study {study_id}")
        study.best_trial_id = best_trial_id
    if status is not None:
        study.status = JobStatus(status)
    session.commit()
    return study
