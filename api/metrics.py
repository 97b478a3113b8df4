"""The controller's Prometheus metrics (``GET /metrics``), in a registry of the app's own.

`create_app` makes one `Metrics` per app, never using prometheus_client's global default registry, so two
apps in one process (the tests, the load benchmark) count apart.  The numbers come from three places:

- requests: `RequestMetrics`, an ASGI middleware, counts and times every request by method, route template
  (``/v1/jobs/{job_id}``, never the raw path: one series per route, not one per job) and status;
- trials: the result route observes how long each reported trial ran (claim to report, `observe_trial`);
- state: `StateCollector` reads the counts from the database at every scrape (jobs by status, trials queued
  and leased, workers alive), so every controller process on one database shows the same numbers.

With ``serve --workers N`` each process keeps its own request and trial counters and a scrape reaches one
of them; the state gauges are the same in all.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import storage
from storage import Trial
from storage.models import GONE_WORKER_STATUSES

State = TypeVar("State", bound=enum.Enum)

UNMATCHED = "unmatched"
"""The route label of a request no route matched (scanners' paths must not each make a series)."""
REQUEST_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0, 600.0)
"""Reads answer in milliseconds; an event stream lasts up to its 600 s cap."""
TRIAL_BUCKETS_S = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""A trial is a few timed repeats of one config: seconds on a GPU, longer on the CPU backend."""


@dataclass(frozen=True, kw_only=True)
class Metrics:
    """One app's registry and the metrics its code updates (the state gauges are read at scrape time)."""

    registry: CollectorRegistry
    requests: Counter
    request_seconds: Histogram
    trial_seconds: Histogram
    best_answers: Counter
    """``GET /v1/best`` answers by where they came from (`api.cache.Served`)."""

    def observe_trial(self, trial: Trial) -> None:
        """Count a reported trial's run time, from its claim to its result."""
        if trial.started_at is not None and trial.finished_at is not None:
            seconds = (trial.finished_at - trial.started_at).total_seconds()
            self.trial_seconds.labels(state=trial.state.value).observe(max(seconds, 0.0))


def create_metrics(*, sessions: sessionmaker[Session]) -> Metrics:
    """A fresh registry holding the request and trial metrics and the database's state gauges."""
    registry = CollectorRegistry(auto_describe=True)
    labels = ("method", "route", "status")
    metrics = Metrics(
        registry=registry,
        requests=Counter("autotune_http_requests", "HTTP requests answered", labels, registry=registry),
        request_seconds=Histogram(
            "autotune_http_request_duration_seconds",
            "Time from a request's arrival to the end of its answer",
            labels,
            buckets=REQUEST_BUCKETS_S,
            registry=registry,
        ),
        trial_seconds=Histogram(
            "autotune_trial_duration_seconds",
            "How long reported trials ran, from the claim to the result, by final state",
            ("state",),
            buckets=TRIAL_BUCKETS_S,
            registry=registry,
        ),
        best_answers=Counter(
            "autotune_best_answers",
            "GET /v1/best answers: kept from an earlier request (cache), computed for a concurrent one (shared), "
            "or computed for this one (computed)",
            ("source",),
            registry=registry,
        ),
    )
    registry.register(StateCollector(sessions=sessions))
    return metrics


class StateCollector(Collector):
    """Gauges counted in the database at each scrape: jobs by status, trials by state, workers by status."""

    def __init__(self, *, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # registering must not query the database; the families appear on the first scrape

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.sessions() as session:
            counts = storage.state_counts(session=session)
        yield _gauge("autotune_jobs", "Jobs by status", "status", counts.jobs)
        yield _gauge(
            "autotune_trials",
            "Trials by state: waiting is queued for a worker, running is leased",
            "state",
            counts.trials,
        )
        yield _gauge("autotune_workers", "Registered workers by status", "status", counts.workers)
        alive = sum(n for status, n in counts.workers.items() if status not in GONE_WORKER_STATUSES)
        yield GaugeMetricFamily("autotune_workers_alive", "Workers heard from within the heartbeat timeout", alive)


def _gauge(name: str, documentation: str, label: str, counts: Mapping[State, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=[label])
    for state, n in counts.items():
        family.add_metric([state.value], n)
    return family


class RequestMetrics:
    """ASGI middleware: counts and times each HTTP request by method, route template and status."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        root = scope.get("root_path", "")
        status = 500  # what the client sees when the app raises before answering
        counted = False

        def count() -> None:
            nonlocal counted
            if not counted:
                counted = True
                labels = {"method": scope["method"], "route": _template(scope, root=root), "status": str(status)}
                self.metrics.requests.labels(**labels).inc()
                self.metrics.request_seconds.labels(**labels).observe(time.perf_counter() - start)

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # Counted before the last byte leaves: a file response still closes its file (in a thread)
                # after it, and a client's next request, a scrape of /metrics, must already see this one.
                count()
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            count()  # an app that raised, or that never finished its body


def _template(scope: Scope, *, root: str) -> str:
    """The route template a request matched, from the scope the router filled in (it fills in the one it is
    given, which is the middleware's): the route's path, or for a mounted app (``/static``) the mount's path,
    which the mount adds to ``root_path``, followed by ``/{path}``."""
    route = scope.get("route")
    if route is not None:
        return route.path
    mounted = scope.get("root_path", "")
    if mounted != root:
        return f"{mounted.removeprefix(root)}/{{path}}"
    return UNMATCHED
