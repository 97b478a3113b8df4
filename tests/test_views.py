"""A job's progress as the API shows it: done never exceeds total, and 100% comes with every trial planned done.

The rows are real (SQLite); a slot's trial counters are set as the trials of an early-stopped or a
finalist-extended search would leave them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session

import storage
from api.views import UNFINISHED_CAP, job_view
from overlap_runtime.shape import ModelShape
from storage import Backend, JobStatus

pytest_plugins = ("conftest_storage",)  # sqlite_url


@pytest.fixture
def session(sqlite_url: str) -> Iterator[Session]:
    engine = storage.create_engine_for(url=sqlite_url)
    storage.upgrade(engine=engine)
    with storage.session_factory(engine=engine)() as session:
        yield session
    engine.dispose()


def _slot(session: Session, *, job_id: str, slot: str, ran: int, status: JobStatus) -> None:
    study = storage.add_layer_study(session=session, job_id=job_id, slot=slot, optuna_study_name=f"s:{slot}")
    study.n_complete, study.n_failed = ran - 1, 1
    storage.update_layer_study(session=session, study_id=study.id, status=status)


@pytest.mark.parametrize(
    ("slots", "done", "total", "fraction"),
    [
        # The bug: both slots stopped early (42 and 30 of 60): the job is done, so is every trial it planned.
        ({"qkv_fprop": (42, JobStatus.SUCCEEDED), "proj_fprop": (30, JobStatus.SUCCEEDED)}, 72, 72, 1.0),
        # One slot decided early, one still searching.
        (
            {"qkv_fprop": (42, JobStatus.SUCCEEDED), "proj_fprop": (30, JobStatus.RUNNING)},
            72,
            102,
            0.5 + 0.25 * UNFINISHED_CAP,
        ),
        # Finalists took a running slot past its 60: more done than n_trials, still not done.
        (
            {"qkv_fprop": (42, JobStatus.SUCCEEDED), "proj_fprop": (66, JobStatus.RUNNING)},
            108,
            108,
            0.5 + 0.5 * UNFINISHED_CAP,
        ),
        # A slot decided in an earlier job's study runs nothing here.
        ({"qkv_fprop": (1, JobStatus.SUCCEEDED), "proj_fprop": (1, JobStatus.SUCCEEDED)}, 2, 2, 1.0),
    ],
)
def test_progress_never_passes_100_percent_and_reaches_it_with_every_planned_trial(
    session: Session, slots: dict[str, tuple[int, JobStatus]], done: int, total: int, fraction: float
) -> None:
    job = storage.create_job(
        session=session, shape=ModelShape(hidden=64, tp=2, seq=32), layers=list(slots), n_trials=60, backend=Backend.CPU
    )
    for slot, (ran, status) in slots.items():
        _slot(session, job_id=job.id, slot=slot, ran=ran, status=status)
    progress = job_view(session=session, job=job).progress
    assert (progress.done, progress.total) == (done, total)
    assert progress.fraction == pytest.approx(fraction, abs=1e-4)
    assert progress.done <= progress.total and progress.fraction <= 1.0


def test_a_queued_job_plans_n_trials_per_slot(session: Session) -> None:
    job = storage.create_job(
        session=session,
        shape=ModelShape(hidden=64, tp=2, seq=32),
        layers=["qkv_fprop", "fc2_fprop"],
        n_trials=7,
        backend=Backend.CPU,
    )
    progress = job_view(session=session, job=job).progress
    assert (progress.done, progress.total, progress.fraction) == (0, 14, 0.0)
