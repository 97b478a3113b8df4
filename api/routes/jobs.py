"""Tuning jobs: submit (202 and a status URL to poll), list, look at, cancel, page through trials, follow live.

A job is only written here; the scheduler (`api.scheduler`) picks it up, creates one study per slot and
hands its trials to workers.  Cancel is best effort, as in Google's long-running operations: trials already
running finish and are kept, nothing new starts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.sse import EventSourceResponse, ServerSentEvent
from sqlalchemy.orm import Session, sessionmaker

import storage
from api.deps import Authorized, SessionDep, SettingsDep, WakeDep
from api.errors import error
from api.events import RETRY_AFTER_S as STREAMS_RETRY_AFTER_S
from api.events import JobFeed, StreamsFull, Subscription
from api.fit import check_memory
from api.schemas import ErrorPublic, JobAccepted, JobCreate, JobPublic, JobsPage, JobSummary, TrialsPage
from api.views import job_view, trial_view
from overlap_runtime.config import OverlapConfig, check_backend_size
from overlap_runtime.errors import ConfigError, InputError
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import slot_space, tunable_slots
from search_spaces.catalog import suggest
from storage import Backend, JobStatus, TrialState
from storage.models import ACTIVE_JOB_STATUSES

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

Limit = Annotated[int, Query(ge=1, le=storage.page.MAX_PAGE_SIZE)]
Offset = Annotated[int, Query(ge=0, le=1 << 31)]
RETRY_AFTER_S = 2
EVENT_STREAM_MAX_S = 600.0
"""An event stream ends after this long (the browser reconnects): proxies and load balancers cut idle streams."""

JOB_ID_PREFIX = r"^[0-9a-fA-F-]+$"
"""A job id's first characters: hex digits and dashes, as a UUID is written."""
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorPublic, "description": "No job with this id"}}


@router.post(
    "",
    status_code=status.HTTP_202_ACCEPTED,
    dependencies=[Authorized],
    responses={401: {"model": ErrorPublic}, 422: {"model": ErrorPublic}},
)
def submit_job(
    body: JobCreate, session: SessionDep, settings: SettingsDep, response: Response, wake: WakeDep
) -> JobAccepted:
    """Queue a tuning job; poll ``Location`` (or follow its ``/events``) until it has finished."""
    shape = body.shape.to_shape()
    slots = tunable_slots(shape, body.layers)
    check_memory(shape, slots, storage.list_workers(session=session))
    backend = Backend(body.backend or settings.default_backend)
    check_backend_size(shape, backend.value)  # a CPU job past the limit would never end: 422 now
    job = storage.create_job(
        session=session,
        shape=shape,
        layers=[s.value for s in slots],
        n_trials=body.n_trials,
        backend=backend,
        gpu=body.gpu,
        measure_first=_measure_first(body, shape=shape, slots=slots, backend=backend),
        consumer=None if body.consumer is None else body.consumer.value,
    )
    wake()  # the job starts in this pass rather than at the next interval
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return JobAccepted(id=job.id, status=job.status.value)


def _measure_first(
    body: JobCreate, *, shape: ModelShape, slots: Sequence[Slot], backend: Backend
) -> dict[str, list[OverlapConfig]] | None:
    """The job's configs to measure first, each checked against the runtime's rules for its slot (it need not
    lie in the search space): a 422 names the slot, the config's index and the knob (a device the job lands
    on may still refuse it, fewer SMs say: its study then skips the config and says so)."""
    if body.measure_first is None:
        return None
    names = [slot.value for slot in slots]
    first: dict[str, list[OverlapConfig]] = {}
    for name, bodies in body.measure_first.items():
        where = f"measure_first.{name}"
        if name not in names:
            raise InputError(where, f"is not a slot this job tunes ({', '.join(names)}){suggest(name, names)}")
        space = slot_space(shape, Slot(name), backend=backend.value)
        first[name] = [config.to_config() for config in bodies]
        for index, config in enumerate(first[name]):
            try:
                space.check(config)
            except ConfigError as e:
                raise InputError(f"{where}.{index}.{e.field}", e.rule, e.value) from None
    return first


@router.get("", responses={422: {"model": ErrorPublic}})
def list_jobs(
    session: SessionDep,
    limit: Limit = 50,
    offset: Offset = 0,
    status: JobStatus | None = None,
    id_prefix: Annotated[str | None, Query(pattern=JOB_ID_PREFIX, max_length=36)] = None,
) -> JobsPage:
    """Jobs, newest first; ``id_prefix``: only those whose id starts with it (how a client finds a job by the
    first characters of its id)."""
    page = storage.list_jobs(session=session, limit=limit, offset=offset, status=status, id_prefix=id_prefix)
    return JobsPage(
        items=[JobSummary.model_validate(job) for job in page.items],
        total=page.total,
        limit=limit,
        offset=offset,
        next_offset=_next(page),
    )


