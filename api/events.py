"""One poller behind every open event stream (``GET /v1/jobs/{id}/events``), fanned out to the streams.

A stream used to read its job from the database once a second with a session of its own, and that session
held a pooled connection for the stream's whole life: about 25 open streams (dashboard tabs) took the pool
and froze the controller.  Now one task per process (`JobFeed.run`) reads the view of every job that some
stream follows, once per `POLL_S`, with one session that it closes before it sleeps, and wakes each
stream whose job changed.  A waiting stream holds no connection and no thread, only its socket, so open
streams cost the database nothing; a stream only touches the database to check that its job exists.

Streams are still bounded (``AUTOTUNE_MAX_STREAMS``): past the bound a new stream is refused with a 503 and
``Retry-After`` (`StreamsFull`), since sockets and memory are finite and a flood must not take the process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session, sessionmaker

import storage
from api.logs import RateLimitedLog
from api.schemas import JobPublic
from api.views import job_view
from overlap_runtime.errors import AutotuneError

POLL_S = 1.0
"""How often the followed jobs are read: the latency of a progress event."""
RETRY_AFTER_S = 5
"""What a stream refused at the bound is told to wait."""


class StreamsFull(AutotuneError):
    """As many event streams are open as ``AUTOTUNE_MAX_STREAMS`` allows (the route answers 503)."""


@dataclass(kw_only=True)
class _Watch:
    """What the streams of one job share: its latest view (or why it could not be read) and a wake-up."""

    view: JobPublic | None = None
    error: str | None = None
    version: int = 0
    """Bumped on every change; a stream remembers the version it last sent."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    streams: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Update:
    """What a stream sends next: the job's view, or the public reason its job cannot be read now."""

    view: JobPublic | None
    error: str | None
    version: int


class JobFeed:
    """The one poller of a controller process and the register of its open streams."""

    def __init__(
        self, *, sessions: sessionmaker[Session], max_streams: int, outages: RateLimitedLog, poll_s: float = POLL_S
    ) -> None:
        self.sessions = sessions
        self.max_streams = max_streams
        self.poll_s = poll_s
        self._watches: dict[str, _Watch] = {}
        self._open = 0
        self._wake = asyncio.Event()
        self._outages = outages

    @property
    def open_streams(self) -> int:
        return self._open

    @contextlib.asynccontextmanager
    async def follow(self, job_id: str) -> AsyncIterator[Subscription]:
        """A stream's place on ``job_id`` for as long as the block runs; `StreamsFull` at the bound."""
        if self._open >= self.max_streams:
            raise StreamsFull(f"{self._open} event streams are open, the most this controller serves")
        self._open += 1
        watch = self._watches.setdefault(job_id, _Watch())
        watch.streams += 1
        self._wake.set()
        try:
            yield Subscription(feed=self, watch=watch)
        finally:
            self._open -= 1
            watch.streams -= 1
            if watch.streams == 0 and self._watches.get(job_id) is watch:
                del self._watches[job_id]

    async def run(self) -> None:
        """Read the followed jobs every `poll_s` and wake the streams of those that changed, until cancelled."""
        while True:
            if not self._watches:
                self._wake.clear()
                await self._wake.wait()
            watched = dict(self._watches)
            try:
                views = await run_in_threadpool(self._read, list(watched))
            except storage.StorageError as e:
                self._outages.warning("events", "event streams cannot read their jobs: %s", e)
                views = {job_id: None for job_id in watched}
            for job_id, watch in watched.items():
                self._publish(watch, views.get(job_id))
            await asyncio.sleep(self.poll_s)

    def _read(self, job_ids: list[str]) -> dict[str, JobPublic | None]:
        """Each job's view, in one session closed before the poller sleeps (None: the job is gone)."""
        views: dict[str, JobPublic | None] = {}
        with self.sessions() as session:
            for job_id in job_ids:
                try:
                    views[job_id] = job_view(session=session, job=storage.get_job(session=session, job_id=job_id))
                except storage.NotFound:
                    views[job_id] = None
        return views

    @staticmethod
    def _publish(watch: _Watch, view: JobPublic | None) -> None:
        error = "is unavailable; the stream ends, reconnect later" if view is None else None
        if view == watch.view and error == watch.error:
            return
        watch.view, watch.error = view, error
        watch.version += 1
        changed, watch.changed = watch.changed, asyncio.Event()
        changed.set()


@dataclass(frozen=True, kw_only=True, slots=True)
class Subscription:
    feed: JobFeed
    watch: _Watch

    async def next(self, *, after: int, timeout_s: float) -> Update | None:
        """The job's state once it is newer than version ``after``; None when ``timeout_s`` passed first."""
        watch = self.watch
        if watch.version <= after:
            try:
                await asyncio.wait_for(watch.changed.wait(), timeout_s)
            except TimeoutError:
                return None
        return Update(view=watch.view, error=watch.error, version=watch.version)
