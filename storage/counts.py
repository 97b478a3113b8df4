"""How many jobs, trials and workers are in each state: what the controller's ``/metrics`` gauges show.

One ``GROUP BY`` per table, so a scrape costs three indexed queries however many rows there are; every
state is in the answer, those with no rows at 0, so a gauge falls back to 0 instead of vanishing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy import func, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from storage.errors import wraps_driver_errors
from storage.models import Job, JobStatus, Trial, TrialState, Worker, WorkerStatus

State = TypeVar("State", bound=enum.Enum)


@dataclass(frozen=True, kw_only=True, slots=True)
class StateCounts:
    jobs: dict[JobStatus, int]
    trials: dict[TrialState, int]
    """Waiting is queued for a worker, running is leased to one."""
    workers: dict[WorkerStatus, int]


@wraps_driver_errors
def state_counts(*, session: Session) -> StateCounts:
    return StateCounts(
        jobs=_count(session, Job.status, JobStatus),
        trials=_count(session, Trial.state, TrialState),
        workers=_count(session, Worker.status, WorkerStatus),
    )


def _count(session: Session, column: InstrumentedAttribute[State], states: type[State]) -> dict[State, int]:
    found: dict[State, int] = dict(session.execute(select(column, func.count()).group_by(column)).all())
    return {state: found.get(state, 0) for state in states}