@router.get("/{job_id}", responses=NOT_FOUND)
def get_job(job_id: uuid.UUID, session: SessionDep) -> JobPublic:
    """Status (queued, running, succeeded, failed, cancelled), progress, and each slot's best config so far."""
    return job_view(session=session, job=storage.get_job(session=session, job_id=str(job_id)))


@router.post(
    "/{job_id}/cancel",
    dependencies=[Authorized],
    responses={**NOT_FOUND, 401: {"model": ErrorPublic}, 409: {"model": ErrorPublic}},
)
def cancel_job(job_id: uuid.UUID, session: SessionDep, wake: WakeDep) -> JobPublic:
    """Stop handing out the job's trials; running ones finish and are kept. 409 if it already finished."""
    job = storage.cancel_job(session=session, job_id=str(job_id))
    wake()
    return job_view(session=session, job=job)


@router.get("/{job_id}/trials", responses=NOT_FOUND)
def list_trials(
    job_id: uuid.UUID,
    session: SessionDep,
    limit: Limit = 50,
    offset: Offset = 0,
    state: TrialState | None = None,
) -> TrialsPage:
    """The job's trials in the order they were queued, with the proposal and the worker's measurements."""
    job = storage.get_job(session=session, job_id=str(job_id))
    slots = {s.id: s.slot for s in storage.list_layer_studies(session=session, job_id=job.id)}
    page = storage.list_trials(session=session, job_id=job.id, limit=limit, offset=offset, state=state)
    return TrialsPage(
        items=[trial_view(t, slots=slots) for t in page.items],
        total=page.total,
        limit=limit,
        offset=offset,
        next_offset=_next(page),
    )


async def _follow(job_id: uuid.UUID, request: Request) -> AsyncIterator[Subscription]:
    """The stream's place in the controller's `JobFeed` for as long as the stream lasts: a 503 with
    ``Retry-After`` at the bound on open streams, a 404 for an unknown job, both before the stream starts.
    The existence check takes a connection for one read and gives it back (`_job_exists`)."""
    feed: JobFeed = request.app.state.job_feed
    try:
        async with feed.follow(str(job_id)) as subscription:
            await run_in_threadpool(_job_exists, request.app.state.sessions, str(job_id))
            yield subscription
    except StreamsFull as e:
        raise HTTPException(
            status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
            detail=[error("events", f"{e}: retry later", feed.max_streams)],
            headers={"Retry-After": str(STREAMS_RETRY_AFTER_S)},
        ) from None


def _job_exists(sessions: sessionmaker[Session], job_id: str) -> None:
    with sessions() as session:
        storage.get_job(session=session, job_id=job_id)


@router.get(
    "/{job_id}/events",
    response_class=EventSourceResponse,
    responses={**NOT_FOUND, 503: {"model": ErrorPublic, "description": "As many streams are open as allowed"}},
)
async def job_events(subscription: Annotated[Subscription, Depends(_follow)]) -> AsyncIterator[ServerSentEvent]:
    """Server-sent events: ``progress`` (the job view, as GET /v1/jobs/{id}) on every change, then ``done``.

    The stream ends when the job has finished, or after a while (clients reconnect) so idle proxies never
    hold it open forever.  Waiting streams hold no database connection: one poller reads every followed job
    (`api.events`).  A 503 with ``Retry-After`` answers a stream past ``AUTOTUNE_MAX_STREAMS``.
    """
    deadline = time.monotonic() + EVENT_STREAM_MAX_S
    seen = 0
    while (left := deadline - time.monotonic()) > 0:
        update = await subscription.next(after=seen, timeout_s=left)
        if update is None:
            return
        seen = update.version
        if update.view is None:
            yield ServerSentEvent(event="error", data={"field": "database", "rule": update.error})
            return
        yield ServerSentEvent(event="progress", data=update.view, id=str(update.view.progress.done))
        if update.view.status not in ACTIVE_JOB_STATUSES:
            yield ServerSentEvent(event="done", data={"id": update.view.id, "status": update.view.status})
            return


def _next(page: storage.Page) -> int | None:
    end = page.offset + len(page.items)
    return end if end < page.total else None
