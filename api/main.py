"""The app factory: one `Settings` in, one FastAPI app out, with its database, registry and scheduler.

Start-up migrates the database (safe on every start and with several controllers at once) and, unless
``settings.scheduler`` is off, runs the scheduler loop on a background thread for the app's lifetime: it
schedules while this process holds the database's scheduler lease and stands by otherwise, so any number of
controller processes may share one database.  ``uvicorn --factory api.main:app_from_env`` (with any number of
``--workers``) serves a controller configured only by ``AUTOTUNE_*``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

import storage
from api import errors
from api.body_limit import BodyLimit
from api.cache import AnswerCache
from api.events import JobFeed
from api.logs import RateLimitedLog
from api.metrics import RequestMetrics, create_metrics
from api.routes import best, dashboard, docs, health, jobs, metrics, presets, workers
from api.scheduler import SchedulerThread
from api.schemas import ErrorPublic
from api.settings import Settings
from search_spaces import PresetRegistry

COMMON_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorPublic, "description": "A body that is not JSON"},
    422: {"model": ErrorPublic, "description": "Invalid input: each item names the field and the rule"},
}
"""Documented on every operation, replacing FastAPI's default 422 schema: our 4xx bodies all look alike."""

API_DESCRIPTION = """Measures TransformerEngine TP comm-GEMM overlap configs on your GPUs and returns the winners.

Writes need `Authorization: Bearer <token>` (the controller's `AUTOTUNE_TOKEN`).  A worker registers with
the controller's worker token (`AUTOTUNE_WORKER_TOKEN`; the clients' token where none is set), its own
calls send the secret its registration returned instead, and a lease's calls its `X-Lease-Nonce`.
Every 4xx answers `{"detail": [{"field", "rule", "value"}]}`."""


def create_app(settings: Settings) -> FastAPI:
    """A controller app for ``settings``; raises `InputError` when its auth settings are unsafe."""
    settings.check_auth()
    settings.check_scheduler()
    engine = storage.create_engine_for(url=settings.db_url)
    # The scheduler gets a pool of its own: requests never wait behind it, nor it behind a burst of requests.
    scheduler_engine = storage.create_engine_for(url=settings.db_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        storage.upgrade(engine=engine)
        loop = None
        if settings.scheduler:
            loop = SchedulerThread(
                engine=scheduler_engine,
                interval_s=settings.scheduler_interval_s,
                heartbeat_timeout_s=settings.heartbeat_timeout_s,
                queue_depth=settings.queue_depth,
                leader_ttl_s=settings.leader_ttl_s,
            )
            loop.start()
        app.state.scheduler = loop
        feed = asyncio.create_task(app.state.job_feed.run(), name="job feed")
        try:
            yield
        finally:
            feed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feed
            if loop is not None:
                loop.stop()
            scheduler_engine.dispose()
            engine.dispose()

    app = FastAPI(
        title="overlap autotune",
        description=API_DESCRIPTION,
        version="1",
        lifespan=lifespan,
        docs_url=None,  # api.routes.docs serves both pages with self-hosted assets
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = storage.session_factory(engine=engine)
    app.state.registry = PresetRegistry.with_nvidia()
    # One rate-limited log of the process's database failures: requests, event polls and /healthz (api.logs).
    app.state.outage_log = RateLimitedLog(logging.getLogger("api"))
    app.state.job_feed = JobFeed(
        sessions=app.state.sessions, max_streams=settings.max_streams, outages=app.state.outage_log
    )
    app.state.scheduler = None  # the `SchedulerThread` while the app runs one: /healthz says whether it leads
    app.state.metrics = create_metrics(sessions=app.state.sessions)
    served = app.state.metrics.best_answers
    app.state.best_cache = AnswerCache(
        ttl_s=settings.best_cache_s, on_served=lambda source: served.labels(source=source).inc()
    )
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)  # outermost: it counts the 413s too
    errors.install(app)
    for module in (jobs, best, presets, workers, health, metrics, dashboard):
        app.include_router(module.router, responses=COMMON_RESPONSES)
    app.mount("/static", dashboard.static_files(), name="static")
    app.include_router(docs.router)
    docs.mount_assets(app)
    return app


def app_from_env() -> FastAPI:
    """The app configured by the environment alone (``AUTOTUNE_TOKEN``, ``AUTOTUNE_DB_URL``, ...)."""
    return create_app(Settings())
